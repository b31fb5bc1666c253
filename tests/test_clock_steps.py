"""A wall-clock step does not stretch leases, timeouts or durations: they run on monotonic time;
only slot instants are wall clock."""

from __future__ import annotations

import asyncio
import secrets
import time

import asyncpg

from brokersched import JobContext, MemoryBackend, PostgresBackend, RunEvent, Scheduler
from brokersched._clock import SystemClock
from brokersched.testing import TestClock

START = "2027-01-15T08:00:30+00:00"


class SteppedClock(SystemClock):
    """The real clocks, with a wall clock an operator (NTP) can step."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def now_ms(self) -> int:
        return super().now_ms() + self.offset_ms


async def test_a_wall_step_back_does_not_let_another_instance_take_over_a_live_run(
    postgres_dsn: str,
) -> None:
    """PostgreSQL expires leases on its own clock. The runner's wall clock steps back 10 s
    mid-run: its renewals must go on every lease_ttl/3 of real time, or the lease expires in
    the database and the other instance runs the slot again while the first still runs."""
    schema = "t" + secrets.token_hex(5)
    stepped = SteppedClock()
    starts: dict[str, list[float]] = {"stepped": [], "steady": []}
    first_started = asyncio.Event()

    def fleet_member(name: str, clock: SystemClock) -> Scheduler[PostgresBackend]:
        backend = PostgresBackend(postgres_dsn, schema=schema, lease_ttl="1s")
        sched = Scheduler(backend, clock=clock, jitter=0, instance_id=name)

        @sched.every("report", "1h", catch_up=0)
        async def report(ctx: JobContext) -> None:
            starts[name].append(time.monotonic())
            if name == "stepped":
                first_started.set()
                stepped.offset_ms -= 10_000  # NTP steps this machine's clock back 10 s
            await asyncio.sleep(3)  # three lease lifetimes of real work

        return sched

    runner = fleet_member("stepped", stepped)
    other = fleet_member("steady", SystemClock())
    outcomes: list[tuple[str, str | None]] = []
    runner.on("complete", lambda e: outcomes.append((e.outcome, None)))
    runner.on("fail", lambda e: outcomes.append((e.outcome, e.error)))
    try:
        await runner.start()
        await other.start()  # sweeps for dead runners every lease_ttl/2
        job = runner.get("report")
        assert job is not None
        record = await job.trigger()
        assert first_started.is_set()
        assert record is not None
        assert outcomes == [("completed", None)]
        assert starts["steady"] == []  # nobody started the slot beside the live runner
    finally:
        await runner.stop()
        await other.stop()
        conn = await asyncpg.connect(postgres_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


async def test_timeouts_and_durations_ignore_wall_steps() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    seen: list[RunEvent] = []
    sched.on("fail", seen.append)

    @sched.every("slow", "1h", timeout="10s")
    async def slow(ctx: JobContext) -> None:
        await ctx.sleep(3600)

    await sched.start()
    job = sched.get("slow")
    assert job is not None
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("4s")
    await clock.step("1h", back=True)  # the wall clock steps back an hour
    await clock.advance("6s")  # 10 s of real time since the start: the timeout fires
    await trigger
    [event] = seen
    assert (event.outcome, event.duration_ms) == ("timed-out", 10_000)
    await sched.stop()


async def test_slots_follow_the_wall_clock_through_a_step() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    slots: list[str] = []
    sched.every("tick", "1m", lambda ctx: slots.append(f"{ctx.scheduled_at:%H:%M}"))
    await sched.start()
    await clock.advance("1m")  # 08:01:00 runs
    await clock.step("2m")  # the wall clock jumps to 08:03:30: 08:02 and 08:03 are behind it
    await clock.advance("30s")  # 08:04 runs
    await sched.stop()
    assert slots[0] == "08:01"
    assert slots[-1] == "08:04"

"""A wall-clock step back on one instance does not let another take over its live run, on
PostgreSQL (tests/unit/test_clock_steps.py has the steps on virtual time)."""

from __future__ import annotations

import asyncio
import time

import asyncpg

from brokersched import JobContext, PostgresBackend, Scheduler
from brokersched._clock import SystemClock
from tests.support.names import unique


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
    schema = unique("t")
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

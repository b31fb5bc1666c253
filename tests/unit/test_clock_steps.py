"""A wall-clock step does not stretch leases, timeouts or durations: they run on monotonic time;
only slot instants are wall clock."""

from __future__ import annotations

import asyncio

from brokersched import JobContext, MemoryBackend, RunEvent, Scheduler
from brokersched.testing import TestClock
from tests.support.clocks import START


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

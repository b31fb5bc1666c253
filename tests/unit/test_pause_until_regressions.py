"""Regressions found by breaking ``pause(until=)`` (branch breakpause).

BUG: a pause until an instant that is exactly one of the job's slots loses that slot when the
pause's end fires a millisecond or more late on every instance (a real event loop often does).
``FleetControls._end_pause_at`` re-applies the control at ``until``; ``Timers.rearm`` then arms
from ``now - jitter - 1``, so with ``now > until`` (jitter=0, or a wake-up later than the
jitter) the first slot armed is the one after ``until``, while ``Job.next_run`` and
``brokersched jobs`` said ``until``. Seen for real (ops_app, 1 s job, jitter=0, ``brokersched
pause APP tick --until <a whole second>``, 3 members): the slot at until ran nowhere in 7 of 19
trials (RabbitMQ, PostgreSQL, Redis, NATS, SQLite); on a lease backend it ran only when a
member had just restarted (as ``catch-up``, 160-540 ms late); two in-process members on the
memory backend and the real clock lost it 3 times in 3."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from brokersched import JobContext, Scheduler
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START

_BASE = datetime.fromisoformat(START).replace(second=0)


def _at(minutes: int) -> datetime:
    return _BASE + timedelta(minutes=minutes)


async def test_the_slot_at_until_runs_when_the_pause_end_fires_a_millisecond_late(
    clock: TestClock,
) -> None:
    store, runs = MemoryStore(), []

    async def tick(ctx: JobContext) -> None:
        runs.append(f"{ctx.instance_id}@{ctx.scheduled_at:%H:%M}")

    fleet = [
        Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id=name)
        for name in ("A", "B")
    ]
    for sched in fleet:
        sched.every("tick", "1m", tick, catch_up=0)
        await sched.start()
    try:
        job = fleet[0].get("tick")
        assert job is not None
        await job.pause(until=_at(4))
        await clock.advance_to(_at(4) - timedelta(milliseconds=1))
        other = fleet[1].get("tick")
        assert other is not None and other.next_run == _at(4)  # both say 08:04 runs
        # The event loop wakes 2 ms after its timer was due (as a real loop does, by a little).
        await clock.stall("2ms")
        await clock.advance_to(_at(6))
        slots = sorted(run.split("@")[1] for run in runs)
        assert slots == ["08:04", "08:05", "08:06"], runs  # got ['08:05', '08:06']
    finally:
        for sched in fleet:
            await sched.stop()


async def test_a_pause_until_the_end_of_year_9999_is_refused_or_breaks_no_reader(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    """BUG: ``pause(until=)`` (and ``brokersched pause --until 9999-12-31T23:59:59.9Z``, which
    answers "paused ... until 9999-12-31 23:59:59.900Z") accepts an instant whose next slot is
    past what a datetime holds; then ``Job.next_run`` raises ``ValueError: year 10000 is out of
    range``, and so do ``brokersched jobs APP`` (a traceback, for every operator, until someone
    resumes the job) and the admin API's job list (``runs_ahead`` -> ``ms_to_datetime``)."""

    async def tick(ctx: JobContext) -> None:
        pass

    scheduler.every("tick", "1s", tick)
    await scheduler.start()
    job = scheduler.get("tick")
    assert job is not None
    far = datetime(9999, 12, 31, 23, 59, 59, 900000, tzinfo=UTC)
    try:
        await job.pause(until=far)
    except ValueError:
        return  # refused with a message: as promised for bad input
    assert job.paused
    assert job.next_run is None or job.next_run >= far  # raises ValueError: year 10000

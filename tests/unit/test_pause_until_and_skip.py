"""A pause that ends by itself (``pause(until=)``), ``skip(n)`` and ``note=``, on two instances
of one fleet (the memory backend, virtual time): what each slot does on every instance, what
the control record keeps, and what bad input is told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from brokersched import JobContext, Scheduler
from brokersched._fleetrecords import SkipWindow
from brokersched.abc import ControlChange, JobControl
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START


def _every_minute(schedulers: list[Scheduler[MemoryBackend]], runs: list[str]) -> None:
    async def tick(ctx: JobContext) -> None:
        runs.append(f"{ctx.scheduled_at:%H:%M}")

    for sched in schedulers:
        sched.every("tick", "1m", tick, catch_up=0)


_BASE = datetime.fromisoformat(START).replace(second=0)  # the minute the clock starts in


def _at(minutes: int) -> datetime:
    """The slot ``minutes`` after 08:00."""
    return _BASE + timedelta(minutes=minutes)


async def test_a_pause_until_an_instant_ends_there_on_every_instance_without_a_write(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    a, b = memory_fleet
    for sched in memory_fleet:
        await sched.start()
    job = a.get("tick")
    assert job is not None
    control = await job.pause(until=_at(4), note="db maintenance", by="alice")
    assert control is not None and control.paused and control.until == _at(4)
    other = b.get("tick")
    await clock.advance("10s")
    assert other is not None and other.paused and other.next_run == _at(4)
    await clock.advance_to(_at(6))
    assert runs == ["08:04", "08:05", "08:06"]  # 08:01-08:03 paused; each later slot once
    assert not job.paused and not other.paused
    controls = await a.backend.controls()
    stored = controls["tick"]
    assert stored.paused and stored.until == _at(4)  # ended by its instant, not a write
    assert stored.note == "db maintenance"  # why it was paused
    change = stored.changes[-1]
    assert (change.action, change.actor, change.note, change.until) == (
        "pause",
        "alice",
        "db maintenance",
        _at(4),
    )


async def test_the_slot_at_a_pauses_end_runs_though_the_process_wakes_late(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    """A wall clock's timer fires after its time: the pause's end is seen late, and its slot,
    then just past, still runs (within max_late), once."""
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    for sched in memory_fleet:
        await sched.start()
    job = memory_fleet[0].get("tick")
    assert job is not None
    await job.pause(until=_at(3))
    await clock.advance_to(_at(3) - timedelta(milliseconds=100))
    await clock.stall("600ms")  # the process frozen across the pause's end
    await clock.advance("1s")
    assert runs == ["08:03"]


async def test_a_pause_until_is_honoured_by_an_instance_that_starts_during_it(
    clock: TestClock,
) -> None:
    store, runs = MemoryStore(), []

    async def tick(ctx: JobContext) -> None:
        runs.append(f"{ctx.instance_id}@{ctx.scheduled_at:%H:%M}")

    first = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="A")
    first.every("tick", "1m", tick, catch_up=0)
    async with first:
        job = first.get("tick")
        assert job is not None
        await job.pause(until=_at(3))
    late = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="B")
    late.every("tick", "1m", tick, catch_up=0)
    async with late:
        await clock.advance_to(_at(4))
    assert runs == ["B@08:03", "B@08:04"]


async def test_skip_n_skips_the_next_n_slots_on_every_instance_and_says_why(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    skips: list[tuple[str, str, str | None]] = []
    for sched in memory_fleet:
        sched.on(
            "skip",
            lambda e, name=sched.instance_id: skips.append((name, e.reason, e.detail)),
        )
        await sched.start()
    job = memory_fleet[1].get("tick")
    assert job is not None
    control = await job.skip(2, note="upstream down", by="bob")
    assert control is not None and control.skip is not None and control.skip.count == 2
    assert control.skip.through_ms == int(_at(2).timestamp() * 1000)
    await clock.advance("10s")
    other = memory_fleet[0].get("tick")
    assert other is not None and other.next_run == _at(3) and not other.paused
    await clock.advance_to(_at(4))
    assert runs == ["08:03", "08:04"]
    skipped = [s for s in skips if s[2] is not None and "skip" in s[2]]
    assert sorted(s[0] for s in skipped) == ["A", "A", "B", "B"]  # each slot, each instance
    assert {s[1] for s in skipped} == {"paused"}


async def test_a_later_skip_replaces_a_pending_one_and_skip_zero_cancels_it(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    for sched in memory_fleet:
        await sched.start()
    job = memory_fleet[0].get("tick")
    assert job is not None
    await job.skip(3)
    await job.skip(3)  # sent twice: still the next three, not six
    control = await job.skip(1)
    assert control is not None and control.skip is not None and control.skip.count == 1
    await clock.advance_to(_at(2))
    assert runs == ["08:02"]
    await job.skip(2)
    control = await job.skip(0)
    assert control is not None and control.skip is None
    await clock.advance_to(_at(3))
    assert runs == ["08:02", "08:03"]


async def test_a_pause_without_until_after_a_pause_until_lasts_until_resumed(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    for sched in memory_fleet:
        await sched.start()
    job = memory_fleet[0].get("tick")
    assert job is not None
    await job.pause(until=_at(2))
    control = await job.pause()
    assert control is not None and control.until is None
    await clock.advance_to(_at(5) + timedelta(seconds=30))
    assert runs == [] and job.paused and job.next_run is None
    await job.resume(note="fixed")
    await clock.advance_to(_at(6))
    assert runs == ["08:06"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda job: job.pause(until=datetime(2030, 1, 1)), "until must be an aware datetime"),
        (lambda job: job.pause(until=_at(-60)), "is not in the future"),
        (lambda job: job.pause(note="x" * 501), "at most 500 characters"),
        (
            lambda job: job.pause(until=datetime(9999, 12, 31, 23, 59, 59, 900000, tzinfo=UTC)),
            "more than 100 years ahead",
        ),
        (lambda job: job.skip(-1), "from 0 (cancel a skip) to 1000, got -1"),
        (lambda job: job.skip(True), "got True"),
        (lambda job: job.skip(1001), "got 1001"),
    ],
)
async def test_a_bad_pause_or_skip_is_refused_naming_it_and_changes_nothing(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock, call: object, message: str
) -> None:
    _every_minute(memory_fleet, [])
    await memory_fleet[0].start()
    job = memory_fleet[0].get("tick")
    assert job is not None
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(job)  # type: ignore[operator]
    assert job.control is None or not job.control.changes
    assert not job.paused


async def test_skip_of_a_job_with_no_slot_left_is_refused(clock: TestClock) -> None:
    sched = Scheduler(MemoryBackend(), clock=clock)

    async def once(ctx: JobContext) -> None: ...

    sched.at("once", _at(-60), once)
    async with sched:
        job = sched.get("once")
        assert job is not None
        with pytest.raises(ValueError, match="job 'once' has no slot left to skip"):
            job.skip(1)


async def test_the_admin_way_takes_note_until_and_count_and_checks_them(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    _every_minute(memory_fleet, [])
    a = memory_fleet[0]
    await a.start()
    control = await a.change_control("tick", "pause", by="ops", note="why", until=_at(9))
    assert control.until == _at(9) and control.changes[-1].note == "why"
    control = await a.change_control("tick", "skip", by="ops", count=2)
    assert control.skip is not None and control.skip.count == 2
    with pytest.raises(ValueError, match="until= is for pause only, not resume"):
        await a.change_control("tick", "resume", by="ops", until=_at(9))


def test_a_skip_says_how_many_of_its_slots_are_still_ahead() -> None:
    window = SkipWindow(after_ms=0, through_ms=3000, count=3)

    def every_second(after: int) -> int:
        return after // 1000 * 1000 + 1000

    assert [window.left(every_second, now) for now in (0, 999, 1000, 2500, 3000)] == [
        3, 3, 2, 1, 0
    ]  # fmt: skip


def test_the_record_reads_back_and_an_older_record_reads_as_before() -> None:
    control = JobControl("tick")
    for change in (
        ControlChange("tick", "pause", "a", _BASE, note="n", until=_at(5)),
        ControlChange("tick", "skip", "b", _BASE, count=2, through_ms=1_700_000_000_000),
    ):
        control = control.apply(change)
    assert JobControl.from_json(control.to_json()) == control
    older = '{"job":"tick","paused":true,"disabled":false,"changes":[{"action":"pause",'
    older += '"actor":"a","at":"2030-01-01T00:00:00+00:00"}]}'
    read = JobControl.from_json(older)
    assert read.paused and read.until is None and read.skip is None
    assert read.stops(0) == "paused"


async def test_a_password_in_a_note_is_masked_before_it_is_kept(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    """A note is shown to whoever reads the fleet's controls (the admin API, ``jobs``): a
    URL's password in it is masked as in the logs, and never reaches the backend."""
    _every_minute(memory_fleet, [])
    await memory_fleet[0].start()
    job = memory_fleet[0].get("tick")
    assert job is not None
    await job.pause(note="failover to amqp://app:s3cret-pw@new-host:5672/")
    kept = (await memory_fleet[0].backend.controls())["tick"].changes[-1].note
    assert kept == "failover to amqp://app:***@new-host:5672/"

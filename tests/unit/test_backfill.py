"""``Scheduler.backfill``: a job's slots of a past range, each claimed like any slot, run once
(``ctx.reason == "backfill"``), rate limited; on the memory backend and virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from brokersched import ConfigurationError, JobContext, MemoryBackend, Scheduler
from brokersched._clock import Clock, Timer
from brokersched._exceptions import BackendUnavailableError
from brokersched.abc import JobPolicy, Slot
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend


def at(text: str) -> datetime:
    return datetime.fromisoformat(f"2027-01-15T{text}+00:00")


class Seen:
    def __init__(self) -> None:
        self.runs: list[tuple[str, str, str]] = []  # (instance, reason, slot HH:MM:SS)

    async def __call__(self, ctx: JobContext) -> None:
        self.runs.append((ctx.instance_id, ctx.reason, ctx.scheduled_at.strftime("%H:%M:%S")))


async def drive(clock: TestClock, coro: Any, step: str = "10ms") -> Any:
    """Await ``coro`` while the virtual clock runs on (a backfill's pauses are on it)."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        await clock.advance(step)
    return task.result()


def statuses(steps: list[Any]) -> list[tuple[str, str]]:
    return [(step.at.strftime("%H:%M"), step.status) for step in steps]


async def down_for_ten_minutes(
    clock: TestClock, store: MemoryStore | None = None, **options: Any
) -> tuple[Scheduler[Any], Seen]:
    """A scheduler that did not schedule (disabled) while ten slots of ``every 1m`` passed."""
    seen = Seen()
    backend = MemoryBackend(lease_ttl="5s", store=store)
    scheduler = Scheduler(backend, clock=clock, jitter=0, instance_id="me", enabled=False)
    # A slot 40 s old (2 x max_late, 2 x lease_ttl, 10 s for records) may be backfilled.
    scheduler.every("report", "1m", seen, **{"catch_up": 0, "max_late": "10s", **options})
    await scheduler.start()
    await clock.advance("10m")  # 08:10:30
    return scheduler, seen


async def test_a_backfill_runs_each_missed_slot_once_in_order(clock: TestClock) -> None:
    scheduler, seen = await down_for_ten_minutes(clock)
    told: list[tuple[int, int, str]] = []
    steps = await drive(
        clock,
        scheduler.backfill(
            "report",
            at("08:01:00"),
            at("08:05:00"),
            rate=100,
            progress=lambda s: told.append((s.index, s.total, s.status)),
        ),
    )
    assert [r for _, r, _ in seen.runs] == ["backfill"] * 5
    assert [s for _, _, s in seen.runs] == [f"08:0{n}:00" for n in range(1, 6)]
    assert told == [(n, 5, "ran") for n in range(1, 6)]
    assert all(step.record is not None and step.record.outcome == "completed" for step in steps)
    history = await scheduler.get("report").history(10)  # type: ignore[union-attr]
    assert {record.reason for record in history} == {"backfill"}
    again = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:05:00"), rate=100)
    )
    assert {step.status for step in again} == {"already-run"}
    assert len(seen.runs) == 5
    await scheduler.stop()


async def test_slots_that_ran_on_schedule_are_not_run_again(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    seen = Seen()
    job = scheduler.every("report", "1m", seen, catch_up=0, max_late="10s")
    await scheduler.start()
    await clock.advance("3m")  # 08:01, 08:02, 08:03 run on schedule
    job.pause()
    await clock.advance("5m")  # 08:04 to 08:08 missed; those of the last 90 s too recent
    steps = await drive(
        clock, scheduler.backfill("report", at("08:00:00"), at("08:06:30"), rate=100)
    )
    assert statuses(steps) == [
        ("08:00", "ran"),  # before the scheduler started
        ("08:01", "already-run"),
        ("08:02", "already-run"),
        ("08:03", "already-run"),
        ("08:04", "ran"),
        ("08:05", "ran"),
        ("08:06", "ran"),
    ]
    assert [(r, s) for _, r, s in seen.runs if r == "backfill"] == [
        ("backfill", "08:00:00"),
        ("backfill", "08:04:00"),
        ("backfill", "08:05:00"),
        ("backfill", "08:06:00"),
    ]


async def test_the_lease_fence_keeps_a_slot_whose_record_was_trimmed(clock: TestClock) -> None:
    scheduler, seen = await down_for_ten_minutes(clock, history_size=1)
    await drive(clock, scheduler.backfill("report", at("08:01:00"), at("08:04:00"), rate=100))
    again = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:06:00"), rate=100)
    )
    assert statuses(again) == [
        ("08:01", "not-acquired"),  # the history keeps one record: the fence refuses them
        ("08:02", "not-acquired"),
        ("08:03", "not-acquired"),
        ("08:04", "already-run"),
        ("08:05", "ran"),
        ("08:06", "ran"),
    ]
    assert len(seen.runs) == 6
    await scheduler.stop()


async def test_two_backfills_at_once_run_each_slot_once(clock: TestClock) -> None:
    backend, seen = MemoryBackend(), Seen()
    schedulers = [
        Scheduler(backend, clock=clock, jitter=0, instance_id=name, enabled=False)
        for name in ("a", "b")
    ]
    for each in schedulers:
        each.every("report", "1m", seen, catch_up=0, max_late="10s")
        await each.start()
    await clock.advance("12m")
    first, last = at("08:01:00"), at("08:09:00")
    backfills = [each.backfill("report", first, last, rate=100) for each in schedulers]
    await drive(clock, asyncio.gather(*backfills))
    slots = [s for _, _, s in seen.runs]
    assert sorted(slots) == [f"08:0{n}:00" for n in range(1, 10)]  # each once, between them
    for each in schedulers:
        await each.stop()


async def test_a_dry_run_says_what_would_run_and_runs_nothing(clock: TestClock) -> None:
    scheduler, seen = await down_for_ten_minutes(clock)
    steps = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:03:00"), dry_run=True)
    )
    assert statuses(steps) == [
        ("08:01", "would-run"),
        ("08:02", "would-run"),
        ("08:03", "would-run"),
    ]
    assert seen.runs == []
    await scheduler.stop()


async def test_the_rate_spaces_the_runs_on_the_scheduler_clock(clock: TestClock) -> None:
    scheduler, _ = await down_for_ten_minutes(clock)
    began = clock.monotonic_ms()
    steps = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:03:00"), rate=0.5)
    )
    assert [s.status for s in steps] == ["ran"] * 3
    assert 4000 <= clock.monotonic_ms() - began < 4100  # two pauses of 2 s
    await scheduler.stop()


async def test_on_a_claim_only_backend_only_slots_it_remembers_are_claimed(
    clock: TestClock,
) -> None:
    claims: dict[str, str] = {}
    seen = Seen()
    schedulers = [
        Scheduler(
            DictClaimBackend(claims, slot_ttl=timedelta(minutes=5)),
            clock=clock, jitter=0, instance_id=name, enabled=False, max_late="1m",
        )
        for name in ("a", "b")
    ]  # fmt: skip
    for each in schedulers:
        each.every("report", "1m", seen)
        await each.start()
    await clock.advance("10m")  # 08:10:30: slots from 08:06 on are within slot_ttl (less 1s)
    first = await drive(
        clock, schedulers[0].backfill("report", at("08:04:00"), at("08:10:00"), rate=100)
    )
    assert statuses(first) == [
        ("08:04", "skipped"),
        ("08:05", "skipped"),
        ("08:06", "ran"),
        ("08:07", "ran"),
        ("08:08", "ran"),
        ("08:09", "ran"),
        ("08:10", "skipped"),  # younger than jitter + max_late: the fleet's
    ]
    assert first[0].detail is not None and "slot memory" in first[0].detail
    # Another instance (its own history): the claims it remembers refuse them.
    second = await drive(
        clock, schedulers[1].backfill("report", at("08:06:00"), at("08:09:00"), rate=100)
    )
    assert {step.status for step in second} == {"not-acquired"}
    assert len(seen.runs) == 4
    for each in schedulers:
        await each.stop()


async def test_bad_ranges_and_rates_are_refused_naming_the_values(clock: TestClock) -> None:
    scheduler, _ = await down_for_ten_minutes(clock)
    scheduler.after("boot", "1s", Seen())
    with pytest.raises(ConfigurationError, match=r"end \(2027-01-15T08:01:00\+00:00\) is before"):
        await scheduler.backfill("report", at("08:05:00"), at("08:01:00"))
    with pytest.raises(ConfigurationError, match=r"end \(2027-01-15T09:00:00\+00:00\) is in the"):
        await scheduler.backfill("report", at("08:05:00"), at("09:00:00"))
    with pytest.raises(ConfigurationError, match="must be a timezone-aware datetime"):
        await scheduler.backfill("report", datetime(2027, 1, 15, 8), at("08:05:00"))
    with pytest.raises(ConfigurationError, match=r"rate \(0/s\) must be greater than 0"):
        await scheduler.backfill("report", at("08:01:00"), at("08:05:00"), rate=0)
    with pytest.raises(ConfigurationError, match="after\\(\\) job has no slots"):
        await scheduler.backfill("boot", at("08:01:00"), at("08:05:00"))
    scheduler.every("fast", "1ms", Seen(), jitter=0)
    with pytest.raises(ConfigurationError, match="more than 100000 slots"):
        await scheduler.backfill("fast", at("08:01:00"), at("08:05:00"))
    with pytest.raises(KeyError, match="no job named 'nope'"):
        await scheduler.backfill("nope", at("08:01:00"), at("08:05:00"))
    await scheduler.stop()
    with pytest.raises(RuntimeError, match="not running"):
        await scheduler.backfill("report", at("08:01:00"), at("08:05:00"))


async def test_a_stop_ends_the_backfill(clock: TestClock) -> None:
    scheduler, seen = await down_for_ten_minutes(clock)
    task = asyncio.create_task(
        scheduler.backfill("report", at("08:01:00"), at("08:09:00"), rate=0.1)
    )
    await clock.advance("15s")  # two slots run (at 0 s and 10 s)
    await scheduler.stop()
    steps = await drive(clock, task)  # the pause before the third ends, then nothing runs
    assert [s.status for s in steps] == ["ran", "ran"] + ["stopped"] * 7
    assert len(seen.runs) == 2


def test_a_job_cannot_take_the_key_of_another_jobs_backfills(scheduler: Scheduler[Any]) -> None:
    scheduler.every("report", "1m", Seen())
    with pytest.raises(ConfigurationError, match="claims its backfills"):
        scheduler.every("other", "1m", Seen(), key="report:backfill")


async def test_on_a_lease_backend_slots_the_fleet_may_still_claim_on_time_are_left_to_it(
    clock: TestClock,
) -> None:
    """Younger than ``jitter + max_late`` (and a second for the claim's answer) when the
    history was read: the fleet's own claim of it may still come."""
    scheduler, _ = await down_for_ten_minutes(clock)  # 08:10:30
    await clock.advance("35s")  # 08:11:05
    steps = await drive(clock, scheduler.backfill("report", at("08:10:00"), at("08:11:00")))
    assert statuses(steps) == [("08:10", "ran"), ("08:11", "skipped")]
    detail = steps[1].detail
    assert detail is not None and "too recent" in detail and "at least 11s old" in detail
    await scheduler.stop()


class Slow:
    """A handler that runs ``seconds`` of virtual time."""

    def __init__(self, clock: TestClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds
        self.runs: list[tuple[str, str, str]] = []

    async def __call__(self, ctx: JobContext) -> None:
        self.runs.append((ctx.instance_id, ctx.reason, ctx.scheduled_at.strftime("%H:%M:%S")))
        await self.clock.sleep(self.seconds)


async def fleet_and_operator(
    clock: TestClock, handler: Any, **options: Any
) -> tuple[Scheduler[Any], Scheduler[Any]]:
    """A fleet instance that runs ``tick`` (every 10 s) from 08:02 on, and an operator's
    scheduler that schedules nothing, on one store; the clock at 08:03:03."""
    backend = MemoryBackend(lease_ttl="5s")
    fleet = Scheduler(backend, clock=clock, jitter=0, instance_id="fleet")
    operator = Scheduler(backend, clock=clock, jitter=0, instance_id="ops", enabled=False)
    for each in (fleet, operator):
        each.every("tick", "10s", handler, max_late="5s", catch_up=0, **options)
    await operator.start()
    await clock.advance_to(at("08:02:00"))
    await fleet.start()
    await clock.advance_to(at("08:03:03"))
    return fleet, operator


def twice(runs: list[tuple[str, str, str]]) -> list[str]:
    slots = [slot for _, _, slot in runs]
    return sorted({slot for slot in slots if slots.count(slot) > 1})


async def test_a_slot_running_when_the_backfill_began_is_not_run_again(clock: TestClock) -> None:
    """The 08:03:00 run is going when the history is read; the backfill reaches the slot
    two minutes later, when it is old enough to take and its record has landed."""
    slow = Slow(clock, 6)
    fleet, operator = await fleet_and_operator(clock, slow, timeout="10s")
    assert ("fleet", "schedule", "08:03:00") in slow.runs
    steps = await drive(
        clock, operator.backfill("tick", at("08:00:00"), at("08:03:00"), rate=0.1), "1s"
    )
    assert twice(slow.runs) == []
    said = {step.at.strftime("%H:%M:%S"): step.status for step in steps}
    assert said["08:03:00"] == "already-run"
    assert [s.status for s in steps].count("ran") == 13  # 08:00:00 to 08:02:00: missed
    for each in (fleet, operator):
        await each.stop()


class Lasting(Slow):
    """The fleet's runs of some slots last longer (``lasting``: slot -> seconds)."""

    def __init__(self, clock: TestClock, lasting: dict[str, float]) -> None:
        super().__init__(clock, 1)
        self.lasting = lasting

    async def __call__(self, ctx: JobContext) -> None:
        slot = ctx.scheduled_at.strftime("%H:%M:%S")
        self.runs.append((ctx.instance_id, ctx.reason, slot))
        await self.clock.sleep(self.lasting.get(slot, 1) if ctx.reason == "schedule" else 1)


async def test_a_run_without_timeout_is_never_backfilled_while_it_runs_or_once_it_ended(
    clock: TestClock,
) -> None:
    """No timeout bounds the run: the store tells. 08:02:10 runs until 08:03:05, 08:02:20
    until 08:07:20; the history is read at 08:03:03 and the backfill reaches them after
    08:03:13 (a slot every 10 s): the first has ended (its record landed before its lease
    ended), the second still runs (its lease)."""
    lasting = Lasting(clock, {"08:02:10": 55, "08:02:20": 300})
    fleet, operator = await fleet_and_operator(clock, lasting, overlap="allow")
    steps = await drive(
        clock, operator.backfill("tick", at("08:01:50"), at("08:02:20"), rate=0.1), "1s"
    )
    assert twice(lasting.runs) == []
    said = [(s.at.strftime("%H:%M:%S"), s.status) for s in steps]
    assert said == [
        ("08:01:50", "ran"),  # missed: the fleet started at 08:02
        ("08:02:00", "ran"),
        ("08:02:10", "already-run"),
        ("08:02:20", "not-acquired"),
    ]
    assert "holds its lease" in (steps[-1].detail or "")
    for each in (fleet, operator):
        await each.stop()


class SlowRecords(MemoryBackend):
    """The fleet's records written apart from a release land ``record_s`` (virtual) after they
    are sent."""

    def __init__(self, clock: TestClock, record_s: float) -> None:
        super().__init__(lease_ttl="30s")
        self.clock, self.record_s = clock, record_s

    async def record(self, job: Any, record: Any) -> None:
        await self.record_many([(job, record)])

    async def record_many(self, records: Any) -> None:
        if any(record.instance_id == "fleet" for _, record in records):
            await self.clock.sleep(self.record_s)
        await super().record_many(records)


async def test_a_runs_record_comes_with_the_end_of_its_lease(clock: TestClock) -> None:
    """The run of 08:02:10 ends at 08:03:12.5; a record written apart from its release would
    land 0.8 s later: the backfill, there at 08:03:13, finds the record, not a slot that holds
    neither lease nor record (which it would run again)."""
    lasting = Lasting(clock, {"08:02:10": 62.5})
    backend = SlowRecords(clock, 0.8)
    fleet = Scheduler(backend, clock=clock, jitter=0, instance_id="fleet")
    operator = Scheduler(backend, clock=clock, jitter=0, instance_id="ops", enabled=False)
    for each in (fleet, operator):
        each.every("tick", "10s", lasting, max_late="5s", catch_up=0, overlap="allow")
    await operator.start()
    await clock.advance_to(at("08:02:00"))
    await fleet.start()
    await clock.advance_to(at("08:03:03"))
    steps = await drive(
        clock, operator.backfill("tick", at("08:02:00"), at("08:02:10"), rate=0.1), "1s"
    )
    assert [s.status for s in steps] == ["ran", "already-run"]
    assert twice(lasting.runs) == []
    for each in (fleet, operator):
        await each.stop()


async def test_a_slot_backfilled_on_the_jobs_own_row_is_not_caught_up_at_the_next_start(
    clock: TestClock,
) -> None:
    """The fleet ran, stopped, and the gap was backfilled; a fleet instance that starts within
    ``catch_up`` of the last slot would catch it up: the backfill's claim, on the job's own
    row, fenced it."""
    backend, seen = MemoryBackend(lease_ttl="5s"), Seen()
    fleet = Scheduler(backend, clock=clock, jitter=0, instance_id="fleet")
    operator = Scheduler(backend, clock=clock, jitter=0, instance_id="ops", enabled=False)
    for each in (fleet, operator):
        each.every("report", "1m", seen, max_late="10s", catch_up="10m")
    await fleet.start()
    await operator.start()
    await clock.advance("2m")  # 08:02:30: the fleet ran 08:01 and 08:02
    await fleet.stop()
    await clock.advance("3m")  # 08:05:30
    steps = await drive(clock, operator.backfill("report", at("08:03:00"), at("08:05:00")))
    assert statuses(steps) == [("08:03", "ran"), ("08:04", "ran"), ("08:05", "ran")]
    restarted = Scheduler(backend, clock=clock, jitter=0, instance_id="fleet2")
    restarted.every("report", "1m", seen, max_late="10s", catch_up="10m")
    await restarted.start()
    await clock.advance("10s")
    assert [r for _, r, _ in seen.runs] == ["schedule"] * 2 + ["backfill"] * 3
    for each in (restarted, operator):
        await each.stop()


async def test_a_slot_run_by_a_catch_up_is_not_backfilled(clock: TestClock) -> None:
    """The fleet ran 08:01 and stopped; the instance that starts at 08:04:50 catches up 08:04
    (``catch_up``). A backfill of 08:02 to 08:04 then runs the two slots nobody ran, not 08:04
    again."""
    backend, seen = MemoryBackend(lease_ttl="5s"), Seen()
    first = Scheduler(backend, clock=clock, jitter=0, instance_id="first")
    restarted = Scheduler(backend, clock=clock, jitter=0, instance_id="restarted")
    operator = Scheduler(backend, clock=clock, jitter=0, instance_id="ops", enabled=False)
    for each in (first, restarted, operator):
        each.every("report", "1m", seen, max_late="10s", catch_up="2m")
    await first.start()
    await operator.start()
    await clock.advance("1m")  # 08:01:30: 08:01 ran
    await first.stop()
    await clock.advance("3m20s")  # 08:04:50
    await restarted.start()
    await clock.advance("30s")  # 08:05:20: 08:04 was caught up, 08:05 ran on schedule
    assert [(r, s) for _, r, s in seen.runs] == [
        ("schedule", "08:01:00"),
        ("catch-up", "08:04:00"),
        ("schedule", "08:05:00"),
    ]
    steps = await drive(clock, operator.backfill("report", at("08:02:00"), at("08:04:00")))
    assert twice(seen.runs) == [], "a slot ran twice"
    assert statuses(steps) == [("08:02", "ran"), ("08:03", "ran"), ("08:04", "already-run")]
    for each in (restarted, operator):
        await each.stop()


async def test_a_disabled_job_is_not_backfilled_and_a_paused_one_is(clock: TestClock) -> None:
    """Pausing stops the schedule, not an operator's explicit run (as ``trigger()``);
    disabling stops both."""
    scheduler, seen = await down_for_ten_minutes(clock)
    job = scheduler.get("report")
    assert job is not None
    await job.disable(by="ops")
    steps = await drive(clock, scheduler.backfill("report", at("08:01:00"), at("08:02:00")))
    assert [(s.status, s.detail) for s in steps] == [
        ("skipped", "the job is disabled for the fleet (enable it to backfill)")
    ] * 2
    dry = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:02:00"), dry_run=True)
    )
    assert [s.status for s in dry] == ["skipped"] * 2  # a dry run says the same
    await job.enable(by="ops")
    await job.pause(by="ops")
    steps = await drive(clock, scheduler.backfill("report", at("08:01:00"), at("08:02:00")))
    assert [s.status for s in steps] == ["ran", "ran"]
    assert len(seen.runs) == 2
    await scheduler.stop()


async def test_a_dry_run_answers_as_the_backfill_then_does(clock: TestClock) -> None:
    """After a newer range was backfilled, an older one is refused by the backfills' fence: the
    dry run says so, as the real one then finds; a slot whose run holds its lease likewise."""
    scheduler, seen = await down_for_ten_minutes(clock)
    await drive(clock, scheduler.backfill("report", at("08:06:00"), at("08:07:00"), rate=100))
    dry = await drive(
        clock, scheduler.backfill("report", at("08:03:00"), at("08:08:00"), dry_run=True)
    )
    real = await drive(
        clock, scheduler.backfill("report", at("08:03:00"), at("08:08:00"), rate=100)
    )
    said = [s.status if s.status != "would-run" else "ran" for s in dry]
    assert said == [s.status for s in real] == [
        "not-acquired", "not-acquired", "not-acquired", "already-run", "already-run", "ran",
    ]  # fmt: skip
    assert dry[0].detail == real[0].detail and "older ranges first" in (dry[0].detail or "")
    assert len(seen.runs) == 3
    await scheduler.stop()


async def test_a_job_disabled_while_the_backfill_waits_for_its_rate_runs_no_more(
    clock: TestClock,
) -> None:
    """At 0.5 slot a second the backfill waits 2 s before each slot: a disable made then (here
    or on any instance) stops the next slot, not only the one after."""
    scheduler, seen = await down_for_ten_minutes(clock)
    job = scheduler.get("report")
    assert job is not None

    async def disable_a_second_later() -> None:
        await clock.sleep(1)
        await job.disable(by="ops")

    disabling = asyncio.ensure_future(disable_a_second_later())
    steps = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:03:00"), rate=0.5)
    )
    await disabling
    assert [s.status for s in steps] == ["ran", "skipped", "skipped"]
    assert len(seen.runs) == 1
    await scheduler.stop()


async def test_a_backfill_waits_for_its_read_of_the_controls_after_a_failed_one(
    clock: TestClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance that schedules nothing (the CLI's) reads the fleet's controls only when it
    runs something: once a read failed, the next is still waited for, so a job disabled for
    the fleet since (by another instance) is not backfilled."""
    store = MemoryStore()
    scheduler, seen = await down_for_ten_minutes(clock, store=store)
    other = Scheduler(MemoryBackend(lease_ttl="5s", store=store), clock=clock, jitter=0,
                      instance_id="ops", enabled=False)  # fmt: skip
    other.every("report", "1m", Seen(), catch_up=0, max_late="10s")
    await other.start()
    backend = scheduler.backend
    read = backend.controls

    async def away() -> Any:
        raise BackendUnavailableError("the store is away")

    job, other_job = scheduler.get("report"), other.get("report")
    assert job is not None and other_job is not None
    await other_job.disable(by="ops")

    async def fail_a_read() -> None:  # a dry run: nothing runs, nothing else is published
        monkeypatch.setattr(backend, "controls", away)
        await drive(
            clock, scheduler.backfill("report", at("08:01:00"), at("08:01:00"), dry_run=True)
        )
        monkeypatch.setattr(backend, "controls", read)
        await clock.advance("2s")  # the failed read is no read of the last second

    await fail_a_read()
    assert await drive(clock, job.trigger()) is None  # not run by hand
    await fail_a_read()
    steps = await drive(clock, scheduler.backfill("report", at("08:01:00"), at("08:01:00")))
    assert [s.status for s in steps] == ["skipped"]  # nor backfilled
    assert seen.runs == []
    await other.stop()
    await scheduler.stop()


async def test_slots_the_fleet_ran_stay_known_while_the_backfills_records_push_theirs_out(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    """The history keeps the latest ``history_size`` records: the backfill's own records push
    out those of the runs after the gap it fills, which it must still know as run."""
    seen = Seen()
    job = scheduler.every("report", "1m", seen, catch_up=0, max_late="10s", history_size=6)
    await scheduler.start()
    job.pause()
    await clock.advance("5m")  # 08:01 to 08:05 missed
    job.resume()
    await clock.advance("5m")  # 08:06 to 08:10 run on schedule: 5 of the 6 records kept
    steps = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:08:00"), rate=100)
    )
    assert statuses(steps) == [
        *[(f"08:0{n}", "ran") for n in range(1, 6)],
        *[(f"08:0{n}", "already-run") for n in range(6, 9)],
    ]
    ran = [slot for _, _, slot in seen.runs]
    assert sorted(ran) == sorted(set(ran))  # each slot once


class LostAnswer(MemoryBackend):
    """A store whose answer to the claim of the backfills' fence for ``lose`` is lost: the
    claim lands, the caller hears an error."""

    lose: int | None = None

    async def acquire(self, slot: Slot, **kwargs: Any) -> Any:
        answer = await super().acquire(slot, **kwargs)
        if slot.job.endswith(":backfill") and slot.slot_ms == self.lose:
            raise BackendUnavailableError("the answer was lost")
        return answer


async def test_a_slot_the_backend_failed_on_stops_the_backfill_and_dry_runs_see_its_fence(
    clock: TestClock,
) -> None:
    """The claim of 08:03's fence lands unanswered: the backfill stops there (a later slot's
    claim would fence 08:03 away for good, unseen), and says so; a dry run then says what the
    real run finds, the fence claimed on a slot of the job's own row."""
    seen = Seen()
    backend = LostAnswer(lease_ttl="5s")
    backend.lose = 1_800_000_000_000 + 180_000  # 08:03
    scheduler = Scheduler(backend, clock=clock, jitter=0, instance_id="me", enabled=False)
    scheduler.every("report", "1m", seen, catch_up=0, max_late="10s")
    await scheduler.start()
    await clock.advance("10m")
    steps = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:06:00"), rate=100)
    )
    assert statuses(steps) == [
        ("08:01", "ran"),
        ("08:02", "ran"),
        ("08:03", "skipped"),
        ("08:04", "skipped"),
        ("08:05", "skipped"),
        ("08:06", "skipped"),
    ]
    assert "the backend failed" in (steps[2].detail or "")
    assert "run the backfill again from it" in (steps[3].detail or "")
    backend.lose = None
    dry = await scheduler.backfill("report", at("08:03:00"), at("08:05:00"), dry_run=True)
    real = await drive(
        clock, scheduler.backfill("report", at("08:03:00"), at("08:05:00"), rate=100)
    )
    assert statuses(dry) == [
        ("08:03", "not-acquired"),
        ("08:04", "would-run"),
        ("08:05", "would-run"),
    ]
    assert statuses(real) == [("08:03", "not-acquired"), ("08:04", "ran"), ("08:05", "ran")]
    await scheduler.stop()


async def test_a_dead_backfills_slot_is_taken_over_by_the_next_backfill(
    clock: TestClock,
) -> None:
    """A backfill's run whose process died holds its slot's lease under the backfills' key,
    which no fleet sweep takes over: the next backfill reaching the slot does, recording the
    dead attempt ``interrupted`` and running the slot again (attempts allowing)."""
    store = MemoryStore()
    scheduler, seen = await down_for_ten_minutes(clock, store=store)
    await drive(clock, scheduler.backfill("report", at("08:01:00"), at("08:01:00"), rate=100))
    dead = MemoryBackend(lease_ttl="5s", store=store)
    await dead.start(clock)
    slot = 1_800_000_000_000 + 120_000  # 08:02
    policy = JobPolicy("report:backfill", overlap="allow", max_attempts=1)
    lease = await dead.acquire(
        Slot("report:backfill", slot), policy=policy, instance_id="dead", run_id="r-dead",
        reason="backfill", timeout=5,
    )  # fmt: skip
    assert lease is not None  # 08:02's backfill, whose process is then killed: no record
    await clock.advance("10s")
    steps = await drive(
        clock, scheduler.backfill("report", at("08:01:00"), at("08:03:00"), rate=100)
    )
    assert statuses(steps) == [("08:01", "already-run"), ("08:02", "ran"), ("08:03", "ran")]
    assert [s for _, _, s in seen.runs] == ["08:01:00", "08:02:00", "08:03:00"]
    history = await scheduler.get("report").history(10)  # type: ignore[union-attr]
    assert [(r.slot_ms, r.attempt, r.outcome) for r in history if r.slot_ms == slot] == [
        (slot, 2, "completed")
    ]
    # The dead attempt is recorded by the take-over, under the backfills' key.
    dead_runs = await dead.history(replace(policy, history_size=10), 10)
    assert [(r.run_id, r.outcome) for r in dead_runs] == [("r-dead", "interrupted")]
    again = await drive(
        clock, scheduler.backfill("report", at("08:02:00"), at("08:02:00"), rate=100)
    )
    assert statuses(again) == [("08:02", "already-run")]
    await dead.stop()
    await scheduler.stop()


async def test_on_a_claim_only_backend_a_slot_in_the_fleets_claim_window_is_left_to_it(
    clock: TestClock,
) -> None:
    """The instance a slot fell due on claims it up to ``jitter + max_late`` later: a
    backfill's claim before that would win it, run it early, as a backfill."""
    seen = Seen()
    backend = DictClaimBackend(slot_ttl=timedelta(minutes=5))
    scheduler = Scheduler(backend, clock=clock, instance_id="me", enabled=False)
    scheduler.every("report", "1m", seen, jitter="10s", max_late="30s")
    await scheduler.start()
    await clock.advance("10m")  # 08:10:30
    steps = await drive(
        clock, scheduler.backfill("report", at("08:08:00"), at("08:10:00"), rate=100)
    )
    assert statuses(steps) == [("08:08", "ran"), ("08:09", "ran"), ("08:10", "skipped")]
    detail = steps[-1].detail
    assert detail is not None and "too recent" in detail and "at least 41s old" in detail
    assert [slot for _, _, slot in seen.runs] == ["08:08:00", "08:09:00"]
    await scheduler.stop()


class Behind(Clock):
    """The store's clock: the instance's, ``ms`` behind (the instance's is fast)."""

    def __init__(self, clock: Clock, ms: int) -> None:
        self.clock, self.ms = clock, ms

    def now_ms(self) -> int:
        return self.clock.now_ms() - self.ms

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        raise NotImplementedError("a store clock has no timers")


@pytest.mark.parametrize("dry_run", [False, True])
async def test_a_backfill_whose_clock_is_fast_takes_no_slot_not_yet_old_enough_by_the_store(
    clock: TestClock, dry_run: bool
) -> None:
    """The instance's clock is 2m20s ahead of the store's: its "now" (08:10:30) is 08:08:10
    for the fleet, whose claims the store judges. Slots are judged on the store's clock."""
    seen = Seen()
    backend = MemoryBackend(lease_ttl="5s", store_clock=Behind(clock, 140_000))
    scheduler = Scheduler(backend, clock=clock, jitter=0, instance_id="me", enabled=False)
    scheduler.every("report", "1m", seen, catch_up=0, max_late="10s")
    await scheduler.start()
    await clock.advance("10m")  # 08:10:30 here, 08:08:10 on the store
    steps = await drive(
        clock,
        scheduler.backfill("report", at("08:06:00"), at("08:10:30"), rate=100, dry_run=dry_run),
    )
    ok = "would-run" if dry_run else "ran"
    assert statuses(steps) == [
        ("08:06", ok),
        ("08:07", ok),
        ("08:08", "skipped"),  # 10 s old on the store: the fleet's (jitter + max_late + 1 s)
        ("08:09", "skipped"),  # not due on the store
        ("08:10", "skipped"),
    ]
    recent, early = steps[2].detail or "", steps[3].detail or ""
    assert "too recent by MemoryBackend's clock (2027-01-15T08:08:10" in recent
    assert "at least 11s old" in recent
    assert "not due yet by MemoryBackend's clock (2027-01-15T08:08:10" in early
    assert "this instance's clock is 2m20s ahead of it" in early
    assert [slot for _, _, slot in seen.runs] == ([] if dry_run else ["08:06:00", "08:07:00"])
    await scheduler.stop()


async def test_a_slot_whose_runner_died_says_its_lease_holds_it_until_the_fleet_takes_it(
    clock: TestClock,
) -> None:
    """A runner that died with its lease, its one attempt spent: nothing retries it. The
    backfill leaves it to the fleet's sweep, and says so without claiming a retry."""
    store = MemoryStore()
    scheduler, seen = await down_for_ten_minutes(clock, store, max_attempts=1)
    dead = MemoryBackend(lease_ttl="5s", store=store)
    await dead.start(clock)
    policy = JobPolicy("report", max_attempts=1)
    slot = Slot("report", datetime_ms(at("08:05:00")))
    lease = await dead.acquire(
        slot, policy=policy, instance_id="dead", run_id="r", reason="schedule", timeout=1
    )
    assert not isinstance(lease, str)  # granted, and never renewed nor released
    steps = await drive(
        clock, scheduler.backfill("report", at("08:05:00"), at("08:05:00"), rate=100)
    )
    assert statuses(steps) == [("08:05", "not-acquired")]
    detail = steps[0].detail or ""
    assert "its runner died and no instance has taken the slot over" in detail
    assert "being retried" not in detail
    assert seen.runs == []
    await dead.stop()
    await scheduler.stop()


def datetime_ms(value: datetime) -> int:
    return round(value.timestamp() * 1000)

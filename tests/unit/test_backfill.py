"""``Scheduler.backfill``: a job's slots of a past range, each claimed like any slot, run once
(``ctx.reason == "backfill"``), rate limited; on the memory backend and virtual time."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import pytest

from brokersched import ConfigurationError, JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend


def at(text: str) -> datetime:
    return datetime.fromisoformat(f"2027-01-15T{text}+00:00")


class Seen:
    def __init__(self) -> None:
        self.runs: list[tuple[str, str, str]] = []  # (instance, reason, slot HH:MM:SS)

    async def __call__(self, ctx: JobContext) -> None:
        self.runs.append((ctx.instance_id, ctx.reason, ctx.scheduled_at.strftime("%H:%M:%S")))


async def drive(clock: TestClock, coro: Any) -> Any:
    """Await ``coro`` while the virtual clock runs on (a backfill's pauses are on it)."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        await clock.advance("10ms")
    return task.result()


def statuses(steps: list[Any]) -> list[tuple[str, str]]:
    return [(step.at.strftime("%H:%M"), step.status) for step in steps]


async def down_for_ten_minutes(clock: TestClock, **options: Any) -> tuple[Scheduler[Any], Seen]:
    """A scheduler that did not schedule (disabled) while ten slots of ``every 1m`` passed."""
    seen = Seen()
    backend = MemoryBackend(lease_ttl="5s")
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
        ("08:10", "ran"),
    ]
    assert first[0].detail is not None and "slot memory" in first[0].detail
    # Another instance (its own history): the claims it remembers refuse them.
    second = await drive(
        clock, schedulers[1].backfill("report", at("08:06:00"), at("08:10:00"), rate=100)
    )
    assert {step.status for step in second} == {"not-acquired"}
    assert len(seen.runs) == 5
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


async def test_on_a_lease_backend_slots_the_fleet_may_still_run_are_skipped(
    clock: TestClock,
) -> None:
    """A backfill's claim is not the job's: a slot still within reach of a late claim, a
    catch-up, a take-over or its record is left alone."""
    scheduler, _ = await down_for_ten_minutes(clock)  # 08:10:30
    steps = await drive(clock, scheduler.backfill("report", at("08:09:00"), at("08:10:00")))
    assert statuses(steps) == [("08:09", "ran"), ("08:10", "skipped")]
    detail = steps[1].detail
    assert detail is not None and "too recent" in detail and "at least 40s old" in detail
    await scheduler.stop()

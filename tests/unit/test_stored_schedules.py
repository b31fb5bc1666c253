"""Schedules as data, in virtual time on one memory store: a schedule written from one process
runs once per slot on a fleet of others; a change applies from its effective time on every
instance alike; a delete stops it; a stale view claims nothing; concurrent writers are ordered
by ``if_version``; bad input is refused naming it and writes nothing."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from brokersched import (
    BackendError,
    ConfigurationError,
    JobContext,
    RabbitMQBackend,
    ScheduleConflictError,
    Scheduler,
    SkipEvent,
)
from brokersched._stored import (
    EFFECTIVE_AFTER_MS,
    LOG_MAX,
    TIMELINE_MAX,
    Log,
    Record,
    Spec,
    VersionedTrigger,
)
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from brokersched.triggers.interval import IntervalTrigger
from tests.support.clocks import START


class Runs:
    """Every run of every instance: (instance, slot time, data)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def task(self, instance: str) -> Any:
        async def send(ctx: JobContext) -> None:
            self.seen.append((instance, f"{ctx.scheduled_at:%H:%M:%S}", ctx.data))

        return send

    def slots(self) -> Counter[str]:
        return Counter(slot for _, slot, _ in self.seen)


def fleet(clock: TestClock, store: MemoryStore, runs: Runs, n: int = 3) -> list[Scheduler[Any]]:
    members = []
    for i in range(n):
        sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id=f"i{i}")
        sched.task("reports.send")(runs.task(f"i{i}"))
        members.append(sched)
    return members


async def start(*schedulers: Scheduler[Any]) -> None:
    for sched in schedulers:
        await sched.start()


async def stop(*schedulers: Scheduler[Any]) -> None:
    for sched in schedulers:
        await sched.stop()


@pytest.mark.asyncio
async def test_a_schedule_written_elsewhere_runs_once_per_slot_on_the_fleet() -> None:
    clock, store, runs = TestClock(START), MemoryStore(), Runs()
    members = fleet(clock, store, runs)
    writer = Scheduler(MemoryBackend(store=store), clock=clock, instance_id="writer")
    await start(writer, *members)
    try:
        written = await writer.schedules.put(
            "acme", task="reports.send", every="10s", data={"tenant": "acme"}, by="admin"
        )
        assert (written.version, written.task, written.updated_by) == (1, "reports.send", "admin")
        assert written.trigger == {"kind": "every", "interval_ms": 10_000, "offset_ms": 0}
        await clock.advance("1m")
        slots = runs.slots()
        assert slots and set(slots.values()) == {1}, slots
        # 08:00:30 + 3 s effective: the first slot is 08:00:40, the last 08:01:30
        expected = ["08:00:40", "08:00:50", "08:01:00", "08:01:10", "08:01:20", "08:01:30"]
        assert sorted(slots) == expected
        assert {data["tenant"] for _, _, data in runs.seen} == {"acme"}
        assert all(sched.get("acme") is not None for sched in members)
    finally:
        await stop(writer, *members)


@pytest.mark.asyncio
async def test_a_change_of_interval_applies_from_its_effective_time_on_every_instance() -> None:
    clock, store, runs = TestClock(START), MemoryStore(), Runs()
    members = fleet(clock, store, runs)
    await start(*members)
    try:
        await members[0].schedules.put("acme", task="reports.send", every="10s")
        await clock.advance("30s")  # 08:01:00
        before = set(runs.slots())
        await members[1].schedules.put("acme", task="reports.send", every="7s", data="v2")
        await clock.advance("30s")  # 08:01:30
        slots = runs.slots()
        assert set(slots.values()) == {1}, slots
        after = [slot for slot in slots if slot not in before]
        # effective 08:01:03: the slots of 7 s from then (on the epoch's grid), none of 10 s
        assert after == ["08:01:09", "08:01:16", "08:01:23", "08:01:30"], after
        assert [d for _, s, d in runs.seen if s in after] == ["v2"] * 4
    finally:
        await stop(*members)


@pytest.mark.asyncio
async def test_a_deleted_schedule_stops_and_leaves_its_job() -> None:
    clock, store, runs = TestClock(START), MemoryStore(), Runs()
    members = fleet(clock, store, runs, n=2)
    await start(*members)
    try:
        await members[0].schedules.put("acme", task="reports.send", every="10s")
        await clock.advance("20s")
        assert await members[1].schedules.delete("acme", by="ops") is True
        assert await members[1].schedules.delete("acme") is False
        count = len(runs.seen)
        await clock.advance("1m")
        assert len(runs.seen) == count
        await clock.advance("10s")  # its last slot's max_late (60 s) is over: the job goes
        assert all(sched.get("acme") is None for sched in members)
        assert await members[0].schedules.get("acme") is None
    finally:
        await stop(*members)


@pytest.mark.asyncio
async def test_an_instance_without_the_task_leaves_the_slots_to_those_with_it() -> None:
    clock, store, runs = TestClock(START), MemoryStore(), Runs()
    (member,) = fleet(clock, store, runs, n=1)
    other = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="old")
    other.task("something.else")(runs.task("old"))
    await start(member, other)
    try:
        await other.schedules.put("acme", task="reports.send", every="10s")
        await clock.advance("1m")
        assert {instance for instance, _, _ in runs.seen} == {"i0"}
        assert other.get("acme") is None
    finally:
        await stop(member, other)


@pytest.mark.asyncio
async def test_a_stale_view_claims_nothing() -> None:
    clock, store, runs = TestClock(START), MemoryStore(), Runs()
    (member,) = fleet(clock, store, runs, n=1)
    skips: list[SkipEvent] = []
    member.on("skip", skips.append)
    await start(member)
    try:
        await member.schedules.put("acme", task="reports.send", every="10s")
        await clock.advance("15s")
        ran = len(runs.seen)
        real_read = member.backend.fleet_records

        async def failing(kind: Any) -> dict[str, str]:
            raise BackendError("store away")

        member.backend.fleet_records = failing  # type: ignore[method-assign]
        await clock.advance("30s")
        assert len(runs.seen) == ran
        assert skips and all(s.reason == "backend-error" for s in skips)
        assert "stored schedules were last read" in (skips[0].detail or "")
        member.backend.fleet_records = real_read  # type: ignore[method-assign]
        await clock.advance("20s")
        assert len(runs.seen) > ran
    finally:
        await stop(member)


@pytest.mark.asyncio
async def test_if_version_orders_concurrent_writers() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock)
    await sched.start()
    try:
        first = await sched.schedules.put("acme", task="t", every="1m", if_version=0)
        with pytest.raises(ScheduleConflictError) as conflict:
            await sched.schedules.put("acme", task="t", every="2m", if_version=0)
        assert conflict.value.version == 1
        second = await sched.schedules.put("acme", task="t", every="2m", if_version=1)
        assert second.version == 2
        with pytest.raises(ScheduleConflictError):
            await sched.schedules.delete("acme", if_version=first.version)
        assert await sched.schedules.delete("acme", if_version=2)
        again = await sched.schedules.put("acme", task="t", every="1m", if_version=0)
        assert again.version == 4  # the numbering goes on after a delete
        listed = [s.id async for s in sched.schedules.list(prefix="ac")]
        assert listed == ["acme"]
    finally:
        await sched.stop()


@pytest.mark.asyncio
async def test_bad_input_is_refused_naming_it_and_writes_nothing() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock)
    await sched.start()
    try:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"task": "t"}, "exactly one of every=, cron= or at="),
            ({"task": "t", "every": "1m", "cron": "* * * * *"}, "given: every, cron"),
            ({"task": "t", "cron": "0 25 * * *"}, "hour '25' is out of range"),
            ({"task": "t", "cron": "0 8 * * *", "timezone": "Mars/Olympus"}, "Mars/Olympus"),
            ({"task": "t", "every": "1m", "key": "x"}, "option 'key' is not taken"),
            ({"task": "t", "every": "1m", "data": object()}, "cannot be stored"),
            ({"task": "t", "every": "1m", "jitter": "soon"}, "jitter"),
            ({"task": "t", "every": "1m", "claim": False}, "runs once on the fleet"),
            ({"task": "t", "every": "1m", "run_on_start": True}, "no start of its own"),
            ({"task": "", "every": "1m"}, "is not a task name"),
            ({"task": "a\x00b", "every": "1m"}, "is not a task name"),
            ({"task": "t", "at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))}, "at "),
            ({"task": "t", "at": "0001-01-01T00:00:00+05:00"}, "at "),
            ({"task": "t", "every": "1m", "data": "x" * 20_000}, "more than 16384"),
        ]
        for given, words in cases:
            with pytest.raises(ConfigurationError, match=None) as refused:
                await sched.schedules.put("acme", **given)
            assert words in str(refused.value), (given, str(refused.value))
        with pytest.raises(ConfigurationError, match="not valid"):
            await sched.schedules.put("a b", task="t", every="1m")
        assert [s async for s in sched.schedules.list()] == []
    finally:
        await sched.stop()


@pytest.mark.asyncio
async def test_a_lease_only_option_is_refused_on_a_claim_only_backend_when_written() -> None:
    backend = RabbitMQBackend("amqp://guest:guest@127.0.0.1:1/")
    sched = Scheduler(backend)
    with pytest.raises(ConfigurationError) as refused:
        await sched.schedules.put("acme", task="t", every="1m", overlap="skip")
    assert refused.value.option == "overlap"
    assert "RabbitMQBackend" in str(refused.value)


@pytest.mark.asyncio
async def test_the_name_of_a_job_of_the_code_is_not_a_schedule_id() -> None:
    sched = Scheduler(MemoryBackend(), clock=TestClock(START))
    sched.every("acme", "1m", lambda ctx: None)
    with pytest.raises(ConfigurationError, match="taken"):
        await sched.schedules.put("acme", task="t", every="1m")


def test_a_versioned_trigger_gives_each_instant_the_version_in_force() -> None:
    ten, seven = IntervalTrigger(timedelta(seconds=10)), IntervalTrigger(timedelta(seconds=7))
    trigger = VersionedTrigger([(5_000, ten), (63_000, seven), (90_000, None)])
    fires, at = [], 0
    while (nxt := trigger.next_ms(at)) is not None:
        fires.append(nxt)
        at = nxt
    assert fires == [10_000, 20_000, 30_000, 40_000, 50_000, 60_000, 63_000, 70_000, 77_000, 84_000]


def test_the_log_keeps_every_change_until_it_is_dropped_to_its_record() -> None:
    log, dropped_all = Log(), []
    for n in range(LOG_MAX + 5):
        record = Record.new(f"s{n}").changed(Spec("t", "every", "1m"), n, None)
        log, dropped = log.appended(record, n)
        dropped_all += dropped
    assert len(log.changes) == LOG_MAX and [c.record.id for c in dropped_all] == [
        f"s{n}" for n in range(5)
    ]
    assert Log.loads(log.dumps()) == log


def test_a_schedule_changed_again_and_again_keeps_one_change_and_its_latest_versions() -> None:
    log, record = Log(), Record.new("a")
    for n in range(300):
        record = record.changed(Spec("t", "every", f"{n + 1}m"), n, None)
        log, dropped = log.appended(record, n)
        assert dropped == []  # superseded, not dropped: the latest record holds it
    assert [c.record for c in log.changes] == [record] and log.rev == 300
    assert record.version == 300 and len(record.timeline) == TIMELINE_MAX
    assert record.effective_ms == 299 + EFFECTIVE_AFTER_MS
    assert record.latest == Spec("t", "every", "300m")


@pytest.mark.asyncio
async def test_a_change_of_time_zone_runs_the_old_zones_slots_then_the_new_ones() -> None:
    clock, store = TestClock("2027-01-15T07:14:50+00:00"), MemoryStore()
    runs = Runs()
    members = fleet(clock, store, runs, n=2)
    await start(*members)
    try:
        # 13:00 in Kathmandu (+05:45) is 07:15Z; in Kolkata (+05:30), 07:30Z
        await members[0].schedules.put(
            "acme", task="reports.send", cron="0 13 * * *", timezone="Asia/Kathmandu"
        )
        await clock.advance("20s")  # Kathmandu's 13:00 has run
        await members[1].schedules.put(
            "acme", task="reports.send", cron="0 13 * * *", timezone="Asia/Kolkata"
        )
        await clock.advance("16m")
        assert runs.slots() == Counter({"07:15:00": 1, "07:30:00": 1})
    finally:
        await stop(*members)


@pytest.mark.asyncio
async def test_a_run_going_on_when_its_schedule_is_deleted_ends_as_it_began() -> None:
    clock, store = TestClock(START), MemoryStore()
    ended: list[tuple[str, Any]] = []

    async def long_report(ctx: JobContext) -> None:
        await ctx.sleep(20)
        ended.append((f"{ctx.scheduled_at:%H:%M:%S}", ctx.data))

    sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="i0")
    sched.task("reports.send")(long_report)
    await sched.start()
    try:
        await sched.schedules.put("acme", task="reports.send", every="30s", data="v1")
        await clock.advance("35s")  # 08:01:05: the run of 08:01:00 goes on until 08:01:20
        await sched.schedules.delete("acme")
        await clock.advance("2m")
        assert ended == [("08:01:00", "v1")]
        assert sched.get("acme") is None
    finally:
        await sched.stop()


@pytest.mark.asyncio
async def test_an_at_instant_before_the_version_takes_effect_is_refused() -> None:
    """A one-off ``at=`` whose instant is past, or before the write takes effect (3 s after it
    is made), would never run: refused naming ``at``, and nothing written; one after it runs."""
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    seen: list[str] = []
    sched.task("t")(Runs().task("i0"))

    @sched.task("u")
    async def once(ctx: JobContext) -> None:
        seen.append(f"{ctx.scheduled_at:%H:%M:%S}")

    await sched.start()
    try:
        for when in ("2027-01-15T08:00:20+00:00", "2027-01-15T08:00:32+00:00"):
            with pytest.raises(ConfigurationError) as refused:
                await sched.schedules.put("once", task="u", at=when)
            assert refused.value.option == "at" and "never run" in str(refused.value)
        assert await sched.schedules.get("once") is None
        await sched.schedules.put("once", task="u", at="2027-01-15T08:00:34+00:00")
        await clock.advance("10s")
        assert seen == ["08:00:34"]
    finally:
        await sched.stop()

"""Job option ``key``: claims, leases, fencing and history kept under a stable key."""

from __future__ import annotations

import logging
from datetime import datetime

import pytest

from brokersched import (
    ConfigurationError,
    MemoryBackend,
    Scheduler,
)
from brokersched.abc import Slot
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from tests.support.helpers import SlotRuns
from tests.support.leases import acquire

START = "2027-01-15T08:00:30+00:00"


def test_key_defaults_to_the_name() -> None:
    scheduler = Scheduler()
    job = scheduler.every("sync", "1m", SlotRuns())
    assert job.key == "sync"
    assert job.settings.policy.name == "sync"
    keyed = scheduler.every("sync.renamed", "1m", SlotRuns(), key="sync-v2")
    assert keyed.key == "sync-v2"
    assert keyed.settings.policy.name == "sync-v2"


def test_two_jobs_of_one_scheduler_with_one_key_are_refused() -> None:
    scheduler = Scheduler()
    scheduler.every("sync", "1m", SlotRuns(), key="sync-v2")
    with pytest.raises(ConfigurationError) as caught:
        scheduler.every("other", "1m", SlotRuns(), key="sync-v2")
    assert str(caught.value) == (
        "job 'other': key 'sync-v2' is taken by job 'sync'; two jobs of one scheduler need "
        "different keys (claims and history are kept under the key)"
    )
    assert caught.value.option == "key"
    scheduler.every("plain", "1m", SlotRuns())
    with pytest.raises(ConfigurationError, match="key 'plain' is taken by job 'plain'"):
        scheduler.every("again", "1m", SlotRuns(), key="plain")  # another job's name is its key
    assert [job.name for job in scheduler.jobs()] == ["sync", "plain"]


def test_a_key_that_is_another_jobs_boot_key_is_refused() -> None:
    """A job's fleet boot run is claimed under ``<key>:start``: a job keyed so would take its
    windows (a later deploy's boot run then never runs) and adopt its leases."""
    scheduler = Scheduler()
    scheduler.every("recover", "1h", SlotRuns(), run_on_start=True)
    with pytest.raises(ConfigurationError) as caught:
        scheduler.every("recover:start", "1m", SlotRuns())
    assert str(caught.value) == (
        "job 'recover:start': key 'recover:start' is where job 'recover' claims its boot runs "
        "('<key>:start'); two jobs of one scheduler need different keys (claims and history "
        "are kept under the key)"
    )
    scheduler.after("sweep:start", "1s", SlotRuns())
    with pytest.raises(
        ConfigurationError, match="'sweep' would claim its boot runs under the key of"
    ):
        scheduler.after("v2", "1s", SlotRuns(), key="sweep")
    assert [job.name for job in scheduler.jobs()] == ["recover", "sweep:start"]
    etl = scheduler.every("etl", "1h", SlotRuns())  # no boot runs: "etl:start" is a key like any
    scheduler.every("etl:start", "1h", SlotRuns())
    with pytest.raises(ConfigurationError, match="key 'etl' would claim its boot runs under"):
        etl.update(run_on_start=True)
    assert not etl.options.run_on_start
    overridden = Scheduler(overrides={"other": {"key": "recover:start"}})
    overridden.every("recover", "1h", SlotRuns(), run_on_start=True)
    with pytest.raises(ConfigurationError, match="key 'recover:start' is where job 'recover'"):
        overridden.every("other", "1m", SlotRuns())


def test_a_job_keeps_its_own_key_on_update() -> None:
    scheduler = Scheduler()
    job = scheduler.every("sync", "1m", SlotRuns(), key="sync-v2")
    job.update(jitter="1s")
    assert job.key == "sync-v2"
    other = scheduler.every("b", "1m", SlotRuns())
    with pytest.raises(ConfigurationError, match="key 'sync-v2' is taken"):
        other.update(key="sync-v2")
    assert other.key == "b"


@pytest.mark.parametrize("key", ["", "has space", "a/b", "x" * 129, ".dot-first"])
def test_an_invalid_key_is_refused(key: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Scheduler().every("sync", "1m", SlotRuns(), key=key)
    assert str(caught.value).startswith(f"job 'sync': option 'key' {key!r} is not valid: use")
    assert caught.value.option == "key"


def test_a_key_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="option 'key' = 3 is invalid"):
        Scheduler().every("sync", "1m", SlotRuns(), key=3)  # type: ignore[call-overload]


async def test_a_renamed_job_keeping_its_key_never_runs_a_slot_twice() -> None:
    """A deploy renames ``sync`` to ``sync.renamed``: old and new instances overlap for a while
    and claim the same slots, so each slot runs once; the history is the key's."""
    clock, store, runs = TestClock(START), MemoryStore(), SlotRuns()
    old = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="old")
    new = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="new")
    old.every("sync", "1m", runs, key="sync-v2", catch_up=0)
    renamed = new.every("sync.renamed", "1m", runs, key="sync-v2", catch_up=0)
    await old.start()
    await clock.advance("2m")
    await new.start()
    await clock.advance("3m")  # both run
    await old.stop()
    await clock.advance("2m")
    slots = [slot for _, _, slot in runs.seen]
    assert len(slots) == 7
    assert len(set(slots)) == len(slots)
    assert {job for _, job, _ in runs.seen} == {"sync", "sync.renamed"}
    history = await renamed.history(limit=20)
    assert len(history) == 7
    assert {record.job for record in history} == {"sync-v2"}
    assert {record.instance_id for record in history} == {"old", "new"}
    await new.stop()


async def test_logs_and_events_name_the_job_records_carry_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "brokersched")
    clock = TestClock(START)
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    events: list[str] = []
    scheduler.on("complete", lambda event: events.append(event.job))
    job = scheduler.every("sync.renamed", "1m", SlotRuns(), key="sync")
    async with scheduler:
        await clock.advance("30s")
        (record,) = await job.history()
    assert record.job == "sync"
    assert events == ["sync.renamed"]
    (line,) = [r for r in caplog.records if r.getMessage().startswith("run ")]
    assert "job=sync.renamed " in line.getMessage()


async def test_a_new_key_starts_afresh_on_purpose() -> None:
    clock, store, runs = TestClock(START), MemoryStore(), SlotRuns()
    v1 = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="v1")
    v2 = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="v2")
    v1.every("sync", "1m", runs, catch_up=0)
    v2.every("sync", "1m", runs, key="sync-v2", catch_up=0)
    async with v1, v2:
        await clock.advance("2m")
    assert sorted(instance for instance, _, _ in runs.seen) == ["v1", "v1", "v2", "v2"]


async def test_a_slot_left_by_a_dead_runner_is_retried_under_the_key() -> None:
    """The old release died mid-run on slot 08:00 of ``sync``; the renamed job takes it over."""
    clock, store = TestClock(START), MemoryStore()
    corpse = MemoryBackend(store=store, lease_ttl="30s")
    await corpse.start(clock)
    slot_ms = int(datetime.fromisoformat("2027-01-15T08:00:00+00:00").timestamp() * 1000)
    lease = await acquire(corpse, Slot("sync-v2", slot_ms), instance="dead", timeout=1)
    assert not isinstance(lease, str)  # acquired, then the process "dies": no renewals
    runs = SlotRuns()
    scheduler = Scheduler(MemoryBackend(store=store, lease_ttl="30s"), clock=clock, jitter=0)
    job = scheduler.every("sync.renamed", "1h", runs, key="sync-v2", catch_up=0)
    async with scheduler:
        await clock.advance("50s")
        assert runs.seen == [(scheduler.instance_id, "sync.renamed", slot_ms)]
        history = await job.history(5)
    assert [(r.job, r.outcome, r.attempt) for r in history] == [
        ("sync-v2", "completed", 2),
        ("sync-v2", "interrupted", 1),
    ]

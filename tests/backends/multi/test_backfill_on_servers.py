"""Backfills and retries on each real server: two instances backfill one range at once, then
one of them again, and each slot runs once (the claims, then the history); a failed run's
retries wait under its lease, renewed, and no other instance takes the slot over."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import JobContext, Retry, Scheduler
from brokersched._clock import SystemClock
from brokersched.abc import Backend, JobPolicy, LeaseBackend, Slot
from tests.support.namespaces import fresh_namespace

KINDS = ["postgres", "sqlite", "rabbitmq", "nats", "redis", "redis-lease"]


@pytest.fixture(params=KINDS)
async def make_backend(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Backend]]:
    """Backends of one fresh namespace on a real server (one per instance)."""
    async with fresh_namespace(request, request.param, "backfill") as make:
        yield make


async def test_a_backfill_twice_runs_each_slot_once(make_backend: Callable[..., Backend]) -> None:
    runs: list[tuple[str, str, int]] = []

    async def report(ctx: JobContext) -> None:
        runs.append((ctx.instance_id, ctx.reason, ctx.slot_ms))

    schedulers: list[Scheduler[Any]] = []
    lease = make_backend().capabilities.leases
    for name in ("a", "b"):
        backend = make_backend(lease_ttl="2s") if lease else make_backend()
        scheduler = Scheduler(backend, jitter=0, instance_id=name, enabled=False)
        scheduler.every(
            "report", "200ms", report, max_late="1s", **({"catch_up": 0} if lease else {})
        )
        schedulers.append(scheduler)
    await asyncio.gather(*(each.start() for each in schedulers))
    try:
        # A claim-only backend: slots that fell due after the backends started (its fleet
        # record must have been there), waited for until the fleet's claims of them are over
        # (jitter + max_late + 1 s). A lease backend: slots old enough for the fleet to be
        # done with them (2 x max_late, 2 x lease_ttl, 10s).
        first_ms = (int(time.time() * 1000) // 200 + 1) * 200 - (25_000 if lease else 0)
        start, end = (datetime.fromtimestamp(ms / 1000, UTC) for ms in (first_ms, first_ms + 800))
        settled_ms = first_ms + 800 + (50 if lease else 2_100)
        await asyncio.sleep(max(settled_ms / 1000 - time.time(), 0))  # all old enough
        both = await asyncio.gather(
            *(each.backfill("report", start, end, rate=200) for each in schedulers)
        )
        again = await schedulers[1].backfill("report", start, end, rate=200)
    finally:
        await asyncio.gather(*(each.stop() for each in schedulers))
    slots = [slot for _, _, slot in runs]
    assert sorted(slots) == [first_ms + 200 * n for n in range(5)], both
    assert {reason for _, reason, _ in runs} == {"backfill"}
    # Each slot ran by one of the two; the other found it claimed, or (when it read the history
    # after the first had run and recorded it: one backfill late by a few ms under CPU stress)
    # already run.
    steps = [step for each in both for step in each]
    assert {step.status for step in steps} <= {"ran", "not-acquired", "already-run"}, both
    ran = sorted(round(step.at.timestamp() * 1000) for step in steps if step.status == "ran")
    assert ran == [first_ms + 200 * n for n in range(5)], both
    # Run already: in the history, or (a's records may still be on their way) claimed.
    assert {step.status for step in again} <= {"already-run", "not-acquired"}
    assert len(runs) == 5


@pytest.mark.parametrize("make_backend", ["postgres", "sqlite", "redis-lease"], indirect=True)
async def test_retries_wait_under_the_renewed_lease(make_backend: Callable[..., Backend]) -> None:
    """lease_ttl 1s, a retry 1.5s later: the lease is renewed through the wait, so the other
    instance, sweeping for dead runners every 0.5s, never takes the slot over."""
    runs: list[tuple[str, str, int]] = []

    async def flaky(ctx: JobContext) -> None:
        runs.append((ctx.instance_id, ctx.reason, ctx.attempt))
        if ctx.attempt == 1:
            raise ConnectionError("partner API down")

    schedulers: list[Scheduler[Any]] = []
    for name in ("a", "b"):
        scheduler = Scheduler(make_backend(lease_ttl="1s"), jitter=0, instance_id=name)
        scheduler.every("bill", "1h", flaky, retry=Retry(attempts=2, backoff="1.5s"))
        schedulers.append(scheduler)
    job = schedulers[0].get("bill")
    assert job is not None
    await asyncio.gather(*(each.start() for each in schedulers))
    try:
        record = await job.trigger()
        history = await job.history(5)
    finally:
        await asyncio.gather(*(each.stop() for each in schedulers))
    assert runs == [("a", "manual", 1), ("a", "retry", 2)]
    assert record is not None and (record.reason, record.outcome) == ("retry", "completed")
    assert [(r.reason, r.attempt, r.outcome) for r in history] == [
        ("retry", 2, "completed"),
        ("manual", 1, "failed"),
    ]


@pytest.mark.parametrize("make_backend", ["postgres", "sqlite", "redis-lease"], indirect=True)
async def test_a_dead_backfills_slot_is_run_by_the_next_backfill(
    make_backend: Callable[..., Backend],
) -> None:
    """A backfill's process dies holding a slot's lease under ``<key>:backfill`` (no fleet
    sweep takes those over): the next backfill takes the slot over once the lease expired, and
    runs it once; a third finds it run."""
    runs: list[tuple[str, int, int]] = []

    async def report(ctx: JobContext) -> None:
        runs.append((ctx.reason, ctx.slot_ms, ctx.attempt))

    dead = make_backend(lease_ttl="1s")
    assert isinstance(dead, LeaseBackend)
    scheduler = Scheduler(make_backend(lease_ttl="2s"), jitter=0, instance_id="a", enabled=False)
    scheduler.every("report", "200ms", report, max_late="1s", catch_up=0)
    await scheduler.start()
    await dead.start(SystemClock())
    try:
        first_ms = (int(time.time() * 1000) // 200) * 200 - 25_000
        policy = JobPolicy("report:backfill", overlap="allow", max_attempts=1)
        held = await dead.acquire(
            Slot("report:backfill", first_ms), policy=policy, instance_id="dead",
            run_id="r-dead", reason="backfill", timeout=5,
        )  # fmt: skip
        assert held is not None  # ... and the process dies: no run, no release
        await asyncio.sleep(1.5)  # its lease expires
        start, end = (datetime.fromtimestamp(ms / 1000, UTC) for ms in (first_ms, first_ms + 200))
        steps = await scheduler.backfill("report", start, end, rate=200)
        again = await scheduler.backfill("report", start, end, rate=200)
    finally:
        await scheduler.stop()
        await dead.stop()
    assert [step.status for step in steps] == ["ran", "ran"], steps
    assert sorted(runs) == [("backfill", first_ms, 2), ("backfill", first_ms + 200, 1)]
    assert {step.status for step in again} == {"already-run"}, again

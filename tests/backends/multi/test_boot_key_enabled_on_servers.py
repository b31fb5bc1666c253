"""The boot runs, job keys and disabled instances of tests/unit/test_boot_runs.py,
test_job_key.py and test_scheduler_enabled.py on the real servers: a fleet's boot run happens
once, a renamed job keeping its key never runs a slot twice, a disabled instance's trigger goes
through the claim."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import Scheduler
from brokersched.abc import Backend
from brokersched.testing import TestClock
from tests.support.helpers import Runs, SlotRuns
from tests.support.namespaces import fresh_namespace


async def boot_three(backends: list[Backend]) -> Runs:
    """Three instances start together; returns once each has run or skipped both jobs."""
    runs = Runs()
    schedulers = [Scheduler(backend, jitter=0) for backend in backends]
    outcomes: list[str] = []
    settled = asyncio.Event()

    def count(what: str) -> None:
        outcomes.append(what)
        if len(outcomes) == 6:
            settled.set()

    for scheduler in schedulers:
        scheduler.after("sweep", "100ms", runs)
        scheduler.after("warm", "100ms", runs, claim=False)
        scheduler.on("complete", lambda event: count(f"ran {event.job}"))
        scheduler.on("skip", lambda event: count(f"{event.reason} {event.job}"))
    await asyncio.gather(*(s.start() for s in schedulers))
    try:
        await asyncio.wait_for(settled.wait(), 10)
    finally:
        await asyncio.gather(*(s.stop() for s in schedulers))
    assert sorted(outcomes) == [
        "not-acquired sweep",
        "not-acquired sweep",
        "ran sweep",
        "ran warm",
        "ran warm",
        "ran warm",
    ]
    history = await _history(backends[0])
    assert len(history) == 4
    return runs


async def _history(backend: Backend) -> list[Any]:
    async with Scheduler(backend) as reader:
        reader.after("sweep", "1h", Runs())
        reader.after("warm", "1h", Runs(), claim=False)
        sweep, warm = reader.get("sweep"), reader.get("warm")
        assert sweep is not None and warm is not None
        return [*(await sweep.history()), *(await warm.history())]


@pytest.mark.parametrize("kind", ["postgres", "rabbitmq", "nats", "redis", "sqlite"])
async def test_a_fleet_boot_run_happens_once(request: pytest.FixtureRequest, kind: str) -> None:
    async with fresh_namespace(request, kind, "bootkey") as make:
        runs = await boot_three([make() for _ in range(3)])
    assert len(runs.of("sweep")) == 1
    assert len({i for i, _, _ in runs.of("warm")}) == 3


@pytest.fixture(params=["postgres", "rabbitmq", "nats", "redis"])
async def make_backend(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], Backend]]:
    """A factory of backends of one fresh namespace on a real server (one per instance)."""
    async with fresh_namespace(request, request.param, "bootkey") as make:
        # virtual slots run ahead of the database's clock
        skew = {"max_clock_skew": "1h"} if request.param == "postgres" else {}
        yield lambda: make(**skew)


async def test_a_rename_keeping_the_key_on_a_real_server(
    make_backend: Callable[[], Backend],
) -> None:
    """The deploy of a rename: the old and the new release run side by side (on virtual time)
    and claim each slot under the same key."""
    clock, runs = TestClock(datetime.now(UTC).replace(microsecond=0)), SlotRuns()

    def instance(name: str) -> Scheduler[Any]:
        return Scheduler(make_backend(), clock=clock, jitter=0, instance_id=name)

    old, new = instance("old"), instance("new")
    old.every("sync", "10s", runs, key="sync-v2")
    renamed = new.every("sync.renamed", "10s", runs, key="sync-v2")
    async with old:
        await clock.advance("20s")
        async with new:
            await clock.advance("50s")
            await old.stop()
            await clock.advance("20s")
            history = await renamed.history(limit=50)
    slots = [slot for _, _, slot in runs.seen]
    assert len(slots) == 9
    assert len(set(slots)) == len(slots)
    assert {job for _, job, _ in runs.seen} == {"sync", "sync.renamed"}
    assert sorted(record.slot_ms for record in history) == sorted(slots)
    assert {record.job for record in history} == {"sync-v2"}


async def test_a_disabled_instance_triggers_through_rabbitmq(
    request: pytest.FixtureRequest,
) -> None:
    """On a claim-only backend a trigger from a disabled instance is claimed and recorded."""
    runs = Runs()
    async with fresh_namespace(request, "rabbitmq", "bootkey") as make:
        scheduler = Scheduler(make(), jitter=0, enabled=False)
        job = scheduler.every("sync", "1s", runs)
        async with scheduler:
            record = await job.trigger()
            assert record is not None and record.reason == "manual"
            assert [r.run_id for r in await job.history()] == [record.run_id]
    # and no scheduled run
    assert [(i, reason) for i, _, reason, _ in runs.seen] == [(scheduler.instance_id, "manual")]

"""The boot runs, job keys and disabled instances of tests/unit/test_seeds_*.py on the real
servers: a fleet's boot run happens once, a renamed job keeping its key never runs a slot
twice, a disabled instance's trigger goes through the claim."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from brokersched import (
    JobContext,
    NATSBackend,
    PostgresBackend,
    RabbitMQBackend,
    RedisBackend,
    Scheduler,
    SQLiteBackend,
)
from brokersched.abc import Backend
from brokersched.testing import TestClock
from tests.support.helpers import Runs
from tests.support.leftovers import remove_rabbitmq
from tests.support.names import unique
from tests.support.nats_helpers import delete_streams
from tests.support.redis_helpers import delete_keys


@pytest.fixture
async def postgres_schema(postgres_dsn: str) -> AsyncIterator[str]:
    schema = unique("seeds")
    yield schema
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


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


async def test_a_fleet_boot_run_happens_once_on_postgres(
    postgres_dsn: str, postgres_schema: str
) -> None:
    runs = await boot_three(
        [PostgresBackend(postgres_dsn, schema=postgres_schema) for _ in range(3)]
    )
    assert len(runs.of("sweep")) == 1
    assert len({i for i, _, _ in runs.of("warm")}) == 3


async def test_a_fleet_boot_run_happens_once_on_rabbitmq(amqp_url: str) -> None:
    prefix = unique("seeds")
    try:
        runs = await boot_three([RabbitMQBackend(amqp_url, prefix=prefix) for _ in range(3)])
    finally:
        await remove_rabbitmq(amqp_url, prefix)
    assert len(runs.of("sweep")) == 1
    assert len({i for i, _, _ in runs.of("warm")}) == 3


async def test_a_fleet_boot_run_happens_once_on_nats(nats_url: str) -> None:
    prefix = unique()
    try:
        runs = await boot_three([NATSBackend(nats_url, prefix=prefix) for _ in range(3)])
    finally:
        await delete_streams(nats_url, prefix)
    assert len(runs.of("sweep")) == 1


async def test_a_fleet_boot_run_happens_once_on_redis(redis_url: str) -> None:
    prefix = unique("seeds")
    try:
        runs = await boot_three([RedisBackend(redis_url, prefix=prefix) for _ in range(3)])
    finally:
        await delete_keys(redis_url, prefix)
    assert len(runs.of("sweep")) == 1


async def test_a_fleet_boot_run_happens_once_on_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "boot.db"
    runs = await boot_three([SQLiteBackend(path) for _ in range(3)])
    assert len(runs.of("sweep")) == 1


class SlotRuns:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []  # (instance, job, slot)

    async def __call__(self, ctx: JobContext) -> None:
        self.seen.append((ctx.instance_id, ctx.job, ctx.slot_ms))


@pytest.fixture(params=["postgres", "rabbitmq", "nats", "redis"])
async def make_backend(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], Backend]]:
    """A factory of backends of one fresh namespace on a real server (one per instance)."""
    kind: str = request.param
    name = unique("seeds")
    url = request.getfixturevalue(
        {"postgres": "postgres_dsn", "rabbitmq": "amqp_url", "nats": "nats_url"}.get(
            kind, "redis_url"
        )
    )

    def make() -> Backend:
        if kind == "postgres":  # virtual slots run ahead of the database's clock
            return PostgresBackend(url, schema=name, max_clock_skew="1h")
        if kind == "rabbitmq":
            return RabbitMQBackend(url, prefix=name)
        if kind == "nats":
            return NATSBackend(url, prefix=name)
        return RedisBackend(url, prefix=name)

    yield make
    if kind == "postgres":
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            await conn.close()
    elif kind == "rabbitmq":
        await remove_rabbitmq(url, name)
    elif kind == "nats":
        await delete_streams(url, name)
    elif kind == "redis":
        await delete_keys(url, name)


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


async def test_a_disabled_instance_triggers_through_rabbitmq(amqp_url: str) -> None:
    """On a claim-only backend a trigger from a disabled instance is claimed and recorded."""
    prefix = unique("seeds")
    backend = RabbitMQBackend(amqp_url, prefix=prefix)
    runs = Runs()
    scheduler = Scheduler(backend, jitter=0, enabled=False)
    job = scheduler.every("sync", "1s", runs)
    try:
        async with scheduler:
            record = await job.trigger()
            assert record is not None and record.reason == "manual"
            assert [r.run_id for r in await job.history()] == [record.run_id]
    finally:
        await remove_rabbitmq(amqp_url, prefix)
    # and no scheduled run
    assert [(i, reason) for i, _, reason, _ in runs.seen] == [(scheduler.instance_id, "manual")]

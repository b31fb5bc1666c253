"""What the lease backends' tests share (MemoryBackend, SQLite, PostgreSQL, Redis): a fleet of
backends of one namespace (``fleet_of``), its store clock stopped, a claim in one call, racers at
one barrier, a skewed instance clock; for SQLite and PostgreSQL the schema's version and the
write lock held."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis.asyncio

from brokersched._clock import Clock, SystemClock
from brokersched.abc import JobPolicy, Lease, LeaseBackend, Slot
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.redis import RedisLeaseBackend
from brokersched.backends.sqlite import SQLiteBackend
from tests.support.names import unique
from tests.support.redis_helpers import delete_keys

SLOT = 1_700_000_000_000  # in the past, as every slot an instance claims


TTL = timedelta(seconds=1)


class SkewedClock(SystemClock):
    """An instance whose clock is wrong by ``offset``."""

    def __init__(self, offset: timedelta) -> None:
        self.offset_ms = round(offset / timedelta(milliseconds=1))

    def now_ms(self) -> int:
        return super().now_ms() + self.offset_ms


class StoppedClock(SystemClock):
    """A store's clock standing at ``now`` (ms)."""

    def __init__(self, now: int) -> None:
        self.now = now

    def now_ms(self) -> int:
        return self.now


@dataclass
class Fleet:
    """Backends of one namespace, each with its own connection, as instances of one fleet:
    ``kind`` is ``memory`` (one MemoryStore), ``sqlite`` (a file), ``postgres`` (a schema),
    ``redis`` or ``redis-cluster`` (a key prefix)."""

    kind: str
    namespace: str
    path: Path  # the SQLite file
    dsn: str  # the PostgreSQL server
    url: str = ""  # the Redis server, or a node of the Redis Cluster
    store: MemoryStore = field(default_factory=MemoryStore)
    started: list[LeaseBackend] = field(default_factory=list)

    @property
    def cluster(self) -> bool:
        return self.kind == "redis-cluster"

    def build(self, **options: Any) -> LeaseBackend:
        if self.kind == "memory":
            # The members' store keeps the system's time, as a server's does; unset, a
            # MemoryBackend would judge on its own scheduler's clock.
            options.setdefault("store_clock", SystemClock())
            return MemoryBackend(store=self.store, **options)
        if self.kind == "sqlite":
            return VirtualClockSQLite(self.path, **options)
        if self.kind == "postgres":
            return PostgresBackend(self.dsn, schema=self.namespace, max_size=2, **options)
        return RedisLeaseBackend(self.url, prefix=self.namespace, cluster=self.cluster, **options)

    async def set_store_time(self, now_ms: int) -> None:
        """Stop the store's clock at ``now_ms`` (SQLite's one hook, PostgreSQL's
        ``store_now()``, the Redis scripts' ``store_time``, MemoryBackend's ``store_clock``):
        time passes for the leases only when the test says so, however long its calls take.
        For the members started so far (and every PostgreSQL member: the schema's clock)."""
        for backend in self.started:
            if isinstance(backend, VirtualClockSQLite | RedisLeaseBackend):
                backend.store_time = now_ms
            elif isinstance(backend, MemoryBackend):
                backend.store_clock = StoppedClock(now_ms)
        if self.kind == "postgres":
            await set_postgres_store_time(self.dsn, [self.namespace], now_ms)

    async def start(self, clock: Clock | None = None, **options: Any) -> LeaseBackend:
        options.setdefault("lease_ttl", TTL)
        backend = self.build(**options)
        await backend.start(clock or SystemClock())
        self.started.append(backend)
        return backend

    async def many(self, count: int, **options: Any) -> list[LeaseBackend]:
        return list(await asyncio.gather(*(self.start(**options) for _ in range(count))))

    def redis(self) -> Any:
        """A client of the Redis server or cluster (the caller closes it)."""
        if self.cluster:
            return redis.asyncio.RedisCluster.from_url(self.url)
        return redis.asyncio.Redis.from_url(self.url)

    async def clean_up(self) -> None:
        """Stop the members, and remove what they left in the store."""
        for backend in reversed(self.started):
            await backend.stop()
        if self.kind == "postgres":
            await drop_schema(self.dsn, self.namespace)
        elif self.kind.startswith("redis"):
            await delete_keys(self.url, self.namespace, cluster=self.cluster)


@asynccontextmanager
async def fleet_of(kind: str, request: pytest.FixtureRequest, tmp: Path) -> AsyncIterator[Fleet]:
    """A fleet of ``kind`` in a new namespace, cleaned up after. The servers are the session's
    (``postgres_dsn``, ``redis_url``); a ``redis-cluster`` fleet's is ``redis_cluster_url``,
    which the test module imports from ``tests.support.redis_helpers``."""
    namespace = unique("t")
    dsn = request.getfixturevalue("postgres_dsn") if kind == "postgres" else ""
    url = ""
    if kind.startswith("redis"):
        server = "redis_cluster_url" if kind == "redis-cluster" else "redis_url"
        url = request.getfixturevalue(server)
    fleet = Fleet(kind, namespace, tmp / f"{namespace}.db", dsn, url)
    try:
        yield fleet
    finally:
        await fleet.clean_up()


async def drop_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def acquire(
    backend: LeaseBackend,
    slot: Slot,
    policy: JobPolicy | None = None,
    *,
    instance: str = "i1",
    reason: Any = "schedule",
    timeout: float = 5.0,
) -> Lease | str:
    return await backend.acquire(
        slot,
        policy=policy or JobPolicy(slot.job),
        instance_id=instance,
        run_id=secrets.token_hex(4),
        reason=reason,
        timeout=timeout,
    )


async def expire() -> None:
    await asyncio.sleep(TTL.total_seconds() * 1.5)


async def schema_version(fleet: Fleet, set_to: int | None = None) -> int:
    if fleet.kind == "sqlite":
        with sqlite3.connect(fleet.path) as conn:
            if set_to is not None:
                conn.execute("UPDATE brokersched_schema_version SET version = ?", (set_to,))
            return int(conn.execute("SELECT version FROM brokersched_schema_version").fetchone()[0])
    conn = await asyncpg.connect(fleet.dsn)
    try:
        table = f'"{fleet.namespace}".schema_version'
        if set_to is not None:
            await conn.execute(f"UPDATE {table} SET version = $1", set_to)
        return int(await conn.fetchval(f"SELECT version FROM {table}"))
    finally:
        await conn.close()


@asynccontextmanager
async def hold_write_lock(fleet: Fleet) -> AsyncIterator[None]:
    """Another client holding what a claim of ``job`` needs: SQLite's write lock, or the job's
    row in PostgreSQL."""
    if fleet.kind == "sqlite":
        lite = sqlite3.connect(fleet.path, isolation_level=None)
        lite.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            lite.execute("ROLLBACK")
            lite.close()
        return
    conn = await asyncpg.connect(fleet.dsn)
    try:
        async with conn.transaction():
            await conn.execute(
                f"SELECT * FROM \"{fleet.namespace}\".jobs WHERE job = 'job' FOR UPDATE"
            )
            yield
    finally:
        await conn.close()


async def race(calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Run ``calls`` released at the same moment by a barrier."""
    barrier = asyncio.Barrier(len(calls))

    async def run(call: Callable[[], Awaitable[Any]]) -> Any:
        await barrier.wait()
        return await call()

    return list(await asyncio.gather(*(run(call) for call in calls)))


def now_ms() -> int:
    """The backends' clock: the database server runs on this host, as does the instance."""
    return time.time_ns() // 1_000_000


def lease_of(result: Lease | str) -> Lease:
    assert isinstance(result, Lease), result
    return result


class VirtualClockSQLite(SQLiteBackend):
    """SQLite whose store clock reads ``store_time`` once it is set (its one hook)."""

    store_time: int | None = None

    def _store_now_ms(self) -> int:
        return super()._store_now_ms() if self.store_time is None else self.store_time


async def set_postgres_store_time(dsn: str, schemas: Iterable[str], now_ms: int) -> None:
    """The schemas' store clock (``store_now()``, which every statement reads) reads a table
    this sets."""
    conn = await asyncpg.connect(dsn)
    try:
        for schema in schemas:
            await conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{schema}".test_clock (now timestamptz);'
                f'CREATE OR REPLACE FUNCTION "{schema}".store_now() RETURNS timestamptz'
                f" LANGUAGE sql VOLATILE AS 'SELECT now FROM \"{schema}\".test_clock'"
            )
            await conn.execute(
                f'DELETE FROM "{schema}".test_clock;'
                f'INSERT INTO "{schema}".test_clock VALUES (to_timestamp({now_ms} / 1000.0))'
            )
    finally:
        await conn.close()

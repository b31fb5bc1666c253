"""A run completes just as its store goes away for less than ``lease_ttl``: a
connection blip (PostgreSQL, Redis, NATS, through a TcpProxy that cuts and restores the
runner's link) or another process holding SQLite's write lock. The runner keeps retrying the
release until it lands, so the completed slot is never taken over and run again.

Real servers and real time: the failure is in how the runner's retries line up with the lease
on the store's clock. The runner is one scheduler; another, on its own connection, sweeps for
dead runners' slots every ``lease_ttl / 2`` as every fleet member does.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from brokersched import (
    JobContext,
    NATSLeaseBackend,
    PostgresBackend,
    RedisLeaseBackend,
    Scheduler,
    SQLiteBackend,
)
from brokersched._clock import SystemClock
from brokersched.abc import JobPolicy, LeaseBackend
from tests.support.names import unique
from tests.support.nats_helpers import FaultProxy, delete_named_streams, fault_proxy, lease_streams
from tests.support.redis_helpers import delete_keys
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import until

TTL_S = 3.0
OUTAGE_S = 1.5  # shorter than the lease: the release can land before it expires
SQLITE_HOLD_S = 2.4  # the other process's transaction, begun as the run completes
JOB = "blip"


@dataclass
class Fault:
    """What goes wrong as the run completes: ``begin()`` (called by the handler as its last
    act) starts it; it ends by itself ``OUTAGE_S`` or ``SQLITE_HOLD_S`` later."""

    begin: Callable[[], Awaitable[None]]
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Store:
    """The runner's backend (through the fault), another instance's and a probe's (direct)."""

    runner: LeaseBackend
    other: LeaseBackend
    probe: LeaseBackend
    fault: Fault


def a_cut_link(proxy: TcpProxy) -> Fault:
    """The runner's link is reset and new connections refused, for ``OUTAGE_S``."""
    fault: Fault

    async def begin() -> None:
        await proxy.cut()

        async def restore() -> None:
            await asyncio.sleep(OUTAGE_S)  # real time: the outage is the point
            proxy.restore()
            fault.ended.set()

        asyncio.get_running_loop().create_task(restore())

    fault = Fault(begin)
    return fault


def a_silent_link(proxy: FaultProxy) -> Fault:
    """The server's answers to the runner are held for ``OUTAGE_S`` (its requests still reach
    the server: a release may land unanswered), then the link is cut and they are lost (nats-py
    reconnects; a cut that also refused reconnections leaves nats-py's sockets unclosed)."""
    fault: Fault

    async def begin() -> None:
        proxy.hold_replies()

        async def restore() -> None:
            await asyncio.sleep(OUTAGE_S)  # real time: the outage is the point
            proxy.cut()
            proxy.release_replies()
            fault.ended.set()

        asyncio.get_running_loop().create_task(restore())

    fault = Fault(begin)
    return fault


def a_held_write_lock(path: Path) -> Fault:
    """Another connection (application code sharing the file) holds ``BEGIN IMMEDIATE`` for
    ``SQLITE_HOLD_S``."""
    fault: Fault

    async def begin() -> None:
        holding = threading.Event()
        loop = asyncio.get_running_loop()

        def hold() -> None:
            lite = sqlite3.connect(path, isolation_level=None)
            try:
                lite.execute("BEGIN IMMEDIATE")
                holding.set()
                time.sleep(SQLITE_HOLD_S)  # a thread of its own: the application's transaction
                lite.execute("ROLLBACK")
            finally:
                lite.close()
                loop.call_soon_threadsafe(fault.ended.set)

        threading.Thread(target=hold, daemon=True).start()
        await asyncio.to_thread(holding.wait, 10)
        assert holding.is_set()

    fault = Fault(begin)
    return fault


@asynccontextmanager
async def postgres(postgres_dsn: str) -> AsyncIterator[Store]:
    schema = unique("t")
    parts = urlsplit(postgres_dsn)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        proxied = postgres_dsn.replace(f":{parts.port or 5432}/", f":{proxy.port}/")

        def backend(dsn: str) -> PostgresBackend:
            return PostgresBackend(dsn, schema=schema, lease_ttl=TTL_S, max_size=2)

        try:
            yield Store(
                backend(proxied), backend(postgres_dsn), backend(postgres_dsn), a_cut_link(proxy)
            )
        finally:
            conn = await asyncpg.connect(postgres_dsn)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()


@asynccontextmanager
async def redis(redis_url: str) -> AsyncIterator[Store]:
    prefix = unique("t")
    parts = urlsplit(redis_url)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        proxied = f"redis://127.0.0.1:{proxy.port}{parts.path or '/0'}"
        try:
            yield Store(
                RedisLeaseBackend(proxied, prefix=prefix, lease_ttl=TTL_S),
                RedisLeaseBackend(redis_url, prefix=prefix, lease_ttl=TTL_S),
                RedisLeaseBackend(redis_url, prefix=prefix, lease_ttl=TTL_S),
                a_cut_link(proxy),
            )
        finally:
            await delete_keys(redis_url, prefix)


@asynccontextmanager
async def nats(nats_url: str) -> AsyncIterator[Store]:
    bucket = unique("t")
    parts = urlsplit(nats_url)
    async with fault_proxy(parts.port or 4222, parts.hostname or "127.0.0.1") as proxy:
        try:
            yield Store(
                NATSLeaseBackend(proxy.url, bucket=bucket, lease_ttl=TTL_S),
                NATSLeaseBackend(nats_url, bucket=bucket, lease_ttl=TTL_S),
                NATSLeaseBackend(nats_url, bucket=bucket, lease_ttl=TTL_S),
                a_silent_link(proxy),
            )
        finally:
            await delete_named_streams(nats_url, *lease_streams(bucket))


@asynccontextmanager
async def sqlite(path: Path) -> AsyncIterator[Store]:
    yield Store(
        SQLiteBackend(path, lease_ttl=TTL_S),
        SQLiteBackend(path, lease_ttl=TTL_S),
        SQLiteBackend(path, lease_ttl=TTL_S),
        a_held_write_lock(path),
    )


@pytest.fixture(params=["postgres", "redis", "nats", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> AbstractAsyncContextManager[Store]:
    if request.param == "postgres":
        return postgres(request.getfixturevalue("postgres_dsn"))
    if request.param == "redis":
        return redis(request.getfixturevalue("redis_url"))
    if request.param == "nats":
        return nats(request.getfixturevalue("nats_url"))
    return sqlite(tmp_path / "app.db")


async def test_a_store_away_for_less_than_the_lease_as_a_run_completes_never_reruns_it(
    store: AbstractAsyncContextManager[Store],
) -> None:
    starts: list[tuple[str, int, int]] = []
    # A whole second, after both schedulers have started.
    when = datetime.fromtimestamp(math.ceil(time.time()) + 2, UTC)
    policy = JobPolicy(JOB, max_attempts=3)
    async with store as backends:
        fault = backends.fault

        async def handler(ctx: JobContext) -> None:
            starts.append((ctx.instance_id, ctx.slot_ms, ctx.attempt))
            if ctx.instance_id == "runner":
                await fault.begin()  # its last act: the release is the next thing to fail

        runner = Scheduler(backends.runner, instance_id="runner", jitter=0)
        job = runner.at(JOB, when, handler)
        other = Scheduler(backends.other, instance_id="other", jitter=0)
        other.at(JOB, when + timedelta(days=1), handler)  # the same job: it sweeps its slots
        await backends.probe.start(SystemClock())
        try:
            async with runner, other:
                await until(lambda: bool(starts), timeout=10, what="the slot's run")
                # The earliest moment a sweep can find the lease expired (it was granted at
                # `when`, plus the claim's few milliseconds): a sweep of the worst phase.
                # Real time: the lease ends on the server's clock.
                await asyncio.sleep(max(when.timestamp() + TTL_S + 0.15 - time.time(), 0))
                taken = await backends.probe.take_over([policy], instance_id="probe")
                await asyncio.wait_for(fault.ended.wait(), 10)
                await until(lambda: not job.is_running, timeout=10, what="the release")
                # the record is written after the run (by the recorder, which may be retrying)
                await until(job.history, timeout=10, what="the run's record")
                history = await job.history(10)
        finally:
            await backends.probe.stop()
    slot_ms = int(when.timestamp() * 1000)
    assert taken == []
    assert starts == [("runner", slot_ms, 1)]
    assert [(r.slot_ms, r.attempt, r.outcome) for r in history] == [(slot_ms, 1, "completed")]

"""A claim whose write lands but whose answer comes later than the lease is counted on (a tenth
of ``lease_ttl`` before it can expire, from when the claim was sent): the runner never starts
the handler on it, and the slot runs once fleet-wide, taken over once the lease has expired
(PostgreSQL, Redis, NATS KV through a proxy that holds the server's answers; SQLite through a
connection whose claim's COMMIT lands and is answered late, as in a paused process).

Real servers and real time: the lease expires on the store's clock. The runner is one
scheduler; another, on its own connection, sweeps for dead runners' slots every
``lease_ttl / 2`` as every fleet member does. The same on virtual time, with a batch of claims
and a take-over too: tests/unit/test_late_lease.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from brokersched import (
    JobContext,
    NATSLeaseBackend,
    PostgresBackend,
    RedisLeaseBackend,
    Scheduler,
    SkipEvent,
    SQLiteBackend,
    StartEvent,
)
from brokersched._clock import Clock
from brokersched.abc import LeaseBackend, Slot
from brokersched.backends.nats._rows import row_key
from tests.support.names import unique
from tests.support.nats_helpers import delete_named_streams, fault_proxy, lease_streams
from tests.support.redis_helpers import delete_keys
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import until

TTL_S = 3.0  # counted on for 2.7 s after the claim was sent
JOB = "late"


@dataclass
class Fault:
    """The runner's claim lands and its answer is held (``held`` is set then) until
    ``deliver()``; ``after_take_over``: delivered once the slot was taken over, else in the
    last tenth of the lease (after the runner can count on it, before it expires)."""

    deliver: Callable[[], None]
    held: asyncio.Event
    after_take_over: bool = True


@dataclass
class Store:
    """The runner's backend (through the fault) and another instance's (direct)."""

    runner: LeaseBackend
    other: LeaseBackend
    fault: Fault


@asynccontextmanager
async def postgres(postgres_dsn: str, when: datetime) -> AsyncIterator[Store]:
    schema = unique("t")
    parts = urlsplit(postgres_dsn)
    # The claim's Bind message: the job's name and the slot (int8, binary), as asyncpg sends them.
    claim = (JOB.encode(), struct.pack("!q", int(when.timestamp() * 1000)))
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        proxy.hold_answers_after(lambda data: all(part in data for part in claim))
        proxied = postgres_dsn.replace(f":{parts.port or 5432}/", f":{proxy.port}/")

        def backend(dsn: str) -> PostgresBackend:
            return PostgresBackend(dsn, schema=schema, lease_ttl=TTL_S, max_size=2)

        try:
            fault = Fault(proxy.resume, proxy.answers_held)
            yield Store(backend(proxied), backend(postgres_dsn), fault)
        finally:
            proxy.resume()
            conn = await asyncpg.connect(postgres_dsn)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()


@asynccontextmanager
async def redis(redis_url: str, when: datetime) -> AsyncIterator[Store]:
    prefix = unique("t")
    parts = urlsplit(redis_url)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        proxy.hold_answers_from(lambda data: b"granted" in data)  # the claim script's answer
        proxied = f"redis://127.0.0.1:{proxy.port}{parts.path or '/0'}"
        try:
            yield Store(
                RedisLeaseBackend(proxied, prefix=prefix, lease_ttl=TTL_S),
                RedisLeaseBackend(redis_url, prefix=prefix, lease_ttl=TTL_S),
                Fault(proxy.resume, proxy.answers_held),
            )
        finally:
            proxy.resume()
            await delete_keys(redis_url, prefix)


@asynccontextmanager
async def nats(nats_url: str, when: datetime) -> AsyncIterator[Store]:
    bucket = unique("t")
    parts = urlsplit(nats_url)
    async with fault_proxy(parts.port or 4222, parts.hostname or "127.0.0.1") as proxy:
        # The claim's compare-and-set of the job's row (the only write a claim makes).
        write = f"HPUB $KV.{bucket}.{row_key(JOB)} ".encode()
        proxy.hold_replies_after(lambda data: write in data)
        # A NATS claim that lost its answer reads its row again: after a take-over it finds
        # the row changed, and reports the slot lost. So its answer comes before then.
        fault = Fault(proxy.release_replies, proxy.answers_held, after_take_over=False)
        try:
            yield Store(
                NATSLeaseBackend(proxy.url, bucket=bucket, lease_ttl=TTL_S),
                NATSLeaseBackend(nats_url, bucket=bucket, lease_ttl=TTL_S),
                fault,
            )
        finally:
            proxy.release_replies()
            await delete_named_streams(nats_url, *lease_streams(bucket))


_CLAIMING: contextvars.ContextVar[bool] = contextvars.ContextVar("claiming", default=False)


class SlowClaimAnswer(SQLiteBackend):
    """SQLite's claim lands (its COMMIT is done) and is answered late: from then, until
    ``fault.deliver()``, no statement of this connection answers (a process paused, or its
    driver's thread stuck, after the commit)."""

    fault: Fault

    async def acquire(self, slot: Slot, **kwargs: Any) -> Any:
        claiming = _CLAIMING.set(True)
        try:
            return await super().acquire(slot, **kwargs)
        finally:
            _CLAIMING.reset(claiming)

    async def _open(self, clock: Clock) -> None:
        await super()._open(clock)
        assert self._conn is not None
        execute = self._conn.execute
        delivered = asyncio.Event()
        self.fault.deliver = delivered.set

        async def answered_late(sql: str, *args: Any) -> Any:
            if self.fault.held.is_set():
                await delivered.wait()  # nothing more is sent meanwhile (no lock is taken)
            result = await execute(sql, *args)
            if sql == "COMMIT" and _CLAIMING.get():
                self.fault.held.set()
                await delivered.wait()
            return result

        self._conn.execute = answered_late  # type: ignore[method-assign, assignment]


@asynccontextmanager
async def sqlite(path: Path, when: datetime) -> AsyncIterator[Store]:
    runner = SlowClaimAnswer(path, lease_ttl=TTL_S)
    runner.fault = Fault(lambda: None, asyncio.Event())
    yield Store(runner, SQLiteBackend(path, lease_ttl=TTL_S), runner.fault)


Maker = Callable[[datetime], AbstractAsyncContextManager[Store]]


@pytest.fixture(params=["postgres", "redis", "nats", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Maker:
    if request.param == "postgres":
        dsn = request.getfixturevalue("postgres_dsn")
        return lambda when: postgres(dsn, when)
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        return lambda when: redis(url, when)
    if request.param == "nats":
        url = request.getfixturevalue("nats_url")
        return lambda when: nats(url, when)
    return lambda when: sqlite(tmp_path / "app.db", when)


@dataclass
class Seen:
    starts: list[tuple[str, str, int]] = field(default_factory=list)  # instance, reason, attempt
    runner: list[SkipEvent | StartEvent] = field(default_factory=list)  # its claim's end
    held_at: float = 0.0
    ended_at: float = 0.0  # the runner's claim ended: a skip or a start


def handler(kind: str, seen: Seen) -> Callable[[JobContext], Any]:
    def started(ctx: JobContext) -> None:
        seen.starts.append((ctx.instance_id, ctx.reason, ctx.attempt))

    if kind == "sync":
        return started

    async def run(ctx: JobContext) -> None:
        started(ctx)  # its first line: before the first await
        await asyncio.sleep(0)

    return run


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_claim_answered_later_than_its_lease_never_starts_the_handler(
    store: Maker, kind: str
) -> None:
    seen = Seen()
    loop = asyncio.get_running_loop()
    # A whole second, after both schedulers have started.
    when = datetime.fromtimestamp(math.ceil(time.time()) + 2, UTC)

    def runner_event(event: SkipEvent | StartEvent) -> None:
        if isinstance(event, SkipEvent) or event.reason == "schedule":  # not a take-over's
            seen.runner.append(event)
            seen.ended_at = loop.time()

    async with store(when) as backends:
        fault = backends.fault
        runner = Scheduler(backends.runner, instance_id="runner", jitter=0)
        late = runner.at(JOB, when, handler(kind, seen))
        runner.on("skip", runner_event)
        runner.on("start", runner_event)
        other = Scheduler(backends.other, instance_id="other", jitter=0)
        # The same job, a day later: it sweeps the job's slots.
        sweeper = other.at(JOB, when + timedelta(days=1), handler(kind, seen))
        async with runner, other:
            await asyncio.wait_for(fault.held.wait(), 10)  # the claim landed; its answer waits
            seen.held_at = loop.time()
            if fault.after_take_over:
                await until(lambda: seen.starts, timeout=15, what="a take-over of the slot")
            else:  # real time: the answer's delay is the point
                await asyncio.sleep(max(seen.held_at + 0.95 * TTL_S - loop.time(), 0))
            fault.deliver()
            await until(lambda: seen.runner, timeout=15, what="the runner's claim ending")
            [ended] = seen.runner
            assert isinstance(ended, SkipEvent), f"the handler started: {ended}"
            assert ended.reason == "backend-error", ended
            # Given up by the backend's own bound, before the lease could expire.
            assert ended.detail != "TimeoutError", ended
            assert seen.ended_at - seen.held_at < TTL_S
            await until(lambda: seen.starts, timeout=15, what="a take-over of the slot")
            await until(lambda: not (late.is_running or sweeper.is_running), what="the runs' end")
    assert [reason for _, reason, _ in seen.starts] == ["retry"]  # once, and as a take-over

"""What ``PostgresBackend`` uses of asyncpg (``Connection``, ``Pool``: asyncpg ships no type
hints), and ``PostgresCalls``: the bounded call on a pooled connection that every part of the
backend (its leases, history and fleet records) makes, and the pool's share that a claim may
take while the server's connections are shed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, Protocol, TypeVar

from ..._exceptions import BackendUnavailableError
from .._budget import BudgetWatch
from .._errors import Within
from .._sql import SQLLeaseBackend
from ._statements import Statements

__all__ = ["Connection", "Pool", "PostgresCalls", "Row", "keep_session"]

logger = logging.getLogger("brokersched.backends.postgres")

Row = Mapping[str, Any]
T = TypeVar("T")


class Connection(Protocol):
    """What this backend uses of an asyncpg connection (asyncpg ships no type hints)."""

    async def execute(self, query: str, *args: object) -> str: ...
    async def fetch(self, query: str, *args: object) -> list[Row]: ...
    async def fetchrow(self, query: str, *args: object) -> Row | None: ...
    async def fetchval(self, query: str, *args: object) -> Any: ...
    async def executemany(self, query: str, args: Iterable[Sequence[object]]) -> None: ...
    def transaction(self) -> AbstractAsyncContextManager[Any]: ...
    def terminate(self) -> None: ...


class Pool(Protocol):
    """What this backend uses of an ``asyncpg.Pool``."""

    def acquire(self, *, timeout: float | None = None) -> Awaitable[Connection]: ...
    async def release(self, connection: Connection, *, timeout: float | None = None) -> None: ...
    async def close(self) -> None: ...
    def terminate(self) -> None: ...
    def get_idle_size(self) -> int: ...


# How long an abandoned statement (see _Call.abandon) may take to be cancelled on the server
# before its connection is terminated; nobody waits for it.
_CANCEL_WAIT_S = 5.0


class PostgresCalls(SQLLeaseBackend):
    """The calls of ``PostgresBackend`` on its pool, which supplies the pool and the
    translation of errors (set at construction and start)."""

    _sql: Statements
    _pool: Pool | None
    _asyncpg: Any
    _budget: BudgetWatch | None
    _claims_in_flight: int
    _calls: set[asyncio.Task[Any]]  # exchanges in flight, abandoned ones too

    def _spare_connections(self) -> int:
        """While shedding, the pool's idle connections not already promised to a claim in
        flight; otherwise as many as wanted."""
        budget, pool = self._budget, self._pool
        if budget is None or not budget.shedding or pool is None:
            return 1 << 30
        return pool.get_idle_size() - self._claims_in_flight

    @contextlib.contextmanager
    def _claiming(self, what: str) -> Iterator[None]:
        """A claim's own connection: while shedding, no new one is opened for it, so a claim
        that finds no idle connection (less those of the claims in flight) is refused;
        renewals, releases and records go on."""
        if self._spare_connections() <= 0:
            assert self._budget is not None
            self._budget.refuse_if_shedding(f"{what} is not made, as it needs a new connection")
        self._claims_in_flight += 1
        try:
            yield
        finally:
            self._claims_in_flight -= 1

    async def _call(
        self,
        action: str,
        exchange: Callable[[Connection], Awaitable[T]],
        timeout: float | None = None,
    ) -> T:
        """``exchange`` on a pooled connection, answered within ``timeout`` seconds.

        A connection that broke is dropped by the pool and replaced on a later call, so an
        outage fails the calls made during it (closed: no claim, no run) and nothing after.
        """
        with self._translate(action):
            if self._pool is None:
                raise BackendUnavailableError("PostgresBackend is not started")
            return await self._bounded(self._pool, exchange, timeout or self._op_timeout)

    async def _bounded(
        self, pool: Pool, exchange: Callable[[Connection], Awaitable[T]], limit: float
    ) -> T:
        """``exchange`` on a connection of ``pool``; ``TimeoutError`` after ``limit`` seconds
        (its message says so), whatever the link does.

        ``asyncio.timeout`` alone does not bound it: once a query is cut short, asyncpg's
        ``Pool.release()`` waits (shielded) for the server to acknowledge the cancellation,
        which a stalled link (packets dropped, no reset) never does. So the exchange runs in a
        task of its own that the caller stops waiting for; an abandoned exchange ends in the
        background (see ``_Call.abandon``), its connection terminated if the server does not
        answer, and the pool opens a fresh one for a later call. A statement that the server
        completes before the cancellation reaches it stands, as when an answer is lost: a
        claim granted that way is never run, its lease expires and ``take_over`` restarts it.
        """
        call = _Call(pool, exchange, limit)
        task = asyncio.get_running_loop().create_task(call.run())
        self._calls.add(task)
        task.add_done_callback(_forget(self._calls))
        try:
            async with Within(limit):
                return await asyncio.shield(task)
        except BaseException:  # timed out, or the caller was cancelled
            call.abandon(task)
            raise

    async def _end_calls(self) -> None:
        """Wait for the exchanges still in flight (abandoned ones end once their connection is
        terminated); one still connecting is cancelled."""
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)


async def keep_session(conn: Connection) -> None:
    """The pool's reset on release: nothing. This backend never changes a session (no SET, no
    LISTEN, only transaction-scoped locks), and asyncpg's default reset is one more round trip
    on every call; asyncpg still rolls back a transaction left open."""


class _Call(Generic[T]):
    """One exchange on a pooled connection, run in a task of its own (see ``_bounded``)."""

    def __init__(
        self, pool: Pool, exchange: Callable[[Connection], Awaitable[T]], limit: float
    ) -> None:
        self._pool, self._exchange, self._limit = pool, exchange, limit
        self._conn: Connection | None = None

    async def run(self) -> T:
        conn = await self._pool.acquire(timeout=self._limit)
        self._conn = conn
        try:
            return await self._exchange(conn)
        finally:
            # After a cancelled statement, asyncpg's release waits this long for the server
            # to acknowledge the cancellation, then terminates the connection.
            await self._pool.release(conn, timeout=self._cleanup_s)
            self._conn = None

    @property
    def _cleanup_s(self) -> float:
        return max(self._limit, _CANCEL_WAIT_S)

    def abandon(self, task: asyncio.Task[T]) -> None:
        """Nobody waits for the answer any more: end the exchange in the background.

        Cancelled first, so that asyncpg asks the server to cancel the statement (a claim
        stuck behind a lock is then not granted once the lock is free); the connection is
        terminated if the server has not acknowledged that within ``_CANCEL_WAIT_S``.
        """
        if task.done():
            return
        task.cancel()
        asyncio.get_running_loop().call_later(self._cleanup_s, self._terminate, task)

    def _terminate(self, task: asyncio.Task[T]) -> None:
        conn = self._conn
        if task.done() or conn is None:
            return
        try:
            conn.terminate()  # sync: the socket is closed; the pool replaces the connection
        except Exception:  # released meanwhile: nothing left to end
            logger.debug("terminating an abandoned connection failed", exc_info=True)


def _forget(calls: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    """A done-callback: drop the task from ``calls`` and retrieve its outcome, so that an
    abandoned exchange's error is not reported as never retrieved."""

    def done(task: asyncio.Task[Any]) -> None:
        calls.discard(task)
        if not task.cancelled():
            task.exception()

    return done

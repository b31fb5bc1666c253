"""``SQLiteCalls``: the one connection of ``SQLiteBackend``, which every part of the backend
(its leases, history and fleet records) runs its work on, one call at a time, bounded, in a
``BEGIN IMMEDIATE`` transaction when it writes."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from ..._exceptions import BackendUnavailableError
from .._errors import Within
from .._sql import SQLLeaseBackend
from ._statements import Statements

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["SQLiteCalls"]

_BUSY_RETRY_S = 0.005  # the pause before asking again for a write lock SQLite refused

T = TypeVar("T")


class SQLiteCalls(SQLLeaseBackend):
    """The calls of ``SQLiteBackend`` on its connection, which supplies the connection, the
    store's clock and the translation of errors (set at construction and start)."""

    _sql: Statements
    _conn: aiosqlite.Connection | None
    _lock: asyncio.Lock
    _rollbacks: set[asyncio.Task[None]]

    @abstractmethod
    def _store_now_ms(self) -> int: ...

    async def _run(
        self,
        action: str,
        work: Callable[[aiosqlite.Connection], Awaitable[T]],
        *,
        timeout: float | None = None,
        transaction: bool = False,
    ) -> T:
        """``work`` with the connection to itself, answered within ``timeout`` seconds; with
        ``transaction``, between ``BEGIN IMMEDIATE`` and ``COMMIT``.

        A failed transaction's ROLLBACK runs in the background and keeps the connection until
        it is done: a statement cut short by the timeout still runs to its end in aiosqlite's
        thread (perhaps waiting ``busy_timeout`` for another process's write lock), and the
        caller must not wait for it. (A cancelled COMMIT may still commit: a claim granted
        that way never runs, its lease expires and ``take_over`` restarts the slot.)
        """
        with self._translate(action):
            async with Within(timeout or self._op_timeout):
                await self._lock.acquire()
                rolling_back = False
                try:
                    if self._conn is None:
                        raise BackendUnavailableError("SQLiteBackend is not started")
                    conn = self._conn
                    if not transaction:
                        return await work(conn)
                    try:
                        await self._begin(conn)
                        result = await work(conn)
                        await conn.execute("COMMIT")
                    except BaseException:
                        rolling_back = self._roll_back(conn)
                        raise
                    return result
                finally:
                    if not rolling_back:
                        self._lock.release()

    @staticmethod
    async def _begin(conn: aiosqlite.Connection) -> None:
        """``BEGIN IMMEDIATE``, asked again while another process keeps the write lock past
        ``busy_timeout``: a call waits for the lock as long as its own bound (a claim its
        caller's timeout, a release a third of ``lease_ttl``), not one ``busy_timeout``. Under
        load, processes racing for one instant's slots each hold the lock for a few event loop
        turns, and a claim failed after a third of a short ``lease_ttl`` though its caller
        would have waited (seen under CPU stress). A refused BEGIN wrote nothing: asking again
        is safe.
        """
        while True:
            try:
                await conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:  # or BUSY_RECOVERY…
                    raise
            await asyncio.sleep(_BUSY_RETRY_S)

    def _roll_back(self, conn: aiosqlite.Connection) -> bool:
        """Start the ROLLBACK, which releases the connection's lock once done."""

        async def roll_back() -> None:
            try:
                # No transaction if BEGIN itself failed; no connection if it was closed.
                with contextlib.suppress(sqlite3.Error, ValueError):
                    await conn.execute("ROLLBACK")
            finally:
                self._lock.release()

        task = asyncio.get_running_loop().create_task(roll_back())
        self._rollbacks.add(task)
        task.add_done_callback(self._rollbacks.discard)
        return True

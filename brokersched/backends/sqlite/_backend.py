"""``SQLiteBackend``: its configuration and its life (open the file, switch it to WAL, create
or upgrade the tables, close), the operations (``_ops``) and the translation of sqlite3's
errors; the calls on its connection are ``_connection``'s, the leases ``_leases``'s, the
history ``_history``'s, the fleet's records ``_fleet``'s, the SQL ``_statements``'s."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from ..._clock import Clock, host_time_ms
from ..._durations import Duration, to_ms
from ..._exceptions import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
)
from ...abc import Finding, Inventory, Slot
from .._errors import ErrorMap, ErrorRow
from .._keywords import checked_keywords
from .._lease import DEFAULT_MAX_CLOCK_SKEW, ClockName
from .._ops import NamespaceInventory
from .._sql import SCHEMA_VERSION
from . import _ops
from ._fleet import SQLiteFleet
from ._leases import SQLiteLeases
from ._options import SQLiteOptions, check_table_prefix
from ._statements import Statements

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["SQLiteBackend"]

_WAL_SWITCH_S = 10.0  # the longest a start retries the switch of a new file to WAL


class SQLiteBackend(NamespaceInventory, SQLiteLeases, SQLiteFleet):
    """Leases in a SQLite file shared by the processes of one host (not over NFS).

    ``path``: the database file (created if missing). ``lease_ttl``: how long a lease lives
    unless renewed. ``table_prefix``: prepended to the table names, so several schedulers (or
    an application's own tables) can share a file. ``busy_timeout``: how long a statement waits
    for another process's write lock before failing (a transaction then asks again until its
    call's bound: a claim's timeout, a third of ``lease_ttl`` for a release); at most a third
    of ``lease_ttl`` (unset: 5 s, or a third of ``lease_ttl`` if shorter).
    ``max_clock_skew``: how far ahead of the host's clock a claimed slot may be.
    """

    clock_name = ClockName("SQLite's clock (the host's CLOCK_REALTIME)", "this host")

    @checked_keywords
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lease_ttl: Duration = "30s",
        table_prefix: str = "brokersched_",
        busy_timeout: Duration | None = None,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
    ) -> None:
        options = SQLiteOptions.parse(self.name, locals())
        super().__init__(options)
        self._path = os.fspath(path)
        self._errors = ErrorMap(self._error_rows)
        self._prefix, self._busy_timeout = options.table_prefix, options.busy_timeout
        self._sql = Statements(self._prefix)
        # Each object has one connection; a transaction must not interleave with another
        # coroutine's statements on it.
        self._lock = asyncio.Lock()
        self._conn: aiosqlite.Connection | None = None
        self._rollbacks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"SQLiteBackend({self._path!r}, table_prefix={self._prefix!r})"

    def _store_now_ms(self) -> int:
        """The store's clock, which every statement is given as ``:now``: the host's, which no
        in-process fake moves (``host_time_ms``). The one place to move it in a test."""
        return host_time_ms()

    @property
    def busy_timeout(self) -> timedelta:
        return self._busy_timeout

    @property
    def _op_timeout(self) -> float:
        """The bound on calls that take no timeout: the lock wait plus some work."""
        return self._busy_timeout.total_seconds() + 5.0

    # -- lifecycle -------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        try:
            import aiosqlite
        except ImportError as exc:
            raise ConfigurationError(
                "SQLiteBackend needs aiosqlite: pip install 'brokersched[sqlite]'",
                backend=self.name,
            ) from exc
        with self._translate("open the database"):
            # A failed aiosqlite.connect() leaves its worker thread to report to the event loop
            # later, which raises if the loop has closed by then (omnilib/aiosqlite#259): find
            # out whether the file opens before handing it to aiosqlite.
            await asyncio.to_thread(_check_opens, self._path)
            # isolation_level=None: this code issues BEGIN IMMEDIATE / COMMIT itself.
            self._conn = await aiosqlite.connect(self._path, isolation_level=None)
        try:
            await self._run("configure the database", self._configure)
            if not await self._run("read the schema version", self._schema_current):
                await self._run("create the tables", self._migrate, transaction=True)
        except BaseException:
            await self._close()
            raise
        self._clock = clock

    async def _configure(self, conn: aiosqlite.Connection) -> None:
        await conn.execute(f"PRAGMA busy_timeout = {to_ms(self._busy_timeout)}")
        mode = await self._use_wal(conn)
        if str(mode).lower() != "wal":
            raise BackendError(f"SQLiteBackend could not switch {self._path} to WAL ({mode})")
        await conn.execute("PRAGMA synchronous = NORMAL")

    async def _use_wal(self, conn: aiosqlite.Connection) -> object:
        """Switch the file to WAL (once for good); the journal mode it is in.

        Instances opening a new file together can deadlock on the exclusive lock the switch
        needs, and SQLite then answers "locked" at once rather than wait ``busy_timeout``:
        try again until it has passed, and at least ``_WAL_SWITCH_S`` (a start may wait; with a
        short ``lease_ttl``, ``busy_timeout`` is too short for five instances on a loaded
        machine: seen in CI).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self._busy_timeout.total_seconds(), _WAL_SWITCH_S)
        while True:
            try:
                rows = await conn.execute_fetchall("PRAGMA journal_mode = WAL")
                return next(iter(rows))[0]
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or loop.time() > deadline:
                    raise
            await asyncio.sleep(0.01)

    async def _migrate(self, conn: aiosqlite.Connection) -> None:
        """Create or upgrade the tables; under the write lock, so instances starting together
        take turns (and the second finds the work done)."""
        table = self._sql.version_table
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (version INTEGER NOT NULL)")
        version = await self._version(conn) or 0
        self._check_version(version)
        for step in self._sql.migrations[version:]:
            for statement in step:
                await conn.execute(statement)
        await conn.execute(f"DELETE FROM {table}")
        await conn.execute(f"INSERT INTO {table} VALUES (?)", (SCHEMA_VERSION,))
        missing = await self._missing_columns(conn)
        for name, statement in self._sql.added_columns.items():
            if name in missing:
                await conn.execute(statement)
        await conn.execute(self._sql.fleet_table)

    async def _schema_current(self, conn: aiosqlite.Connection) -> bool:
        return (
            await self._version(conn) == SCHEMA_VERSION
            and not await self._missing_columns(conn)
            and bool(await conn.execute_fetchall(self._sql.fleet_exists))
        )

    async def _missing_columns(self, conn: aiosqlite.Connection) -> set[str]:
        """The columns added since the schema's version that the history table lacks."""
        rows = await conn.execute_fetchall(self._sql.history_columns)
        return set(self._sql.added_columns) - {row[0] for row in rows}

    async def _version(self, conn: aiosqlite.Connection) -> int | None:
        try:
            rows = await conn.execute_fetchall(f"SELECT version FROM {self._sql.version_table}")
        except sqlite3.OperationalError:
            return None  # no such table yet
        return int(next(iter(rows))[0]) if rows else None

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise BackendError(
                f"SQLiteBackend: tables {self._prefix}* in {self._path} are at schema version "
                f"{version}, newer than this brokersched understands ({SCHEMA_VERSION}); "
                "upgrade brokersched"
            )

    async def _close(self) -> None:
        conn, self._conn, self._clock = self._conn, None, None
        if conn is not None:
            # aiosqlite queues the close after any statement still running on the connection.
            with contextlib.suppress(Exception):  # closing must not raise; nothing is left to do
                await conn.close()
            await asyncio.gather(*self._rollbacks, return_exceptions=True)

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    async def _inventory(self, namespace: str | None) -> Inventory:
        """The tables of this ``table_prefix`` (or ``namespace``) in the file; never creates
        the file. Live: a lease granted in the last minute, or a run going on."""
        prefix = self._namespace(namespace)
        with self._translate("list its tables"):
            return await asyncio.to_thread(_ops.inventory, self._path, prefix, self._store_now_ms())

    async def _presence_records(self, namespace: str | None) -> list[str]:
        """The ``fleet`` table's instance records; never creates the file."""
        prefix = self._namespace(namespace)
        with self._translate("read the fleet's presence"):
            return await asyncio.to_thread(_ops.presence, self._path, prefix, self._store_now_ms())

    async def _control_records(self) -> list[str]:
        """The ``fleet`` table's control records; never creates the file."""
        now = self._store_now_ms()
        with self._translate("read the jobs' controls"):
            return await asyncio.to_thread(_ops.presence, self._path, self._prefix, now, "control")

    async def purge(self, inventory: Inventory) -> Inventory:
        """Drop the tables of ``inventory``; the file stays (it may hold other tables)."""
        with self._translate("drop its tables"):
            return await asyncio.to_thread(_ops.purge, self._path, inventory, self._store_now_ms())

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        with self._translate("check the database"):
            return await asyncio.to_thread(_ops.doctor, self._path, self._prefix)

    def _namespace(self, namespace: str | None) -> str:
        if namespace is None:
            return self._prefix
        return check_table_prefix(namespace, self.name)

    # -- plumbing --------------------------------------------------------------------------

    def _error_rows(self) -> list[ErrorRow]:
        """What sqlite3's and aiosqlite's errors mean (``_translate``)."""

        def timed_out(action: str, exc: BaseException) -> BackendError:
            return BackendUnavailableError(
                f"SQLiteBackend could not {action} in {self._path}: {str(exc) or 'timed out'}"
            )

        def failed(action: str, exc: BaseException) -> BackendError:
            kind = BackendUnavailableError if _unavailable(exc) else BackendError
            return kind(f"SQLiteBackend could not {action} in {self._path}: {exc}")

        return [(TimeoutError, timed_out), ((sqlite3.Error, ValueError, OSError), failed)]


def _check_opens(path: str) -> None:
    sqlite3.connect(path).close()


def _unavailable(exc: BaseException) -> bool:
    """Errors that mean "cannot get at the database now" rather than "it said no"."""
    if isinstance(exc, OSError | ValueError):  # aiosqlite: ValueError("Connection closed")
        return True
    text = str(exc).lower()
    return any(word in text for word in ("locked", "busy", "unable to open", "disk i/o"))

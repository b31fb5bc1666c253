"""The SQLite lease backend: several processes on one host sharing one database file.

Every write that decides something runs in a ``BEGIN IMMEDIATE`` transaction, which takes
SQLite's single write lock before reading: claims, hand-overs and take-overs are serialised
across processes, and a deferred transaction's "read, then fail to upgrade" (``SQLITE_BUSY``
that ``busy_timeout`` cannot wait out) never happens.

The store's clock is the host's (``_store_now_ms``): the kernel's ``CLOCK_REALTIME``, read by a
direct system call under the write lock (after ``BEGIN IMMEDIATE``; a lone statement reads it
just before it runs), and passed to the statements as ``:now``. Every process sharing the file
runs on this host and reads that one clock, even a process whose C library's time is faked
(libfaketime): SQLite's own ``julianday('now')`` reads the calling process's time, so a process
40 s fast would be judged on its own clock and claim slots 40 s ahead for the whole fleet.
Lease expiry and the time check of a claimed slot (``max_clock_skew``) are judged on it;
history times come from the scheduler's clock (as in every backend).

``busy_timeout`` (how long a statement waits for another process's write lock) must fit in a
third of ``lease_ttl``: a release or renewal waiting longer could land after the lease expired,
when another process has already restarted the slot. A transaction refused the lock after
``busy_timeout`` asks again until its call's own bound (a claim's timeout, a third of
``lease_ttl`` for a release).

The database runs in WAL mode with ``synchronous=NORMAL``: durable against a crashed or killed
process, which is what leases guard against; a power cut may lose the last commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .._clock import Clock, datetime_to_ms, host_time_ms
from .._durations import Duration, to_ms
from .._exceptions import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
)
from ..abc import (
    Claim,
    Finding,
    FleetKind,
    Inventory,
    JobPolicy,
    Lease,
    LeaseOutcome,
    LeaseState,
    RunReason,
    RunRecord,
    Slot,
)
from . import _sqlite_ops
from ._errors import ErrorMap, ErrorRow, Within
from ._keywords import checked_keywords
from ._lease import (
    BATCH_CHUNK,
    DEFAULT_MAX_CLOCK_SKEW,
    ClockName,
    JobRow,
    JobState,
    LeaseRow,
    Store,
    TakenOver,
    TakeOver,
    check_lock_wait,
    decide,
    in_chunks,
    new_token,
    refusal,
)
from ._sql import (
    NO_SLOT,
    SCHEMA_VERSION,
    SQLLeaseBackend,
    check_identifier,
    datetime_to_us,
    history_cutoff,
    history_limit,
    run_record,
    us_to_datetime,
)

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["SQLiteBackend"]

_BUSY_RETRY_S = 0.005  # the pause before asking again for a write lock SQLite refused
_WAL_SWITCH_S = 10.0  # the longest a start retries the switch of a new file to WAL

T = TypeVar("T")

_SCHEMA_V1 = (
    """CREATE TABLE {jobs} (
        job TEXT PRIMARY KEY,
        last_slot_ms INTEGER NOT NULL,
        lease_until_ms INTEGER NOT NULL
    ) STRICT, WITHOUT ROWID""",
    """CREATE TABLE {leases} (
        job TEXT NOT NULL,
        slot_ms INTEGER NOT NULL,
        token TEXT NOT NULL,
        run_id TEXT NOT NULL,
        instance_id TEXT NOT NULL,
        reason TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('running', 'handover')),
        started_us INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL,
        PRIMARY KEY (job, slot_ms)
    ) STRICT, WITHOUT ROWID""",
    """CREATE TABLE {history} (
        job TEXT NOT NULL,
        n INTEGER NOT NULL,
        slot_ms INTEGER NOT NULL,
        run_id TEXT NOT NULL,
        instance_id TEXT NOT NULL,
        reason TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        started_us INTEGER NOT NULL,
        finished_us INTEGER,
        outcome TEXT NOT NULL,
        error TEXT,
        PRIMARY KEY (job, n)
    ) STRICT, WITHOUT ROWID""",
    "CREATE INDEX {history_started} ON {history} (job, started_us)",
)
# Manual runs get their own fence; a grant remembers its slot, so only its release ends it.
_SCHEMA_V2 = (
    "ALTER TABLE {jobs} ADD COLUMN grant_slot_ms INTEGER",
    "ALTER TABLE {jobs} ADD COLUMN manual_slot_ms INTEGER",
    "UPDATE {jobs} SET grant_slot_ms = last_slot_ms",
)
#: ``_MIGRATIONS[v]`` takes the tables from version ``v`` to ``v + 1``.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (_SCHEMA_V1, _SCHEMA_V2)
# A failed run's traceback (RunRecord.traceback): added at start when missing, without a schema
# version change: instances of an earlier release name their columns, so they neither write nor
# read it, and keep starting.
_TRACEBACK_COLUMN = "ALTER TABLE {history} ADD COLUMN traceback TEXT"
# The fleet's records (presence, controls: issue 25), added at start when missing, as above.
_FLEET_TABLE = """CREATE TABLE IF NOT EXISTS {fleet} (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    expires_ms INTEGER,
    PRIMARY KEY (kind, key)
) STRICT, WITHOUT ROWID"""
_FLEET_EXISTS = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '{fleet_name}'"
# :now: the store's clock (ms); expired presence goes with the next write of its kind.
_FLEET_READ = """SELECT key, value FROM {fleet}
WHERE kind = :kind AND (expires_ms IS NULL OR expires_ms > :now)"""
_FLEET_PUT = """INSERT INTO {fleet} (kind, key, value, expires_ms)
VALUES (:kind, :key, :value, :now + :ttl_ms)
ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value, expires_ms = excluded.expires_ms"""
_FLEET_EXPIRE = "DELETE FROM {fleet} WHERE kind = :kind AND expires_ms <= :now"
_FLEET_INSERT = """INSERT INTO {fleet} (kind, key, value, expires_ms)
VALUES (:kind, :key, :new, NULL) ON CONFLICT (kind, key) DO NOTHING RETURNING 1"""
_FLEET_SWAP = """UPDATE {fleet} SET value = :new, expires_ms = NULL
WHERE kind = :kind AND key = :key AND value = :old RETURNING 1"""
_HISTORY_COLUMNS = "SELECT name FROM pragma_table_info('{history_name}')"

_DEFAULT_BUSY_TIMEOUT = timedelta(seconds=5)
# :now, in every statement below, is the store's clock in milliseconds (_store_now_ms).
_LIVE = """({jobs}.lease_until_ms > :now OR EXISTS (
    SELECT 1 FROM {leases} AS l
    WHERE l.job = {jobs}.job AND l.state = 'running' AND l.expires_ms > :now))"""

# A slot whose lease row is taken (a manual run at a scheduled slot's very instant) is refused.
_FREE = "NOT EXISTS (SELECT 1 FROM {leases} WHERE job = :job AND slot_ms = :slot_ms)"

_GRANT = """INSERT INTO {jobs} (job, last_slot_ms, lease_until_ms, grant_slot_ms)
VALUES (:job, :slot_ms, :now + :ttl_ms, :slot_ms)
ON CONFLICT (job) DO UPDATE
    SET last_slot_ms = excluded.last_slot_ms, lease_until_ms = excluded.lease_until_ms,
        grant_slot_ms = excluded.grant_slot_ms
    WHERE {jobs}.last_slot_ms < excluded.last_slot_ms AND (:allow OR NOT {live}) AND {free}
RETURNING lease_until_ms"""

# A catch-up never creates the job's row: a job never claimed has missed nothing (nor does a
# job only ever run manually).
_GRANT_CATCH_UP = """UPDATE {jobs}
SET last_slot_ms = :slot_ms, lease_until_ms = :now + :ttl_ms, grant_slot_ms = :slot_ms
WHERE job = :job AND last_slot_ms > :no_slot AND last_slot_ms < :slot_ms
    AND (:allow OR NOT {live}) AND {free}
RETURNING lease_until_ms"""

# A manual run passes its own fence and leaves the job's fence where it is.
_GRANT_MANUAL = """INSERT INTO {jobs} (job, last_slot_ms, lease_until_ms, grant_slot_ms,
    manual_slot_ms)
VALUES (:job, :no_slot, :now + :ttl_ms, :slot_ms, :slot_ms)
ON CONFLICT (job) DO UPDATE
    SET lease_until_ms = excluded.lease_until_ms, grant_slot_ms = excluded.grant_slot_ms,
        manual_slot_ms = excluded.manual_slot_ms
    WHERE coalesce({jobs}.manual_slot_ms < excluded.manual_slot_ms, 1)
        AND (:allow OR NOT {live}) AND {free}
RETURNING lease_until_ms"""

_INSERT_LEASE = """INSERT INTO {leases}
    (job, slot_ms, token, run_id, instance_id, reason, attempt, state, started_us, expires_ms)
VALUES (:job, :slot_ms, :token, :run_id, :instance_id, :reason, 1, 'running', :started_us,
    :expires_ms)"""

_JOB_STATE = """SELECT last_slot_ms, manual_slot_ms, {live}, NOT {free}
FROM {jobs} WHERE job = :job"""

_RENEW = """UPDATE {leases} SET expires_ms = :now + :ttl_ms
WHERE job = :job AND slot_ms = :slot_ms AND token = :token AND state = 'running'
    AND expires_ms > :now
RETURNING 1"""

# Ends the job's "latest grant" too, so that the next claim does not wait for it to expire: in
# the distant past, not at SQLite's "now", which a clock stepped back would make live again.
_END_GRANT = """UPDATE {jobs} SET lease_until_ms = :no_slot
WHERE job = :job AND grant_slot_ms = :slot_ms AND EXISTS (
    SELECT 1 FROM {leases} WHERE job = :job AND slot_ms = :slot_ms AND token = :token)"""

_DELETE_LEASE = "DELETE FROM {leases} WHERE job = :job AND slot_ms = :slot_ms AND token = :token"

_HAND_OVER = """UPDATE {leases} SET state = 'handover', expires_ms = :now
WHERE job = :job AND slot_ms = :slot_ms AND token = :token"""

_DEAD_JOBS = """SELECT DISTINCT job FROM {leases}
WHERE job IN (SELECT value FROM json_each(:jobs))
    AND (state = 'handover' OR expires_ms <= :now)
ORDER BY job"""

_JOB_ROW = "SELECT last_slot_ms, manual_slot_ms FROM {jobs} WHERE job = :job"

_JOB_LEASES = """SELECT slot_ms, token, run_id, instance_id, reason, attempt, state, started_us,
    expires_ms
FROM {leases} WHERE job = :job"""

_RETRY = """UPDATE {leases}
SET token = :token, run_id = :run_id, instance_id = :instance_id, reason = 'retry',
    attempt = :attempt, state = 'running', started_us = :started_us, expires_ms = :expires_ms
WHERE job = :job AND slot_ms = :slot_ms"""

_RETRY_GRANT = """UPDATE {jobs} SET lease_until_ms = :expires_ms, grant_slot_ms = :slot_ms
WHERE job = :job"""

_DROP_GRANT = """UPDATE {jobs} SET lease_until_ms = :no_slot
WHERE job = :job AND grant_slot_ms = :slot_ms"""

_DROP_LEASE = "DELETE FROM {leases} WHERE job = :job AND slot_ms = :slot_ms"

_INSERT_RECORD = """INSERT INTO {history} (job, n, slot_ms, run_id, instance_id, reason, attempt,
    started_us, finished_us, outcome, error, traceback)
SELECT :job, coalesce(max(n), 0) + 1, :slot_ms, :run_id, :instance_id, :reason, :attempt,
    :started_us, :finished_us, :outcome, :error, :traceback
FROM {history} WHERE job = :job
RETURNING n"""

# Two statements, so that each is one index range of this job (an OR would read all its rows).
_TRIM_SIZE = "DELETE FROM {history} WHERE job = :job AND n <= :n - :size"
_TRIM_AGE = "DELETE FROM {history} WHERE job = :job AND started_us < :cutoff_us"

_HISTORY = """SELECT job, slot_ms, run_id, instance_id, reason, attempt, outcome, error,
    traceback, started_us, finished_us
FROM {history}
WHERE job = :job AND (:cutoff_us IS NULL OR started_us >= :cutoff_us)
ORDER BY n DESC LIMIT :limit"""


class _Statements:
    """The SQL above with this backend's table names filled in, built once."""

    def __init__(self, prefix: str) -> None:
        names = {
            "jobs": f'"{prefix}jobs"',
            "leases": f'"{prefix}leases"',
            "history": f'"{prefix}history"',
            "history_name": f"{prefix}history",
            "history_started": f'"{prefix}history_started"',
            "fleet": f'"{prefix}fleet"',
            "fleet_name": f"{prefix}fleet",
        }
        names["live"] = _LIVE.format(**names)
        names["free"] = _FREE.format(**names)

        def fill(template: str) -> str:
            return template.format(**names)

        self.version_table = f'"{prefix}schema_version"'
        self.migrations = tuple(tuple(fill(sql) for sql in step) for step in _MIGRATIONS)
        self.traceback_column = fill(_TRACEBACK_COLUMN)
        self.history_columns = fill(_HISTORY_COLUMNS)
        self.grant = fill(_GRANT)
        self.grant_catch_up = fill(_GRANT_CATCH_UP)
        self.grant_manual = fill(_GRANT_MANUAL)
        self.insert_lease = fill(_INSERT_LEASE)
        self.job_state = fill(_JOB_STATE)
        self.renew = fill(_RENEW)
        self.end_grant = fill(_END_GRANT)
        self.delete_lease = fill(_DELETE_LEASE)
        self.hand_over = fill(_HAND_OVER)
        self.dead_jobs = fill(_DEAD_JOBS)
        self.job_row = fill(_JOB_ROW)
        self.job_leases = fill(_JOB_LEASES)
        self.retry = fill(_RETRY)
        self.retry_grant = fill(_RETRY_GRANT)
        self.drop_grant = fill(_DROP_GRANT)
        self.drop_lease = fill(_DROP_LEASE)
        self.insert_record = fill(_INSERT_RECORD)
        self.trim_size = fill(_TRIM_SIZE)
        self.trim_age = fill(_TRIM_AGE)
        self.history = fill(_HISTORY)
        self.fleet_table = fill(_FLEET_TABLE)
        self.fleet_exists = fill(_FLEET_EXISTS)
        self.fleet_read = fill(_FLEET_READ)
        self.fleet_put = fill(_FLEET_PUT)
        self.fleet_expire = fill(_FLEET_EXPIRE)
        self.fleet_insert = fill(_FLEET_INSERT)
        self.fleet_swap = fill(_FLEET_SWAP)


class SQLiteBackend(SQLLeaseBackend):
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
        super().__init__(lease_ttl, max_clock_skew)
        self._path = os.fspath(path)
        self._errors = ErrorMap(self._error_rows)
        self._prefix = check_identifier(
            table_prefix, option="table_prefix", backend=self.name, max_length=40
        )
        self._busy_timeout = check_lock_wait(
            busy_timeout,
            self._lease_ttl,
            option="busy_timeout",
            default=_DEFAULT_BUSY_TIMEOUT,
            backend=self.name,
        )
        self._sql = _Statements(self._prefix)
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
        if not await self._has_traceback(conn):
            await conn.execute(self._sql.traceback_column)
        await conn.execute(self._sql.fleet_table)

    async def _schema_current(self, conn: aiosqlite.Connection) -> bool:
        return (
            await self._version(conn) == SCHEMA_VERSION
            and await self._has_traceback(conn)
            and bool(await conn.execute_fetchall(self._sql.fleet_exists))
        )

    async def _has_traceback(self, conn: aiosqlite.Connection) -> bool:
        rows = await conn.execute_fetchall(self._sql.history_columns)
        return any(row[0] == "traceback" for row in rows)

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

    async def inventory(
        self,
        *,
        namespace: str | None = None,
        jobs: Sequence[str] = (),
        slots: Sequence[Slot] = (),
    ) -> Inventory:
        """The tables of this ``table_prefix`` (or ``namespace``) in the file; never creates
        the file. Live: a lease granted in the last minute, or a run going on."""
        prefix = self._namespace(namespace)
        with self._translate("list its tables"):
            return await asyncio.to_thread(
                _sqlite_ops.inventory, self._path, prefix, self._store_now_ms()
            )

    async def _presence_records(self, namespace: str | None) -> list[str]:
        """The ``fleet`` table's instance records; never creates the file."""
        prefix = self._namespace(namespace)
        with self._translate("read the fleet's presence"):
            return await asyncio.to_thread(
                _sqlite_ops.presence, self._path, prefix, self._store_now_ms()
            )

    async def purge(self, inventory: Inventory) -> Inventory:
        """Drop the tables of ``inventory``; the file stays (it may hold other tables)."""
        with self._translate("drop its tables"):
            return await asyncio.to_thread(
                _sqlite_ops.purge, self._path, inventory, self._store_now_ms()
            )

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        with self._translate("check the database"):
            return await asyncio.to_thread(_sqlite_ops.doctor, self._path, self._prefix)

    def _namespace(self, namespace: str | None) -> str:
        if namespace is None:
            return self._prefix
        return check_identifier(namespace, option="table_prefix", backend=self.name, max_length=40)

    # -- plumbing --------------------------------------------------------------------------

    def _translate(self, action: str) -> AbstractContextManager[None]:
        """Where sqlite3's and aiosqlite's errors become brokersched's (``backends/_errors.py``:
        an exception not theirs is raised unchanged)."""
        return self._errors(action)

    def _error_rows(self) -> list[ErrorRow]:
        def timed_out(action: str, exc: BaseException) -> BackendError:
            return BackendUnavailableError(
                f"SQLiteBackend could not {action} in {self._path}: {str(exc) or 'timed out'}"
            )

        def failed(action: str, exc: BaseException) -> BackendError:
            kind = BackendUnavailableError if _unavailable(exc) else BackendError
            return kind(f"SQLiteBackend could not {action} in {self._path}: {exc}")

        return [(TimeoutError, timed_out), ((sqlite3.Error, ValueError, OSError), failed)]

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

    # -- leases ----------------------------------------------------------------------------

    async def acquire(
        self,
        slot: Slot,
        *,
        policy: JobPolicy,
        instance_id: str,
        run_id: str,
        reason: RunReason,
        timeout: float,
    ) -> Lease | Literal["overlap", "not-acquired"]:
        claim = Claim(slot, run_id, policy, reason)
        params = self._claim_params(claim, instance_id)

        async def decide(conn: aiosqlite.Connection) -> Lease | Literal["overlap", "not-acquired"]:
            now_ms = self._store_now_ms()  # under the write lock: after any wait for it
            self._check_slot_time(slot, now_ms, self._clock)
            return await self._decide(conn, claim, params | {"now": now_ms})

        return await self._run("claim " + slot.key, decide, timeout=timeout, transaction=True)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """The claims one after the other in one transaction (one write lock, one commit),
        each decided as ``acquire()`` decides it; a batch SQLite refused as a whole (nothing of
        it was written) claims each slot on its own."""
        if len(claims) < 2:
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        if len(claims) > BATCH_CHUNK:  # each process gets its share of the instant's slots

            async def chunk(part: list[Claim]) -> list[LeaseOutcome]:
                return await self.acquire_many(part, instance_id=instance_id, timeout=timeout)

            return await in_chunks(claims, chunk)
        batch = [(claim, self._claim_params(claim, instance_id)) for claim in claims]

        async def decide_all(conn: aiosqlite.Connection) -> list[LeaseOutcome]:
            now_ms = self._store_now_ms()
            outcomes: list[LeaseOutcome] = []
            for claim, params in batch:
                try:
                    self._check_slot_time(claim.slot, now_ms, self._clock)
                except BackendError as exc:
                    outcomes.append(exc)
                    continue
                outcomes.append(await self._decide(conn, claim, params | {"now": now_ms}))
            return outcomes

        action = f"claim {len(claims)} slots"
        try:
            return await self._run(action, decide_all, timeout=timeout, transaction=True)
        except BackendError as exc:
            if isinstance(exc, BackendUnavailableError) or not isinstance(
                exc.__cause__, sqlite3.Error
            ):
                raise
        return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)

    def _claim_params(self, claim: Claim, instance_id: str) -> dict[str, Any]:
        return {
            "job": claim.slot.job,
            "slot_ms": claim.slot.slot_ms,
            "ttl_ms": self._ttl_ms,
            "allow": claim.policy.overlap == "allow",
            "token": new_token(),
            "run_id": claim.run_id,
            "instance_id": instance_id,
            "reason": claim.reason,
            "started_us": datetime_to_us(self._now()),
            "no_slot": NO_SLOT,
        }

    async def _decide(
        self, conn: aiosqlite.Connection, claim: Claim, params: dict[str, Any]
    ) -> Lease | Literal["overlap", "not-acquired"]:
        """Grant or refuse one claim, inside the caller's transaction."""
        grant = {"catch-up": self._sql.grant_catch_up, "manual": self._sql.grant_manual}.get(
            claim.reason, self._sql.grant
        )
        slot = claim.slot
        rows = list(await conn.execute_fetchall(grant, params))
        if rows:
            await conn.execute(self._sql.insert_lease, {**params, "expires_ms": rows[0][0]})
            return Lease(slot.job, slot.slot_ms, params["token"], claim.run_id, 1, claim.reason)
        state = list(await conn.execute_fetchall(self._sql.job_state, params))
        return refusal(
            claim.reason, slot.slot_ms, _job_state(state[0]) if state else None, claim.policy
        )

    async def renew(self, lease: Lease) -> bool:
        params = _lease_params(lease) | {"ttl_ms": self._ttl_ms}

        async def renew(conn: aiosqlite.Connection) -> bool:
            # Read before the statement waits for the write lock: the new expiry can only be
            # earlier than the statement's time, never later than the runner counts on, and a
            # take-over, under the write lock, reads its own.
            now = {"now": self._store_now_ms()}
            return bool(await conn.execute_fetchall(self._sql.renew, params | now))

        # Within a third of the ttl, not busy_timeout + 5 s (see _renew_timeout): a renewal
        # waiting that long for another process's write lock would outlive the lease.
        return await self._run("renew " + lease.slot.key, renew, timeout=self._renew_timeout)

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        end = self._sql.hand_over if handover else self._sql.delete_lease

        async def release(conn: aiosqlite.Connection) -> None:
            await self._end(conn, lease, end, record)

        # Within a third of the ttl (see _renew_timeout): a stuck release gives way to the
        # runner's next try, in time to land before the lease expires.
        await self._run(
            "release " + lease.slot.key, release, timeout=self._renew_timeout, transaction=True
        )

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[tuple[JobPolicy, RunRecord] | None] | None = None,
    ) -> list[Exception | None]:
        """One transaction: all or none."""
        ends = records if records is not None else [None] * len(leases)

        async def release(conn: aiosqlite.Connection) -> None:
            for lease, record in zip(leases, ends, strict=True):
                await self._end(conn, lease, self._sql.delete_lease, record)

        try:
            await self._run(
                f"release {len(leases)} leases",
                release,
                timeout=self._renew_timeout,
                transaction=True,
            )
        except BackendError as exc:
            return [exc for _ in leases]
        return [None for _ in leases]

    async def _end(
        self,
        conn: aiosqlite.Connection,
        lease: Lease,
        end: str,
        record: tuple[JobPolicy, RunRecord] | None,
    ) -> None:
        """End ``lease`` (``end``: delete or hand over), inside the caller's transaction, and
        write ``record`` if that took effect (the lease was still this token's)."""
        params = _lease_params(lease) | {"now": self._store_now_ms()}
        await conn.execute(self._sql.end_grant, params)
        ended = await conn.execute(end, params)
        if record is not None and ended.rowcount:
            await self._append(conn, *record)

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """In one transaction, each job with a dead lease: its row read, the lease protocol's
        take-over (``_lease.decide``), what changed written back with the dead attempts'
        records."""
        by_job = {policy.name: policy for policy in policies}
        params = {"jobs": json.dumps(list(by_job))}

        async def find(conn: aiosqlite.Connection) -> list[str]:
            now = {"now": self._store_now_ms()}
            dead = await conn.execute_fetchall(self._sql.dead_jobs, params | now)
            return [job for (job,) in dead]

        async def take(conn: aiosqlite.Connection) -> list[Lease]:
            leases: list[Lease] = []
            for job in await find(conn):
                leases += await self._take_over_job(conn, by_job[job], instance_id)
            return leases

        # Every instance sweeps often and almost always finds nothing: look before taking the
        # write lock (and look again under it).
        if not by_job or not await self._run("look for dead runners", find):
            return []
        return await self._run("take over slots", take, transaction=True)

    async def _take_over_job(
        self, conn: aiosqlite.Connection, policy: JobPolicy, instance_id: str
    ) -> list[Lease]:
        key = {"job": policy.name}
        now_ms = self._store_now_ms()
        fence, manual_fence = next(iter(await conn.execute_fetchall(self._sql.job_row, key)))
        leases = {
            row[0]: _lease_row(row)
            for row in await conn.execute_fetchall(self._sql.job_leases, key)
        }
        row = JobRow(None if fence == NO_SLOT else fence, manual_fence, leases)
        started = self._now()
        request = TakeOver(policy, instance_id, datetime_to_ms(started))
        after, taken = decide(policy.name, row, request, Store(now_ms, self._ttl_ms, self._skew_ms))
        assert isinstance(taken, TakenOver)
        for record in taken.records:
            await self._append(conn, policy, record)
        for slot_ms in row.leases.keys() - after.leases.keys():
            await conn.execute(self._sql.drop_lease, key | {"slot_ms": slot_ms})
            ended = key | {"slot_ms": slot_ms, "no_slot": NO_SLOT}
            await conn.execute(self._sql.drop_grant, ended)
        for lease in taken.leases:
            expires_ms = after.leases[lease.slot_ms].expires_ms
            await conn.execute(
                self._sql.retry,
                key | {
                    "slot_ms": lease.slot_ms, "token": lease.token, "run_id": lease.run_id,
                    "instance_id": instance_id, "attempt": lease.attempt,
                    "started_us": datetime_to_us(started), "expires_ms": expires_ms,
                },
            )  # fmt: skip
        if taken.leases:
            latest = max(taken.leases, key=lambda lease: lease.slot_ms)
            expires_ms = after.leases[latest.slot_ms].expires_ms
            grant = key | {"slot_ms": latest.slot_ms, "expires_ms": expires_ms}
            await conn.execute(self._sql.retry_grant, grant)
        return taken.leases

    async def lease_state(self, job: str) -> LeaseState:
        key = {"job": job}

        async def read(conn: aiosqlite.Connection) -> LeaseState:
            fences = list(await conn.execute_fetchall(self._sql.job_row, key))
            leases = await conn.execute_fetchall(self._sql.job_leases, key)
            fence, manual_fence = fences[0] if fences else (NO_SLOT, None)
            return LeaseState(
                None if fence == NO_SLOT else fence, manual_fence, frozenset(r[0] for r in leases)
            )

        return await self._run(f"read the leases of {job}", read)

    # -- history ---------------------------------------------------------------------------

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        async def append(conn: aiosqlite.Connection) -> None:
            await self._append(conn, job, record)

        await self._run(f"record a run of {job.name}", append, transaction=True)

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """One transaction: all the records or none."""

        async def append(conn: aiosqlite.Connection) -> None:
            for policy, record in records:
                await self._append(conn, policy, record)

        await self._run(f"record {len(records)} runs", append, transaction=True)

    async def _append(self, conn: aiosqlite.Connection, job: JobPolicy, record: RunRecord) -> None:
        finished = record.finished_at
        rows = await conn.execute_fetchall(
            self._sql.insert_record,
            {
                "job": job.name,
                "slot_ms": record.slot_ms,
                "run_id": record.run_id,
                "instance_id": record.instance_id,
                "reason": record.reason,
                "attempt": record.attempt,
                "started_us": datetime_to_us(record.started_at),
                "finished_us": None if finished is None else datetime_to_us(finished),
                "outcome": record.outcome,
                "error": record.error,
                "traceback": record.traceback,
            },
        )
        (n,) = next(iter(rows))
        await conn.execute(self._sql.trim_size, {"job": job.name, "n": n, "size": job.history_size})
        cutoff = history_cutoff(job, self._now())
        if cutoff is not None:
            params = {"job": job.name, "cutoff_us": datetime_to_us(cutoff)}
            await conn.execute(self._sql.trim_age, params)

    # -- the fleet's records (issue 25): expiry on the host's clock --------------------------

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        params = {"kind": kind, "now": self._store_now_ms()}

        async def read(conn: aiosqlite.Connection) -> Iterable[Sequence[Any]]:
            return await conn.execute_fetchall(self._sql.fleet_read, params)

        return {key: value for key, value in await self._run(f"read the fleet's {kind}s", read)}

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        params = {"kind": kind, "key": key, "value": value, "ttl_ms": to_ms(ttl)}
        params["now"] = self._store_now_ms()

        async def put(conn: aiosqlite.Connection) -> None:
            await conn.execute(self._sql.fleet_expire, params)
            await conn.execute(self._sql.fleet_put, params)

        await self._run(f"write its {kind} record", put, transaction=True)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        params = {"kind": kind, "key": key, "old": old, "new": new}
        sql = self._sql.fleet_insert if old is None else self._sql.fleet_swap

        async def swap(conn: aiosqlite.Connection) -> bool:
            return bool(await conn.execute_fetchall(sql, params))

        return await self._run(f"change the {kind} record of {key}", swap, transaction=True)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        cutoff = history_cutoff(job, self._now())
        params = {
            "job": job.name,
            "cutoff_us": None if cutoff is None else datetime_to_us(cutoff),
            "limit": history_limit(job, limit),
        }

        async def read(conn: aiosqlite.Connection) -> Iterable[Sequence[Any]]:
            return await conn.execute_fetchall(self._sql.history, params)

        rows = await self._run(f"read the history of {job.name}", read)
        return [_history_record(row) for row in rows]


def _history_record(row: Sequence[Any]) -> RunRecord:
    """A row of ``_HISTORY``."""
    finished_us = row[10]
    finished = None if finished_us is None else us_to_datetime(finished_us)
    return run_record(row[:9], us_to_datetime(row[9]), finished)


def _lease_row(row: Sequence[Any]) -> LeaseRow:
    """A row of ``_JOB_LEASES``."""
    _, token, run_id, instance_id, reason, attempt, state, started_us, expires_ms = row
    started_ms = started_us // 1000
    return LeaseRow(token, run_id, instance_id, reason, attempt, state, started_ms, expires_ms)


def _job_state(row: Sequence[Any]) -> JobState:
    """A row of ``_JOB_STATE``."""
    fence, manual_fence, live, taken = row
    return JobState(None if fence == NO_SLOT else fence, manual_fence, bool(live), bool(taken))


def _check_opens(path: str) -> None:
    sqlite3.connect(path).close()


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"job": lease.job, "slot_ms": lease.slot_ms, "token": lease.token, "no_slot": NO_SLOT}


def _unavailable(exc: BaseException) -> bool:
    """Errors that mean "cannot get at the database now" rather than "it said no"."""
    if isinstance(exc, OSError | ValueError):  # aiosqlite: ValueError("Connection closed")
        return True
    text = str(exc).lower()
    return any(word in text for word in ("locked", "busy", "unable to open", "disk i/o"))

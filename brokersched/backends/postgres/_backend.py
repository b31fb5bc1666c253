"""``PostgresBackend``: its configuration and its life (connect, create or upgrade the schema,
close), the budget it watches, the operations (``_ops``) and the translation of asyncpg's
errors; the calls on its pool are ``_connection``'s, the leases ``_leases``'s, the history
``_history``'s, the fleet's records ``_fleet``'s, the SQL ``_statements``'s."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from ... import _redact
from ..._clock import Clock
from ..._durations import Duration
from ..._exceptions import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
)
from ...abc import BrokerBudget, Finding, Inventory, Slot
from .._budget import BudgetWatch
from .._errors import ErrorMap, ErrorRow, Within
from .._keywords import checked_keywords
from .._lease import DEFAULT_MAX_CLOCK_SKEW, ClockName
from .._ops import NamespaceInventory
from .._sql import SCHEMA_VERSION
from . import _ops
from ._budget import BUDGET_SQL, postgres_budget_watch, read_budget
from ._connection import Connection, Pool, Row, keep_session
from ._fleet import PostgresFleet
from ._leases import PostgresLeases
from ._options import PostgresOptions, check_schema
from ._statements import ADDED_COLUMN_NAMES, HAS_COLUMNS, Statements

__all__ = ["PostgresBackend"]

T = TypeVar("T")

# Errors that mean "cannot get at the server now" rather than "it said no".
_UNAVAILABLE = (
    "PostgresConnectionError",
    "CannotConnectNowError",
    "AdminShutdownError",
    "CrashShutdownError",
    "TooManyConnectionsError",
)


class PostgresBackend(NamespaceInventory, PostgresLeases, PostgresFleet):
    """Leases in PostgreSQL, through an asyncpg connection pool.

    ``dsn``: a ``postgresql://`` URL (``sslmode=`` works); its password never appears in a log
    or an error. ``schema``: where the tables live (created at start). ``min_size`` and
    ``max_size``: the pool's connections. ``max_clock_skew``: how far ahead of the database's
    clock a claimed slot may be. ``budget_interval``: how often the database's connections
    are read against ``max_connections`` (``budget``) while started (``None``: never); from
    80 % of what ordinary roles may open, the pool opens no new connection for a claim (one
    that finds no idle connection is skipped, never run twice) until back under 60 %.
    """

    clock_name = ClockName("PostgreSQL's clock_timestamp()", "the PostgreSQL server")

    @checked_keywords
    def __init__(
        self,
        dsn: str,
        *,
        lease_ttl: Duration = "30s",
        schema: str = "brokersched",
        min_size: int = 1,
        max_size: int = 10,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
        budget_interval: Duration | None = "30s",
    ) -> None:
        options = PostgresOptions.parse(self.name, locals())
        super().__init__(options)
        self._budget_period = options.budget_interval
        self._budget: BudgetWatch | None = None
        self._claims_in_flight = 0  # holding, or about to take, a connection of the pool
        self._dsn = dsn
        self._redacted = _redact.redact_url(dsn)
        self._secrets = _redact.url_secrets(dsn)
        self._errors = ErrorMap(self._error_rows, self._secrets)
        self._schema = options.schema_
        self._min_size, self._max_size = options.min_size, options.max_size
        self._sql = Statements(self._schema)
        self._pool: Pool | None = None
        self._asyncpg: Any = None
        self._calls: set[asyncio.Task[Any]] = set()  # exchanges in flight, abandoned ones too

    def __repr__(self) -> str:
        return f"PostgresBackend({self._redacted!r}, schema={self._schema!r})"

    @property
    def schema(self) -> str:
        """Where the tables live."""
        return self._schema

    @property
    def _op_timeout(self) -> float:
        """The bound on calls that take no timeout (renew has its own, see ``_renew_timeout``)."""
        return max(self._lease_ttl.total_seconds(), 5.0)

    # -- lifecycle -------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        self._import_asyncpg()
        pool = await self._connect()
        try:
            with self._translate("create its tables"):
                await self._bounded(pool, self._prepare_schema, self._op_timeout + 10)
        except BaseException:
            pool.terminate()
            await self._end_calls()
            raise
        self._pool, self._clock = pool, clock
        if self._budget_period is not None:
            self._budget = postgres_budget_watch(self.name, self._read_budget, self._budget_period)
            try:
                await self._budget.start(clock)
            except BaseException:  # cancelled
                await self._close()
                raise

    @property
    def budget(self) -> BrokerBudget | None:
        """The database's connections against ``max_connections`` as last read while started
        (``_budget``); ``None`` before, or with ``budget_interval=None``."""
        return None if self._budget is None else self._budget.reading

    async def _read_budget(self) -> BrokerBudget:
        async def read(conn: Connection) -> Row | None:
            return await conn.fetchrow(BUDGET_SQL)

        if self._spare_connections() <= 0:  # shedding: no new connection for this either
            raise BackendError(
                f"{self.name}: no idle connection to read the database's budget with while "
                "shedding (the last reading stands)"
            )
        row = await self._call("read the database's budget", read)
        assert row is not None  # the SELECT always returns its one row
        return read_budget(**dict(row.items()))

    async def _prepare_schema(self, conn: Connection) -> None:
        # The common case: the tables are there; no lock, no DDL (nor the privileges DDL needs).
        if (
            await self._version(conn) != SCHEMA_VERSION
            or not await self._has_store_now(conn)
            or not await self._has_added_columns(conn)
            or not await self._has_fleet(conn)
        ):
            async with conn.transaction():
                await self._migrate(conn)

    async def _has_store_now(self, conn: Connection) -> bool:
        found = await conn.fetchval("SELECT to_regprocedure($1)", f"{self._sql.schema}.store_now()")
        return found is not None

    async def _has_added_columns(self, conn: Connection) -> bool:
        """Whether the history table has the columns added since its schema version."""
        table = f"{self._sql.schema}.history"
        found = await conn.fetchval(HAS_COLUMNS, table, ADDED_COLUMN_NAMES)
        return bool(found == len(ADDED_COLUMN_NAMES))

    async def _has_fleet(self, conn: Connection) -> bool:
        found = await conn.fetchval("SELECT to_regclass($1)", f"{self._sql.schema}.fleet")
        return found is not None

    async def _connect(self) -> Pool:
        try:
            with self._translate("connect"):
                async with Within(self._op_timeout + 10):
                    pool: Pool = await self._asyncpg.create_pool(
                        self._dsn,
                        min_size=self._min_size,
                        max_size=self._max_size,
                        server_settings=self._server_settings(),
                        reset=keep_session,
                    )
                    return pool
        except ValueError as exc:  # a malformed DSN (asyncpg's ClientConfigurationError too)
            error = ConfigurationError(
                f"PostgresBackend cannot use the dsn {self._redacted}: {self._scrub(str(exc))}",
                option="dsn",
                backend=self.name,
            )
            raise error from _redact.chainable(exc, self._secrets)

    def _server_settings(self) -> dict[str, str]:
        """``application_name`` brokersched, unless the DSN names the connections itself."""
        if "application_name" in parse_qs(urlsplit(self._dsn).query):
            return {}
        return {"application_name": "brokersched"}

    async def _migrate(self, conn: Connection) -> None:
        """Create or upgrade the schema, inside the caller's transaction."""
        lock = int.from_bytes(
            hashlib.blake2b(f"brokersched:{self._schema}".encode(), digest_size=8).digest(),
            "big",
            signed=True,
        )
        # Instances starting together would race on CREATE SCHEMA: one at a time.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock)
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self._sql.schema}")
        table = self._sql.version_table
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (version integer NOT NULL)")
        version = await conn.fetchval(f"SELECT version FROM {table}") or 0
        if version > SCHEMA_VERSION:
            raise BackendError(
                f"PostgresBackend: schema {self._schema} is at version {version}, newer than "
                f"this brokersched understands ({SCHEMA_VERSION}); upgrade brokersched"
            )
        for step in self._sql.migrations[version:]:
            await conn.execute(step)
        await conn.execute(f"DELETE FROM {table}")
        await conn.execute(f"INSERT INTO {table} VALUES ($1)", SCHEMA_VERSION)
        if not await self._has_store_now(conn):
            await conn.execute(self._sql.store_now)
        for column in self._sql.added_columns:
            await conn.execute(column)
        await conn.execute(self._sql.fleet_table)

    async def _version(self, conn: Connection) -> int | None:
        exists = await conn.fetchval("SELECT to_regclass($1)", self._sql.version_table)
        if exists is None:
            return None
        version = await conn.fetchval(f"SELECT version FROM {self._sql.version_table}")
        return None if version is None else int(version)

    async def _close(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            await budget.close()
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            async with asyncio.timeout(5):
                await pool.close()  # waits for connections in use to come back
        except Exception:
            pool.terminate()
        await self._end_calls()

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    async def _inventory(self, namespace: str | None) -> Inventory:
        """brokersched's tables and function in the schema (or ``namespace``, another
        schema). Live: a lease live in the last minute, or a run going on."""
        schema = self._ops_schema(namespace)
        return await self._operation("list its tables", _ops.inventory, schema)

    async def _presence_records(self, namespace: str | None) -> list[str]:
        return await self._operation(
            "read the fleet's presence", _ops.presence, self._ops_schema(namespace)
        )

    async def _control_records(self) -> list[str]:
        return await self._operation(
            "read the jobs' controls", _ops.presence, self._schema, "control"
        )

    def _ops_schema(self, namespace: str | None) -> str:
        if namespace is None:
            return self._schema
        return check_schema(namespace, self.name)

    async def purge(self, inventory: Inventory) -> Inventory:
        """Drop the tables and the function of ``inventory``, then the schema if it is empty."""
        return await self._operation("drop its tables", _ops.purge, inventory)

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        return await self._operation(
            "check the database", _ops.doctor, self._schema, self._max_clock_skew
        )

    def _import_asyncpg(self) -> Any:
        try:
            import asyncpg  # pyright: ignore[reportMissingTypeStubs]
        except ImportError as exc:
            raise ConfigurationError(
                "PostgresBackend needs asyncpg: pip install 'brokersched[postgres]'",
                backend=self.name,
            ) from exc
        self._asyncpg = asyncpg
        return asyncpg

    async def _operation(self, action: str, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``call(conn, *args)`` on a connection of its own (the backend need not be started)."""
        asyncpg = self._import_asyncpg()
        with self._translate(action):
            async with Within(self._op_timeout + 10):
                conn = await asyncpg.connect(self._dsn, server_settings=self._server_settings())
                try:
                    return await call(conn, *args)
                finally:
                    await conn.close()

    # -- plumbing --------------------------------------------------------------------------

    def _error_rows(self) -> list[ErrorRow]:
        """What asyncpg's errors mean (``_translate``), with the password scrubbed."""
        known: tuple[type[BaseException], ...] = (OSError, TimeoutError)
        unavailable: tuple[type[BaseException], ...] = (OSError, TimeoutError)
        try:
            import asyncpg  # pyright: ignore[reportMissingTypeStubs]
        except ImportError:  # pragma: no cover - no call is made without it
            pass
        else:
            known += (asyncpg.PostgresError, asyncpg.InterfaceError)
            unavailable += tuple(getattr(asyncpg.exceptions, name) for name in _UNAVAILABLE)

        def make(action: str, exc: BaseException) -> BackendError:
            kind = BackendUnavailableError if isinstance(exc, unavailable) else BackendError
            if isinstance(exc, TimeoutError):
                detail = str(exc) or "timed out"
            else:
                detail = f"{type(exc).__name__}: {exc}"
            detail = self._scrub(detail)
            return kind(f"PostgresBackend could not {action} on {self._redacted}: {detail}")

        # A ValueError (asyncpg's DataError among them) is a malformed DSN or a bad argument:
        # a configuration error (see _connect) or a bug, never translated.
        return [(lambda exc: isinstance(exc, known) and not isinstance(exc, ValueError), make)]

    def _scrub(self, text: str) -> str:
        return _redact.scrub(text, self._secrets)

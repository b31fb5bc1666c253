"""The PostgreSQL lease backend: a fleet of instances sharing one database.

Each decision is one statement, so a race is settled by PostgreSQL's row locks, never by a
read-then-write in the client:

* a claim is an ``INSERT ... ON CONFLICT (job) DO UPDATE ... WHERE <fence and overlap>`` on the
  job's row, chained (in a CTE) to the insert of the slot's lease. N claimers inserting a job
  row that does not exist yet collide on its primary key; all but one then take the
  ``DO UPDATE`` path, which re-reads the row as committed by the winner and is refused.
* a take-over locks the dead lease rows ``FOR UPDATE SKIP LOCKED`` and re-grants through the
  job's row, so each slot goes to exactly one taker and a claim of a newer slot cannot slip in.

Expiry is judged on ``clock_timestamp()`` (the time when the row is examined, after any lock
wait; ``now()`` is frozen at the transaction's start), never on an instance's clock; so is a
slot's time: a claim for a slot further ahead of ``clock_timestamp()`` than ``max_clock_skew`` is
refused (a fast instance would otherwise fence the job's slots for the whole fleet), and a
take-over restarts a slot only within the job's retry window.

Every call is bounded on the client (a claim by its caller's timeout, a renewal and a release by
a third of ``lease_ttl``), whatever the server's ``statement_timeout`` or ``lock_timeout``: a
release never waits past the lease it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import timedelta
from typing import Any, Generic, Literal, Protocol, TypeVar
from urllib.parse import parse_qs, urlsplit

from .. import _redact
from .._clock import Clock
from .._durations import Duration, to_ms
from .._exceptions import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
)
from ..abc import (
    BrokerBudget,
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
from . import _postgres_ops
from ._budget import BudgetWatch, budget_period
from ._errors import ErrorMap, ErrorRow, Within
from ._keywords import checked_keywords
from ._lease import (
    BATCH_CHUNK,
    DEFAULT_MAX_CLOCK_SKEW,
    ClockName,
    DeadRun,
    JobState,
    in_chunks,
    interrupted,
    new_token,
    refusal,
    retry_window_ms,
)
from ._postgres_budget import BUDGET_SQL, postgres_budget_watch, read_budget
from ._sql import (
    NO_SLOT,
    SCHEMA_VERSION,
    SQLLeaseBackend,
    check_identifier,
    history_cutoff,
    history_limit,
    run_record,
)

__all__ = ["PostgresBackend"]

logger = logging.getLogger(__name__)

Row = Mapping[str, Any]
T = TypeVar("T")


class _Connection(Protocol):
    """What this backend uses of an asyncpg connection (asyncpg ships no type hints)."""

    async def execute(self, query: str, *args: object) -> str: ...
    async def fetch(self, query: str, *args: object) -> list[Row]: ...
    async def fetchrow(self, query: str, *args: object) -> Row | None: ...
    async def fetchval(self, query: str, *args: object) -> Any: ...
    async def executemany(self, query: str, args: Iterable[Sequence[object]]) -> None: ...
    def transaction(self) -> AbstractAsyncContextManager[Any]: ...
    def terminate(self) -> None: ...


class _Pool(Protocol):
    """What this backend uses of an ``asyncpg.Pool``."""

    def acquire(self, *, timeout: float | None = None) -> Awaitable[_Connection]: ...
    async def release(self, connection: _Connection, *, timeout: float | None = None) -> None: ...
    async def close(self) -> None: ...
    def terminate(self) -> None: ...
    def get_idle_size(self) -> int: ...


_MS = "* interval '1 millisecond'"

_SCHEMA_V1 = """
CREATE TABLE {s}.jobs (
    job text PRIMARY KEY,
    last_slot_ms bigint NOT NULL,
    lease_until timestamptz NOT NULL
);
CREATE TABLE {s}.leases (
    job text NOT NULL,
    slot_ms bigint NOT NULL,
    token text NOT NULL,
    run_id text NOT NULL,
    instance_id text NOT NULL,
    reason text NOT NULL,
    attempt integer NOT NULL,
    state text NOT NULL CHECK (state IN ('running', 'handover')),
    started_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (job, slot_ms)
);
CREATE TABLE {s}.history (
    job text NOT NULL,
    n bigint NOT NULL,
    slot_ms bigint NOT NULL,
    run_id text NOT NULL,
    instance_id text NOT NULL,
    reason text NOT NULL,
    attempt integer NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz,
    outcome text NOT NULL,
    error text,
    PRIMARY KEY (job, n)
);
CREATE INDEX history_started ON {s}.history (job, started_at);
CREATE TABLE {s}.history_counters (
    job text PRIMARY KEY,
    n bigint NOT NULL
);
"""
# Manual runs get their own fence; a grant remembers its slot, so only its release ends it.
_SCHEMA_V2 = """
ALTER TABLE {s}.jobs ADD COLUMN grant_slot_ms bigint, ADD COLUMN manual_slot_ms bigint;
UPDATE {s}.jobs SET grant_slot_ms = last_slot_ms;
"""
#: ``_MIGRATIONS[v]`` takes the schema from version ``v`` to ``v + 1``.
_MIGRATIONS = (_SCHEMA_V1, _SCHEMA_V2)

# The store's clock, read by every statement: the time when a row is examined. A function of
# the schema, so that a test can make the statements judge time on a clock it drives (the
# conformance suite's protocol check); PostgreSQL inlines it (a volatile SQL function whose
# body is volatile), so production statements read clock_timestamp() directly. Made at start
# when missing: instances of an earlier release neither need nor mind it.
# A failed run's traceback (RunRecord.traceback): added at start when missing, without a schema
# version change, like store_now(): instances of an earlier release name their columns, so they
# neither write nor read it, and keep starting.
_TRACEBACK_COLUMN = "ALTER TABLE {s}.history ADD COLUMN IF NOT EXISTS traceback text"
_HAS_TRACEBACK = """SELECT EXISTS (SELECT FROM pg_attribute
    WHERE attrelid = to_regclass($1) AND attname = 'traceback' AND NOT attisdropped)"""

# The fleet's records (presence, controls: issue 25), added at start when missing, as above.
# Expiry is judged on the database's clock.
_FLEET_TABLE = """CREATE TABLE IF NOT EXISTS {s}.fleet (
    kind text NOT NULL,
    key text NOT NULL,
    value text NOT NULL,
    expires_at timestamptz,
    PRIMARY KEY (kind, key)
)"""
_FLEET_READ = """SELECT key, value FROM {s}.fleet
WHERE kind = $1 AND (expires_at IS NULL OR expires_at > {now})"""
_FLEET_PUT = """WITH expired AS (
    DELETE FROM {s}.fleet WHERE kind = $1 AND key <> $2 AND expires_at <= {now}
)
INSERT INTO {s}.fleet (kind, key, value, expires_at)
VALUES ($1, $2, $3, {now} + $4::bigint * interval '1 millisecond')
ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at"""
_FLEET_INSERT = """INSERT INTO {s}.fleet (kind, key, value, expires_at) VALUES ($1, $2, $3, NULL)
ON CONFLICT (kind, key) DO NOTHING RETURNING 1"""
_FLEET_SWAP = """UPDATE {s}.fleet SET value = $3, expires_at = NULL
WHERE kind = $1 AND key = $2 AND value = $4 RETURNING 1"""

_STORE_NOW = """CREATE OR REPLACE FUNCTION {s}.store_now() RETURNS timestamptz
    LANGUAGE sql VOLATILE PARALLEL SAFE AS 'SELECT clock_timestamp()'"""

_NOW_MS = "(extract(epoch FROM {now}) * 1000)::bigint"
_NO_SLOT = f"'{NO_SLOT}'::bigint"

# $10: max_clock_skew in ms.
_IN_TIME = "$2::bigint <= {now_ms} + $10::bigint"

# A slot whose lease row is taken (a manual run at a scheduled slot's very instant) is refused.
_FREE = "NOT EXISTS (SELECT FROM {s}.leases AS f WHERE f.job = $1 AND f.slot_ms = $2)"

_LIVE = """(j.lease_until > {now} OR EXISTS (
    SELECT FROM {s}.leases AS l
    WHERE l.job = j.job AND l.state = 'running' AND l.expires_at > {now}))"""

_UPSERT_JOB = """INSERT INTO {s}.jobs AS j (job, last_slot_ms, lease_until, grant_slot_ms)
    SELECT $1, $2, {now} + $3::bigint {ms}, $2 WHERE {in_time}
    ON CONFLICT (job) DO UPDATE
        SET last_slot_ms = excluded.last_slot_ms, lease_until = excluded.lease_until,
            grant_slot_ms = excluded.grant_slot_ms
        WHERE j.last_slot_ms < excluded.last_slot_ms AND ($4::boolean OR NOT {live}) AND {free}
    RETURNING j.lease_until"""

# A catch-up never creates the job's row: a job never claimed has missed nothing (nor does a
# job only ever run manually).
_UPDATE_JOB = """UPDATE {s}.jobs AS j
    SET last_slot_ms = $2, lease_until = {now} + $3::bigint {ms}, grant_slot_ms = $2
    WHERE j.job = $1 AND j.last_slot_ms > {no_slot} AND j.last_slot_ms < $2 AND {in_time}
        AND ($4::boolean OR NOT {live}) AND {free}
    RETURNING j.lease_until"""

# A manual run passes its own fence and leaves the job's fence where it is.
_MANUAL_JOB = """INSERT INTO {s}.jobs AS j
        (job, last_slot_ms, lease_until, grant_slot_ms, manual_slot_ms)
    SELECT $1, {no_slot}, {now} + $3::bigint {ms}, $2, $2 WHERE {in_time}
    ON CONFLICT (job) DO UPDATE
        SET lease_until = excluded.lease_until, grant_slot_ms = excluded.grant_slot_ms,
            manual_slot_ms = excluded.manual_slot_ms
        WHERE coalesce(j.manual_slot_ms < excluded.manual_slot_ms, true)
            AND ($4::boolean OR NOT {live}) AND {free}
    RETURNING j.lease_until"""

# The last SELECT reads the job's row as of the statement's start: only used to say why a
# claim was refused (see ``refusal``).
_ACQUIRE = """WITH granted AS (
    {grant}
), leased AS (
    INSERT INTO {s}.leases
        (job, slot_ms, token, run_id, instance_id, reason, attempt, state, started_at, expires_at)
    SELECT $1, $2, $5::text, $6::text, $7::text, $8::text, 1, 'running', $9::timestamptz,
        lease_until
    FROM granted
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT FROM leased) AS granted, j.last_slot_ms, j.manual_slot_ms,
    {live} AS live, NOT {free} AS taken, {now_ms} AS now_ms
FROM (VALUES (1)) AS one (x) LEFT JOIN {s}.jobs AS j ON j.job = $1"""

# Several jobs' scheduled slots in one statement, each decided as ``_ACQUIRE`` decides one:
# $1 jobs (distinct), $2 slots, $3 ttl ms, $4 allow overlap, $5 tokens, $6 run ids, $7 instance
# id, $8 started_at, $9 max_clock_skew ms. Job rows are locked in the order of their names, so
# that batches of several instances never wait on each other in a circle.
_ACQUIRE_MANY = """WITH claim AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $4::boolean[], $5::text[], $6::text[])
        WITH ORDINALITY AS c (job, slot_ms, allow, token, run_id, n)
), granted AS (
    INSERT INTO {s}.jobs AS j (job, last_slot_ms, lease_until, grant_slot_ms)
    SELECT c.job, c.slot_ms, {now} + $3::bigint {ms}, c.slot_ms
    FROM claim AS c WHERE c.slot_ms <= {now_ms} + $9::bigint
    ORDER BY c.job
    ON CONFLICT (job) DO UPDATE
        SET last_slot_ms = excluded.last_slot_ms, lease_until = excluded.lease_until,
            grant_slot_ms = excluded.grant_slot_ms
        WHERE j.last_slot_ms < excluded.last_slot_ms
            AND ((SELECT c.allow FROM claim AS c WHERE c.job = excluded.job) OR NOT {live})
            AND NOT EXISTS (SELECT FROM {s}.leases AS f
                WHERE f.job = excluded.job AND f.slot_ms = excluded.last_slot_ms)
    RETURNING j.job, j.lease_until
), leased AS (
    INSERT INTO {s}.leases
        (job, slot_ms, token, run_id, instance_id, reason, attempt, state, started_at, expires_at)
    SELECT c.job, c.slot_ms, c.token, c.run_id, $7::text, 'schedule', 1, 'running',
        $8::timestamptz, g.lease_until
    FROM granted AS g JOIN claim AS c ON c.job = g.job
    ON CONFLICT DO NOTHING
    RETURNING job
)
SELECT EXISTS (SELECT FROM leased AS l WHERE l.job = c.job) AS granted, j.last_slot_ms,
    j.manual_slot_ms, {live} AS live, {now_ms} AS now_ms,
    EXISTS (SELECT FROM {s}.leases AS f WHERE f.job = c.job AND f.slot_ms = c.slot_ms) AS taken
FROM claim AS c LEFT JOIN {s}.jobs AS j ON j.job = c.job
ORDER BY c.n"""

_RENEW = """UPDATE {s}.leases SET expires_at = {now} + $4::bigint {ms}
WHERE job = $1 AND slot_ms = $2 AND token = $3 AND state = 'running'
    AND expires_at > {now}
RETURNING true"""

# Both end the job's latest grant too, so that the next claim does not wait for it to expire:
# at -infinity, not at the database's "now", which a clock stepped back would make live again.
_RELEASE = """WITH ended AS (
    DELETE FROM {s}.leases WHERE job = $1 AND slot_ms = $2 AND token = $3 RETURNING slot_ms
)
UPDATE {s}.jobs AS j SET lease_until = '-infinity'
FROM ended WHERE j.job = $1 AND j.grant_slot_ms = ended.slot_ms"""

_HAND_OVER = """WITH ended AS (
    UPDATE {s}.leases SET state = 'handover', expires_at = {now}
    WHERE job = $1 AND slot_ms = $2 AND token = $3 RETURNING slot_ms
)
UPDATE {s}.jobs AS j SET lease_until = '-infinity'
FROM ended WHERE j.job = $1 AND j.grant_slot_ms = ended.slot_ms"""

# The jobs of ``$1`` with a dead lease (expired while running, or handed over): most sweeps
# find none, and lock nothing.
_DEAD_JOBS = """SELECT DISTINCT job FROM {s}.leases
WHERE job = ANY($1::text[]) AND (state = 'handover' OR expires_at <= {now})"""

# Taken first, in the order of job names (as claims take them): the take-over then decides on
# rows nobody changes until it commits.
_LOCK_JOBS = """SELECT job FROM {s}.jobs WHERE job = ANY($1::text[]) ORDER BY job FOR UPDATE"""

# $1 job names, $2 their max_attempts, $3 instance id, $4 ttl ms, $5 started_at, $6 their retry
# windows in ms (NULL: none), $7 their overlap='skip'. The lease protocol's take-over
# (``_lease._take_over``) on rows locked by ``_LOCK_JOBS``: a dead slot restarts while it is
# its job's latest (``is_latest``), within its window and attempts (``restart_attempt``); with
# overlap='skip' it waits (untouched, unrecorded) while another run of the job is live, and only
# the job's latest restartable slot restarts. The others are dropped. The dead attempts come
# back for the history.
_TAKE_OVER = """WITH policy AS (
    SELECT * FROM unnest($1::text[], $2::integer[], $6::bigint[], $7::boolean[])
        AS p (job, max_attempts, window_ms, skip)
), dead AS (
    SELECT l.job, l.slot_ms, l.run_id, l.instance_id, l.reason, l.attempt, l.state,
        l.started_at, p.skip,
        l.attempt + (l.state = 'running')::integer AS next_attempt,
        (extract(epoch FROM {now} - l.expires_at) * 1000)::bigint AS waited_ms,
        (j.last_slot_ms = l.slot_ms
            OR (j.manual_slot_ms = l.slot_ms AND j.last_slot_ms < l.slot_ms))
            AND (p.window_ms IS NULL
                OR (extract(epoch FROM {now} - l.expires_at) * 1000)::bigint <= p.window_ms)
            AND l.attempt + (l.state = 'running')::integer <= p.max_attempts AS restartable
    FROM {s}.leases AS l JOIN policy AS p ON p.job = l.job JOIN {s}.jobs AS j ON j.job = l.job
    WHERE l.state = 'handover' OR l.expires_at <= {now}
    FOR UPDATE OF l SKIP LOCKED
), waiting AS (
    SELECT d.job, d.slot_ms FROM dead AS d
    WHERE d.restartable AND d.skip AND (
        EXISTS (SELECT FROM {s}.leases AS o
            WHERE o.job = d.job AND o.slot_ms <> d.slot_ms AND o.state = 'running'
                AND o.expires_at > {now})
        OR EXISTS (SELECT FROM dead AS n
            WHERE n.job = d.job AND n.restartable AND n.slot_ms > d.slot_ms))
), decided AS (
    SELECT d.*, d.restartable AND w.job IS NULL AS restarted
    FROM dead AS d LEFT JOIN waiting AS w ON w.job = d.job AND w.slot_ms = d.slot_ms
    WHERE NOT (d.restartable AND w.job IS NOT NULL)
), leased AS (
    UPDATE {s}.leases AS l
    SET token = replace(gen_random_uuid()::text, '-', ''),
        run_id = left(replace(gen_random_uuid()::text, '-', ''), 16),
        instance_id = $3, reason = 'retry', attempt = d.next_attempt, state = 'running',
        started_at = $5, expires_at = {now} + $4::bigint {ms}
    FROM decided AS d WHERE d.restarted AND l.job = d.job AND l.slot_ms = d.slot_ms
    RETURNING l.job, l.slot_ms, l.token, l.run_id, l.attempt, l.expires_at
), granted AS (
    -- The job's grant: its latest restart, or ended (-infinity) when its slot was dropped.
    UPDATE {s}.jobs AS j
    SET lease_until = coalesce(g.expires_at, '-infinity'),
        grant_slot_ms = coalesce(g.slot_ms, j.grant_slot_ms)
    FROM (SELECT d.job, r.slot_ms, r.expires_at
        FROM (SELECT DISTINCT job FROM decided) AS d LEFT JOIN (
            SELECT DISTINCT ON (job) job, slot_ms, expires_at FROM leased
            ORDER BY job, slot_ms DESC) AS r ON r.job = d.job) AS g
    WHERE j.job = g.job AND (g.slot_ms IS NOT NULL OR EXISTS (SELECT FROM decided AS x
        WHERE x.job = j.job AND NOT x.restarted AND x.slot_ms = j.grant_slot_ms))
), dropped AS (
    DELETE FROM {s}.leases AS l USING decided AS d
    WHERE NOT d.restarted AND l.job = d.job AND l.slot_ms = d.slot_ms
)
SELECT true AS leased, job, slot_ms, token, run_id, NULL AS instance_id, NULL AS reason,
    attempt, NULL AS state, NULL::timestamptz AS started_at, NULL::bigint AS waited_ms,
    true AS restarted
FROM leased
UNION ALL
SELECT false, d.job, d.slot_ms, NULL, d.run_id, d.instance_id, d.reason, d.attempt, d.state,
    d.started_at, d.waited_ms, d.restarted
FROM decided AS d WHERE d.state = 'running'
ORDER BY leased DESC, job, slot_ms"""

# n counts the job's records, from a counter row whose lock queues concurrent writers of one
# job (no retries, no starvation). Each trim is one index range of this job: by (job, n) for the
# size, by (job, started_at) for the age (none when $12 is NULL). The DELETEs see the rows from
# before the INSERT; a row another writer committed meanwhile is trimmed by the next record.
_RECORD = """WITH counted AS (
    INSERT INTO {s}.history_counters AS c (job, n) VALUES ($1, 1)
    ON CONFLICT (job) DO UPDATE SET n = c.n + 1
    RETURNING c.n
), inserted AS (
    INSERT INTO {s}.history (job, n, slot_ms, run_id, instance_id, reason, attempt, started_at,
        finished_at, outcome, error, traceback)
    SELECT $1, n, $2, $3, $4, $5, $6, $7, $8, $9, $10, $13 FROM counted
), too_many AS (
    DELETE FROM {s}.history WHERE job = $1 AND n <= (SELECT n FROM counted) - $11::bigint
)
DELETE FROM {s}.history WHERE job = $1 AND started_at < $12::timestamptz"""

# A release (or hand-over) of lease $14:$15 with token $16 ($17: a hand-over), and, if it took
# effect and $18, the run's record ($1-$13 as ``_RECORD``'s) in the same statement.
_RELEASE_RECORDED = """WITH ended AS (
    DELETE FROM {s}.leases
    WHERE job = $14 AND slot_ms = $15 AND token = $16 AND NOT $17::boolean
    RETURNING slot_ms
), handed AS (
    UPDATE {s}.leases SET state = 'handover', expires_at = {now}
    WHERE job = $14 AND slot_ms = $15 AND token = $16 AND $17::boolean
    RETURNING slot_ms
), done AS (
    SELECT slot_ms FROM ended UNION ALL SELECT slot_ms FROM handed
), grant_ended AS (
    UPDATE {s}.jobs AS j SET lease_until = '-infinity'
    FROM done WHERE j.job = $14 AND j.grant_slot_ms = done.slot_ms
), counted AS (
    INSERT INTO {s}.history_counters AS c (job, n)
    SELECT $1::text, 1 WHERE $18::boolean AND EXISTS (SELECT FROM done)
    ON CONFLICT (job) DO UPDATE SET n = c.n + 1
    RETURNING c.n
), inserted AS (
    INSERT INTO {s}.history (job, n, slot_ms, run_id, instance_id, reason, attempt, started_at,
        finished_at, outcome, error, traceback)
    SELECT $1, n, $2, $3, $4, $5, $6, $7, $8, $9, $10, $13 FROM counted
), too_many AS (
    DELETE FROM {s}.history WHERE job = $1 AND n <= (SELECT n FROM counted) - $11::bigint
)
DELETE FROM {s}.history WHERE job = $1 AND started_at < $12::timestamptz
    AND EXISTS (SELECT FROM counted)"""

_HISTORY = """SELECT job, slot_ms, run_id, instance_id, reason, attempt, outcome, error,
    traceback, started_at, finished_at
FROM {s}.history
WHERE job = $1 AND ($2::timestamptz IS NULL OR started_at >= $2::timestamptz)
ORDER BY n DESC LIMIT $3"""

_LEASE_STATE = """SELECT j.last_slot_ms, j.manual_slot_ms,
    ARRAY(SELECT slot_ms FROM {s}.leases WHERE job = $1) AS leased
FROM (VALUES (1)) AS one (x) LEFT JOIN {s}.jobs AS j ON j.job = $1"""

# Errors that mean "cannot get at the server now" rather than "it said no".
# How long an abandoned statement (see _Call.abandon) may take to be cancelled on the server
# before its connection is terminated; nobody waits for it.
_CANCEL_WAIT_S = 5.0

_UNAVAILABLE = (
    "PostgresConnectionError",
    "CannotConnectNowError",
    "AdminShutdownError",
    "CrashShutdownError",
    "TooManyConnectionsError",
)


class _Statements:
    """The SQL above for one schema, built once."""

    def __init__(self, schema: str) -> None:
        s = f'"{schema}"'
        parts = {"s": s, "ms": _MS, "no_slot": _NO_SLOT, "now": f"{s}.store_now()"}
        parts["now_ms"] = _NOW_MS.format(**parts)
        parts["live"] = _LIVE.format(**parts)
        parts["in_time"] = _IN_TIME.format(**parts)
        parts["free"] = _FREE.format(**parts)

        def fill(template: str, **more: str) -> str:
            return template.format(**parts, **more)

        self.schema = s
        self.version_table = f"{s}.schema_version"
        self.migrations = tuple(fill(step) for step in _MIGRATIONS)
        self.traceback_column = fill(_TRACEBACK_COLUMN)
        self.fleet_table = fill(_FLEET_TABLE)
        self.fleet_read = fill(_FLEET_READ)
        self.fleet_put = fill(_FLEET_PUT)
        self.fleet_insert = fill(_FLEET_INSERT)
        self.fleet_swap = fill(_FLEET_SWAP)
        self.acquire = fill(_ACQUIRE, grant=fill(_UPSERT_JOB))
        self.acquire_catch_up = fill(_ACQUIRE, grant=fill(_UPDATE_JOB))
        self.acquire_manual = fill(_ACQUIRE, grant=fill(_MANUAL_JOB))
        self.acquire_many = fill(_ACQUIRE_MANY)
        self.renew = fill(_RENEW)
        self.release = fill(_RELEASE)
        self.release_recorded = fill(_RELEASE_RECORDED)
        self.hand_over = fill(_HAND_OVER)
        self.dead_jobs = fill(_DEAD_JOBS)
        self.lock_jobs = fill(_LOCK_JOBS)
        self.take_over = fill(_TAKE_OVER)
        self.store_now = fill(_STORE_NOW)
        self.record = fill(_RECORD)
        self.history = fill(_HISTORY)
        self.lease_state = fill(_LEASE_STATE)


class PostgresBackend(SQLLeaseBackend):
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
        super().__init__(lease_ttl, max_clock_skew)
        self._budget_period = budget_period(budget_interval, backend=self.name)
        self._budget: BudgetWatch | None = None
        self._claims_in_flight = 0  # holding, or about to take, a connection of the pool
        self._dsn = dsn
        self._redacted = _redact.redact_url(dsn)
        self._secrets = _redact.url_secrets(dsn)
        self._errors = ErrorMap(self._error_rows, self._secrets)
        self._schema = check_identifier(schema, option="schema", backend=self.name, max_length=63)
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ConfigurationError(
                f"PostgresBackend needs 0 <= min_size <= max_size and max_size >= 1 "
                f"(got min_size={min_size}, max_size={max_size})",
                option="max_size",
                backend=self.name,
            )
        self._min_size, self._max_size = min_size, max_size
        self._sql = _Statements(self._schema)
        self._pool: _Pool | None = None
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
        (``_postgres_budget``); ``None`` before, or with ``budget_interval=None``."""
        return None if self._budget is None else self._budget.reading

    async def _read_budget(self) -> BrokerBudget:
        async def read(conn: _Connection) -> Row | None:
            return await conn.fetchrow(BUDGET_SQL)

        if self._spare_connections() <= 0:  # shedding: no new connection for this either
            raise BackendError(
                f"{self.name}: no idle connection to read the database's budget with while "
                "shedding (the last reading stands)"
            )
        row = await self._call("read the database's budget", read)
        assert row is not None  # the SELECT always returns its one row
        return read_budget(**dict(row.items()))

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

    async def _prepare_schema(self, conn: _Connection) -> None:
        # The common case: the tables are there; no lock, no DDL (nor the privileges DDL needs).
        if (
            await self._version(conn) != SCHEMA_VERSION
            or not await self._has_store_now(conn)
            or not await self._has_traceback(conn)
            or not await self._has_fleet(conn)
        ):
            async with conn.transaction():
                await self._migrate(conn)

    async def _has_store_now(self, conn: _Connection) -> bool:
        found = await conn.fetchval("SELECT to_regprocedure($1)", f"{self._sql.schema}.store_now()")
        return found is not None

    async def _has_traceback(self, conn: _Connection) -> bool:
        return bool(await conn.fetchval(_HAS_TRACEBACK, f"{self._sql.schema}.history"))

    async def _has_fleet(self, conn: _Connection) -> bool:
        found = await conn.fetchval("SELECT to_regclass($1)", f"{self._sql.schema}.fleet")
        return found is not None

    async def _connect(self) -> _Pool:
        try:
            with self._translate("connect"):
                async with Within(self._op_timeout + 10):
                    pool: _Pool = await self._asyncpg.create_pool(
                        self._dsn,
                        min_size=self._min_size,
                        max_size=self._max_size,
                        server_settings=self._server_settings(),
                        reset=_keep_session,
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

    async def _migrate(self, conn: _Connection) -> None:
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
        await conn.execute(self._sql.traceback_column)
        await conn.execute(self._sql.fleet_table)

    async def _version(self, conn: _Connection) -> int | None:
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

    async def _end_calls(self) -> None:
        """Wait for the exchanges still in flight (abandoned ones end once their connection is
        terminated); one still connecting is cancelled."""
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    async def inventory(
        self,
        *,
        namespace: str | None = None,
        jobs: Sequence[str] = (),
        slots: Sequence[Slot] = (),
    ) -> Inventory:
        """brokersched's tables and function in the schema (or ``namespace``, another
        schema). Live: a lease live in the last minute, or a run going on."""
        schema = self._ops_schema(namespace)
        return await self._operation("list its tables", _postgres_ops.inventory, schema)

    async def _presence_records(self, namespace: str | None) -> list[str]:
        return await self._operation(
            "read the fleet's presence", _postgres_ops.presence, self._ops_schema(namespace)
        )

    def _ops_schema(self, namespace: str | None) -> str:
        if namespace is None:
            return self._schema
        return check_identifier(namespace, option="schema", backend=self.name, max_length=63)

    async def purge(self, inventory: Inventory) -> Inventory:
        """Drop the tables and the function of ``inventory``, then the schema if it is empty."""
        return await self._operation("drop its tables", _postgres_ops.purge, inventory)

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        return await self._operation(
            "check the database", _postgres_ops.doctor, self._schema, self._max_clock_skew
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

    def _translate(self, action: str) -> AbstractContextManager[None]:
        """Where asyncpg's errors become brokersched's, with the password scrubbed
        (``backends/_errors.py``: an exception not the client's is raised unchanged)."""
        return self._errors(action)

    def _error_rows(self) -> list[ErrorRow]:
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

    async def _call(
        self,
        action: str,
        exchange: Callable[[_Connection], Awaitable[T]],
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
        self, pool: _Pool, exchange: Callable[[_Connection], Awaitable[T]], limit: float
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
        token = new_token()
        sql = {"catch-up": self._sql.acquire_catch_up, "manual": self._sql.acquire_manual}.get(
            reason, self._sql.acquire
        )
        allow = policy.overlap == "allow"
        args = (
            slot.job, slot.slot_ms, self._ttl_ms, allow, token, run_id, instance_id, reason,
            self._now(), self._skew_ms,
        )  # fmt: skip

        async def claim(conn: _Connection) -> Row | None:
            return await conn.fetchrow(sql, *args)

        with self._claiming(f"the claim of {slot.key}"):
            row = await self._call("claim " + slot.key, claim, timeout)
        assert row is not None  # the SELECT always returns its one row
        self._check_slot_time(slot, row["now_ms"], self._clock, granted=row["granted"])
        if row["granted"]:
            return Lease(slot.job, slot.slot_ms, token, run_id, 1, reason)
        return refusal(reason, slot.slot_ms, _job_state(row), policy)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """Scheduled slots of distinct jobs in one statement (``_ACQUIRE_MANY``); any other
        batch, or one that PostgreSQL refused as a whole (a deadlock with a take-over, say:
        nothing of it was done), claims each slot on its own."""
        jobs = {claim.slot.job for claim in claims}
        shedding = self._budget is not None and self._budget.shedding
        if (
            shedding  # each claim on its own, refused when it finds no idle connection
            or len(claims) < 2
            or len(jobs) < len(claims)
            or any(c.reason != "schedule" for c in claims)
        ):
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        if len(claims) > BATCH_CHUNK:  # each instance gets its share of the instant's slots

            async def chunk(part: list[Claim]) -> list[LeaseOutcome]:
                return await self.acquire_many(part, instance_id=instance_id, timeout=timeout)

            return await in_chunks(claims, chunk)
        tokens = [new_token() for _ in claims]
        args = (
            [c.slot.job for c in claims], [c.slot.slot_ms for c in claims], self._ttl_ms,
            [c.policy.overlap == "allow" for c in claims], tokens, [c.run_id for c in claims],
            instance_id, self._now(), self._skew_ms,
        )  # fmt: skip

        async def claim_all(conn: _Connection) -> list[Row]:
            return await conn.fetch(self._sql.acquire_many, *args)

        try:
            rows = await self._call(f"claim {len(claims)} slots", claim_all, timeout)
        except BackendError as exc:
            if isinstance(exc, BackendUnavailableError) or not self._refused(exc.__cause__):
                raise
            logger.warning("a batch of %d claims was refused (%s): claiming each", len(jobs), exc)
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        return [
            self._outcome(claim, token, row)
            for claim, token, row in zip(claims, tokens, rows, strict=True)
        ]

    def _refused(self, cause: BaseException | None) -> bool:
        """Whether the server answered with an error: the statement did nothing."""
        return self._asyncpg is not None and isinstance(cause, self._asyncpg.PostgresError)

    def _outcome(self, claim: Claim, token: str, row: Row) -> LeaseOutcome:
        slot = claim.slot
        try:
            self._check_slot_time(slot, row["now_ms"], self._clock, granted=row["granted"])
        except BackendError as exc:
            return exc
        if row["granted"]:
            return Lease(slot.job, slot.slot_ms, token, claim.run_id, 1, claim.reason)
        return refusal(claim.reason, slot.slot_ms, _job_state(row), claim.policy)

    async def renew(self, lease: Lease) -> bool:
        """Answers within a third of ``lease_ttl`` (see ``_renew_timeout``)."""
        args = (lease.job, lease.slot_ms, lease.token, self._ttl_ms)

        async def renew(conn: _Connection) -> bool:
            return bool(await conn.fetchval(self._sql.renew, *args))

        return await self._call("renew " + lease.slot.key, renew, self._renew_timeout)

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        sql = self._sql.hand_over if handover else self._sql.release

        async def release(conn: _Connection) -> None:
            if record is None:
                await conn.execute(sql, lease.job, lease.slot_ms, lease.token)
            else:
                args = self._release_args(lease, record, handover=handover)
                await conn.execute(self._sql.release_recorded, *args)

        # Within a third of the ttl (see _renew_timeout): a stuck release gives way to the
        # runner's next try, in time to land before the lease expires.
        await self._call("release " + lease.slot.key, release, self._renew_timeout)

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[tuple[JobPolicy, RunRecord] | None] | None = None,
    ) -> list[Exception | None]:
        """One pipelined round trip, in one transaction (all or none), in the order of job
        names: each release locks its job's row until the commit."""
        ends = records if records is not None else [None] * len(leases)
        ordered = sorted(zip(leases, ends, strict=True), key=lambda e: (e[0].job, e[0].slot_ms))
        args = [self._release_args(lease, record) for lease, record in ordered]

        async def release(conn: _Connection) -> None:
            await conn.executemany(self._sql.release_recorded, args)

        try:
            await self._call(f"release {len(args)} leases", release, self._renew_timeout)
        except BackendError as exc:
            return [exc for _ in leases]
        return [None for _ in leases]

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """One read when no lease is dead (most sweeps); else, in one transaction, the jobs'
        rows locked (``_LOCK_JOBS``), the decision (``_TAKE_OVER``) and the dead attempts'
        records: a slot is taken over only together with its record, so it is recorded exactly
        once, and a record that fails leaves the slot to the next sweep."""
        by_job = {policy.name: policy for policy in policies}
        if not by_job:
            return []
        now = self._now()

        async def take_over(conn: _Connection) -> list[Row]:
            dead = await conn.fetch(self._sql.dead_jobs, list(by_job))
            if not dead:
                return []
            jobs = [by_job[row["job"]] for row in dead]
            windows = {job.name: retry_window_ms(job, self._lease_ttl) for job in jobs}
            args = (
                [job.name for job in jobs], [job.max_attempts for job in jobs], instance_id,
                self._ttl_ms, now, list(windows.values()), [job.overlap == "skip" for job in jobs],
            )  # fmt: skip
            async with conn.transaction():
                await conn.fetch(self._sql.lock_jobs, args[0])
                rows = await conn.fetch(self._sql.take_over, *args)
                for row in rows:
                    if row["leased"]:
                        continue
                    policy = by_job[row["job"]]
                    record = interrupted(
                        _dead_run(row),
                        now,
                        restarted=row["restarted"],
                        window_ms=windows[row["job"]],
                        max_attempts=policy.max_attempts,
                    )
                    if record is not None:
                        await conn.execute(self._sql.record, *self._record_args(policy, record))
                return rows

        rows = await self._call("take over slots", take_over)
        return [
            Lease(row["job"], row["slot_ms"], row["token"], row["run_id"], row["attempt"], "retry")
            for row in rows
            if row["leased"]
        ]

    # -- history ---------------------------------------------------------------------------

    def _release_args(
        self,
        lease: Lease,
        record: tuple[JobPolicy, RunRecord] | None,
        *,
        handover: bool = False,
    ) -> tuple[object, ...]:
        """``_RELEASE_RECORDED``'s arguments: the record's (none: no record written), then the
        lease's."""
        written = () if record is None else self._record_args(*record)
        padded = written or (None,) * 13
        return (*padded, lease.job, lease.slot_ms, lease.token, handover, bool(written))

    def _record_args(self, job: JobPolicy, record: RunRecord) -> tuple[object, ...]:
        return (
            job.name, record.slot_ms, record.run_id, record.instance_id, record.reason,
            record.attempt, record.started_at, record.finished_at, record.outcome, record.error,
            job.history_size, history_cutoff(job, self._now()), record.traceback,
        )  # fmt: skip

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        args = self._record_args(job, record)

        async def record_run(conn: _Connection) -> None:
            await conn.execute(self._sql.record, *args)

        await self._call(f"record a run of {job.name}", record_run)

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """One pipelined round trip, in one transaction (asyncpg's ``executemany`` is atomic):
        all the records or none. In the order of job names (each job's records in their own
        order): a record locks its job's counter until the commit, and two batches taking
        the same jobs' locks in different orders would wait on each other."""
        ordered = sorted(records, key=lambda item: item[0].name)
        args = [self._record_args(policy, record) for policy, record in ordered]

        async def record_runs(conn: _Connection) -> None:
            await conn.executemany(self._sql.record, args)

        await self._call(f"record {len(args)} runs", record_runs)

    # -- the fleet's records (issue 25) ------------------------------------------------------

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        async def read(conn: _Connection) -> list[Row]:
            return await conn.fetch(self._sql.fleet_read, kind)

        rows = await self._call(f"read the fleet's {kind}s", read)
        return {row["key"]: row["value"] for row in rows}

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        async def put(conn: _Connection) -> None:
            await conn.execute(self._sql.fleet_put, kind, key, value, to_ms(ttl))

        await self._call(f"write its {kind} record", put)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        async def swap(conn: _Connection) -> bool:
            if old is None:
                return bool(await conn.fetchval(self._sql.fleet_insert, kind, key, new))
            return bool(await conn.fetchval(self._sql.fleet_swap, kind, key, new, old))

        return await self._call(f"change the {kind} record of {key}", swap)

    async def lease_state(self, job: str) -> LeaseState:
        async def read(conn: _Connection) -> Row | None:
            return await conn.fetchrow(self._sql.lease_state, job)

        row = await self._call(f"read the leases of {job}", read)
        assert row is not None  # the SELECT always returns its one row
        fence = row["last_slot_ms"]
        return LeaseState(
            None if fence in (None, NO_SLOT) else fence,
            row["manual_slot_ms"],
            frozenset(row["leased"]),
        )

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        args = (job.name, history_cutoff(job, self._now()), history_limit(job, limit))

        async def read(conn: _Connection) -> list[Row]:
            return await conn.fetch(self._sql.history, *args)

        return [
            _run_record(row) for row in await self._call(f"read the history of {job.name}", read)
        ]


async def _keep_session(conn: _Connection) -> None:
    """The pool's reset on release: nothing. This backend never changes a session (no SET, no
    LISTEN, only transaction-scoped locks), and asyncpg's default reset is one more round trip
    on every call; asyncpg still rolls back a transaction left open."""


def _run_record(row: Row) -> RunRecord:
    fields = (
        "job", "slot_ms", "run_id", "instance_id", "reason", "attempt", "outcome", "error",
        "traceback",
    )  # fmt: skip
    return run_record([row[field] for field in fields], row["started_at"], row["finished_at"])


def _dead_run(row: Row) -> DeadRun:
    return DeadRun(
        job=row["job"],
        slot_ms=row["slot_ms"],
        run_id=row["run_id"],
        instance_id=row["instance_id"],
        reason=row["reason"],
        attempt=row["attempt"],
        state=row["state"],
        started_at=row["started_at"],
        waited_ms=row["waited_ms"],
    )


def _job_state(row: Row) -> JobState | None:
    """The job's columns of ``_ACQUIRE``'s answer (``None``: no row)."""
    fence = row["last_slot_ms"]
    if fence is None:
        return None
    fence = None if fence == NO_SLOT else fence
    return JobState(fence, row["manual_slot_ms"], bool(row["live"]), bool(row["taken"]))


class _Call(Generic[T]):
    """One exchange on a pooled connection, run in a task of its own (see ``_bounded``)."""

    def __init__(
        self, pool: _Pool, exchange: Callable[[_Connection], Awaitable[T]], limit: float
    ) -> None:
        self._pool, self._exchange, self._limit = pool, exchange, limit
        self._conn: _Connection | None = None

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

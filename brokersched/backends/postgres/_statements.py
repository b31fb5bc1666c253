"""The SQL of ``PostgresBackend``: the schema and its migrations, and one statement per
decision (a claim, a renewal, a release, a take-over, a record, a read), built once for a
schema (``Statements``). The tables are described in ``backends/_sql.py``."""

from __future__ import annotations

from .._sql import NO_SLOT

__all__ = ["ADDED_COLUMN_NAMES", "HAS_COLUMNS", "Statements"]

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
# A failed run's traceback (RunRecord.traceback) and a run's result (RunRecord.result, its
# JSON text): added at start when missing, without a schema version change, like store_now():
# instances of an earlier release name their columns, so they neither write nor read them, and
# keep starting.
_ADDED_COLUMNS = (
    "ALTER TABLE {s}.history ADD COLUMN IF NOT EXISTS traceback text",
    "ALTER TABLE {s}.history ADD COLUMN IF NOT EXISTS result text",
)
ADDED_COLUMN_NAMES = ["traceback", "result"]
#: How many of ``$2`` (column names) the table ``$1`` has.
HAS_COLUMNS = """SELECT count(*) FROM pg_attribute
    WHERE attrelid = to_regclass($1) AND attname = ANY($2::text[]) AND NOT attisdropped"""

# The fleet's records (presence, controls), added at start when missing, as above.
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
# The end of ``_RECORD`` and of ``_RELEASE_RECORDED``, after their ``counted``.
_APPEND = """inserted AS (
    INSERT INTO {s}.history (job, n, slot_ms, run_id, instance_id, reason, attempt, started_at,
        finished_at, outcome, error, traceback, result)
    SELECT $1, n, $2, $3, $4, $5, $6, $7, $8, $9, $10, $13, $14 FROM counted
), too_many AS (
    DELETE FROM {s}.history WHERE job = $1 AND n <= (SELECT n FROM counted) - $11::bigint
)
DELETE FROM {s}.history WHERE job = $1 AND started_at < $12::timestamptz"""

_RECORD = """WITH counted AS (
    INSERT INTO {s}.history_counters AS c (job, n) VALUES ($1, 1)
    ON CONFLICT (job) DO UPDATE SET n = c.n + 1
    RETURNING c.n
), {append}"""

# A release (or hand-over) of lease $15:$16 with token $17 ($18: a hand-over), and, if it took
# effect and $19, the run's record ($1-$14 as ``_RECORD``'s) in the same statement.
_RELEASE_RECORDED = """WITH ended AS (
    DELETE FROM {s}.leases
    WHERE job = $15 AND slot_ms = $16 AND token = $17 AND NOT $18::boolean
    RETURNING slot_ms
), handed AS (
    UPDATE {s}.leases SET state = 'handover', expires_at = {now}
    WHERE job = $15 AND slot_ms = $16 AND token = $17 AND $18::boolean
    RETURNING slot_ms
), done AS (
    SELECT slot_ms FROM ended UNION ALL SELECT slot_ms FROM handed
), grant_ended AS (
    UPDATE {s}.jobs AS j SET lease_until = '-infinity'
    FROM done WHERE j.job = $15 AND j.grant_slot_ms = done.slot_ms
), counted AS (
    INSERT INTO {s}.history_counters AS c (job, n)
    SELECT $1::text, 1 WHERE $19::boolean AND EXISTS (SELECT FROM done)
    ON CONFLICT (job) DO UPDATE SET n = c.n + 1
    RETURNING c.n
), {append}
    AND EXISTS (SELECT FROM counted)"""

_HISTORY = """SELECT job, slot_ms, run_id, instance_id, reason, attempt, outcome, error,
    traceback, result, started_at, finished_at
FROM {s}.history
WHERE job = $1 AND ($2::timestamptz IS NULL OR started_at >= $2::timestamptz)
ORDER BY n DESC LIMIT $3"""

_LEASE_STATE = """SELECT j.last_slot_ms, j.manual_slot_ms,
    ARRAY(SELECT slot_ms FROM {s}.leases WHERE job = $1) AS leased, {now_ms} AS now_ms
FROM (VALUES (1)) AS one (x) LEFT JOIN {s}.jobs AS j ON j.job = $1"""


class Statements:
    """The SQL above for one schema, built once."""

    def __init__(self, schema: str) -> None:
        s = f'"{schema}"'
        parts = {"s": s, "ms": _MS, "no_slot": _NO_SLOT, "now": f"{s}.store_now()"}
        parts["now_ms"] = _NOW_MS.format(**parts)
        parts["live"] = _LIVE.format(**parts)
        parts["in_time"] = _IN_TIME.format(**parts)
        parts["free"] = _FREE.format(**parts)
        parts["append"] = _APPEND.format(**parts)

        def fill(template: str, **more: str) -> str:
            return template.format(**parts, **more)

        self.schema = s
        self.version_table = f"{s}.schema_version"
        self.migrations = tuple(fill(step) for step in _MIGRATIONS)
        self.added_columns = tuple(fill(column) for column in _ADDED_COLUMNS)
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

"""The SQL of ``SQLiteBackend``: the tables and their migrations, and the statements of
every decision (a claim, a renewal, a release, a take-over, a record, a read), with the table
names of one prefix filled in once (``Statements``). The tables are described in
``backends/_sql.py``."""

from __future__ import annotations

__all__ = ["Statements"]

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
# A failed run's traceback (RunRecord.traceback) and a run's result (RunRecord.result, its JSON
# text): added at start when missing, without a schema version change: instances of an earlier
# release name their columns, so they neither write nor read them, and keep starting.
_ADDED_COLUMNS = {
    "traceback": "ALTER TABLE {history} ADD COLUMN traceback TEXT",
    "result": "ALTER TABLE {history} ADD COLUMN result TEXT",
}
# The fleet's records (presence, controls), added at start when missing, as above.
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
    started_us, finished_us, outcome, error, traceback, result)
SELECT :job, coalesce(max(n), 0) + 1, :slot_ms, :run_id, :instance_id, :reason, :attempt,
    :started_us, :finished_us, :outcome, :error, :traceback, :result
FROM {history} WHERE job = :job
RETURNING n"""

# Two statements, so that each is one index range of this job (an OR would read all its rows).
_TRIM_SIZE = "DELETE FROM {history} WHERE job = :job AND n <= :n - :size"
_TRIM_AGE = "DELETE FROM {history} WHERE job = :job AND started_us < :cutoff_us"

_HISTORY = """SELECT job, slot_ms, run_id, instance_id, reason, attempt, outcome, error,
    traceback, result, started_us, finished_us
FROM {history}
WHERE job = :job AND (:cutoff_us IS NULL OR started_us >= :cutoff_us)
ORDER BY n DESC LIMIT :limit"""


class Statements:
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
        #: column name -> the statement that adds it
        self.added_columns = {name: fill(sql) for name, sql in _ADDED_COLUMNS.items()}
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

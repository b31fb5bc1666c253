"""SQLiteBackend and PostgresBackend beyond the conformance suite: races on separate
connections, fencing, the database clock, the schema, history trimming, failures and secrets.
The lease rules every lease backend shares (fencing, stale tokens, racing claimers of newer
slots and racing takers among them) are in tests/backends/multi/test_lease_rules.py.

Every test runs on both backends against the real thing: a SQLite file in the test's temporary
directory, the PostgreSQL server of ``postgres_dsn`` in a throwaway schema.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import signal
import sqlite3
import sys
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from brokersched import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
    JobContext,
    Scheduler,
)
from brokersched._clock import SystemClock
from brokersched._redact import redact_url
from brokersched.abc import (
    Instance,
    JobPolicy,
    Lease,
    LeaseBackend,
    RunInProgress,
    RunRecord,
    Slot,
)
from brokersched.backends._sql import SCHEMA_VERSION
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.sqlite import SQLiteBackend
from tests.support.leases import (
    SLOT,
    TTL,
    Fleet,
    SkewedClock,
    acquire,
    drop_schema,
    fleet_of,
    hold_write_lock,
    now_ms,
    race,
    schema_version,
)
from tests.support.names import unique
from tests.support.paths import REPO_ROOT
from tests.support.sql_worker import log_start, read_log
from tests.support.stall_proxy import StallProxy
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import free_port, until

RACERS = 8
SECRET = "s3cr3t-Pa55"


def with_password(dsn: str, password: str, port: int | None = None) -> str:
    """``dsn`` with a password (trust auth ignores it) and optionally another port."""
    scheme, rest = dsn.split("://", 1)
    userinfo, _, hostpart = rest.rpartition("@")
    user = userinfo.split(":", 1)[0] or "postgres"
    host, _, tail = hostpart.partition("/")
    if port is not None:
        host = f"{host.rsplit(':', 1)[0]}:{port}"
    return f"{scheme}://{user}:{password}@{host}/{tail}"


@pytest.fixture(params=["sqlite", "postgres"])
async def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with fleet_of(request.param, request, tmp_path) as fleet:
        yield fleet


# -- races ---------------------------------------------------------------------------------


async def test_racing_claimers_of_one_slot_have_one_winner(fleet: Fleet) -> None:
    backends = await fleet.many(RACERS)
    policy = JobPolicy("race", overlap="allow")
    for n in range(5):  # the first round also races to create the job's row
        slot = Slot("race", SLOT + n * 1000)
        calls = [
            partial(acquire, b, slot, policy, instance=f"i{i}") for i, b in enumerate(backends)
        ]
        results = await race(calls)
        assert sum(isinstance(r, Lease) for r in results) == 1, results
        assert set(results) - {r for r in results if isinstance(r, Lease)} == {"not-acquired"}


# -- fencing and the database clock --------------------------------------------------------


async def test_a_skewed_instance_clock_cannot_steal_a_live_lease(fleet: Fleet) -> None:
    honest = await fleet.start()
    ahead = await fleet.start(clock=SkewedClock(timedelta(hours=1)))
    lease = await acquire(honest, Slot("job", SLOT))
    assert isinstance(lease, Lease)
    assert await acquire(ahead, Slot("job", SLOT + 1000), instance="i2") == "overlap"
    assert await ahead.take_over([JobPolicy("job")], instance_id="i2") == []
    assert await honest.renew(lease) is True


# -- schema --------------------------------------------------------------------------------


async def test_instances_starting_together_create_the_schema_once(fleet: Fleet) -> None:
    backends = await fleet.many(5)  # concurrent migrations of a fresh file or schema
    assert isinstance(await acquire(backends[3], Slot("job", SLOT)), Lease)
    await backends[0].stop()
    await backends[0].start(SystemClock())  # a restart finds the schema and keeps the claims
    assert await acquire(backends[0], Slot("job", SLOT)) == "not-acquired"
    assert await schema_version(fleet) == SCHEMA_VERSION


async def run_sql(fleet: Fleet, statement: str) -> None:
    """``statement`` on the fleet's database; ``{history}`` names its history table."""
    if fleet.kind == "sqlite":
        with sqlite3.connect(fleet.path) as conn:
            conn.execute(statement.format(history="brokersched_history"))
        return
    conn = await asyncpg.connect(fleet.dsn)
    try:
        await conn.execute(statement.format(history=f'"{fleet.namespace}".history'))
    finally:
        await conn.close()


async def test_the_traceback_column_is_added_to_an_earlier_releases_tables(
    fleet: Fleet,
) -> None:
    """Tables made by the release before RunRecord.traceback (no such column, rows written
    without it) get the column at start, with no schema version change."""
    earlier = await fleet.start()
    policy = JobPolicy("job")
    await earlier.record(policy, record("job", 0))
    await earlier.stop()
    await run_sql(fleet, "ALTER TABLE {history} DROP COLUMN traceback")
    backend = await fleet.start()
    failed = replace(record("job", 1), outcome="failed", error="E: x", traceback="Traceback...")
    await backend.record(policy, failed)
    newest, oldest = await backend.history(policy, 10)
    assert (newest.run_id, newest.traceback) == ("run-1", "Traceback...")
    assert (oldest.run_id, oldest.traceback) == ("run-0", None)
    assert await schema_version(fleet) == SCHEMA_VERSION == 2  # earlier releases still start


async def fetch_sql(fleet: Fleet, statement: str) -> list[tuple[Any, ...]]:
    """The rows of ``statement`` on the fleet's database (``{history}`` as in ``run_sql``)."""
    if fleet.kind == "sqlite":
        with sqlite3.connect(fleet.path) as conn:
            return conn.execute(statement.format(history="brokersched_history")).fetchall()
    conn = await asyncpg.connect(fleet.dsn)
    try:
        rows = await conn.fetch(statement.format(history=f'"{fleet.namespace}".history'))
        return [tuple(row.values()) for row in rows]
    finally:
        await conn.close()


# What the release before RunRecord.result writes and reads: its columns named, no result.
_PREVIOUS_COLUMNS = (
    "job, n, slot_ms, run_id, instance_id, reason, attempt, {times}, outcome, error, traceback"
)
_PREVIOUS_TIMES = {
    "sqlite": ("started_us, finished_us", "0, 0"),
    "postgres": ("started_at, finished_at", "now(), now()"),
}


async def test_the_result_column_is_added_to_the_previous_releases_tables(fleet: Fleet) -> None:
    """Tables made by the release before RunRecord.result (no such column) get it at start,
    with no schema version change; the previous release's statements, which name their
    columns, still write to the upgraded table and read what this release wrote."""
    previous = await fleet.start()
    policy = JobPolicy("job")
    await previous.record(policy, record("job", 0))
    await previous.stop()
    await run_sql(fleet, "ALTER TABLE {history} DROP COLUMN result")
    backend = await fleet.start()
    await backend.record(policy, replace(record("job", 2), result={"sent": 3, "to": ["ü"]}))
    times, values = _PREVIOUS_TIMES[fleet.kind]
    columns = _PREVIOUS_COLUMNS.format(times=times)
    await run_sql(
        fleet,
        f"INSERT INTO {{history}} ({columns}) "
        f"VALUES ('job', 100, {SLOT + 4}, 'run-4', 'old', 'schedule', 1, {values}, "
        "'completed', NULL, NULL)",
    )
    read = await fetch_sql(fleet, f"SELECT {columns} FROM {{history}} ORDER BY n")
    assert [row[3] for row in read] == ["run-0", "run-2", "run-4"]
    newest, middle, oldest = await backend.history(policy, 10)
    assert [(r.run_id, r.result) for r in (newest, middle, oldest)] == [
        ("run-4", None),
        ("run-2", {"sent": 3, "to": ["ü"]}),
        ("run-0", None),
    ]
    assert await schema_version(fleet) == SCHEMA_VERSION == 2  # earlier releases still start


async def test_a_newer_schema_is_refused_at_start(fleet: Fleet) -> None:
    await fleet.start()
    await schema_version(fleet, set_to=99)
    with pytest.raises(BackendError, match="version 99"):
        await fleet.start()


async def test_prefixes_and_schemas_isolate(tmp_path: Path, postgres_dsn: str) -> None:
    a, b = unique("t"), unique("t")
    pairs = [
        (
            SQLiteBackend(tmp_path / "x.db", table_prefix=a),
            SQLiteBackend(tmp_path / "x.db", table_prefix=b),
        ),
        (PostgresBackend(postgres_dsn, schema=a), PostgresBackend(postgres_dsn, schema=b)),
    ]
    try:
        for one, two in pairs:
            for backend in (one, two):
                await backend.start(SystemClock())
                assert isinstance(await acquire(backend, Slot("job", SLOT)), Lease)
    finally:
        for one, two in pairs:
            await one.stop()
            await two.stop()
        for schema in (a, b):
            await drop_schema(postgres_dsn, schema)


async def test_postgres_names_its_connections_unless_the_dsn_does(postgres_dsn: str) -> None:
    """Connections show as ``brokersched`` in ``pg_stat_activity``; a DSN's own
    ``application_name`` is kept (an operator tells fleets apart by it)."""
    schema, named = unique("t"), unique("fleet_")
    sep = "&" if "?" in postgres_dsn else "?"
    backends = {
        "brokersched": PostgresBackend(postgres_dsn, schema=schema),
        named: PostgresBackend(f"{postgres_dsn}{sep}application_name={named}", schema=schema),
    }

    async def show(conn: Any) -> str:
        return str(await conn.fetchval("SHOW application_name"))

    try:
        for expected, backend in backends.items():
            await backend.start(SystemClock())
            assert await backend._call("read application_name", show) == expected
    finally:
        for backend in backends.values():
            await backend.stop()
        await drop_schema(postgres_dsn, schema)


# -- history -------------------------------------------------------------------------------


def record(job: str, n: int, *, age: timedelta = timedelta(0)) -> RunRecord:
    started = datetime.now(UTC) - age
    return RunRecord(
        job=job,
        slot_ms=SLOT + n,
        run_id=f"run-{n}",
        instance_id="test",
        reason="schedule",
        attempt=1,
        started_at=started,
        finished_at=None if n % 2 else started + timedelta(microseconds=1234),
        outcome="completed",
        error=None if n % 3 else "it went wrong: ünïcode",
    )


async def test_concurrent_records_of_one_job_are_all_kept_or_trimmed(fleet: Fleet) -> None:
    backends = await fleet.many(5)
    roomy, small = JobPolicy("roomy", history_size=1000), JobPolicy("small", history_size=7)

    async def write(index: int, policy: JobPolicy) -> None:
        for n in range(12):
            await backends[index].record(policy, record(policy.name, index * 100 + n))

    await asyncio.gather(*(write(i, p) for i in range(5) for p in (roomy, small)))
    kept = await backends[0].history(roomy, 1000)
    assert len({r.run_id for r in kept}) == len(kept) == 60
    assert len(await backends[0].history(small, 1000)) == 7


async def test_history_round_trips_exactly(fleet: Fleet) -> None:
    backend = await fleet.start()
    policy = JobPolicy("job")
    written = [record("job", n) for n in range(4)]
    for item in written:
        await backend.record(policy, item)
    assert await backend.history(policy, 10) == written[::-1]
    assert await backend.history(policy, 0) == []


async def test_history_ttl_applies_on_read_and_on_write(fleet: Fleet) -> None:
    backend = await fleet.start()
    keep_all, aged = JobPolicy("job"), JobPolicy("job", history_ttl=timedelta(hours=1))
    await backend.record(keep_all, record("job", 1, age=timedelta(hours=2)))
    await backend.record(keep_all, record("job", 2))
    assert [r.run_id for r in await backend.history(aged, 10)] == ["run-2"]
    assert len(await backend.history(keep_all, 10)) == 2
    await backend.record(aged, record("job", 3))  # a write trims what the ttl dropped
    assert [r.run_id for r in await backend.history(keep_all, 10)] == ["run-3", "run-2"]


async def test_trimming_uses_the_indexes(fleet: Fleet) -> None:
    """A trim is a range of this job's index, never a read of the whole table (nor of all the
    job's rows)."""
    backend = await fleet.start()
    await backend.record(JobPolicy("job"), record("job", 1))
    if isinstance(backend, SQLiteBackend):
        statements = (backend._sql.trim_size, backend._sql.trim_age)
        params = {"job": "job", "n": 5, "size": 3, "cutoff_us": 0}
        with sqlite3.connect(fleet.path) as conn:
            plans = [
                conn.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall() for sql in statements
            ]
        details = [" | ".join(str(row[-1]) for row in plan) for plan in plans]
        assert "PRIMARY KEY (job=? AND n<?)" in details[0], details
        assert "(job=? AND started_us<?)" in details[1], details
        return
    assert isinstance(backend, PostgresBackend)
    conn = await asyncpg.connect(fleet.dsn)
    try:
        table = f'"{fleet.namespace}".history'
        await conn.execute(
            f"""INSERT INTO {table} (job, n, slot_ms, run_id, instance_id, reason, attempt,
                started_at, outcome)
            SELECT 'job' || (g % 20), g, g, 'r', 'i', 'schedule', 1, now(), 'completed'
            FROM generate_series(1, 20000) AS g"""
        )
        await conn.execute(f"ANALYZE {table}")
        plan = await conn.fetch(
            "EXPLAIN " + backend._sql.record,
            *("job7", SLOT, "r", "i", "schedule", 1, datetime.now(UTC), None, "completed", None),
            *(1000, datetime.now(UTC), None, None),  # history_size, cutoff, traceback, result
        )
    finally:
        await conn.close()
    text = "\n".join(row[0] for row in plan)
    assert "Seq Scan" not in text, text
    assert re.search(r"Index Cond: \(\(job = .*\) AND \(n <= \(\$\d+ - ", text), text
    assert re.search(r"Index Cond: \(\(job = .*\) AND \(started_at < ", text), text


# -- failures ------------------------------------------------------------------------------


async def test_a_database_error_fails_the_claim_closed(fleet: Fleet) -> None:
    backend = await fleet.start()
    if fleet.kind == "sqlite":
        with sqlite3.connect(fleet.path) as conn:
            conn.execute("DROP TABLE brokersched_jobs")
    else:
        await drop_schema(fleet.dsn, fleet.namespace)
    with pytest.raises(BackendError) as caught:
        await acquire(backend, Slot("job", SLOT))
    assert not isinstance(caught.value, BackendUnavailableError)
    assert "claim job:" in str(caught.value)


async def test_a_claim_that_cannot_answer_in_time_fails_closed(fleet: Fleet) -> None:
    backend = (
        await fleet.start(lease_ttl="15s", busy_timeout="5s")
        if fleet.kind == "sqlite"
        else await fleet.start()
    )
    assert isinstance(
        await acquire(backend, Slot("job", SLOT), JobPolicy("job", overlap="allow")), Lease
    )
    async with hold_write_lock(fleet):
        # The answer comes within the claim's timeout, not after busy_timeout or a lock wait.
        async with asyncio.timeout(2.5):
            with pytest.raises(BackendUnavailableError, match="timed out after 300ms"):
                await acquire(backend, Slot("job", SLOT + 1000), timeout=0.3)
    # The connection was not left inside a transaction or a cancelled query.
    later = await acquire(backend, Slot("job", SLOT + 2000), JobPolicy("job", overlap="allow"))
    assert isinstance(later, Lease)


async def test_postgres_survives_connection_loss(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    schema = unique("t")
    async with TcpProxy("127.0.0.1", 5432) as proxy:
        dsn = with_password(postgres_dsn, SECRET, proxy.port)
        backend = PostgresBackend(dsn, schema=schema, lease_ttl=TTL, min_size=2, max_size=2)
        await backend.start(SystemClock())
        try:
            lease = await acquire(backend, Slot("job", SLOT))
            assert isinstance(lease, Lease)
            await proxy.cut()
            with pytest.raises(BackendUnavailableError) as caught:
                await acquire(backend, Slot("job", SLOT + 1000), timeout=2)
            assert_no_secret(caught.value)
            proxy.restore()

            async def renewed() -> bool:
                try:
                    return await backend.renew(lease)
                except BackendUnavailableError:
                    return False

            await until(renewed)
            assert await acquire(backend, Slot("job", SLOT + 1000)) == "overlap"
        finally:
            await backend.stop()
            await drop_schema(postgres_dsn, schema)
    assert SECRET not in caplog.text


# A call's answer may come this much after its timeout (scheduling on a loaded CI machine); a
# call that waits for the server instead overshoots by its whole op timeout or hangs.
MARGIN_S = 1.0


@asynccontextmanager
async def stalled_postgres(postgres_dsn: str, **options: Any) -> AsyncIterator[StalledFleet]:
    """A started PostgresBackend ``a`` reaching the server through a proxy that can stall the
    link, and ``b`` on a direct connection, in a throwaway schema."""
    schema = unique("t")
    port = urlsplit(postgres_dsn).port or 5432
    async with StallProxy(port) as proxy:
        proxied = postgres_dsn.replace(f":{port}/", f":{proxy.port}/")
        a = PostgresBackend(proxied, schema=schema, min_size=1, max_size=2, **options)
        b = PostgresBackend(postgres_dsn, schema=schema, max_size=1, **options)
        await a.start(SystemClock())
        await b.start(SystemClock())
        try:
            yield StalledFleet(proxy, a, b)
        finally:
            proxy.resume()  # so that stop() closes the pool gracefully, not after 5 s
            await a.stop()
            await b.stop()
            await drop_schema(postgres_dsn, schema)


@dataclass
class StalledFleet:
    proxy: StallProxy
    a: PostgresBackend
    b: PostgresBackend


async def test_postgres_calls_answer_in_time_on_a_stalled_link(postgres_dsn: str) -> None:
    """Packets dropped, no reset: asyncpg's release of a cut-short query waits for the server
    for ever (shielded); a call must answer within its timeout anyway, and the pool recovers."""
    async with stalled_postgres(postgres_dsn, lease_ttl="3s") as fleet:
        lease = await acquire(fleet.a, Slot("job", SLOT), JobPolicy("job", overlap="allow"))
        assert isinstance(lease, Lease)
        fleet.proxy.stall()
        async with asyncio.timeout(1.0 + MARGIN_S):
            with pytest.raises(BackendUnavailableError, match="timed out after 1s"):
                await acquire(fleet.a, Slot("job", SLOT + 1000), timeout=1.0)
        # renew() is bounded by a third of lease_ttl (1 s here), not by max(ttl, 5 s)
        async with asyncio.timeout(1.0 + MARGIN_S):
            with pytest.raises(BackendUnavailableError, match=r"renew job:.*timed out after 1s"):
                await fleet.a.renew(lease)
        fleet.proxy.resume()
        # the stalled connection was terminated: later calls get a working one
        later = await acquire(fleet.a, Slot("job", SLOT + 2000), JobPolicy("job", overlap="allow"))
        assert isinstance(later, Lease)
        assert await fleet.a.renew(later)


async def test_postgres_a_stalled_renewal_fails_before_the_lease_can_be_taken_over(
    postgres_dsn: str,
) -> None:
    """The runner renews every ttl/3 and aborts when a renewal fails; a renewal still pending
    when the lease expires would let another instance restart the slot while this runner
    goes on: two runners of one slot."""
    ttl = 1.5
    async with stalled_postgres(postgres_dsn, lease_ttl=ttl) as fleet:
        policy = JobPolicy("job", max_attempts=3)
        lease = await acquire(fleet.a, Slot("job", SLOT), policy, instance="A")
        assert isinstance(lease, Lease)
        fleet.proxy.stall()
        renewal = asyncio.create_task(fleet.a.renew(lease))
        taken: list[Lease] = []

        async def taken_over() -> bool:
            taken.extend(await fleet.b.take_over([policy], instance_id="B"))
            return bool(taken)

        await until(taken_over)
        assert renewal.done()  # failed before B could take the slot: the runner was told
        assert isinstance(renewal.exception(), BackendUnavailableError)
        assert [(t.slot_ms, t.attempt) for t in taken] == [(SLOT, 2)]


async def test_postgres_a_claim_given_up_behind_a_lock_is_cancelled_on_the_server(
    postgres_dsn: str, tmp_path: Path
) -> None:
    """The caller stops waiting at its timeout; in the background the statement is cancelled
    on the server, not merely cut off (a statement whose client vanished still runs once the
    lock is free, and would grant a lease that nobody runs)."""
    fleet = Fleet("postgres", unique("t"), tmp_path / "unused.db", postgres_dsn)
    backend = await fleet.start()
    assert isinstance(backend, PostgresBackend)
    allow = JobPolicy("job", overlap="allow")
    try:
        assert isinstance(await acquire(backend, Slot("job", SLOT), allow), Lease)
        async with hold_write_lock(fleet):
            with pytest.raises(BackendUnavailableError, match="timed out after 300ms"):
                await acquire(backend, Slot("job", SLOT + 1000), allow, timeout=0.3)
            await until(lambda: not backend._calls)  # the abandoned exchange has ended
        watcher = await asyncpg.connect(postgres_dsn)
        try:

            async def no_statement_left() -> bool:
                active = await watcher.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                    " AND pid <> pg_backend_pid() AND strpos(query, $1) > 0",
                    f'"{fleet.namespace}".',
                )
                return bool(active == 0)

            await until(no_statement_left)
        finally:
            await watcher.close()
        assert isinstance(await acquire(backend, Slot("job", SLOT + 1000), allow), Lease)
    finally:
        await backend.stop()
        await drop_schema(postgres_dsn, fleet.namespace)


async def test_sqlite_renew_answers_within_a_third_of_the_ttl(tmp_path: Path) -> None:
    """Another process holds the write lock: renew gives up after ttl/3 (busy_timeout is at most
    that much, see test_a_lock_wait_longer_than_a_third_of_the_lease_is_refused)."""
    fleet = Fleet("sqlite", "unused", tmp_path / "renew.db", "")
    backend = await fleet.start(lease_ttl="1500ms", busy_timeout="500ms")
    try:
        lease = await acquire(backend, Slot("job", SLOT))
        assert isinstance(lease, Lease)
        async with hold_write_lock(fleet), asyncio.timeout(0.5 + MARGIN_S):
            with pytest.raises(BackendUnavailableError, match=r"timed out|locked"):
                await backend.renew(lease)
        assert await backend.renew(lease)
    finally:
        await backend.stop()


async def test_sqlite_claim_waits_for_the_write_lock_up_to_its_own_timeout(
    tmp_path: Path,
) -> None:
    """Another process holds the write lock for several busy_timeouts: the claim asks again
    until its caller's timeout, and wins once the lock is free (before, it failed after one
    busy_timeout: eight racers with lease_ttl 1 s, under CPU stress)."""
    fleet = Fleet("sqlite", "unused", tmp_path / "wait.db", "")
    backend = await fleet.start(lease_ttl="300ms")
    assert backend.busy_timeout == timedelta(milliseconds=100)
    try:
        async with hold_write_lock(fleet):
            claim = asyncio.create_task(acquire(backend, Slot("job", SLOT), timeout=30))
            await asyncio.sleep(0.4)  # the lock held for four busy_timeouts
            assert not claim.done(), claim
        assert isinstance(await claim, Lease)
    finally:
        await backend.stop()


# -- secrets, configuration ----------------------------------------------------------------


def assert_no_secret(error: BaseException) -> None:
    text = "".join(traceback.format_exception(error)) + repr(error)
    assert SECRET not in text, text


async def test_the_password_never_reaches_errors_or_logs(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    closed = with_password(postgres_dsn, SECRET, free_port())
    backend = PostgresBackend(closed, schema="unused")
    assert SECRET not in repr(backend)
    with pytest.raises(BackendUnavailableError) as caught:
        await backend.start(SystemClock())
    assert "***" in str(caught.value)
    assert_no_secret(caught.value)
    no_database = with_password(postgres_dsn, SECRET).rsplit("/", 1)[0] + "/no_such_db_here"
    with pytest.raises(BackendError) as refused:
        await PostgresBackend(no_database, schema="unused").start(SystemClock())
    assert_no_secret(refused.value)
    assert SECRET not in caplog.text


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://app:pw@db:5432/x", "postgresql://app:***@db:5432/x"),
        ("postgres://app:p%40ss@db/x?sslmode=require", "postgres://app:***@db/x?sslmode=require"),
        ("postgresql://app:p@ss/w@db/x", "postgresql://app:***@db/x"),
        ("postgresql://app@db/x", "postgresql://app@db/x"),
        (
            "postgresql://db/x?user=app&password=pw&sslmode=verify-full",
            "postgresql://db/x?user=app&password=***&sslmode=verify-full",
        ),
        ("postgresql://h1:5432,h2:5433/x", "postgresql://h1:5432,h2:5433/x"),
        ("host=db password='a b' user=app", "host=db password=*** user=app"),
    ],
)
def test_a_dsn_is_redacted_like_a_url(dsn: str, expected: str) -> None:
    assert redact_url(dsn) == expected


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://u:{SECRET}@127.0.0.1:notaport/x",
        f"postgresql://u:{SECRET}@127.0.0.1:5432/x?sslmode=bogus",
        f"mysql://u:{SECRET}@127.0.0.1/x",
    ],
)
async def test_a_malformed_dsn_is_a_configuration_error_without_the_password(dsn: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        await PostgresBackend(dsn).start(SystemClock())
    assert (caught.value.option, caught.value.backend) == ("dsn", "PostgresBackend")
    assert_no_secret(caught.value)


async def test_an_error_message_never_carries_the_password_even_percent_decoded() -> None:
    backend = PostgresBackend(f"postgresql://u:{SECRET}%21@127.0.0.1:{free_port()}/x")
    with pytest.raises(BackendUnavailableError) as caught:
        await backend.start(SystemClock())
    assert_no_secret(caught.value)


def test_construction_validates_and_never_connects(tmp_path: Path) -> None:
    PostgresBackend(f"postgresql://u:{SECRET}@127.0.0.1:1/x")  # nothing listens: fine until start
    SQLiteBackend(tmp_path / "missing-dir" / "x.db")
    with pytest.raises(ConfigurationError) as caught:
        PostgresBackend("postgresql://127.0.0.1/x", schema="no-dashes")
    assert (caught.value.option, caught.value.backend) == ("schema", "PostgresBackend")
    with pytest.raises(ConfigurationError, match="table_prefix"):
        SQLiteBackend(tmp_path / "x.db", table_prefix="x; DROP TABLE y")
    with pytest.raises(ConfigurationError, match="lease_ttl"):
        SQLiteBackend(tmp_path / "x.db", lease_ttl=0)
    with pytest.raises(ConfigurationError, match="max_size"):
        PostgresBackend("postgresql://127.0.0.1/x", min_size=3, max_size=2)
    assert PostgresBackend("postgresql://x/y", lease_ttl="45s").lease_ttl == timedelta(seconds=45)
    caps = SQLiteBackend(tmp_path / "x.db").capabilities
    assert (caps.leases, caps.slot_memory, caps.history_ttl, caps.history_size_per_job) == (
        True,
        None,
        True,
        True,
    )


@pytest.mark.parametrize(("module", "extra"), [("asyncpg", "postgres"), ("aiosqlite", "sqlite")])
async def test_a_missing_extra_is_named_at_start(
    module: str, extra: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    backend: LeaseBackend = (
        PostgresBackend("postgresql://127.0.0.1/x")
        if extra == "postgres"
        else SQLiteBackend(tmp_path / "x.db")
    )
    with pytest.raises(ConfigurationError, match=rf"pip install 'brokersched\[{extra}\]'"):
        await backend.start(SystemClock())


async def test_sqlite_cannot_open_is_unavailable(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "missing-dir" / "x.db")
    with pytest.raises(BackendUnavailableError, match="missing-dir"):
        await backend.start(SystemClock())


# -- with the Scheduler: processes, SIGKILL, catch-up, overlap -----------------------------
#
# A worker process (tests/support/sql_worker.py) runs one Scheduler on the shared database and
# appends a line per run it starts to a log file.


@dataclass
class Processes:
    kind: str
    target: str
    namespace: str
    log: Path
    running: list[asyncio.subprocess.Process] = field(default_factory=list)

    async def spawn(self, instance: str, scenario: str, **more: Any) -> asyncio.subprocess.Process:
        spec = {"kind": self.kind, "target": self.target, "namespace": self.namespace}
        spec |= {"instance": instance, "log": str(self.log), "scenario": scenario, **more}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.sql_worker", json.dumps(spec),
            cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.running.append(process)
        assert process.stdout is not None
        async with asyncio.timeout(30):
            assert await process.stdout.readline() == b"ready\n"
        return process

    async def terminate_all(self) -> None:
        for process in self.running:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running:
            try:
                async with asyncio.timeout(20):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


@pytest.fixture
async def processes(fleet: Fleet, tmp_path: Path) -> AsyncIterator[Processes]:
    target = str(fleet.path) if fleet.kind == "sqlite" else fleet.dsn
    group = Processes(fleet.kind, target, fleet.namespace, tmp_path / "runs.log")
    try:
        yield group
    finally:
        for process in group.running:
            if process.returncode is None:
                process.kill()
                await process.wait()


def scheduler_on(fleet: Fleet, instance: str) -> Scheduler[LeaseBackend]:
    return Scheduler(fleet.build(lease_ttl=TTL), instance_id=instance)


async def test_a_dead_instances_run_leaves_the_runs_in_progress_once_taken_over(
    fleet: Fleet,
) -> None:
    """An instance killed in a run keeps listing it in its presence record for 10 minutes;
    once a live instance took the slot over and recorded the run ``interrupted``, neither
    ``runs_in_progress()`` nor ``instances()`` shows it."""
    watcher = scheduler_on(fleet, "watcher")
    watcher.every("long", "1h", lambda ctx: None, catch_up=0)
    corpse = await fleet.start()
    policy = watcher.get("long").settings.policy
    lease = await acquire(corpse, Slot(policy.name, now_ms() - 1_000), policy, instance="corpse")
    assert isinstance(lease, Lease)
    now = datetime.now(UTC)
    run = RunInProgress("long", lease.run_id, lease.slot_ms, now, "schedule", leased=True)
    beat = timedelta(milliseconds=100)  # dead 300 ms after its last beat, its lease still held
    await corpse.publish_instance(Instance("corpse", "h", 1, "0", now, now, beat, (run,)))
    await asyncio.sleep(0.4)
    await watcher.start()
    try:
        assert [(i.id, r.run_id) for i, r in await watcher.runs_in_progress()] == [
            ("corpse", lease.run_id)
        ], "a dead instance's run whose lease is held is in progress"

        async def interrupted() -> bool:
            return any(r.outcome == "interrupted" for r in await watcher.get("long").history(5))

        await until(interrupted, what="the take-over of the dead run")
        # (the taker's own retry of the slot, under the same run id, may still be going)
        in_progress = await watcher.runs_in_progress()
        assert [r.run_id for i, r in in_progress if i.id == "corpse"] == []
        corpses = [i for i in await watcher.instances() if i.id == "corpse"]
        assert [(i.liveness(datetime.now(UTC)), i.running) for i in corpses] == [("dead", ())]
    finally:
        await watcher.stop()


async def test_three_processes_run_every_slot_exactly_once(processes: Processes) -> None:
    for n in range(3):
        await processes.spawn(f"p{n}", "every", interval="300ms")
    await until(lambda: len(read_log(processes.log)) >= 12, timeout=30)
    await processes.terminate_all()
    runs = read_log(processes.log)
    slots = [run.slot_ms for run in runs]
    assert len(slots) == len(set(slots)), "a slot ran twice"
    assert sorted(slots) == list(range(min(slots), max(slots) + 1, 300)), "a slot was missed"
    assert len({run.instance for run in runs}) > 1  # the work really was shared


async def test_a_killed_runner_is_restarted_once_or_recorded(
    processes: Processes, fleet: Fleet
) -> None:
    """SIGKILL a runner mid-run: its slot restarts elsewhere with attempt 2 after the lease
    expires; with max_attempts=1 it is recorded interrupted and never started again."""
    when_ms = (time.time_ns() // 10**6 // 1000 + 4) * 1000  # a whole second, after start-up
    runner = await processes.spawn("doomed", "hang", when_ms=when_ms)
    await until(lambda: len(read_log(processes.log)) == 2, timeout=30)
    runner.kill()  # SIGKILL: no drain, no hand-over, the leases just stop being renewed
    await runner.wait()

    survivor = scheduler_on(fleet, "survivor")
    when = datetime.fromtimestamp(when_ms / 1000, UTC)
    retry = survivor.at(
        "retry", when, partial(log_start, processes.log, "survivor"), max_attempts=3
    )
    charge = survivor.at(
        "charge", when, partial(log_start, processes.log, "survivor"), max_attempts=1
    )
    async with survivor:

        async def settled() -> bool:
            return len(await retry.history(10)) == 2 and len(await charge.history(10)) == 1

        await until(settled, timeout=20)
        retried, charged = await retry.history(10), await charge.history(10)

    assert [(r.outcome, r.attempt, r.instance_id, r.reason) for r in retried] == [
        ("completed", 2, "survivor", "retry"),
        ("interrupted", 1, "doomed", "schedule"),
    ]
    assert retried[1].error == "runner lost its lease"
    assert [(r.outcome, r.attempt, r.instance_id) for r in charged] == [
        ("interrupted", 1, "doomed")
    ]
    starts = sorted((s.job, s.instance, s.attempt, s.slot_ms) for s in read_log(processes.log))
    assert starts == [
        ("charge", "doomed", 1, when_ms),
        ("retry", "doomed", 1, when_ms),
        ("retry", "survivor", 2, when_ms),
    ]


async def test_catch_up_runs_the_latest_missed_slot_once_after_a_full_restart(
    fleet: Fleet, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"

    def fleet_of_two() -> list[Scheduler[LeaseBackend]]:
        members = [scheduler_on(fleet, f"i{n}") for n in range(2)]
        for member in members:
            # No jitter: the missed slot is caught up at once, not after its jitter window
            # (when, this close to the next slot, a loaded machine may claim that one first).
            member.every(
                "tick", "500ms", partial(log_start, log, member.instance_id), catch_up="1m",
                jitter=0,
            )  # fmt: skip
        return members

    first = fleet_of_two()
    for member in first:
        await member.start()
    await until(lambda: len(read_log(log)) >= 2)
    for member in first:
        await member.stop()
    assert {run.reason for run in read_log(log)} == {"schedule"}  # a new job missed nothing
    last_ran = max(run.slot_ms for run in read_log(log))

    await asyncio.sleep(1.6)  # every instance is down: slots pass unclaimed
    second = fleet_of_two()
    restart_ms = time.time_ns() // 10**6
    for member in second:
        await member.start()
    await until(lambda: any(r.slot_ms > restart_ms for r in read_log(log)))
    for member in second:
        await member.stop()

    runs = read_log(log)
    # The first run after the restart is the catch-up of the latest slot missed while every
    # instance was down (the last one before restart_ms, or a later one if the first member
    # came up later on a loaded machine); no earlier missed slot ran.
    after = sorted((run for run in runs if run.slot_ms > last_ran), key=lambda run: run.slot_ms)
    assert after and after[0].reason == "catch-up", runs
    assert after[0].slot_ms >= restart_ms - 500, runs  # the latest missed slot, not every one
    slots = [run.slot_ms for run in runs]
    assert len(slots) == len(set(slots))


async def test_overlap_skips_slots_during_a_long_run_without_queueing(fleet: Fleet) -> None:
    runs: list[tuple[int, int, int]] = []  # (slot, start, end) in ms
    overlapped: list[int] = []
    members = [scheduler_on(fleet, f"i{n}") for n in range(2)]

    async def long_run(ctx: JobContext) -> None:
        start = time.time_ns() // 10**6
        await asyncio.sleep(1.2)  # longer than the interval: the next slots find it running
        runs.append((ctx.slot_ms, start, time.time_ns() // 10**6))

    def on_skip(event: Any) -> None:
        if event.reason == "overlap":
            overlapped.append(event.slot_ms)

    for member in members:
        member.every("long", "500ms", long_run, jitter=0)
        member.on("skip", on_skip)
        await member.start()
    await until(lambda: len(runs) >= 3, timeout=20)
    for member in members:
        await member.stop()

    runs.sort()
    assert overlapped, "no slot was skipped for overlap"
    ran = {slot for slot, _, _ in runs}
    assert not ran & set(overlapped), "a skipped slot ran later: it was queued"
    for (_, _, end), (next_slot, next_start, _) in itertools.pairwise(runs):
        assert next_start >= end, "two runs of the job overlapped"
        # The first slot after the run ends (its release may land just after that slot).
        assert next_slot - end <= 500 + 250, "the next run waited past the first free slot"

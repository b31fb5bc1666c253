"""``PostgresBackend.inventory()``, ``purge()`` and ``doctor()``, on one asyncpg connection
(``conn``, typed ``Any``: asyncpg has no stubs). Only brokersched's own tables and function of
the schema are dropped; the schema itself goes only when nothing else is left in it."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from ..._durations import format_duration
from ...abc import Finding, FleetKind, Inventory, StoredObject
from .._ops import LIVE_WINDOW, server_finding
from .._sql import schema_finding

__all__ = ["MIN_VERSION", "TABLES", "doctor", "inventory", "presence", "purge"]

_BACKEND = "PostgresBackend"
#: Every table the backend makes in its schema, with columns that only brokersched's has: a
#: table of that name without them is the application's (Flyway's ``schema_version``, an
#: audit ``history``) and is never listed nor dropped.
TABLES = {
    "jobs": {"job", "last_slot_ms", "lease_until"},
    "leases": {"job", "slot_ms", "token", "run_id"},
    "history": {"job", "n", "slot_ms", "run_id"},
    "history_counters": {"job", "n"},
    "fleet": {"kind", "key", "value", "expires_at"},
    "schema_version": {"version"},
}
MIN_VERSION = (12,)


async def inventory(conn: Any, schema: str) -> Inventory:
    if not await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema):
        return Inventory(_BACKEND, schema)
    columns: dict[str, set[str]] = {}
    for table, column in await conn.fetch(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = $1 AND table_name = ANY($2)",
        schema,
        list(TABLES),
    ):
        columns.setdefault(table, set()).add(column)
    tables = {name for name, wanted in TABLES.items() if _ours(name, columns.get(name, set()))}
    unknown = tuple(
        f"table {schema}.{name} is not brokersched's (not its columns): left"
        for name in TABLES
        if name in columns and name not in tables
    )
    objects = [StoredObject("table", f"{schema}.{name}") for name in TABLES if name in tables]
    if await conn.fetchval("SELECT to_regprocedure($1)", f'"{schema}".store_now()') is not None:
        objects.append(StoredObject("function", f"{schema}.store_now()"))
    objects.append(StoredObject("schema", schema))
    live: list[str] = []
    s = f'"{schema}"'
    if "jobs" in tables:
        for job, until in await conn.fetch(
            f"SELECT job, lease_until FROM {s}.jobs"
            " WHERE lease_until > clock_timestamp() - $1::interval",
            LIVE_WINDOW,
        ):
            live.append(f"job {job!r} had a lease until {until.isoformat()} ({schema}.jobs)")
    if "leases" in tables:
        for job, slot_ms, instance in await conn.fetch(
            f"SELECT job, slot_ms, instance_id FROM {s}.leases "
            "WHERE state = 'running' AND expires_at > clock_timestamp()"
        ):
            live.append(f"job {job!r} slot {slot_ms} is being run by instance {instance!r}")
    if "history" in tables:
        newest = await conn.fetchval(
            f"SELECT max(started_at) FROM {s}.history"
            " WHERE started_at > clock_timestamp() - $1::interval",
            LIVE_WINDOW,
        )
        if newest is not None:
            live.append(f"a run started at {newest.isoformat()} was recorded ({schema}.history)")
    return Inventory(_BACKEND, schema, tuple(objects), unknown, tuple(live))


async def presence(conn: Any, schema: str, kind: FleetKind = "instance") -> list[str]:
    """The records of ``kind`` (instance, by default) of the schema's ``fleet`` table not yet
    expired, on the database's clock (none without brokersched's table)."""
    columns = {
        column
        for (column,) in await conn.fetch(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = $1 AND table_name = 'fleet'",
            schema,
        )
    }
    if not _ours("fleet", columns):
        return []
    rows = await conn.fetch(
        f'SELECT value FROM "{schema}".fleet WHERE kind = $1'
        " AND (expires_at IS NULL OR expires_at > clock_timestamp())",
        kind,
    )
    return [row["value"] for row in rows]


def _ours(table: str, columns: set[str]) -> bool:
    """Whether a table of one of brokersched's names has its columns (``schema_version``: only
    its one column, as Flyway's table of that name has a ``version`` too)."""
    wanted = TABLES[table]
    return columns == wanted if table == "schema_version" else wanted <= columns


async def purge(conn: Any, found: Inventory) -> Inventory:
    schema = found.namespace
    s = f'"{schema}"'
    ours = {f"{schema}.{name}" for name in TABLES}
    async with conn.transaction():
        for item in found.objects:
            if item.kind == "table" and item.name in ours:
                await conn.execute(f'DROP TABLE IF EXISTS {s}."{item.name.split(".", 1)[1]}"')
            elif item.kind == "function" and item.name == f"{schema}.store_now()":
                await conn.execute(f"DROP FUNCTION IF EXISTS {s}.store_now()")
    left = await inventory(conn, schema)
    if [item.kind for item in left.objects] == ["schema"]:
        others = await conn.fetchval(
            "SELECT (SELECT count(*) FROM pg_class c WHERE c.relnamespace = n.oid)"
            " + (SELECT count(*) FROM pg_proc p WHERE p.pronamespace = n.oid)"
            " + (SELECT count(*) FROM pg_type t WHERE t.typnamespace = n.oid AND t.typrelid = 0"
            "    AND t.typelem = 0) FROM pg_namespace n WHERE n.nspname = $1",
            schema,
        )
        if not others and schema != "public":
            await conn.execute(f"DROP SCHEMA IF EXISTS {s} RESTRICT")
            left = await inventory(conn, schema)
        else:
            note = f"schema {schema} kept: it holds other objects"
            left = Inventory(_BACKEND, schema, unknown=(*left.unknown, note))
    return left


async def doctor(conn: Any, schema: str, max_clock_skew: timedelta) -> list[Finding]:
    version = await conn.fetchval("SHOW server_version")
    findings = [server_finding("PostgreSQL", str(version).split()[0], MIN_VERSION)]
    findings.append(await _clock_finding(conn, max_clock_skew))
    findings.append(await _schema_finding(conn, schema))
    return findings


async def _clock_finding(conn: Any, max_clock_skew: timedelta) -> Finding:
    before = time.time()
    server = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
    after = time.time()
    offset = float(server) - (before + after) / 2  # + the database is ahead of this host
    shown = f"{offset * 1000:+.0f} ms (± {(after - before) * 500:.0f} ms)"
    check = "clock offset"
    if abs(offset) <= max_clock_skew.total_seconds() / 2:
        return Finding("ok", check, f"the database's clock is {shown} from this host's")
    return Finding(
        "warning",
        check,
        f"the database's clock is {shown} from this host's (max_clock_skew "
        f"{format_duration(max_clock_skew)})",
        "leases are judged on the database's clock; an instance whose clock is ahead by more "
        "than max_clock_skew has its claims refused (slots skipped, never run twice), and "
        "history times disagree with the database's",
        "synchronise the clocks (NTP) of this host and the database server",
    )


async def _schema_finding(conn: Any, schema: str) -> Finding:
    table = f'"{schema}".schema_version'
    if await conn.fetchval("SELECT to_regclass($1)", table) is None:
        return Finding("ok", "schema", f"no schema {schema} yet: the first start creates it")
    version = await conn.fetchval(f"SELECT version FROM {table}")
    return schema_finding(version, f"schema {schema} at version", "it")

"""Claim latency and throughput of SQLiteBackend and PostgresBackend, next to the raw cost of
the SQL that decides a claim, measured in the same run.

    .venv/bin/python bench/bench_sql.py [--claims 2000] [--seconds 3] [--workers 4]
        [--dsn postgresql://postgres@127.0.0.1:5432/test] [--only sqlite|postgres]

For each backend:
* ``acquire``: one instance claiming new slots one after another (latency per claim);
* ``raw``: the same claim without the backend around it: PostgreSQL's one statement on a bare
  asyncpg connection, and its server-side time from ``EXPLAIN ANALYZE``; SQLite's transaction
  on a plain ``sqlite3`` connection in this thread (no aiosqlite thread hop);
* ``renew``: one lease renewed over and over (a renewal should cost one indexed UPDATE);
* ``claims/s``: ``--workers`` instances (own connections) claiming distinct jobs for
  ``--seconds``, then racing for the same slots (each slot decided once).
Nothing here asserts: it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

from brokersched import SystemClock
from brokersched.abc import JobPolicy, Lease, LeaseBackend, Slot
from brokersched.backends._sql import datetime_to_us
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.sqlite import SQLiteBackend

SLOT = 1_800_000_000_000
ALLOW = "allow"


def summary(name: str, samples_ns: list[int]) -> str:
    us = sorted(s / 1000 for s in samples_ns)
    p = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
    return (
        f"  {name:<34} n={len(us):<6} mean {statistics.fmean(us):8.1f} us   p50 {p(0.5):8.1f}"
        f"   p99 {p(0.99):8.1f}   max {us[-1]:8.1f}"
    )


async def timed(count: int, call: Callable[[int], Awaitable[Any]]) -> list[int]:
    samples = []
    for n in range(count):
        start = time.perf_counter_ns()
        await call(n)
        samples.append(time.perf_counter_ns() - start)
    return samples


async def claim(backend: LeaseBackend, job: str, slot_ms: int, instance: str = "bench") -> Any:
    return await backend.acquire(
        Slot(job, slot_ms),
        policy=JobPolicy(job, overlap=ALLOW),
        instance_id=instance,
        run_id=secrets.token_hex(4),
        reason="schedule",
        timeout=10,
    )


async def sequential(backend: LeaseBackend, count: int, job: str = "seq") -> list[int]:
    async def one(n: int) -> None:
        assert isinstance(await claim(backend, job, SLOT + n), Lease)

    return await timed(count, one)


async def renewals(backend: LeaseBackend, count: int) -> list[int]:
    lease = await claim(backend, "renew", SLOT)
    assert isinstance(lease, Lease)

    async def one(_: int) -> None:
        assert await backend.renew(lease)

    return await timed(count, one)


async def throughput(backends: list[LeaseBackend], seconds: float, *, contended: bool) -> float:
    """Decided slots per second: distinct jobs per worker, or all workers racing per slot."""
    deadline = time.perf_counter() + seconds
    decided: set[tuple[str, int]] = set()

    async def worker(index: int, backend: LeaseBackend) -> None:
        job = "race" if contended else f"job{index}"
        n = 0
        while time.perf_counter() < deadline:
            result = await claim(backend, job, SLOT + n, f"w{index}")
            if isinstance(result, Lease):
                decided.add((job, n))
            n += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(i, b) for i, b in enumerate(backends)))
    return len(decided) / (time.perf_counter() - start)


# -- the raw statement -------------------------------------------------------------------
# Each raw claim is timed right after a backend claim, in the same loop, so that both see the
# same load on the machine.

Raw = Callable[[int], Awaitable[None]]


async def paired(backend: LeaseBackend, raw: Raw, count: int) -> tuple[list[int], list[int]]:
    through_backend: list[int] = []
    direct: list[int] = []
    for n in range(count):
        start = time.perf_counter_ns()
        assert isinstance(await claim(backend, "seq", SLOT + n), Lease)
        middle = time.perf_counter_ns()
        await raw(n)
        through_backend.append(middle - start)
        direct.append(time.perf_counter_ns() - middle)
    return through_backend, direct


def postgres_args(n: int) -> tuple[Any, ...]:
    token = secrets.token_hex(16)
    return ("raw", SLOT + n, 30_000, True, token, "r", "i", "schedule", SystemClock().now())


async def raw_postgres(backend: PostgresBackend, conn: asyncpg.Connection) -> Raw:
    """The backend's claim statement on a bare connection."""
    sql = backend._sql.acquire  # the very statement the backend sends

    async def one(n: int) -> None:
        row = await conn.fetchrow(sql, *postgres_args(n))
        assert row is not None and row["granted"]

    return one


async def server_time(backend: PostgresBackend, conn: asyncpg.Connection) -> str:
    """The statement's execution time inside the server (EXPLAIN ANALYZE, rolled back)."""
    times = []
    for n in range(10**6, 10**6 + 300):
        transaction = conn.transaction()
        await transaction.start()
        try:
            plan = await conn.fetchval(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + backend._sql.acquire, *postgres_args(n)
            )
        finally:
            await transaction.rollback()  # EXPLAIN ANALYZE really claims
        times.append(json.loads(plan)[0]["Execution Time"])
    median_us = statistics.median(times) * 1000
    return f"server-side execution (EXPLAIN ANALYZE): median {median_us:.1f} us"


def raw_sqlite(backend: SQLiteBackend, conn: sqlite3.Connection) -> Raw:
    """The backend's claim transaction on a plain sqlite3 connection, in this thread."""
    sql = backend._sql
    started_us = datetime_to_us(SystemClock().now())

    async def one(n: int) -> None:
        params = {
            "job": "raw", "slot_ms": SLOT + n, "ttl_ms": 30_000, "allow": True,
            "token": secrets.token_hex(16), "run_id": "r", "instance_id": "i",
            "reason": "schedule", "started_us": started_us,
        }  # fmt: skip
        conn.execute("BEGIN IMMEDIATE")
        (expires,) = conn.execute(sql.grant, params).fetchone()
        conn.execute(sql.insert_lease, {**params, "expires_ms": expires})
        conn.execute("COMMIT")

    return one


# -- per backend -------------------------------------------------------------------------


async def bench(
    name: str,
    backends: list[LeaseBackend],
    raw: Raw,
    note: Callable[[], Awaitable[str]],
    args: argparse.Namespace,
) -> None:
    for backend in backends:
        await backend.start(SystemClock())
    try:
        first = backends[0]
        await sequential(first, 50, "warm-up")  # connections, prepared statements, page cache
        print(f"\n{name}")
        through_backend, direct = await paired(first, raw, args.claims)
        print(summary("acquire (through the backend)", through_backend))
        print(summary("raw claim (same SQL, bare client)", direct))
        if text := await note():
            print(f"  {text}")
        print(summary("renew", await renewals(first, args.claims)))
        free = await throughput(backends, args.seconds, contended=False)
        print(f"  claims/s, {args.workers} instances, distinct jobs   {free:10.0f}")
        raced = await throughput(backends, args.seconds, contended=True)
        print(f"  slots/s, {args.workers} instances racing per slot  {raced:10.0f}")
    finally:
        for backend in backends:
            await backend.stop()


async def main(args: argparse.Namespace) -> None:
    print(f"SQLite {sqlite3.sqlite_version}; {args.claims} claims, {args.workers} workers")
    if args.only in (None, "sqlite"):
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "bench.db"
            backends: list[LeaseBackend] = [SQLiteBackend(path) for _ in range(args.workers)]
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA busy_timeout = 5000")
            conn.execute("PRAGMA synchronous = NORMAL")  # as the backend's connections
            try:
                first = backends[0]
                assert isinstance(first, SQLiteBackend)
                await first.start(SystemClock())  # creates the tables the raw claims use
                name = "SQLiteBackend (WAL, synchronous=NORMAL)"
                await bench(name, backends, raw_sqlite(first, conn), _nothing, args)
                await first.stop()
            finally:
                conn.close()
    if args.only in (None, "postgres"):
        schema = "bench_" + secrets.token_hex(4)
        conn_pg = await asyncpg.connect(args.dsn)
        version = await conn_pg.fetchval("SHOW server_version")
        pg = [PostgresBackend(args.dsn, schema=schema, max_size=2) for _ in range(args.workers)]
        try:
            await pg[0].start(SystemClock())
            name = f"PostgresBackend (PostgreSQL {version.split()[0]}, 127.0.0.1)"
            raw = await raw_postgres(pg[0], conn_pg)
            await bench(name, list(pg), raw, lambda: server_time(pg[0], conn_pg), args)
            await pg[0].stop()
        finally:
            await conn_pg.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await conn_pg.close()


async def _nothing() -> str:
    return ""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=4)
    default_dsn = "postgresql://postgres@127.0.0.1:5432/test"
    parser.add_argument("--dsn", default=os.environ.get("BROKERSCHED_POSTGRES_DSN", default_dsn))
    parser.add_argument("--only", choices=("sqlite", "postgres"))
    asyncio.run(main(parser.parse_args()))

"""PostgreSQL's budget (issue 28.2) read on the tests' server: the figures are coherent (this
backend's own connection counted, the limit what ordinary roles may open); the states are
the pure function's (tests/unit/test_server_budgets.py)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import asyncpg

from brokersched.backends.postgres import PostgresBackend
from brokersched.testing import TestClock
from tests.support.leases import drop_schema
from tests.support.names import unique


async def test_the_connections_are_read_against_max_connections(postgres_dsn: str) -> None:
    schema = unique("budget")
    backend = PostgresBackend(postgres_dsn, schema=schema, budget_interval="1s")
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await backend.start(TestClock(datetime.now(UTC)))
        reading = backend.budget
        assert reading is not None
        found = re.fullmatch(
            r"(\d+) client connections of the (\d+) ordinary roles may open "
            r"\(max_connections (\d+) - (\d+) reserved\); PostgreSQL (\S+).*",
            reading.detail,
        )
        assert found is not None, reading.detail
        used, limit, most, kept = (int(found[n]) for n in range(1, 5))
        assert most == int(await conn.fetchval("SHOW max_connections"))
        assert kept >= int(await conn.fetchval("SHOW superuser_reserved_connections"))
        assert limit == most - kept
        assert used >= 2  # the pool's connection and this test's
        assert reading.used == used / limit
        assert reading.state == ("ok" if used < 0.6 * limit else reading.state)
        assert found[5] == (await conn.fetchval("SHOW server_version")).split()[0]
    finally:
        await backend.stop()
        await conn.close()
        await drop_schema(postgres_dsn, schema)


async def test_budget_interval_none_reads_nothing(postgres_dsn: str) -> None:
    schema = unique("budget")
    backend = PostgresBackend(postgres_dsn, schema=schema, budget_interval=None)
    try:
        await backend.start(TestClock(datetime.now(UTC)))
        assert backend.budget is None
    finally:
        await backend.stop()
        await drop_schema(postgres_dsn, schema)

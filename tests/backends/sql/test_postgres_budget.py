"""PostgreSQL's budget read on the tests' server: the figures are coherent (this
backend's own connection counted, the limit what ordinary roles may open); the states are
the pure function's (tests/unit/test_server_budgets.py)."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime

import asyncpg

from brokersched import BackendError
from brokersched.abc import BrokerBudget, JobPolicy, Lease, Slot
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.postgres._budget import BUDGET_SQL
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


async def test_a_role_without_monitoring_rights_counts_every_client_connection(
    postgres_dsn: str,
) -> None:
    """Other roles' sessions show no ``backend_type`` to a role without ``pg_read_all_stats``:
    they are counted all the same."""
    role, password = unique("budget_role"), "budget-role-pw"
    admin = await asyncpg.connect(postgres_dsn)
    await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    try:
        plain = await asyncpg.connect(postgres_dsn, user=role, password=password)
        try:
            assert not await plain.fetchval("SELECT pg_has_role('pg_read_all_stats', 'MEMBER')")
            seen_plain = (await plain.fetchrow(BUDGET_SQL))["used"]
            seen_admin = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
            )
        finally:
            await plain.close()
        # the suite's other lanes open and close connections meanwhile: about the same
        assert seen_plain >= 2 and abs(seen_plain - seen_admin) <= 3, (seen_plain, seen_admin)
    finally:
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()


async def test_shedding_refuses_a_claim_that_needs_a_new_connection(postgres_dsn: str) -> None:
    """Shedding (the reading set by hand: the server's own figures are the other tests'), a
    claim goes on over an idle connection of the pool; claims racing for the one idle
    connection: one goes on, the others are refused; renewals go on."""
    schema = unique("budget")
    backend = PostgresBackend(
        postgres_dsn, schema=schema, min_size=1, max_size=4, budget_interval="1h"
    )
    clock = TestClock(datetime.now(UTC))
    await backend.start(clock)
    try:
        assert backend._budget is not None
        backend._budget.reading = BrokerBudget(0.9, "shed", "set by the test")

        async def claim(job: str) -> object:
            slot = Slot(job, clock.now_ms())
            try:
                return await backend.acquire(
                    slot, policy=JobPolicy(job), instance_id="a", run_id=job,
                    reason="schedule", timeout=5,
                )  # fmt: skip
            except BackendError as exc:
                return exc

        held = await claim("job")
        assert isinstance(held, Lease)  # the pool's idle connection
        answers = await asyncio.gather(*(claim(f"racer{n}") for n in range(3)))
        refused = [a for a in answers if isinstance(a, BackendError)]
        assert len(refused) == 2, answers
        assert all("shedding" in str(a) for a in refused)
        assert await backend.renew(held)
        await backend.release(held)
    finally:
        await backend.stop()
        await drop_schema(postgres_dsn, schema)

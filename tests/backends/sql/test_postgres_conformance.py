"""PostgresBackend passes the public lease conformance suite on the real PostgreSQL server, in a
throwaway schema per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import pytest_asyncio

from brokersched.backends.postgres import PostgresBackend
from brokersched.testing.conformance import LeaseBackendSuite
from tests.support.conformance import StoreClockElapse, in_run
from tests.support.leases import set_postgres_store_time


class TestPostgresBackend(StoreClockElapse, LeaseBackendSuite[PostgresBackend]):
    dsn = ""
    schemas: set[str]

    @pytest_asyncio.fixture(autouse=True)
    async def _server(self, postgres_dsn: str) -> AsyncIterator[None]:
        """Remember the server for make_backend; drop the test's schemas afterwards."""
        self.dsn, self.schemas = postgres_dsn, set()
        yield
        conn = await asyncpg.connect(postgres_dsn)
        try:
            for schema in self.schemas:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    async def set_store_time(self, backends: Sequence[PostgresBackend], now_ms: int) -> None:
        await set_postgres_store_time(self.dsn, {backend.schema for backend in backends}, now_ms)

    def make_backend(self, namespace: str, **options: Any) -> PostgresBackend:
        namespace = in_run(namespace)
        self.schemas.add(namespace)
        # A small pool: the races start eight backends at once on one server.
        backend = PostgresBackend(self.dsn, schema=namespace, min_size=1, max_size=2, **options)
        return self.built(backend)  # type: ignore[no-any-return]

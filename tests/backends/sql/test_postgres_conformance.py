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
        """The schema's store clock (``store_now()``) reads a table this sets."""
        schemas = {backend.schema for backend in backends}
        conn = await asyncpg.connect(self.dsn)
        try:
            for schema in schemas:
                await conn.execute(
                    f'CREATE TABLE IF NOT EXISTS "{schema}".test_clock (now timestamptz);'
                    f'CREATE OR REPLACE FUNCTION "{schema}".store_now() RETURNS timestamptz'
                    f" LANGUAGE sql VOLATILE AS 'SELECT now FROM \"{schema}\".test_clock'"
                )
                await conn.execute(
                    f'DELETE FROM "{schema}".test_clock;'
                    f'INSERT INTO "{schema}".test_clock VALUES (to_timestamp({now_ms} / 1000.0))'
                )
        finally:
            await conn.close()

    def make_backend(self, namespace: str, **options: Any) -> PostgresBackend:
        namespace = in_run(namespace)
        self.schemas.add(namespace)
        # A small pool: the races start eight backends at once on one server.
        backend = PostgresBackend(self.dsn, schema=namespace, min_size=1, max_size=2, **options)
        return self.built(backend)  # type: ignore[no-any-return]

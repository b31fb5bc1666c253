"""SQLiteBackend passes the public lease conformance suite, on a file in a temporary directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from brokersched.backends.sqlite import SQLiteBackend
from brokersched.testing.conformance import LeaseBackendSuite
from tests.support.conformance import StoreClockElapse


class VirtualClockSQLite(SQLiteBackend):
    """SQLite whose store clock reads ``store_time`` once it is set (its one hook)."""

    store_time: int | None = None

    def _store_now_ms(self) -> int:
        return super()._store_now_ms() if self.store_time is None else self.store_time


class TestSQLiteBackend(StoreClockElapse, LeaseBackendSuite[SQLiteBackend]):
    directory: Path

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        """One file per namespace, in this test's own directory (pytest removes old ones)."""
        self.directory = tmp_path

    async def set_store_time(self, backends: Sequence[SQLiteBackend], now_ms: int) -> None:
        for backend in backends:
            assert isinstance(backend, VirtualClockSQLite)
            backend.store_time = now_ms

    def make_backend(self, namespace: str, **options: Any) -> SQLiteBackend:
        return self.built(VirtualClockSQLite(self.directory / f"{namespace}.db", **options))  # type: ignore[no-any-return]

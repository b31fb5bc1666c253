"""SQLiteBackend passes the public lease conformance suite, on a file in a temporary directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from brokersched.backends.sqlite import SQLiteBackend
from brokersched.testing.conformance import LeaseBackendSuite
from tests.support.conformance import StoreClockElapse
from tests.support.leases import VirtualClockSQLite


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

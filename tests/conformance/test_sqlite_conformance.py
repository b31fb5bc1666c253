"""SQLiteBackend passes the public lease conformance suite, on a file in a temporary directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from brokersched.backends.sqlite import SQLiteBackend
from brokersched.testing.conformance import LeaseBackendSuite


class TestSQLiteBackend(LeaseBackendSuite[SQLiteBackend]):
    directory: Path

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        """One file per namespace, in this test's own directory (pytest removes old ones)."""
        self.directory = tmp_path

    def make_backend(self, namespace: str, **options: Any) -> SQLiteBackend:
        return SQLiteBackend(self.directory / f"{namespace}.db", **options)

"""``fleet``: the worker processes of a seam or break-it test (tests/support/seams.py),
stopped and their stores removed after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.seams import Fleet


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    members = Fleet(tmp_path)
    try:
        yield members
    finally:
        await members.close()

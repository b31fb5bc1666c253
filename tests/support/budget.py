"""The server's budget in tests: one more reading of a started backend's budget, awaited."""

from __future__ import annotations

from brokersched.abc import Backend
from brokersched.testing import TestClock

from .wait import until


async def read_again(backend: Backend, clock: TestClock) -> None:
    """One more reading (the next ``budget_interval`` of the virtual clock, which must be 1 s
    at most), awaited."""
    before = backend.budget
    await clock.advance("1s")
    await until(lambda: backend.budget is not before, what="a new reading of the budget")

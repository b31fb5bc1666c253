"""The virtual-time fixtures of the scheduler tests (a pytest plugin of tests/conftest.py):
``clock``, a ``TestClock`` at ``START``, and ``scheduler``, a Scheduler on the memory backend
and that clock (no jitter, instance ``me``), stopped after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from brokersched import Scheduler
from brokersched.backends.memory import MemoryBackend
from brokersched.testing import TestClock

START = "2027-01-15T08:00:30+00:00"


@pytest.fixture
def clock() -> TestClock:
    return TestClock(START)


@pytest.fixture
async def scheduler(clock: TestClock) -> AsyncIterator[Scheduler[MemoryBackend]]:
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="me")
    yield sched
    await sched.stop()

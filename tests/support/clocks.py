"""The virtual-time fixtures of the scheduler tests (a pytest plugin of tests/conftest.py):
``clock``, a ``TestClock`` at ``START``, and ``scheduler``, a Scheduler on the memory backend
and that clock (no jitter, instance ``me``), stopped after the test; ``memory_fleet``, two
such instances (``A``, ``B``, a 5 s heartbeat) of one fleet, on one memory store."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from brokersched import Scheduler
from brokersched.backends.memory import MemoryBackend, MemoryStore
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


@pytest.fixture
async def memory_fleet(clock: TestClock) -> AsyncIterator[list[Scheduler[MemoryBackend]]]:
    store = MemoryStore()
    schedulers = [
        Scheduler(
            MemoryBackend(store=store), clock=clock, jitter=0, instance_id=name, heartbeat="5s"
        )
        for name in ("A", "B")
    ]
    yield schedulers
    for sched in schedulers:
        await sched.stop()

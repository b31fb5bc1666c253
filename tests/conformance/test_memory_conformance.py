"""The MemoryBackend passes the lease conformance suite, in virtual time."""

from __future__ import annotations

from typing import Any, ClassVar

from brokersched._clock import Clock
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from brokersched.testing.conformance import LeaseBackendSuite


class TestMemoryBackend(LeaseBackendSuite[MemoryBackend]):
    stores: ClassVar[dict[str, MemoryStore]] = {}

    def make_backend(self, namespace: str, **options: Any) -> MemoryBackend:
        store = self.stores.setdefault(namespace, MemoryStore())
        return MemoryBackend(store=store, **options)

    def make_clock(self) -> Clock:
        return TestClock()

    async def elapse(self, clock: Clock, seconds: float) -> None:
        assert isinstance(clock, TestClock)
        await clock.advance(seconds)

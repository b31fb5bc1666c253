"""The MemoryBackend passes the lease conformance suite, in virtual time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from brokersched._clock import Clock, Timer
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from brokersched.testing.conformance import LeaseBackendSuite


class _StoreClock(Clock):
    """The shared store's own clock, set by the protocol check."""

    def __init__(self) -> None:
        self.now = 0

    def now_ms(self) -> int:
        return self.now

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        raise NotImplementedError("a store clock has no timers")


class TestMemoryBackend(LeaseBackendSuite[MemoryBackend]):
    stores: ClassVar[dict[str, MemoryStore]] = {}

    def make_backend(self, namespace: str, **options: Any) -> MemoryBackend:
        store = self.stores.setdefault(namespace, MemoryStore())
        return MemoryBackend(store=store, **options)

    async def set_store_time(self, backends: Sequence[MemoryBackend], now_ms: int) -> None:
        for backend in backends:
            if not isinstance(backend.store_clock, _StoreClock):
                backend.store_clock = _StoreClock()
            backend.store_clock.now = now_ms

    def make_clock(self) -> Clock:
        return TestClock()

    async def elapse(self, clock: Clock, seconds: float) -> None:
        assert isinstance(clock, TestClock)
        await clock.advance(seconds)

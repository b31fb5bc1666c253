"""What the conformance subclasses of this suite share.

``in_run(namespace)``: the suites draw a namespace per test; the subclasses prefix it with
this run's tag, so the end-of-run check sees what a conformance test left behind.

``StoreClockElapse``: the lease suite waits out real leases by default (``elapse`` sleeps).
A backend whose store clock the test can set (``set_store_time``: PostgreSQL's
``store_now()``, SQLite's ``_store_now_ms``, the time Redis's scripts are given) lets time pass
on the store instead: no waiting, and no race that a loaded machine can lose (eight takers of
a dead runner's slot spread over more than a lease's lifetime took it twice).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from brokersched.abc import Backend
from tests.support.names import RUN_PREFIX


def in_run(namespace: str) -> str:
    return f"{RUN_PREFIX}{namespace}"


class StoreClockElapse:
    """A mixin of a ``LeaseBackendSuite`` subclass: ``elapse`` moves the store's clock.

    The first ``elapse`` of a test stops the store's clock at the real time then, plus the
    seconds; each later one adds its own. Until then the store reads the real time. The
    subclass calls ``self.built(backend)`` on each backend it makes."""

    _store_ms: int | None
    _built: list[Backend]

    @pytest.fixture(autouse=True)
    def _store_clock(self) -> None:
        self._store_ms, self._built = None, []

    def built(self, backend: Any) -> Any:
        self._built.append(backend)
        return backend

    async def set_store_time(self, backends: Sequence[Any], now_ms: int) -> None:
        raise NotImplementedError

    async def elapse(self, clock: Any, seconds: float) -> None:
        if self._store_ms is None:
            self._store_ms = time.time_ns() // 1_000_000
        self._store_ms += round(seconds * 1000)
        await self.set_store_time(self._built, self._store_ms)

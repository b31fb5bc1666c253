"""``TaskSet``: the tasks a scheduler starts, for ``stop()`` to wait for or cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._clock import Clock

__all__ = ["TaskSet"]

T = TypeVar("T")


class TaskSet:
    """Runs, claims and listeners are *drained* (``stop()`` waits for them); lease renewals are
    *background* work, cancelled once the drain is over."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._drained: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str, drained: bool = True
    ) -> asyncio.Task[T]:
        task = self._clock.spawn(coro, name=name)
        tasks = self._drained if drained else self._background
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def pending(self) -> set[asyncio.Task[Any]]:
        """The drained tasks not finished yet."""
        return {task for task in self._drained if not task.done()}

    def cancel_background(self) -> None:
        for task in self._background:
            task.cancel()

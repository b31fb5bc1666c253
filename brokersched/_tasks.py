"""``TaskSet``: the tasks a scheduler starts, for ``stop()`` to wait for or cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Collection, Coroutine, Sequence
from typing import Any, TypeVar, cast

from ._clock import Clock

__all__ = [
    "TaskSet",
    "Tracked",
    "cancel_requests",
    "gather_each",
    "raise_if_cancelled_since",
    "to_the_end",
    "track",
]

T = TypeVar("T")

# Tasks kept in the order they were made: whatever iterates them (to cancel them, to abort their
# runs) does so in that order, never in an order of memory addresses, which differ between two
# runs of the same fleet simulator seed (seen: a seed that ran otherwise in a longer process).
Tracked = dict[asyncio.Task[Any], None]


def track(tasks: Tracked, task: asyncio.Task[Any]) -> None:
    """Keep ``task`` in ``tasks`` until it is done."""
    tasks[task] = None
    task.add_done_callback(lambda done: tasks.pop(done, None))


class TaskSet:
    """Runs, claims and listeners are *drained* (``stop()`` waits for them); lease renewals are
    *background* work, cancelled once the drain is over."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._drained: Tracked = {}
        self._background: Tracked = {}

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str, drained: bool = True
    ) -> asyncio.Task[T]:
        task = self._clock.spawn(coro, name=name)
        track(self._drained if drained else self._background, task)
        return task

    def pending(self) -> list[asyncio.Task[Any]]:
        """The drained tasks not finished yet, oldest first."""
        return [task for task in self._drained if not task.done()]

    def is_drained(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether ``task`` is one that ``stop()`` waits for."""
        return task in self._drained

    def background(self) -> list[asyncio.Task[Any]]:
        """The background tasks not finished yet."""
        return [task for task in self._background if not task.done()]

    async def cut(self, tasks: Collection[asyncio.Task[Any]], timeout_s: float) -> None:
        """Cancel ``tasks`` and wait (at most ``timeout_s``) until they have ended: once the
        backend stops, nothing of this scheduler is still calling it (a client library would
        open a connection that nobody closes). The calling task is never cut."""
        current = asyncio.current_task()
        cut = [task for task in tasks if task is not current and not task.done()]
        for task in cut:
            task.cancel()
        await self._clock.wait(cut, timeout_s)


def cancel_requests() -> int:
    """The cancellations of the current task not yet taken back (``Task.cancelling()``)."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


def raise_if_cancelled_since(cancels: int) -> None:
    """Raise the cancellation of this task that a client call swallowed since ``cancels`` was
    read. The client libraries await through ``asyncio.wait_for``, which on Python 3.11 returns
    the result instead of raising ``CancelledError`` when the awaited operation finishes in the
    same loop iteration as the cancellation (CPython gh-86296, fixed in 3.12); the request stays
    counted in ``Task.cancelling()``."""
    if cancel_requests() > cancels:
        raise asyncio.CancelledError


async def to_the_end(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` to its end although this task is being cancelled: a cancellation that
    arrives meanwhile (a second Ctrl-C, an outer timeout) is raised once it is done."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def gather_each(calls: Sequence[Awaitable[T]]) -> list[T | Exception]:
    """The calls run concurrently; each one's answer or error, in order. A cancellation (of
    this task, or of one call) is raised, never returned."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    return cast(list[T | Exception], results)

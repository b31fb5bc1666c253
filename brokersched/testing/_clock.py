"""``TestClock``: virtual time that runs whole schedules without sleeping."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any, TypeVar

from .._clock import Clock, Timer, datetime_to_ms, resolve
from .._durations import Duration, parse_duration, to_ms

__all__ = ["TestClock"]

T = TypeVar("T")

_DEFAULT_START = "2026-01-01T00:00:00+00:00"


class _VirtualTimer:
    __slots__ = ("callback", "cancelled", "when_ms")

    def __init__(self, when_ms: int, callback: Callable[[], object]) -> None:
        self.when_ms = when_ms
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class TestClock(Clock):
    """A virtual clock: ``await clock.advance("1m")`` fires what falls due, in order, and waits
    until the work it started has settled.

    Work has settled when every task the scheduler started is finished or waiting on this clock
    (a timer, ``ctx.sleep()``). A handler that waits on anything else (a real broker, a thread)
    is waited for in real time, up to ``settle_timeout`` seconds.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, start: datetime | str = _DEFAULT_START, *, settle_timeout: float = 30.0):
        moment = datetime.fromisoformat(start) if isinstance(start, str) else start
        if moment.tzinfo is None:
            raise ValueError(
                f"TestClock start {moment.isoformat()} needs a time zone (e.g. +00:00)"
            )
        self._now = datetime_to_ms(moment)
        self._timers: list[tuple[int, int, _VirtualTimer]] = []
        self._seq = itertools.count()
        self._tracked: set[asyncio.Task[Any]] = set()
        self._sleeping: dict[asyncio.Task[Any], asyncio.Future[None]] = {}
        self.settle_timeout = settle_timeout

    def now_ms(self) -> int:
        return self._now

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        timer = _VirtualTimer(when_ms, callback)
        heapq.heappush(self._timers, (when_ms, next(self._seq), timer))
        if when_ms <= self._now:
            asyncio.get_running_loop().call_soon(self._fire_due)
        return timer

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        task = super().spawn(coro, name=name)
        self._tracked.add(task)
        task.add_done_callback(self._tracked.discard)
        return task

    async def sleep_until(self, when_ms: int) -> None:
        if when_ms <= self._now:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_at(when_ms, lambda: resolve(future))
        task = asyncio.current_task()
        if task is not None:
            self._sleeping[task] = future
        try:
            await future
        finally:
            timer.cancel()
            if task is not None:
                self._sleeping.pop(task, None)

    # -- driving time ----------------------------------------------------------------------

    async def advance(self, duration: Duration) -> None:
        """Move time forward by ``duration``, firing everything that falls due on the way."""
        await self._advance_to_ms(self._now + to_ms(parse_duration(duration, name="advance")))

    async def advance_to(self, moment: datetime | str) -> None:
        """Move time forward to ``moment`` (never backwards)."""
        when = datetime.fromisoformat(moment) if isinstance(moment, str) else moment
        await self._advance_to_ms(datetime_to_ms(when))

    async def stall(self, duration: Duration) -> None:
        """The process freezes for ``duration`` (a GC pause, a suspended VM): time moves on with
        nothing running, then everything that fell due meanwhile fires at once, late."""
        await self.settle()
        self._now += to_ms(parse_duration(duration, name="stall"))
        await self._advance_to_ms(self._now)

    async def _advance_to_ms(self, target_ms: int) -> None:
        await self.settle()
        while (timer := self._pop_due(target_ms)) is not None:
            self._now = max(self._now, timer.when_ms)
            timer.callback()
            await self.settle()
        self._now = max(self._now, target_ms)
        await self.settle()

    def _pop_due(self, target_ms: int) -> _VirtualTimer | None:
        while self._timers and self._timers[0][0] <= target_ms:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                return timer
        return None

    def _fire_due(self) -> None:
        while (timer := self._pop_due(self._now)) is not None:
            timer.callback()

    def busy(self) -> list[asyncio.Task[Any]]:
        """Tracked tasks that are neither finished nor waiting on this clock."""
        return [task for task in self._tracked if not self._waiting(task)]

    def _waiting(self, task: asyncio.Task[Any]) -> bool:
        future = self._sleeping.get(task)  # task.cancel() cancels it: the task is then busy
        return future is not None and not future.done()

    async def settle(self) -> None:
        """Wait until every tracked task is finished or waiting on this clock."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout
        quiet = spins = 0
        while quiet < 3:  # idle over several loop turns: no callback left to wake anything
            busy = self.busy()
            quiet = 0 if busy else quiet + 1
            if busy and loop.time() > deadline:
                names = ", ".join(sorted(task.get_name() for task in busy))
                raise TimeoutError(
                    f"TestClock: tasks still busy after {self.settle_timeout:g}s of real time: "
                    f"{names} (a handler waiting on something other than the clock? use "
                    "ctx.sleep() in virtual time)"
                )
            spins += 1
            await asyncio.sleep(0 if spins < 100 or not busy else 0.001)

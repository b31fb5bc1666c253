"""``TestClock``: virtual time that runs whole schedules without sleeping."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections.abc import Callable, Collection, Coroutine, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

from .._clock import Clock, Timer, datetime_to_ms, resolve
from .._durations import Duration, parse_duration, to_ms
from .._tasks import Tracked, track

__all__ = ["FleetClock", "InstanceClock", "TestClock"]

T = TypeVar("T")

_DEFAULT_START = "2026-01-01T00:00:00+00:00"


class _VirtualTimer:
    __slots__ = ("callback", "cancelled", "due", "view", "wall_ms")

    def __init__(
        self,
        due: int,
        wall_ms: int | None,
        callback: Callable[[], object],
        view: InstanceClock | None = None,
    ) -> None:
        self.due = due  # on the monotonic clock
        self.wall_ms = wall_ms  # a wall-clock timer's instant: a step() moves its due time
        self.callback = callback
        self.cancelled = False
        self.view = view  # the instance clock whose wall clock ``wall_ms`` is on (FleetClock)

    def cancel(self) -> None:
        self.cancelled = True


class TestClock(Clock):
    """A virtual clock: ``await clock.advance("1m")`` fires what falls due, in order, and waits
    until the work it started has settled.

    Work has settled, as in trio's and anyio's ``wait_all_tasks_blocked``, when nothing is ready
    to run: every task of the event loop is blocked, and every task the scheduler started is
    finished, waiting on this clock (a timer, ``ctx.sleep()``), or an async handler blocked on
    anything at all (an ``asyncio.Event`` the test sets later, a lock, a queue). So a test can
    hold a run open, look at it, release it and advance again; a virtual timeout cancels a
    handler wherever it is blocked. The scheduler's own work (a claim to a real broker, a sync
    handler's thread) is waited for in real time, up to ``settle_timeout`` seconds.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, start: datetime | str = _DEFAULT_START, *, settle_timeout: float = 30.0):
        moment = datetime.fromisoformat(start) if isinstance(start, str) else start
        if moment.tzinfo is None:
            raise ValueError(
                f"TestClock start {moment.isoformat()} needs a time zone (e.g. +00:00)"
            )
        self._mono = 0
        self._offset = datetime_to_ms(moment)  # wall = monotonic + offset; step() moves it
        self._timers: list[tuple[int, int, _VirtualTimer]] = []
        self._seq = itertools.count()
        self._tracked: set[asyncio.Task[Any]] = set()
        self._sleeping: dict[asyncio.Task[Any], asyncio.Future[None]] = {}
        self._blocking: set[asyncio.Task[Any]] = set()  # tasks inside blocking()
        self.settle_timeout = settle_timeout

    def now_ms(self) -> int:
        return self._mono + self._offset

    def monotonic_ms(self) -> int:
        return self._mono

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        return self._push(_VirtualTimer(when_ms - self._offset, when_ms, callback))

    def call_later(self, delay_ms: int, callback: Callable[[], object]) -> Timer:
        return self._push(_VirtualTimer(self._mono + delay_ms, None, callback))

    def _push(self, timer: _VirtualTimer) -> _VirtualTimer:
        heapq.heappush(self._timers, (timer.due, next(self._seq), timer))
        if timer.due <= self._mono:
            asyncio.get_running_loop().call_soon(self._fire_due)
        return timer

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        task = super().spawn(coro, name=name)
        self._tracked.add(task)
        task.add_done_callback(self._tracked.discard)
        return task

    @contextmanager
    def blocking(self) -> Iterator[None]:
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._blocking.add(task)
        try:
            yield
        finally:
            self._blocking.discard(task)

    async def sleep_until(self, when_ms: int) -> None:
        await self._sleep(self.call_at, when_ms)

    async def sleep(self, seconds: float) -> None:
        await self._sleep(self.call_later, round(seconds * 1000))

    async def _sleep(
        self, make_timer: Callable[[int, Callable[[], object]], Timer], at: int
    ) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = make_timer(at, lambda: resolve(future))
        task = asyncio.current_task()
        if task is not None:
            self._sleeping[task] = future
        try:
            await future
        finally:
            timer.cancel()
            if task is not None:
                self._sleeping.pop(task, None)

    async def wait(self, tasks: Collection[asyncio.Task[Any]], timeout: float) -> None:
        """Wait for ``tasks``, at most ``timeout`` seconds of virtual time, which runs on by
        itself meanwhile: ``await scheduler.stop()`` drains as it would in real time, timers
        (timeouts, renewals, ``ctx.sleep()``) firing on the way. Work that runs in real time
        (a sync handler's thread) is given at most ``timeout`` real seconds."""
        deadline = self._mono + round(timeout * 1000)
        pending = [task for task in tasks if not task.done()]
        while pending:
            await self._settle(min(self.settle_timeout, timeout))
            pending = [task for task in pending if not task.done()]
            timer = self._pop_due(deadline) if pending else None
            if timer is None:
                if pending:
                    self._mono = max(self._mono, deadline)
                return
            self._mono = max(self._mono, timer.due)
            timer.callback()

    # -- driving time ----------------------------------------------------------------------

    async def advance(self, duration: Duration) -> None:
        """Move time forward by ``duration``, firing everything that falls due on the way."""
        await self._advance_to(self._mono + to_ms(parse_duration(duration, name="advance")))

    async def advance_to(self, moment: datetime | str) -> None:
        """Move time forward to ``moment`` on the wall clock (never backwards)."""
        when = datetime.fromisoformat(moment) if isinstance(moment, str) else moment
        await self._advance_to(datetime_to_ms(when) - self._offset)

    async def stall(self, duration: Duration) -> None:
        """The process freezes for ``duration`` (a GC pause, a suspended VM): time moves on with
        nothing running, then everything that fell due meanwhile fires at once, late."""
        await self.settle()
        self._mono += to_ms(parse_duration(duration, name="stall"))
        await self._advance_to(self._mono)

    async def step(self, duration: Duration, *, back: bool = False) -> None:
        """The wall clock jumps by ``duration`` (``back=True``: backwards), as NTP or an operator
        may step it; monotonic time does not move. Wall-clock timers (slots) follow the wall
        clock; timeouts, lease renewals and sleeps do not."""
        await self.settle()
        delta = to_ms(parse_duration(duration, name="step"))
        self._offset += -delta if back else delta
        for _, _, timer in self._timers:
            if timer.wall_ms is not None:
                timer.due = timer.wall_ms - self._offset - _ahead(timer)
        self._timers = [(timer.due, seq, timer) for _, seq, timer in self._timers]
        heapq.heapify(self._timers)
        await self._advance_to(self._mono)

    async def _advance_to(self, target: int) -> None:
        await self.settle()
        while (timer := self._pop_due(target)) is not None:
            self._mono = max(self._mono, timer.due)
            timer.callback()
            await self.settle()
        self._mono = max(self._mono, target)
        await self.settle()

    def _pop_due(self, target: int) -> _VirtualTimer | None:
        while self._timers and self._timers[0][0] <= target:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                return timer
        return None

    def _fire_due(self) -> None:
        while (timer := self._pop_due(self._mono)) is not None:
            timer.callback()

    def busy(self) -> list[asyncio.Task[Any]]:
        """The tasks that keep the work from settling: tracked tasks that are neither finished,
        nor waiting on this clock, nor blocked handlers; else any task ready to run."""
        busy = [task for task in self._tracked if not self._settled(task)]
        if not busy:
            current = asyncio.current_task()
            busy = [task for task in asyncio.all_tasks() if task is not current and _ready(task)]
        return busy

    def _settled(self, task: asyncio.Task[Any]) -> bool:
        future = self._sleeping.get(task)  # task.cancel() cancels it: the task is then busy
        if future is not None and not future.done():
            return True
        return task in self._blocking and not _ready(task)

    async def settle(self) -> None:
        """Wait until nothing is ready to run (see the class docstring); ``TimeoutError`` names
        the tasks still busy after ``settle_timeout`` seconds of real time."""
        if busy := await self._settle(self.settle_timeout):
            names = ", ".join(sorted(task.get_name() for task in busy))
            raise TimeoutError(
                f"TestClock: tasks still busy after {self.settle_timeout:g}s of real time: "
                f"{names} (a handler waiting on something other than the clock? use "
                "ctx.sleep() in virtual time)"
            )

    async def _settle(self, limit_s: float) -> list[asyncio.Task[Any]]:
        """Settle, for at most ``limit_s`` of real time; return the tasks still busy then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        quiet = spins = 0
        while quiet < 3:  # idle over several loop turns: no callback left to wake anything
            busy = self.busy()
            quiet = 0 if busy else quiet + 1
            if busy and loop.time() > deadline:
                return busy
            spins += 1
            await asyncio.sleep(0 if spins < 100 or not busy else 0.001)
        return []


def _ready(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` can run now: it waits on no future, or on one that is done. asyncio has no
    public API for this; anyio's ``wait_all_tasks_blocked`` reads the same attribute."""
    waiter = getattr(task, "_fut_waiter", None)
    return waiter is None or bool(waiter.done())


def _ahead(timer: _VirtualTimer) -> int:
    return 0 if timer.view is None else timer.view.ahead_ms


class FleetClock(TestClock):
    """The virtual time of a fleet simulated in one process (``brokersched.testing.simulate``):
    one timeline, and an ``InstanceClock`` per instance whose wall clock may be ahead or behind
    (skew) and may be stepped on its own.

    Unlike a ``TestClock``, waiting (``wait()``, as in a scheduler's drain) never moves time by
    itself: only the driver's ``advance()`` does, as several instances wait at once.
    """

    def __init__(self, start: datetime | str = _DEFAULT_START, *, seed: int = 0) -> None:
        super().__init__(start)
        self._seed = seed
        self._rngs = itertools.count()

    def instance(self, ahead_ms: int = 0) -> InstanceClock:
        """A clock for one instance, its wall clock ``ahead_ms`` ahead (negative: behind)."""
        return InstanceClock(self, ahead_ms)

    def random(self) -> random.Random:
        return random.Random(f"{self._seed}:{next(self._rngs)}")

    async def wait(self, tasks: Collection[asyncio.Task[Any]], timeout: float) -> None:
        pending = {task for task in tasks if not task.done()}
        if not pending:
            return
        loop = asyncio.get_running_loop()
        expired: asyncio.Future[None] = loop.create_future()
        timer = self.call_later(round(timeout * 1000), lambda: resolve(expired))
        current = asyncio.current_task()
        if current is not None:
            self._sleeping[current] = expired  # settled while it waits
        try:
            while pending and not expired.done():
                done, _ = await asyncio.wait({*pending, expired}, return_when="FIRST_COMPLETED")
                pending -= done
        finally:
            timer.cancel()
            if current is not None:
                self._sleeping.pop(current, None)

    def _push_view(self, timer: _VirtualTimer) -> _VirtualTimer:
        return self._push(timer)

    def _retime(self, view: InstanceClock) -> None:
        for _, _, timer in self._timers:
            if timer.view is view and timer.wall_ms is not None:
                timer.due = timer.wall_ms - self._offset - view.ahead_ms
        self._timers = [(timer.due, seq, timer) for _, seq, timer in self._timers]
        heapq.heapify(self._timers)


class InstanceClock(Clock):
    """One instance's clock in a ``FleetClock``: the fleet's timeline, its own wall clock.
    ``kill()`` is kill -9 for everything the instance runs on it: its tasks are cancelled, its
    timers never fire."""

    def __init__(self, fleet: FleetClock, ahead_ms: int) -> None:
        self.fleet = fleet
        self.ahead_ms = ahead_ms
        self.dead = False
        self.tasks: Tracked = {}

    def kill(self) -> None:
        self.dead = True
        for task in list(self.tasks):
            task.cancel()

    def _alive(self, callback: Callable[[], object]) -> Callable[[], object]:
        return lambda: None if self.dead else callback()

    def now_ms(self) -> int:
        return self.fleet.now_ms() + self.ahead_ms

    def monotonic_ms(self) -> int:
        return self.fleet.monotonic_ms()

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        due = when_ms - self.ahead_ms - (self.fleet.now_ms() - self.fleet.monotonic_ms())
        return self.fleet._push_view(_VirtualTimer(due, when_ms, self._alive(callback), self))

    def call_later(self, delay_ms: int, callback: Callable[[], object]) -> Timer:
        return self.fleet.call_later(delay_ms, self._alive(callback))

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        task = self.fleet.spawn(coro, name=name)
        track(self.tasks, task)
        if self.dead:
            task.cancel()
        return task

    @contextmanager
    def blocking(self) -> Iterator[None]:
        with self.fleet.blocking():
            yield

    async def sleep(self, seconds: float) -> None:
        await self.fleet.sleep(seconds)

    async def sleep_until(self, when_ms: int) -> None:
        await self.fleet.sleep_until(when_ms - self.ahead_ms)

    async def wait(self, tasks: Collection[asyncio.Task[Any]], timeout: float) -> None:
        await self.fleet.wait(tasks, timeout)

    def random(self) -> random.Random:
        return self.fleet.random()

    def step(self, delta_ms: int) -> None:
        """This instance's wall clock jumps by ``delta_ms`` (negative: back), as NTP may step
        it; the fleet's timeline and the other instances do not move."""
        self.ahead_ms += delta_ms
        self.fleet._retime(self)

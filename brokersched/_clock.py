"""Time as every brokersched component reads it.

The scheduler never calls ``time`` or ``asyncio.sleep`` directly: it asks a ``Clock``, so that
``brokersched.testing.TestClock`` can drive whole schedules in virtual time. Timers are callbacks
(``call_at``) rather than sleeping tasks: ten thousand idle jobs cost one timer, not ten thousand
tasks.
"""

from __future__ import annotations

import asyncio
import functools
import platform
import random
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

__all__ = [
    "Clock",
    "SystemClock",
    "Timer",
    "datetime_to_ms",
    "host_time_ms",
    "ms_to_datetime",
    "resolve",
]

T = TypeVar("T")

# A wall clock can be stepped (NTP): a timer never trusts one long monotonic delay, it wakes at
# least this often and looks at the wall clock again.
_MAX_DELAY_S = 30.0


# clock_gettime's system call number on the 64-bit Linux machines (see host_time_ms).
_CLOCK_GETTIME = {"x86_64": 228, "amd64": 228, "aarch64": 113, "arm64": 113, "riscv64": 113,
                  "ppc64le": 246, "ppc64": 246, "s390x": 260}  # fmt: skip
_CLOCK_REALTIME = 0


@functools.cache
def _kernel_clock() -> Callable[[], int] | None:
    """Milliseconds of the kernel's ``CLOCK_REALTIME`` by a direct ``syscall()``, or ``None``
    where that call is unknown (not 64-bit Linux) or fails."""
    import ctypes  # only a process on SQLite needs it

    number = _CLOCK_GETTIME.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None or sys.maxsize < 2**32:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p]

    def read() -> int:
        timespec = (ctypes.c_int64 * 2)()  # tv_sec, tv_nsec
        if syscall(number, _CLOCK_REALTIME, timespec) != 0:
            return time.time_ns() // 1_000_000  # cannot happen once the first call worked
        return timespec[0] * 1000 + timespec[1] // 1_000_000

    try:  # a sandbox (seccomp) may refuse the call: then the C library's clock
        works = syscall(number, _CLOCK_REALTIME, (ctypes.c_int64 * 2)()) == 0
    except ctypes.ArgumentError:
        works = False
    return read if works else None


def host_time_ms() -> int:
    """The host's wall clock in milliseconds since the Unix epoch: the kernel's
    ``CLOCK_REALTIME``, which every process of the host shares.

    Read by a direct system call rather than the C library's ``clock_gettime`` (which
    ``time.time`` uses): an in-process fake such as libfaketime (``LD_PRELOAD``) replaces the
    C library's time functions, so one process could read the time 40 s ahead of the others.
    Only a fake that replaces ``syscall()`` itself (libfaketime built with
    ``INTERCEPT_SYSCALL``) or traces the process still moves it. Elsewhere than on 64-bit
    Linux, ``time.time_ns()``. About a microsecond.
    """
    read = _kernel_clock()
    return time.time_ns() // 1_000_000 if read is None else read()


def ms_to_datetime(ms: int) -> datetime:
    """An aware UTC datetime for ``ms`` milliseconds since the Unix epoch."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def datetime_to_ms(value: datetime) -> int:
    """Milliseconds since the Unix epoch; ``value`` must be aware."""
    if value.tzinfo is None:
        raise ValueError(f"datetime {value.isoformat()} has no time zone; pass an aware datetime")
    return round(value.timestamp() * 1000)


def resolve(future: asyncio.Future[None]) -> None:
    """Set ``future``'s result unless it is done already (a timer may race a cancellation)."""
    if not future.done():
        future.set_result(None)


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(ABC):
    """The source of time, timers, and the tasks that wait on them.

    Two times: the wall clock (``now_ms``, ``call_at``) places slots, which are instants every
    instance agrees on; the monotonic clock (``monotonic_ms``, ``call_later``, ``sleep``,
    ``wait``) measures everything else — lease renewals and deadlines, timeouts, durations,
    the drain — so that a wall-clock step (NTP, a VM resumed) cannot stretch or shrink them.
    """

    @abstractmethod
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch (UTC), on the wall clock."""

    @abstractmethod
    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        """Call ``callback`` (from the event loop) once ``now_ms() >= when_ms``."""

    def monotonic_ms(self) -> int:
        """Milliseconds on a clock that never steps (its origin means nothing)."""
        return self.now_ms()

    def call_later(self, delay_ms: int, callback: Callable[[], object]) -> Timer:
        """Call ``callback`` once ``delay_ms`` milliseconds have passed on the monotonic clock."""
        return self.call_at(self.now_ms() + delay_ms, callback)

    def now(self) -> datetime:
        """The current time as an aware UTC datetime."""
        return ms_to_datetime(self.now_ms())

    async def sleep_until(self, when_ms: int) -> None:
        """Return once ``now_ms() >= when_ms`` (wall clock)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_at(when_ms, lambda: resolve(future))
        try:
            await future
        finally:
            timer.cancel()

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` on the monotonic clock."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(round(seconds * 1000), lambda: resolve(future))
        try:
            await future
        finally:
            timer.cancel()

    @asynccontextmanager
    async def timeout(self, seconds: float) -> AsyncIterator[None]:
        """``asyncio.timeout`` on this clock: the block is cut (``TimeoutError``) once
        ``seconds`` have passed on the monotonic clock. On a virtual clock a bound is virtual
        too, so that how busy the machine is never decides what a simulated fleet does."""
        async with asyncio.timeout(None) as bound:

            def expire() -> None:
                if bound.expired() is False and bound.when() is None:
                    bound.reschedule(asyncio.get_running_loop().time())

            timer = self.call_later(round(seconds * 1000), expire)
            try:
                yield
            finally:
                timer.cancel()

    async def wait(self, tasks: Collection[asyncio.Task[Any]], timeout: float) -> None:
        """Wait until ``tasks`` are done, at most ``timeout`` seconds (monotonic)."""
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as a task; a virtual clock tracks it to know when work has settled."""
        return asyncio.get_running_loop().create_task(coro, name=name)

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """The current task runs code that may wait on anything (an async handler awaiting an
        event the test sets later): a virtual clock counts it as settled while it is blocked."""
        yield

    def random(self) -> random.Random:
        """A source of randomness for jitter: fresh from the OS; a simulated fleet's clocks
        give seeded ones, so that a run can be replayed."""
        return random.Random()


class _WallTimer:
    __slots__ = ("_callback", "_clock", "_handle", "_when_ms")

    def __init__(self, clock: SystemClock, when_ms: int, callback: Callable[[], object]) -> None:
        self._clock = clock
        self._when_ms = when_ms
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        delay = (self._when_ms - self._clock.now_ms()) / 1000
        loop = asyncio.get_running_loop()
        self._handle = loop.call_later(max(0.0, min(delay, _MAX_DELAY_S)), self._fire)

    def _fire(self) -> None:
        if self._clock.now_ms() < self._when_ms:
            self._arm()  # woke early: a long delay was cut, or the wall clock stepped back
            return
        self._handle = None
        self._callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class SystemClock(Clock):
    """The real clocks: ``time.time`` and the event loop's monotonic time."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        return _WallTimer(self, when_ms, callback)

    def monotonic_ms(self) -> int:
        return time.monotonic_ns() // 1_000_000

    def call_later(self, delay_ms: int, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(max(delay_ms, 0) / 1000, callback)

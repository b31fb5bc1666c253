"""``JobContext``: what a handler knows about the run it is doing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Generator
from datetime import datetime
from typing import Any, Literal

from ._clock import Clock, SystemClock, ms_to_datetime, resolve
from .abc import RunReason, RunRecord

__all__ = ["AbortReason", "JobContext", "PreviousRun", "abort"]

AbortReason = Literal["timeout", "lock-lost", "removed", "shutdown", "aborted", "replaced"]

_logger = logging.getLogger("brokersched.job")


class _RunAdapter(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs.setdefault("extra", {}).update(extra)
        return f"[{extra.get('job')} {extra.get('run_id')}] {msg}", kwargs


class PreviousRun:
    """``ctx.previous``: the job's last finished run before this one (its ``RunRecord``, with
    the ``result`` its handler returned), or ``None``: ``await ctx.previous`` in an async
    handler, ``ctx.previous.get()`` in a sync one (it waits in the handler's thread while the
    scheduler's event loop reads).

    Read from the backend's history when first asked, never before, and once per run: a run
    that does not ask costs nothing more (a history read is not cheap on every backend: a
    RabbitMQ stream is scanned). The newest record of the job that is not this run's (a retry
    sees the attempt it follows), after this instance's own records waiting to be written have
    been written. Another instance's run that is still being recorded may not be there yet.
    Raises ``BackendError`` when the backend cannot be read.
    """

    __slots__ = ("_done", "_loop", "_read", "_value")

    def __init__(
        self,
        read: Callable[[], Awaitable[RunRecord | None]],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._read = read
        self._loop = loop  # the scheduler's, where a sync handler's read is made
        self._done = False
        self._value: RunRecord | None = None

    @classmethod
    def known(cls, record: RunRecord | None) -> PreviousRun:
        """One that answers ``record`` without reading anything (``make_context``)."""
        previous = cls(_nothing)
        previous._done, previous._value = True, record
        return previous

    def __await__(self) -> Generator[Any, None, RunRecord | None]:
        return self._get().__await__()

    async def _get(self) -> RunRecord | None:
        if not self._done:
            self._value = await self._read()
            self._done = True
        return self._value

    def get(self, timeout: float | None = None) -> RunRecord | None:
        """The previous run, from a sync handler's thread: waits (at most ``timeout`` seconds)
        for the scheduler's event loop to read it. On the event loop's own thread it would
        block the loop: ``RuntimeError`` (use ``await ctx.previous``) unless already read."""
        if self._done:
            return self._value
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "ctx.previous.get() would block the event loop: in an async handler, use "
                "`await ctx.previous`"
            )
        if self._loop is None:
            raise RuntimeError("ctx.previous.get(): this context has no scheduler to read with")
        return asyncio.run_coroutine_threadsafe(self._get(), self._loop).result(timeout)


async def _nothing() -> RunRecord | None:
    return None


_NO_PREVIOUS = PreviousRun.known(None)  # answers None; nothing to read, nothing to change


class JobContext:
    """The run a handler is doing.

    ``abort_reason`` becomes ``"timeout"``, ``"lock-lost"``, ``"removed"``, ``"aborted"``
    (``Scheduler.abort(run_id)``, from any instance) or ``"replaced"`` (a later slot of a job
    with ``overlap="replace"`` came due) when the run must stop at once: async handlers are
    then cancelled at their next ``await``. It becomes
    ``"shutdown"`` when the scheduler stops: the handler is told, not cancelled, and may
    checkpoint and return (``await ctx.wait_aborted()``); only a run still going after
    ``drain_timeout`` is cancelled. Sync handlers (run in a worker thread) watch
    ``abort_reason``.

    ``previous`` is the job's last finished run (a ``RunRecord`` or ``None``), read from the
    backend only when the handler asks: ``prev = await ctx.previous`` in an async handler,
    ``prev = ctx.previous.get()`` in a sync one; ``prev.result`` is what that run's handler
    returned (see ``PreviousRun``). A handler's JSON return value is kept in its run's record
    (``RunRecord.result``, unless ``Scheduler(record_results=False)``).
    """

    __slots__ = (
        "_abort_reason",
        "_clock",
        "_waiters",
        "attempt",
        "data",
        "instance_id",
        "job",
        "logger",
        "previous",
        "reason",
        "run_id",
        "slot_ms",
    )

    def __init__(
        self,
        *,
        job: str,
        run_id: str,
        slot_ms: int,
        reason: RunReason,
        attempt: int,
        data: Any,
        instance_id: str,
        clock: Clock | None = None,
        previous: PreviousRun | None = None,
    ) -> None:
        self.job = job
        self.run_id = run_id
        self.slot_ms = slot_ms
        self.reason: RunReason = reason
        self.attempt = attempt
        self.data = data
        self.instance_id = instance_id
        self._abort_reason: AbortReason | None = None
        self._waiters: dict[asyncio.Future[None], None] = {}  # woken in the order they came
        self.logger: logging.LoggerAdapter[logging.Logger] = _RunAdapter(
            _logger, {"job": job, "run_id": run_id}
        )
        self._clock = clock or SystemClock()
        #: The job's last finished run, read when asked (``PreviousRun``); none without one.
        self.previous = previous if previous is not None else _NO_PREVIOUS

    @property
    def scheduled_at(self) -> datetime:
        """The slot's instant, an aware UTC datetime."""
        return ms_to_datetime(self.slot_ms)

    @property
    def abort_reason(self) -> AbortReason | None:
        """Why the run must stop (``None`` while it may go on)."""
        return self._abort_reason

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    async def wait_aborted(self, timeout: float | None = None) -> bool:
        """Wait until the run is told to stop, at most ``timeout`` seconds on the scheduler's
        clock; return whether it was. ``if await ctx.wait_aborted(5): return`` paces a loop
        that ends as soon as the scheduler stops."""
        if self._abort_reason is None and (timeout is None or timeout > 0):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[waiter] = None
            timer = None
            if timeout is not None:
                timer = self._clock.call_later(round(timeout * 1000), lambda: resolve(waiter))
            try:
                await waiter
            finally:
                self._waiters.pop(waiter, None)
                if timer is not None:
                    timer.cancel()
        return self._abort_reason is not None

    async def sleep(self, seconds: float) -> None:
        """Sleep on the scheduler's clock (virtual under ``TestClock``)."""
        await self._clock.sleep(seconds)

    def __repr__(self) -> str:
        return (
            f"JobContext(job={self.job!r}, run_id={self.run_id!r}, slot_ms={self.slot_ms}, "
            f"reason={self.reason!r}, attempt={self.attempt})"
        )


def abort(ctx: JobContext, reason: AbortReason) -> None:
    """Tell the handler holding ``ctx`` to stop, as the scheduler would: ``ctx.abort_reason``
    is set and ``ctx.wait_aborted()`` returns (the scheduler also cancels an async handler,
    except on ``shutdown``)."""
    ctx._abort_reason = reason
    for waiter in list(ctx._waiters):
        resolve(waiter)

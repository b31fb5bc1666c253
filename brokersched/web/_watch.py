"""How the admin app reads the backend, and what it knows of the backend's health.

Every read is bounded (``READ_TIMEOUT_S``): a page never waits on a backend that does not
answer (``job.history()`` alone first waits up to 5 s for the records being written, and a
stalled broker longer). The read itself is never cancelled (a backend client cut in the middle
of a call may leave a channel or a connection unusable): it goes on in the background, and the
same question asked again meanwhile joins it, so many tabs cost one read.

Once a read failed, the backend counts as unreachable: further reads fail at once, except one
trial read every ``RETRY_S`` (a fresh one: an earlier read may hang for ever on a dead
connection; at most ``MAX_PENDING`` are left waiting), until one answers. The scheduler's
events say it too: a slot skipped for ``backend-error`` or a record dropped (unreachable), a
claimed run starting (reachable). ``/health`` reads the backend itself when nothing was heard
of it for ``STALE_S``, so it knows within seconds, not after two missed slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from .._events import Event, RecordDroppedEvent, SkipEvent, StartEvent
from .._exceptions import BackendError
from .._redact import redact_text
from .._scheduler import Scheduler

__all__ = ["READ_TIMEOUT_S", "RETRY_S", "STALE_S", "BackendUnreachableError", "BackendWatch"]

T = TypeVar("T")

READ_TIMEOUT_S = 2.0  # the longest a request waits for the backend
RETRY_S = 2.0  # while unreachable: one trial read at most this often, the others fail at once
STALE_S = 3.0  # /health reads the backend itself when nothing was heard of it for this long
MAX_PENDING = 8  # reads left waiting on a stalled backend; beyond, no new one is started
_OUTAGES = (BackendError, OSError, TimeoutError)


class BackendUnreachableError(Exception):
    """A read refused at once (the backend is known to be unreachable) or not answered in
    time; the message says which, since when and the last error."""


class BackendWatch:
    def __init__(self, scheduler: Scheduler[Any]) -> None:
        self._scheduler = scheduler
        self._reachable: bool | None = None  # None: nothing heard yet
        self._since_ms: int | None = None  # when it last changed (the scheduler's clock)
        self._error: str | None = None
        self._heard = -float("inf")  # time.monotonic() of the last news, good or bad
        self._failed = -float("inf")  # ... of the last failure
        self._tried = -float("inf")  # ... of the last trial read while unreachable
        self._reads: dict[Hashable, asyncio.Task[Any]] = {}  # by question: the one to join
        self._pending: set[asyncio.Task[Any]] = set()  # every read not answered yet
        scheduler.on("skip", self._on_event)
        scheduler.on("start", self._on_event)
        scheduler.on("record-dropped", self._on_event)

    # -- what is known -------------------------------------------------------------------------

    @property
    def reachable(self) -> bool | None:
        return self._reachable

    @property
    def stale(self) -> bool:
        return time.monotonic() - self._heard > STALE_S

    def status(self) -> dict[str, Any]:
        """``reachable`` (``None``: not known yet), ``since`` (ms on the scheduler's clock),
        ``error`` (the last failure, redacted), ``checked_s_ago``."""
        heard = time.monotonic() - self._heard
        return {
            "reachable": self._reachable,
            "since_ms": self._since_ms,
            "error": self._error,
            "checked_s_ago": round(heard, 1) if heard != float("inf") else None,
        }

    def describe(self) -> str:
        since = ""
        if self._since_ms is not None:
            seconds = (self._scheduler.clock.now_ms() - self._since_ms) // 1000
            since = f" for {seconds}s" if seconds >= 1 else ""
        why = f" ({self._error})" if self._error else ""
        return f"the backend ({self._scheduler.backend.name}) is unreachable{since}{why}"

    # -- news ------------------------------------------------------------------------------------

    def _ok(self) -> None:
        self._heard = time.monotonic()
        if self._reachable is not True:
            self._reachable, self._error = True, None
            self._since_ms = self._scheduler.clock.now_ms()

    def _fail(self, error: str) -> None:
        self._heard = self._failed = time.monotonic()
        self._error = redact_text(error)[:300]
        if self._reachable is not False:
            self._reachable = False
            self._since_ms = self._scheduler.clock.now_ms()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, SkipEvent) and event.reason == "backend-error":
            self._fail(event.detail or "a claim failed")
        elif isinstance(event, RecordDroppedEvent):
            self._fail("a run's record could not be written")
        elif isinstance(event, StartEvent):
            job = self._scheduler.get(event.job)
            if job is not None and job.settings.claim:  # it went through the backend's claim
                self._ok()

    # -- reading ---------------------------------------------------------------------------------

    async def read(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        """``make()``'s answer, shared with every caller asking ``key`` meanwhile; raises
        ``BackendUnreachableError`` at once while the backend is known to be down (but for one
        trial read every ``RETRY_S``), or after ``READ_TIMEOUT_S`` without an answer. Other
        exceptions of the read are raised as they are."""
        task = self._reads.get(key)  # the same question asked meanwhile: one read
        if self._reachable is False:
            # One caller every RETRY_S tries a fresh read (an earlier one may hang on a dead
            # connection for ever); the others are told at once.
            if not self._may_try():
                raise BackendUnreachableError(self.describe())
            self._tried = time.monotonic()
            task = None
        if task is None:
            task = asyncio.ensure_future(make())
            self._reads[key] = task
            self._pending.add(task)
            task.add_done_callback(lambda done: self._done(key, done))
        done, _ = await asyncio.wait({task}, timeout=READ_TIMEOUT_S)
        if not done:
            self._fail(f"no answer within {READ_TIMEOUT_S:g}s")
            raise BackendUnreachableError(self.describe())
        result: T = task.result()
        return result

    def _may_try(self) -> bool:
        if len(self._pending) >= MAX_PENDING:  # reads hanging on a stalled link: no more
            return False
        return time.monotonic() - max(self._failed, self._tried) >= RETRY_S

    def _done(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if self._reads.get(key) is task:
            del self._reads[key]
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here: a read nobody waits for any more is no warning
        if exc is None:
            self._ok()
        elif isinstance(exc, _OUTAGES):
            self._fail(f"{type(exc).__name__}: {exc}")
        else:  # a bug or a refusal: the backend answered
            self._heard = time.monotonic()

    async def probe(self) -> None:
        """Read the backend once (the newest record of a job), unless something was heard of
        it lately (while it is unreachable: unless a trial read was made lately); the outcome
        lands in ``status()``."""
        if self._reachable is not False and not self.stale:
            return
        jobs = self._scheduler.jobs()
        if not jobs:
            return
        job = jobs[0]
        with contextlib.suppress(Exception):  # recorded by read(): status() says it
            await self.read(("history", job.name, 1), lambda: job.history(1))

"""``Job``: one registered job, as the application sees it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from ._clock import ms_to_datetime
from ._context import JobContext
from ._options import JobOptions, JobSettings
from .abc import Backend, Lease, RunRecord
from .triggers.base import Trigger

if TYPE_CHECKING:
    from ._scheduler import Scheduler

__all__ = ["Handler", "Job"]

Handler: TypeAlias = Callable[[JobContext], Awaitable[None]] | Callable[[JobContext], None]


def is_async_handler(handler: object) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    return inspect.iscoroutinefunction(call)


@dataclass(slots=True, eq=False)
class Run:
    """A run in progress on this instance."""

    ctx: JobContext
    task: asyncio.Task[Any]
    lease: Lease | None
    started_ms: int
    job: Job
    finishing: bool = False  # the handler is done; its release and record are under way
    cut: bool = False  # cancelled at an await by an abort
    abandoned: bool = False  # stop() stopped waiting for it


class Job:
    """A registered job: its schedule (a trigger), handler and options, and its runs here."""

    __slots__ = (
        "_scheduler",
        "armed_ms",
        "armed_seq",
        "handler",
        "is_async",
        "kind",
        "last_ok_ms",
        "make_trigger",
        "name",
        "options",
        "paused",
        "runs",
        "schedule",
        "settings",
    )

    def __init__(
        self,
        scheduler: Scheduler[Any],
        name: str,
        kind: Literal["every", "cron", "at"],
        trigger: Trigger,
        handler: Handler,
        settings: JobSettings,
        options: JobOptions,
        make_trigger: Callable[[JobOptions], Trigger],
    ) -> None:
        self._scheduler = scheduler
        self.name = name
        self.kind = kind
        self.schedule = trigger
        self.handler = handler
        self.settings = settings
        self.options = options
        self.make_trigger = make_trigger  # rebuilds the schedule when options change
        self.is_async = is_async_handler(handler)
        self.paused = False
        self.armed_ms: int | None = None  # the slot this instance waits for, if any
        self.armed_seq: int | None = None  # its entry in the scheduler's timer heap
        self.runs: dict[str, Run] = {}  # run_id -> run in progress here
        # the last slot handled: completed here, or claimed by another instance (for overdue())
        self.last_ok_ms: int | None = None

    @property
    def next_run(self) -> datetime | None:
        """When the next slot falls (before jitter), or ``None`` when paused, removed or done."""
        if self.armed_ms is not None:
            return ms_to_datetime(self.armed_ms)
        if self.paused or self._scheduler.get(self.name) is not self:
            return None
        nxt = self.schedule.next_ms(self._scheduler.clock.now_ms())
        return None if nxt is None else ms_to_datetime(nxt)

    def next_runs(self, n: int, after: datetime | None = None) -> list[datetime]:
        """The next ``n`` slots after ``after`` (default: now on the scheduler's clock)."""
        return self.schedule.next_runs(n, after or self._scheduler.clock.now())

    @property
    def is_running(self) -> bool:
        """Whether a run of this job is going on this instance."""
        return bool(self.runs)

    def pause(self) -> None:
        """Stop arming slots on this instance (other instances are not affected)."""
        self.paused = True
        self.armed_ms = None

    def update(self, **options: Any) -> None:
        """Change options at run time (``job.update(jitter="5s", timeout="1m")``).

        The merged options are validated exactly as at registration, against the backend and the
        scheduler's defaults; on a ``ConfigurationError`` nothing changes. Runs in progress keep
        the options they started with.
        """
        self._scheduler._update(self, options)

    def resume(self) -> None:
        """Arm the next slot again."""
        if self.paused:
            self.paused = False
            self._scheduler._arm(self)

    async def trigger(self) -> RunRecord | None:
        """Run the job now, through the claim (``ctx.reason == "manual"``).

        Returns the run's record, or ``None`` when the claim was refused (another instance, an
        overlap) or the backend failed. The run's slot is the current instant: on a lease
        backend, occurrence fencing then refuses an earlier slot nobody has claimed yet (one
        still inside its jitter window), which is skipped.
        """
        return await self._scheduler._run_manual(self)

    async def history(self, limit: int = 20) -> list[RunRecord]:
        """The job's recorded runs, newest first, at most ``limit``."""
        backend: Backend = self._scheduler.backend
        return await backend.history(self.settings.policy, limit)

    def describe(self) -> str:
        return self.schedule.describe()

    def __repr__(self) -> str:
        return f"Job({self.name!r}, {self.schedule.describe()})"

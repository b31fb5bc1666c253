"""What the scheduler keeps of a registered job (``JobState``: its ``JobSpec``, its place in the
timer heap, its runs) and of a run here (``Run``)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ._clock import Timer
from ._context import JobContext
from ._exceptions import ConfigurationError
from ._options import JobOptions, JobSettings, Kind
from .abc import JobControl, Lease
from .triggers.base import Trigger

__all__ = [
    "Arming",
    "AroundRun",
    "Handler",
    "JobSpec",
    "JobState",
    "Run",
    "call_sync",
    "check_handler",
    "is_async_handler",
]

# A handler may return a value: a JSON one is kept in its run's record (``RunRecord.result``).
Handler: TypeAlias = Callable[[JobContext], Awaitable[object]] | Callable[[JobContext], object]
AroundRun: TypeAlias = Callable[[JobContext], AbstractContextManager[object]]
"""``Scheduler(around_run=...)``: a context manager made for each run and entered around its
handler, in the thread the handler runs in (a worker thread for a sync handler, the event loop
for an async one)."""


def is_async_handler(handler: object) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
    return inspect.iscoroutinefunction(call)


def check_handler(job: str, handler: object) -> None:
    """Refuse a handler that cannot be called with one positional argument, the ``JobContext``
    (``def cleanup(): ...`` would fail every run with a ``TypeError``). A callable without an
    inspectable signature (some builtins and C extensions) is accepted as it is."""
    if not callable(handler):
        raise ConfigurationError(
            f"job '{job}': handler {handler!r} is not callable; pass a function that takes the "
            "JobContext: `def handler(ctx: JobContext) -> None`",
            option="handler",
            job=job,
        )
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None)
    except TypeError:
        shown = getattr(handler, "__qualname__", None) or repr(handler)
        raise ConfigurationError(
            f"job '{job}': handler {shown}{signature} cannot be called with the JobContext: it "
            "must accept exactly one positional argument (`def handler(ctx: JobContext)`, or "
            "`async def`); other parameters need defaults",
            option="handler",
            job=job,
        ) from None


def call_sync(handler: Handler, ctx: JobContext, around: AroundRun | None) -> object:
    """A sync handler's run, in its worker thread, and what it returned: ``around`` (if any) is
    entered here too, so that thread-bound resources (Django's database connections) are the
    handler's own."""
    if around is None:
        return handler(ctx)
    with around(ctx):
        return handler(ctx)


@dataclass(slots=True, eq=False)
class Run:
    """A run in progress on this instance."""

    ctx: JobContext
    task: asyncio.Task[Any]
    lease: Lease | None
    started_ms: int  # wall clock: the record's started_at
    started_mono: int  # monotonic: the run's duration
    job: JobState
    handler: Handler | None = None  # the run's own (a stored schedule's version), else the job's
    renewer: Any = None  # the Renewer keeping its lease, if any (``_leasekeeping``)
    finishing: bool = False  # the handler is done; its release and record are under way
    cut: bool = False  # cancelled at an await by an abort
    abandoned: bool = False  # stop() stopped waiting for it
    waiting: bool = False  # between a failed attempt and its retry (an abort ends the wait)
    exception: Exception | None = None  # what the handler raised
    cancelled: BaseException | None = None  # the cancellation that cut it (where it was)
    returned: object = None  # what the handler returned (its record keeps it as JSON)

    @property
    def is_async(self) -> bool:
        return self.job.is_async if self.handler is None else is_async_handler(self.handler)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What registration made of a job: its schedule and options, validated and resolved.
    Never changed in place: ``job.update()`` and overrides replace it whole (``_registry``)."""

    name: str
    kind: Kind
    schedule: Trigger
    settings: JobSettings
    options: JobOptions
    make_trigger: Callable[[JobOptions], Trigger]  # rebuilds the schedule when options change
    enabled: bool = True  # False: switched off by an override (registered, never armed)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # the override applied, as given
    # the trigger maker and options as registered, before any override
    origin: tuple[Callable[[JobOptions], Trigger], dict[str, Any]] | None = None


@dataclass(slots=True)
class Arming:
    """Where a job stands in the timer heap of its scheduler: written by ``_timers`` only."""

    armed_ms: int | None = None  # the slot this instance waits for, if any
    seq: int | None = None  # its entry in the timer heap
    fired_ms: int | None = None  # the last slot whose timer fired here
    boot_ms: int | None = None  # when the boot run (after(), run_on_start) is due here
    boot_timer: Timer | None = None


@dataclass(slots=True, eq=False)
class JobState:
    """A registered job on this instance; the application holds a ``Job`` (``_jobhandle``),
    which shows only the public API.

    Each part has one writer: ``spec`` the registry (``_registry``, replaced whole), ``arming``
    the timer heap (``_timers``), ``runs`` and ``last_ok_ms`` the runner (``_runner``,
    ``_runlog``), ``paused``, ``disabled`` and ``control`` the fleet's controls (``_controls``:
    ``Job.pause()`` and friends, the fleet's control records), ``removed`` ``remove()`` (the
    life cycle, ``_lifecycle``)."""

    spec: JobSpec
    handler: Handler
    is_async: bool = field(init=False)
    paused: bool = False
    disabled: bool = False  # Job.disable(): no slot, nor manual run, until enable()
    control: JobControl | None = None  # the fleet's control record as last read (or made here)
    removed: bool = False  # remove() took it out of its scheduler
    arming: Arming = field(default_factory=Arming)
    # the last slot handled: completed here, or claimed by another instance (for overdue())
    last_ok_ms: int | None = None
    runs: dict[str, Run] = field(default_factory=dict)  # run_id -> run in progress here
    stored: bool = False  # the job of a stored schedule (``_storedjobs``), not of the code

    def __post_init__(self) -> None:
        self.is_async = is_async_handler(self.handler)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def halted(self) -> bool:
        """No slot of it runs now (paused or disabled)."""
        return self.paused or self.disabled

    def stops(self, slot_ms: int) -> str | None:
        """Why the fleet's controls stop the slot at ``slot_ms`` (``disabled``, ``paused``,
        ``skipped``: see ``JobControl.stops``), or ``None`` when they let it run."""
        if self.control is not None:
            return self.control.stops(slot_ms)
        return "disabled" if self.disabled else "paused" if self.paused else None

    @property
    def kind(self) -> Kind:
        return self.spec.kind

    @property
    def schedule(self) -> Trigger:
        return self.spec.schedule

    @property
    def settings(self) -> JobSettings:
        return self.spec.settings

    @property
    def options(self) -> JobOptions:
        return self.spec.options

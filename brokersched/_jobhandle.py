"""``Job``: a registered job as the application holds it (``scheduler.every()`` and friends
return it, ``scheduler.get(name)`` finds it): its schedule and options, its runs on this
instance, and the calls that change it, which go to the scheduler that registered it
(``JobOwner``). What the scheduler itself keeps of the job is its ``JobState`` (``_job``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from ._clock import Clock, ms_to_datetime
from ._fleet import Change
from ._fleetrecords import Asked, ControlAction, JobControl, asked, runs_ahead
from ._job import JobState
from ._options import JobOptions, JobSettings, Kind
from ._runner import JOB_DATA
from .abc import RunRecord
from .triggers.base import Trigger

__all__ = ["Job", "JobOwner", "state_of"]


class JobOwner(Protocol):
    """What a ``Job`` asks of the scheduler that registered it."""

    @property
    def clock(self) -> Clock: ...
    @property
    def enabled(self) -> bool: ...
    def control(self, job: JobState, action: ControlAction, by: str | None, extra: Asked) -> Change:
        """Pause, resume, disable, enable or skip the job for the whole fleet."""
        ...

    def update(self, job: JobState, options: dict[str, Any]) -> None:
        """Change the job's options (validated as at registration)."""
        ...

    async def trigger(self, job: JobState, data: Any) -> RunRecord | None:
        """Run the job now, through the claim."""
        ...

    async def history(self, job: JobState, limit: int) -> list[RunRecord]:
        """The job's recorded runs, newest first."""
        ...


def state_of(job: Job) -> JobState:
    """What the scheduler keeps of ``job``: for the rooms behind the façade, never for users."""
    return job._state


class Job:
    """A registered job, as the application sees it: its schedule and options, and its runs on
    this instance. ``scheduler.every()`` and friends return it; ``scheduler.get(name)`` finds it."""

    __slots__ = ("_owner", "_state")

    def __init__(self, owner: JobOwner, state: JobState) -> None:
        self._owner = owner
        self._state = state

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def key(self) -> str:
        """What claims, leases, fencing and history are kept under: the ``key`` option, or
        the name."""
        return self._state.settings.key

    @property
    def kind(self) -> Kind:
        return self._state.kind

    @property
    def schedule(self) -> Trigger:
        """The trigger: ``describe()``, ``next_runs()``."""
        return self._state.schedule

    @property
    def options(self) -> JobOptions:
        """The options as given (validated)."""
        return self._state.options

    @property
    def settings(self) -> JobSettings:
        """The options as resolved against the scheduler's defaults and the backend."""
        return self._state.settings

    @property
    def next_run(self) -> datetime | None:
        """When the next slot that runs falls (before jitter): after a pause ``until`` an
        instant, the first at or after it; slots ``skip()`` skips are passed over. ``None``
        when paused without an end, disabled, removed, done, or when the scheduler is not
        enabled."""
        state, arming = self._state, self._state.arming
        if arming.boot_ms is not None and not state.halted:  # its boot run comes first
            return ms_to_datetime(arming.boot_ms)
        if arming.armed_ms is not None and not state.stops(arming.armed_ms):
            return ms_to_datetime(arming.armed_ms)
        if state.removed or not (self._owner.enabled and state.spec.enabled):
            return None
        now = self._owner.clock.now_ms()
        ahead = runs_ahead(state.schedule.next_ms, state.control, 1, now)
        return ms_to_datetime(ahead[0]) if ahead else None

    def next_runs(self, n: int, after: datetime | None = None) -> list[datetime]:
        """The next ``n`` slots after ``after`` (default: now on the scheduler's clock)."""
        return self._state.schedule.next_runs(n, after or self._owner.clock.now())

    @property
    def is_running(self) -> bool:
        """Whether a run of this job is going on this instance."""
        return bool(self._state.runs)

    @property
    def enabled(self) -> bool:
        """``False`` when an override (``{"enabled": False}``) switched the job off here (it
        stays registered and runs on ``trigger()``, but no slot of it is armed), or
        ``disable()`` switched it off for the fleet (``disabled``). (Whether the whole
        scheduler schedules is ``scheduler.enabled``.)"""
        return self._state.spec.enabled and not self._state.disabled

    @property
    def overrides(self) -> dict[str, Any]:
        """The override applied to this job (``Scheduler(overrides=...)``, the environment or
        the CLI), as given; ``{}`` when none."""
        return dict(self._state.spec.overrides)

    @property
    def paused(self) -> bool:
        """Whether the job is paused: for the whole fleet (``pause()`` here or on any other
        instance, as last read from the backend), or here only on a backend that keeps no
        fleet records."""
        return self._state.paused

    @property
    def disabled(self) -> bool:
        """Whether ``disable()`` (here or on any instance) switched the job off."""
        return self._state.disabled

    @property
    def control(self) -> JobControl | None:
        """The job's fleet-wide control record as last read or written here: paused,
        disabled, and its ``changes`` (who did what when, newest last); ``None`` when never
        read (not started, or a backend that keeps no fleet records and no change here)."""
        return self._state.control

    def pause(
        self, *, until: datetime | None = None, note: str | None = None, by: str | None = None
    ) -> Change:
        """Pause the job for the whole fleet: no instance runs its slots (nor catch-up or
        take-over) until ``resume()``, or with ``until`` (an aware datetime in the future)
        until that instant: its slots before it are skipped, the first at or after it runs,
        on every instance, without anyone resuming it. A manual ``trigger()`` still runs.
        Applies here at once; other instances honour it before their next slot's claim.
        ``by`` names who paused it (default ``code@<instance_id>``) and ``note`` says why
        (free text, at most 500 characters), both kept in ``control.changes``. ``await`` the
        answer to know the change reached the backend. On a backend that keeps no fleet
        records (``backend.fleet`` is false) it pauses this instance only. A bad ``until`` or
        ``note`` raises ``ValueError`` and changes nothing."""
        return self._control("pause", by, note=note, until=until)

    def resume(self, *, note: str | None = None, by: str | None = None) -> Change:
        """Undo ``pause()`` for the whole fleet (the next slot whose jitter window is still
        open included)."""
        return self._control("resume", by, note=note)

    def disable(self, *, note: str | None = None, by: str | None = None) -> Change:
        """Switch the job off for the whole fleet: as ``pause()``, and ``trigger()`` is
        refused too, until ``enable()``."""
        return self._control("disable", by, note=note)

    def enable(self, *, note: str | None = None, by: str | None = None) -> Change:
        """Undo ``disable()`` for the whole fleet."""
        return self._control("enable", by, note=note)

    def skip(self, n: int = 1, *, note: str | None = None, by: str | None = None) -> Change:
        """Skip the job's next ``n`` slots (after now) on the whole fleet: each is skipped as
        ``paused`` (detail ``skipped``) wherever it falls due, and the slots after them run.
        A later ``skip()`` replaces a pending one (``skip(0)`` cancels it), so a change sent
        twice skips no more. ``n`` from 0 to 1000; a job with no slot left raises
        ``ValueError``, as does a bad ``n``, and nothing changes."""
        return self._control("skip", by, note=note, count=n)

    def _control(
        self,
        action: ControlAction,
        by: str | None,
        *,
        note: str | None,
        until: datetime | None = None,
        count: int | None = None,
    ) -> Change:
        extra = asked(action, now=self._owner.clock.now(), note=note, until=until, count=count)
        return self._owner.control(self._state, action, by, extra)

    def update(self, **options: Any) -> None:
        """Change options at run time (``job.update(jitter="5s", timeout="1m")``).

        The merged options are validated exactly as at registration, against the backend and the
        scheduler's defaults; on a ``ConfigurationError`` nothing changes. Runs in progress keep
        the options they started with.
        """
        self._owner.update(self._state, options)

    async def trigger(self, data: Any = JOB_DATA) -> RunRecord | None:
        """Run the job now, through the claim (``ctx.reason == "manual"``); ``data`` (JSON-like)
        is the run's ``ctx.data`` instead of the job's.

        Returns the run's record, or ``None`` when the claim was refused (another instance, an
        overlap), the job is disabled, or the backend failed.
        """
        return await self._owner.trigger(self._state, data)

    async def history(self, limit: int = 20) -> list[RunRecord]:
        """The job's recorded runs, newest first, at most ``limit``."""
        return await self._owner.history(self._state, limit)

    def describe(self) -> str:
        return self._state.schedule.describe()

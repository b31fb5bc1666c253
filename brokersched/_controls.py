"""The fleet's controls, as this instance applies and changes them: ``Job.pause()`` and friends
(applied here at once, written through the backend for the whole fleet), the admin API's
changes, the fleet's instances and runs in progress, and the abort of a run wherever it runs.
The fleet's presence itself (heartbeats, the reading of the control records) is ``_fleet``'s."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from datetime import datetime

from ._clock import Timer, datetime_to_ms
from ._fleet import Change, Fleet, run_in_progress
from ._fleetrecords import Asked, ControlAction, ControlChange, JobControl, RunInProgress
from ._host import Host
from ._job import JobState
from ._lifecycle import LifeCycle
from ._presence import without_ended_runs
from ._replace import replaced_by
from .abc import Instance
from .triggers.base import Trigger

__all__ = ["FleetControls", "control_change", "skip_through"]

logger = logging.getLogger("brokersched")

NOTHING_ASKED = Asked()  # a change that asks nothing beyond its action


def skip_through(schedule: Trigger, count: int, now_ms: int) -> int | None:
    """The last of the next ``count`` slots of ``schedule`` after ``now_ms`` (fewer when it
    ends first); ``None`` when it has none, or ``count`` is 0."""
    last: int | None = None
    after = now_ms
    for _ in range(count):
        slot = schedule.next_ms(after)
        if slot is None:
            break
        last = after = slot
    return last


def control_change(
    name: str,
    key: str,
    schedule: Trigger,
    action: ControlAction,
    actor: str,
    now: datetime,
    extra: Asked,
    run_id: str | None = None,
) -> ControlChange:
    """The change of job ``name`` (kept under ``key``) asked at ``now``, whoever writes it (an
    instance, the CLI): a skip's last slot found from the job's ``schedule``; ``ValueError``
    when it has none left."""
    through = None
    if action == "skip" and extra.count:
        through = skip_through(schedule, extra.count, datetime_to_ms(now))
        if through is None:
            raise ValueError(f"job {name!r} has no slot left to skip")
    return ControlChange(
        key,
        action,
        actor,
        now,
        run_id,
        note=extra.note,
        until=extra.until,
        count=extra.count,
        through_ms=through,
    )


class FleetControls:
    """The controls of ``host``'s jobs; ``life`` says whether the scheduler runs, and gives the
    runner and the fleet's presence of its current start; ``jobs`` the registered jobs, by
    name."""

    def __init__(
        self,
        host: Host,
        life: LifeCycle,
        jobs: Callable[[], dict[str, JobState]],
    ) -> None:
        self._host = host
        self._life = life
        self._jobs = jobs
        self._unsent: list[tuple[JobState, ControlChange]] = []  # changes before start()
        self._local_control_said = False
        # job name -> when its pause ends by itself, and the timer that ends it here
        self._pause_ends: dict[str, tuple[int, Timer]] = {}

    def apply(self, job: JobState, control: JobControl) -> None:
        """The fleet's control record of ``job`` (read, or written here) takes effect here. A
        pause until an instant ends here at that instant, as on every instance (no write)."""
        was = job.halted
        job.control = control
        now = self._host.clock.now()
        job.paused, job.disabled = control.paused_at(now), control.disabled
        self._end_pause_at(job, control.until if job.paused else None)
        timers = self._life.timers
        if job.halted and not was:
            timers.disarm(job)
        elif was and not job.halted:
            # A pause that ended at its instant lets the slot at that instant run, however late
            # this wakes (a wall clock's timer fires a little after its time).
            ended = control.until if control.paused else None
            timers.rearm(job, since_ms=datetime_to_ms(ended) if ended is not None else None)
        runner = self._life.runner
        if job.runs and runner is not None:
            now = self._host.clock.now()
            aborts, replaced = control.aborts(now), control.replaces(now)
            for run in list(job.runs.values()):
                if run.ctx.run_id in aborts:
                    runner.abort(run, "aborted")
                elif replaced is not None and replaced_by(run, replaced):
                    runner.abort(run, "replaced")  # a later slot waits for its lease

    def _end_pause_at(self, job: JobState, until: datetime | None) -> None:
        """Apply ``job``'s control again at ``until`` (its pause then ends), or never. The
        controls are read every heartbeat: a timer already set for that instant stays."""
        at_ms = datetime_to_ms(until) if until is not None else None
        kept = self._pause_ends.get(job.name)
        if kept is not None and kept[0] == at_ms:
            return
        if kept is not None:
            kept[1].cancel()
            del self._pause_ends[job.name]
        if at_ms is not None:

            def ended() -> None:
                self._pause_ends.pop(job.name, None)
                if job.control is not None and not job.removed:
                    self.apply(job, job.control)

            self._pause_ends[job.name] = (at_ms, self._host.clock.call_at(at_ms, ended))

    def change_of(
        self,
        job: JobState,
        action: ControlAction,
        actor: str,
        extra: Asked,
        run_id: str | None = None,
    ) -> ControlChange:
        """The change asked of ``job``, made now (``control_change``)."""
        return control_change(
            job.name, job.settings.key, job.schedule, action, actor, self._host.clock.now(),
            extra, run_id,
        )  # fmt: skip

    def control(
        self, job: JobState, action: ControlAction, by: str | None, extra: Asked = NOTHING_ASKED
    ) -> Change:
        """``Job.pause()`` and friends: applied here at once, and written through the backend
        for the whole fleet (at start, when the scheduler is not running)."""
        life, host = self._life, self._host
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # another thread (start_in_thread's caller): on the scheduler's loop
            loop = life.loop
            if loop is not None and life.running and not loop.is_closed():
                loop.call_soon_threadsafe(self.control, job, action, by, extra)
                return Change()
        actor = by or f"code@{host.instance_id}"
        change = self.change_of(job, action, actor, extra)
        self.apply(job, (job.control or JobControl(job.settings.key)).apply(change))
        fleet = life.fleet
        if not host.backend.fleet:
            if not self._local_control_said:
                self._local_control_said = True
                logger.warning(
                    "%s keeps no fleet records: %s of job %s applies to this instance only",
                    host.backend.name,
                    action,
                    job.name,
                )
            return Change()
        if fleet is None or not life.running:
            self._unsent.append((job, change))
            return Change()
        written = fleet.change(job, change)
        written.add_done_callback(functools.partial(self._written, job, action))
        return Change(written)

    async def send_unsent(self, fleet: Fleet) -> None:
        """Write the changes made before the start, in order, each once the last has landed."""
        for job, change in self._unsent:
            written = fleet.change(job, change)
            await asyncio.wait([written])
            self._written(job, change.action, written)
        self._unsent.clear()

    def _written(
        self, job: JobState, action: ControlAction, written: asyncio.Future[JobControl]
    ) -> None:
        if not written.cancelled() and (exc := written.exception()) is not None:
            logger.error(
                "could not %s job %s for the fleet through %s: %s; it applies to this "
                "instance only until the backend answers",
                action,
                job.name,
                self._host.backend.name,
                exc,
            )

    async def change(
        self,
        name: str,
        action: ControlAction,
        *,
        by: str,
        run_id: str | None = None,
        extra: Asked = NOTHING_ASKED,
    ) -> JobControl:
        """``Scheduler.change_control``."""
        job = self._jobs()[name]
        fleet = self._life.fleet
        if fleet is None or not self._life.running or not fleet.enabled:
            if not self._host.backend.fleet:
                raise RuntimeError(f"{self._host.backend.name} keeps no fleet records")
            raise RuntimeError("the scheduler is not running")
        runner = self._life.runner
        if action == "abort":
            for run in list(job.runs.values()):
                if run.ctx.run_id == run_id and runner is not None:
                    runner.abort(run, "aborted")  # here: at once
        return await fleet.change(job, self.change_of(job, action, by, extra, run_id))

    async def instances(self) -> list[Instance]:
        """``Scheduler.instances``: without the runs that are over (``without_ended_runs``)."""
        backend = self._host.backend
        if not backend.fleet:
            return []
        policies = {name: job.settings.policy for name, job in self._jobs().items()}
        found = await backend.instances()
        return await without_ended_runs(found, self._host.clock.now(), backend, policies)

    async def runs_in_progress(self) -> list[tuple[Instance, RunInProgress]]:
        """``Scheduler.runs_in_progress``."""
        here = self._life.fleet
        found: list[tuple[Instance, RunInProgress]] = []
        for instance in await self.instances():
            if here is not None and instance.id == self._host.instance_id and self._life.running:
                instance = here.presence()
            found += [(instance, run) for run in instance.running]
        found.sort(key=lambda pair: pair[1].started_at)
        return found

    async def abort(self, run_id: str, *, by: str | None = None) -> RunInProgress | None:
        """``Scheduler.abort``."""
        actor = by or f"code@{self._host.instance_id}"
        jobs = self._jobs()
        for state in jobs.values():
            here = state.runs.get(run_id)
            if here is None:
                continue
            if self._life.runner is not None:
                self._life.runner.abort(here, "aborted")
            if self._host.backend.fleet and self._life.running:  # kept in the job's audit trail
                await self.change(state.name, "abort", by=actor, run_id=run_id)
            return run_in_progress(here)
        for instance, run in await self.runs_in_progress():
            if run.run_id != run_id or instance.stopped:
                continue
            job = self._jobs().get(run.job)
            if job is None:
                raise KeyError(f"run {run_id} is a run of job {run.job!r}, unknown here")
            await self.change(job.name, "abort", by=actor, run_id=run_id)
            return run
        return None

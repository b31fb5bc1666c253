"""What the admin API shows of a job, a run and a scheduler, as JSON: nothing of a job's
``data`` (not even quoted by a handler's error), and no URL or error message that has not been
through ``redact``."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from .._clock import datetime_to_ms, ms_to_datetime
from .._durations import format_duration
from .._fleetrecords import runs_ahead
from .._json import iso
from .._json import record_json as shared_record_json
from .._redact import MASK, redact_text
from .._scheduler import Job, Scheduler
from .._timezones import timezone_name
from ..abc import Backend, Instance, JobControl, RunRecord
from ..triggers.cron import CronTrigger

__all__ = [
    "JobState",
    "backend_text",
    "control_json",
    "instance_json",
    "job_json",
    "job_state",
    "record_json",
    "timeline_slots",
]

JobState = Literal["armed", "paused", "running", "idle", "disabled"]
MAX_TIMELINE_SLOTS = 500


def backend_text(scheduler: Scheduler[Any]) -> str:
    backend: Backend = scheduler.backend
    if "__repr__" not in vars(type(backend)):  # no useful repr: the class name will do
        return f"{backend.name}()"
    return redact_text(repr(backend))


def control_json(control: JobControl, job: Job, now: datetime) -> dict[str, Any]:
    """``job``'s fleet-wide control record at ``now``: paused, disabled, until when, the slots
    a skip skips (and how many are left), and its changes, newest first."""
    return {
        **_control_state(control, job, now),
        "changes": [c.to_dict() for c in reversed(control.changes)],
    }


def _control_state(control: JobControl, job: Job, now: datetime) -> dict[str, Any]:
    paused, skip = control.paused_at(now), control.skip
    shown_skip = None
    if skip is not None:
        left = skip.left(job.schedule.next_ms, datetime_to_ms(now))
        shown_skip = {**asdict(skip), "left": left}
    return {
        "paused": paused,
        "disabled": control.disabled,
        "until": control.until.isoformat() if paused and control.until is not None else None,
        "note": control.note if paused or control.disabled else None,
        "skip": shown_skip,
    }


def instance_json(instance: Instance, now: datetime, here: str) -> dict[str, Any]:
    """An instance's presence and liveness (a dead instance's runs hold their leases until
    they expire and another instance takes the slots over)."""
    data = instance.to_dict(now)
    data["here"] = instance.id == here
    data["host"] = redact_text(instance.host)
    for run in data["running"]:
        run["held"] = run["leased"] and data["liveness"] == "dead"
    return data


def job_state(scheduler: Scheduler[Any], job: Job) -> JobState:
    """``running`` (a run is going on here), ``disabled`` (scheduling is switched off here, or
    the job is, for the fleet or here: it runs on trigger only, or not at all once disabled for
    the fleet), ``paused`` (for the fleet, or here on a backend that keeps no fleet records),
    ``armed`` (waiting for its next slot) or ``idle`` (the scheduler is not running, or the
    schedule has ended)."""
    if job.is_running:
        return "running"
    if not (scheduler.enabled and job.enabled):
        return "disabled"
    if job.paused:
        return "paused"
    return "armed" if scheduler.running and job.next_run is not None else "idle"


def _options(scheduler: Scheduler[Any], job: Job) -> dict[str, Any]:
    """The options that decide how a slot runs, resolved against the defaults; ``data`` only
    says that there is some."""
    settings = job.settings
    options: dict[str, Any] = {
        "jitter": format_duration(timedelta(milliseconds=settings.jitter_ms)),
        "max_late": format_duration(timedelta(milliseconds=settings.max_late_ms)),
        "timeout": format_duration(settings.timeout) if settings.timeout else None,
        "claim": settings.claim,
        "history_size": settings.policy.history_size,
    }
    if scheduler.backend.capabilities.leases:
        options["overlap"] = settings.policy.overlap
        options["max_attempts"] = settings.policy.max_attempts
        options["catch_up"] = format_duration(timedelta(milliseconds=settings.catch_up_ms))
    if settings.retry is not None:
        options["retry"] = repr(settings.retry)
    if settings.data is not None:
        options["data"] = MASK
    return options


def job_json(
    scheduler: Scheduler[Any], job: Job, last: RunRecord | None, *, runs: int = 5
) -> dict[str, Any]:
    schedule = job.schedule
    zone = schedule.timezone if isinstance(schedule, CronTrigger) else UTC
    return {
        "name": job.name,
        "kind": job.kind,
        "schedule": job.describe(),
        "zone": timezone_name(zone),
        "options": _options(scheduler, job),
        "state": job_state(scheduler, job),
        "next_runs": [iso(ms_to_datetime(ms)) for ms in _runs_ahead(scheduler, job, runs)],
        "last": record_json(last, job) if last is not None else None,
        "control": _latest_control(job, scheduler.clock.now()),
    }


def _runs_ahead(scheduler: Scheduler[Any], job: Job, count: int) -> list[int]:
    """The job's next slots that run, as the fleet's controls stand (``runs_ahead``)."""
    control = job.control
    if control is None and job.paused:  # paused here, on a backend without fleet records
        return []
    return runs_ahead(job.schedule.next_ms, control, count, scheduler.clock.now_ms())


def _latest_control(job: Job, now: datetime) -> dict[str, Any] | None:
    """The job's fleet-wide control as last read here, and its latest change."""
    control = job.control
    if control is None:
        return None
    latest = control.changes[-1].to_dict() if control.changes else None
    state = _control_state(control, job, now)
    halting = {"pause"} if state["paused"] else set()
    halting |= {"disable"} if control.disabled else set()
    halted_by = next((c for c in reversed(control.changes) if c.action in halting), None)
    return {**state, "latest": latest, "halted_by": halted_by.to_dict() if halted_by else None}


def record_json(record: RunRecord, job: Job | None) -> dict[str, Any]:
    """A run as the admin API shows it: the CLI's keys, ``duration_ms`` included."""
    return shared_record_json(record, job, duration=True)


def timeline_slots(job: Job, records: list[RunRecord], now_ms: int) -> list[int]:
    """The schedule's slots from the oldest record's to the last one that should have run by
    now (``max_late`` ago): the timeline shows those nobody ran as missed."""
    scheduled = [r.slot_ms for r in records if r.reason not in ("manual", "start")]
    if not scheduled:
        return []
    until = now_ms - job.settings.max_late_ms
    start = min(scheduled) - 1
    if (gap := job.schedule.min_gap()) is not None:  # old records: the latest slots only
        start = max(start, until - MAX_TIMELINE_SLOTS * (gap // timedelta(milliseconds=1)))
    slots: list[int] = []
    slot = job.schedule.next_ms(start)
    while slot is not None and slot <= until:
        slots.append(slot)
        slot = job.schedule.next_ms(slot)
    return slots[-MAX_TIMELINE_SLOTS:]

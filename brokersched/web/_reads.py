"""The admin API's reading routes: jobs, a job's history (filtered, paged), its timeline, one
run, the fleet overview, the session, health. Every backend read goes through the
``BackendWatch`` (bounded, shared, failing fast during an outage)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from datetime import timedelta
from typing import Any, get_args

from starlette.requests import Request

from .._clock import datetime_to_ms
from .._redact import redact_text
from .._scheduler import Job, Scheduler
from ..abc import FAILURES, ControlAction, RunRecord
from ._attempts import next_attempt
from ._failures import failure_groups
from ._params import HistoryParams, RunsParams, WindowParams, parse
from ._query import MAX_HISTORY, OUTCOMES, REASONS, Query, QueryError, cursor, cursor_of, window_ms
from ._reply import Reply, error
from ._schedules import SCHEDULE_ACTION
from ._security import Guard
from ._stream import EventHub
from ._timeline import Pauses, Window, timeline
from ._views import (
    backend_text,
    control_json,
    instance_json,
    job_json,
    job_state,
    record_json,
    timeline_slots,
)
from ._watch import BackendUnreachableError, BackendWatch

__all__ = ["MAX_NAME", "Reads", "shown_name"]

MAX_NAME = 128  # the longest job name (see check_name)
FEWEST_RECORDS = 20  # per job, read for the overview whatever its schedule
FAILURES_SHOWN = 50
NEXT_RUNS_SHOWN = 50
HOUR_MS = 3_600_000
#: Every change the API makes, by the name a per-action ``authorize`` is asked with.
CHANGES: tuple[str, ...] = ("trigger", *get_args(ControlAction), SCHEDULE_ACTION)

logger = logging.getLogger("brokersched.web")


def shown_name(name: str) -> str:
    """A name from the path, quoted; not echoed whole when no job could have it."""
    if len(name) <= MAX_NAME:
        return repr(name)
    return f"{name[:MAX_NAME]!r}... ({len(name)} characters; job names have at most {MAX_NAME})"


def _why(exc: Exception) -> str:
    if isinstance(exc, BackendUnreachableError):
        return str(exc)
    return redact_text(f"{type(exc).__name__}: {exc}")


class Reads:
    def __init__(
        self,
        scheduler: Scheduler[Any],
        guard: Guard,
        hub: EventHub,
        watch: BackendWatch,
        pauses: Pauses,
    ) -> None:
        self.scheduler = scheduler
        self.guard = guard
        self.hub = hub
        self.watch = watch
        self.pauses = pauses

    # -- helpers ---------------------------------------------------------------------------------

    def job_of(self, request: Request) -> Job | Reply:
        name = request.path_params["name"]
        job = self.scheduler.get(name)
        if job is None:
            known = ", ".join(j.name for j in self.scheduler.jobs()) or "none"
            return error(404, f"no job named {shown_name(name)} (jobs: {known})")
        return job

    async def records(self, job: Job, limit: int) -> list[RunRecord]:
        return await self.watch.read(("history", job.name, limit), lambda: job.history(limit))

    async def _records_or_error(self, job: Job, limit: int) -> tuple[list[RunRecord], str | None]:
        try:
            return await self.records(job, limit), None
        except Exception as exc:  # one job's history must not take the whole page down
            return [], _why(exc)

    def _unreadable(self, job: Job, exc: Exception) -> Reply:
        return error(
            503,
            f"cannot read the history of job {job.name!r}: {_why(exc)}",
            backend=self.watch.status(),
        )

    def _overlap_skips(self, job: Job) -> bool:
        return self.scheduler.backend.capabilities.leases and job.settings.policy.overlap == "skip"

    def _timeline(
        self, job: Job, records: list[RunRecord], window: Window, read_limit: int
    ) -> dict[str, Any]:
        return timeline(
            job,
            records,
            window=window,
            now_ms=self.scheduler.clock.now_ms(),
            here=self.scheduler.instance_id,
            skips=self.hub.skips(job.name),
            pauses=self.pauses,
            overlap_skips=self._overlap_skips(job),
            read_limit=read_limit,
        )

    def _window(self, request: Request) -> Window | Reply:
        try:
            span = window_ms(parse(WindowParams, request.query_params).window)
        except QueryError as exc:
            return error(400, str(exc))
        now = self.scheduler.clock.now_ms()
        return Window(now - span, now)

    def _about(self) -> dict[str, Any]:
        return {
            "instance_id": self.scheduler.instance_id,
            "backend": backend_text(self.scheduler),
            "backend_status": self.watch.status(),
            "running": self.scheduler.running,
            "changes_enabled": self.guard.configured,
            "now_ms": self.scheduler.clock.now_ms(),
        }

    # -- jobs ------------------------------------------------------------------------------------

    async def _job_json(self, job: Job, runs: int) -> dict[str, Any]:
        records, why = await self._records_or_error(job, 1)
        data = job_json(self.scheduler, job, records[0] if records else None, runs=runs)
        if why is not None:
            data["history_error"] = why
        return data

    async def jobs(self, request: Request) -> Reply:
        jobs = self.scheduler.jobs()
        listed = await asyncio.gather(*(self._job_json(job, 5) for job in jobs))
        return Reply({**self._about(), "jobs": listed})

    async def job(self, request: Request) -> Reply:
        job = self.job_of(request)
        if isinstance(job, Reply):
            return job
        return Reply(await self._job_json(job, 10))

    async def history(self, request: Request) -> Reply:
        job = self.job_of(request)
        if isinstance(job, Reply):
            return job
        try:
            params = parse(HistoryParams, request.query_params)
        except QueryError as exc:
            return error(400, str(exc))
        query = Query(
            limit=params.limit,
            outcomes=frozenset(params.outcome),
            reasons=frozenset(params.reason),
            instances=frozenset(params.instance),
            before=cursor(params.before),
        )
        # The first page unfiltered reads what it shows (and one more: is there a next page?);
        # filters and later pages look through every kept record, up to MAX_HISTORY.
        want = MAX_HISTORY if query.scans else query.limit + 1
        try:
            records = await self.records(job, want)
        except Exception as exc:
            return self._unreadable(job, exc)
        now_ms = self.scheduler.clock.now_ms()
        body: dict[str, Any] = {"job": job.name}
        if query.scans:
            page = query.page(records)
            shown, body["next"] = page.records, page.next
            body["matched"], body["scanned"] = page.matched, page.scanned
        else:
            shown = records[: query.limit]
            body["next"] = cursor_of(shown[-1]) if len(records) > query.limit else None
        body["records"] = [record_json(record, job) for record in shown]
        body["choices"] = {"outcome": list(OUTCOMES), "reason": list(REASONS)}
        body["slots"] = timeline_slots(job, shown, now_ms)
        body["now_ms"] = now_ms
        return Reply(body)

    async def job_timeline(self, request: Request) -> Reply:
        job = self.job_of(request)
        if isinstance(job, Reply):
            return job
        window = self._window(request)
        if isinstance(window, Reply):
            return window
        try:
            records = await self.records(job, MAX_HISTORY)
        except Exception as exc:
            return self._unreadable(job, exc)
        return Reply(self._timeline(job, records, window, MAX_HISTORY))

    async def run(self, request: Request) -> Reply:
        job = self.job_of(request)
        if isinstance(job, Reply):
            return job
        run_id = request.path_params["run_id"]
        try:
            records = await self.records(job, MAX_HISTORY)
        except Exception as exc:
            return self._unreadable(job, exc)
        found = next((i for i, r in enumerate(records) if r.run_id == run_id), None)
        if found is None:
            shown = repr(run_id[:64]) + ("..." if len(run_id) > 64 else "")
            return error(
                404,
                f"no run {shown} in the history of job {job.name!r} (its newest "
                f"{len(records)} records were searched; older ones are trimmed)",
            )
        record = records[found]
        family = _family(record)
        attempts = sorted(
            (r for r in records if r.slot_ms == record.slot_ms and _family(r) == family),
            key=lambda r: (r.attempt, r.started_at),
        )
        return Reply(
            {
                "job": job_json(self.scheduler, job, records[0], runs=3),
                "run": record_json(record, job),
                "attempts": [record_json(r, job) for r in attempts],
                "newer": records[found - 1].run_id if found > 0 else None,
                "older": records[found + 1].run_id if found + 1 < len(records) else None,
                "max_attempts": job.settings.policy.max_attempts
                if self.scheduler.backend.capabilities.leases
                else None,
                "next_attempt": next_attempt(
                    record,
                    [r for r in records if r.slot_ms == record.slot_ms],
                    job,
                    leases=self.scheduler.backend.capabilities.leases,
                    now_ms=self.scheduler.clock.now_ms(),
                ),
            }
        )

    # -- the fleet: presence, runs in progress, controls ---------------------------------------

    async def _presence(self) -> list[dict[str, Any]]:
        """The fleet's instances as they published themselves (``[]`` on a backend that keeps
        no fleet records), with their liveness now; this one first."""
        scheduler = self.scheduler
        if not scheduler.backend.fleet:
            return []
        found = await self.watch.read(("instances",), scheduler.instances)
        now, here = scheduler.clock.now(), scheduler.instance_id
        listed = [instance_json(instance, now, here) for instance in found]
        listed.sort(
            key=lambda entry: (not entry["here"], entry["liveness"] != "alive", entry["id"])
        )
        return listed

    async def instances(self, request: Request) -> Reply:
        """``GET /instances``: every instance of the fleet that published itself in the last
        10 minutes, with its liveness (alive, late, dead, stopped) and runs in progress."""
        try:
            listed = await self._presence()
        except Exception as exc:
            return error(503, f"cannot read the fleet's presence: {_why(exc)}")
        return Reply(
            {
                "supported": self.scheduler.backend.fleet,
                "now_ms": self.scheduler.clock.now_ms(),
                "instances": listed,
            }
        )

    async def runs(self, request: Request) -> Reply:
        """``GET /runs?state=running``: the runs in progress anywhere in the fleet, oldest
        first, each with its instance and that instance's liveness (a dead instance's leased
        run is ``held``: its lease keeps the slot until it expires)."""
        try:
            parse(RunsParams, request.query_params)
        except QueryError as exc:
            return error(400, str(exc))
        try:
            listed = await self._presence()
        except Exception as exc:
            return error(503, f"cannot read the fleet's presence: {_why(exc)}")
        runs = [
            {
                **run,
                "instance_id": entry["id"],
                "host": entry["host"],
                "liveness": entry["liveness"],
            }
            for entry in listed
            for run in entry["running"]
        ]
        runs.sort(key=lambda run: run["started_at"])
        return Reply(
            {
                "supported": self.scheduler.backend.fleet,
                "now_ms": self.scheduler.clock.now_ms(),
                "runs": runs,
            }
        )

    async def audit(self, request: Request) -> Reply:
        """``GET /jobs/{name}/audit``: the job's fleet-wide control and who changed it when,
        newest first, read from the backend."""
        job = self.job_of(request)
        if isinstance(job, Reply):
            return job
        backend = self.scheduler.backend
        if not backend.fleet:
            control = job.control
        else:
            try:
                controls = await self.watch.read(("controls",), backend.controls)
            except Exception as exc:
                return error(503, f"cannot read the controls of job {job.name!r}: {_why(exc)}")
            control = controls.get(job.key)
        return Reply(
            {
                "job": job.name,
                "scope": "fleet" if backend.fleet else "instance",
                "control": (
                    control_json(control, job, self.scheduler.clock.now())
                    if control is not None
                    else None
                ),
            }
        )

    # -- the fleet overview ----------------------------------------------------------------------

    async def overview(self, request: Request) -> Reply:
        window = self._window(request)
        if isinstance(window, Reply):
            return window
        jobs = self.scheduler.jobs()
        span = window.to_ms - window.from_ms
        limits = [_records_for(job, max(span, HOUR_MS)) for job in jobs]
        reads = await asyncio.gather(
            *(self._records_or_error(j, n) for j, n in zip(jobs, limits, strict=True))
        )
        now = self.scheduler.clock.now_ms()
        hour = now - HOUR_MS
        listed: list[dict[str, Any]] = []
        failures: list[tuple[RunRecord, Job]] = []
        complete = True
        unread: dict[str, str] = {}  # job: why its history could not be read
        for job, limit, (records, why) in zip(jobs, limits, reads, strict=True):
            data = job_json(self.scheduler, job, records[0] if records else None, runs=3)
            if why is not None:
                data["history_error"] = unread[job.name] = why
            data["timeline"] = self._timeline(job, records, window, limit)
            in_window = [r for r in records if window.holds(r.slot_ms)]
            data["counts"] = dict(Counter(r.outcome for r in in_window))
            listed.append(data)
            failures += [(r, job) for r in records if r.outcome in FAILURES and _ended(r) >= hour]
            if len(records) >= limit and _ended(records[-1]) >= hour:
                complete = False  # older runs of the hour were not read
        failures.sort(key=lambda pair: _ended(pair[0]), reverse=True)
        failed: dict[str, Any] = {
            "since_ms": hour,
            "count": len(failures),
            "complete": complete and not unread,
            "unread": sorted(unread),
            "runs": [record_json(r, job) for r, job in failures[:FAILURES_SHOWN]],
            "groups": failure_groups(failures),
        }
        if unread:  # the count is of the histories read: none, or some of them
            which = (
                "no job's history could be read"
                if len(unread) == len(jobs)
                else f"the history of {', '.join(sorted(unread))} could not be read"
            )
            failed["error"] = f"{which}: {next(iter(unread.values()))}"
        return Reply(
            {
                **self._about(),
                "window": {"from_ms": window.from_ms, "to_ms": window.to_ms},
                "jobs": listed,
                "failures": failed,
                "next_runs": self._next_runs(jobs),
                "instances": self._instances([r for records, _ in reads for r in records], window),
                **await self._fleet_or_error(),
            }
        )

    async def _fleet_or_error(self) -> dict[str, Any]:
        """The overview's ``fleet``: presence and runs in progress (or why not)."""
        try:
            listed = await self._presence()
        except Exception as exc:
            return {"fleet": {"supported": True, "error": _why(exc), "instances": [], "runs": []}}
        runs = [
            {**run, "instance_id": entry["id"], "liveness": entry["liveness"]}
            for entry in listed
            for run in entry["running"]
        ]
        runs.sort(key=lambda run: run["started_at"])
        supported = self.scheduler.backend.fleet
        return {"fleet": {"supported": supported, "instances": listed, "runs": runs}}

    def _next_runs(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Each armed job's next slot, soonest first."""
        upcoming = [
            (when, job.name)
            for job in jobs
            if job_state(self.scheduler, job) in ("armed", "running")
            for when in job.next_runs(1)
        ]
        upcoming.sort()
        return [
            {"job": name, "at_ms": datetime_to_ms(when)}
            for when, name in upcoming[:NEXT_RUNS_SHOWN]
        ]

    def _instances(self, records: list[RunRecord], window: Window) -> list[dict[str, Any]]:
        """The instances seen in the runs read (the fleet's presence, where the backend keeps
        it, is ``GET /instances``); this one first."""
        here = self.scheduler.instance_id
        seen: dict[str, dict[str, Any]] = {}
        for record in records:
            entry = seen.setdefault(
                record.instance_id,
                {"instance_id": record.instance_id, "last_run_ms": 0, "runs": 0, "failures": 0},
            )
            entry["last_run_ms"] = max(entry["last_run_ms"], _ended(record))
            if window.holds(record.slot_ms):
                entry["runs"] += 1
                entry["failures"] += record.outcome in FAILURES
        mine = seen.pop(here, {"instance_id": here, "last_run_ms": None, "runs": 0, "failures": 0})
        others = sorted(seen.values(), key=lambda entry: -entry["last_run_ms"])
        return [{**mine, "here": True}, *({**entry, "here": False} for entry in others)]

    # -- session, health -------------------------------------------------------------------------

    async def session(self, request: Request) -> Reply:
        try:
            body = await self.guard.session(request, CHANGES)
        except Exception:  # the host application's check failed: not authorised, and logged
            logger.exception("the host application's authorize() failed")
            body = {
                "changes_enabled": self.guard.configured,
                "token_accepted": self.guard.token_set,
                "authorized": False,
                "via": None,
                "can_read": not self.guard.reads_protected,
                "reads_protected": self.guard.reads_protected,
                "actions": [],
            }
        if not body["can_read"]:  # what it runs on is for those who may read
            return Reply(body)
        return Reply(
            {
                **body,
                "instance_id": self.scheduler.instance_id,
                "backend": backend_text(self.scheduler),
            }
        )

    async def health(self, request: Request) -> Reply:
        now_ms = self.scheduler.clock.now_ms()
        if not self.scheduler.running:
            return Reply({"status": "stopped", "overdue": [], "now_ms": now_ms}, 503)
        await self.watch.probe()
        overdue = [
            {"job": job.name, "schedule": job.describe(), "state": job_state(self.scheduler, job)}
            for job in self.scheduler.overdue()
        ]
        backend = self.watch.status()
        status = "ok"
        if backend["reachable"] is False:
            status = "unreachable"
        elif overdue:
            status = "degraded"
        body: dict[str, Any] = {"status": status, "overdue": [], "now_ms": now_ms}
        if await self.guard.may_read(request):  # else a probe learns the status, nothing more
            body.update(instance_id=self.scheduler.instance_id, backend=backend, overdue=overdue)
        return Reply(
            body,
            503 if status == "unreachable" else 200,
        )


def _presence_order(entry: dict[str, Any]) -> tuple[bool, bool, str]:
    """This instance first, then the live ones, by id."""
    return (not entry["here"], entry["liveness"] != "alive", entry["id"])


def _records_for(job: Job, span_ms: int) -> int:
    """How many of a job's records the overview reads: enough for ``span_ms`` of its schedule
    (and a few more: retries, manual runs), within 20 and ``MAX_HISTORY``."""
    gap = job.schedule.min_gap()
    if gap is None:
        return FEWEST_RECORDS
    gap_ms = max(1, gap // timedelta(milliseconds=1))
    return max(FEWEST_RECORDS, min(MAX_HISTORY, -(-span_ms // gap_ms) * 11 // 10 + 10))


def _family(record: RunRecord) -> str:
    """Runs of one slot that are attempts of each other: a slot of the schedule (its catch-up,
    its retries), a manual run, a boot run."""
    return record.reason if record.reason in ("manual", "start") else "slot"


def _ended(record: RunRecord) -> int:
    return datetime_to_ms(record.finished_at or record.started_at)

"""The commands that read the application: ``jobs``, ``next`` and ``check``; of the backend,
only ``jobs`` reads the fleet's controls of the jobs (paused, disabled), without starting it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

import click
from rich import box
from rich.table import Table

from .._clock import ms_to_datetime
from .._durations import format_duration, parse_duration
from .._exceptions import ConfigurationError
from .._fleetrecords import JobControl, runs_ahead
from .._json import iso
from .._logging import configure_logging
from .._redact import MASK, redact_text
from .._registry import collect_errors, past_at
from .._scheduler import Job, Scheduler
from .._timezones import parse_timezone, timezone_name
from ..abc import Backend
from ..triggers.base import Trigger
from ..triggers.cron import DST_POLICIES, CronTrigger, DstPolicy, parse_cron
from ..triggers.interval import IntervalTrigger
from ..triggers.spec import trigger_spec
from ._app import AppConfigurationError, CLIError, fail, load_app, override_option
from ._group import EPILOG, cli
from ._output import WIDE, clock_time, local_time, make_console, shown_backend, utc_time

__all__ = ["check", "jobs", "next_"]


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option("-n", "count", type=click.IntRange(0, 100), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job and line.")
@override_option
def jobs(app: str, count: int, as_json: bool, overrides: tuple[str, ...]) -> None:
    """List the jobs, their keys, schedules, non-default options, overrides, their state
    (enabled, or paused or disabled for the fleet: read from the backend, which is not
    started and in which nothing is made; "enabled?" when it cannot be read that way), and
    their next runs."""
    scheduler = load_app(app, overrides)
    fleet = _fleet_controls(scheduler)
    if as_json:
        for job in scheduler.jobs():
            row = _job_json(scheduler, job, count, fleet)
            click.echo(json.dumps(row, separators=(",", ":")))
        return
    title = f"{app} on {shown_backend(scheduler)}"
    if not scheduler.enabled:
        title += " (scheduling disabled: jobs run on trigger only)"
    if fleet.unread is not None:
        title += f" (fleet-wide pauses not read: {redact_text(fleet.unread)})"
    console = make_console()
    if console.width < WIDE:
        console.print(_narrow_jobs(scheduler, title, count, fleet))
        return
    table = Table(title=title, title_justify="left")
    columns = ("name", "key", "kind", "schedule", "zone", "options", "overrides", "state")
    for column in (*columns, f"next {count} runs"):
        table.add_column(column, overflow="fold")
    for job in scheduler.jobs():
        zone = _zone(job.schedule)
        state = fleet.shown_state(scheduler, job)
        upcoming = fleet.upcoming(scheduler, job, count)
        runs = "\n".join(local_time(when, zone) for when in upcoming) or "-"
        table.add_row(
            job.name,
            job.key,
            job.kind,
            job.describe(),
            timezone_name(zone),
            redact_text(_options(job)),  # data may hold a URL with its password
            redact_text(_shown_overrides(job)),
            state,
            runs,
        )
    console.print(table)


#: How long ``jobs`` waits for the fleet's controls before it lists the jobs without them.
_CONTROLS_WAIT_S = 5.0
#: The states whose next runs are listed: enabled, or so as far as the application says.
_RUNNING = ("enabled", "enabled?")


@dataclass(frozen=True, slots=True)
class _FleetControls:
    """The fleet-wide controls of the application's jobs, by key, as the backend keeps them
    (``Job.pause()``, ``disable()``, the admin API); ``unread``: why they could not be read
    (then a job's state is the application's alone)."""

    by_key: dict[str, JobControl]
    unread: str | None = None

    def state(self, scheduler: Scheduler[Any], job: Job) -> str:
        """``disabled`` (here: scheduling off, or an override; or for the fleet),
        ``paused`` (for the fleet), ``enabled``; ``enabled?`` when the application enables
        it but the fleet's controls could not be read."""
        control = self.by_key.get(job.key)
        if not (scheduler.enabled and job.enabled) or (control is not None and control.disabled):
            return "disabled"
        if control is not None and control.paused_at(scheduler.clock.now()):
            return "paused"
        return "enabled" if self.unread is None else "enabled?"

    def shown_state(self, scheduler: Scheduler[Any], job: Job) -> str:
        """``state``, with until when a pause lasts and how many slots a skip skips."""
        state, control = self.state(scheduler, job), self.by_key.get(job.key)
        if control is None:
            return state
        if state == "paused" and control.until is not None:
            return f"paused until {utc_time(control.until)}"
        skip = control.skip
        left = skip.left(job.schedule.next_ms, scheduler.clock.now_ms()) if skip else 0
        if state in _RUNNING and left:
            return f"{state}, skips {left} slot{'s' if left > 1 else ''}"
        return state

    def upcoming(self, scheduler: Scheduler[Any], job: Job, count: int) -> list[datetime]:
        """The next ``count`` slots that run (``runs_ahead``); none while the application
        does not schedule the job."""
        if self.state(scheduler, job) == "disabled":
            return []
        control = self.by_key.get(job.key)
        slots = runs_ahead(job.schedule.next_ms, control, count, scheduler.clock.now_ms())
        return [ms_to_datetime(slot) for slot in slots]


def _fleet_controls(scheduler: Scheduler[Any]) -> _FleetControls:
    """The fleet's controls, read without starting the backend (``Backend.read_controls``:
    nothing is made); none on a backend that keeps no fleet records (a pause there is one
    instance's, which no other process can see)."""
    backend: Backend = scheduler.backend
    if not backend.fleet:
        return _FleetControls({})

    async def read() -> dict[str, JobControl]:
        async with asyncio.timeout(_CONTROLS_WAIT_S):
            return await backend.read_controls()

    try:
        return _FleetControls(asyncio.run(read()))
    except NotImplementedError:
        return _FleetControls({}, f"{backend.name} cannot read them without being started")
    except TimeoutError:
        return _FleetControls({}, f"{backend.name} did not answer within {_CONTROLS_WAIT_S:g}s")
    except Exception as exc:  # unreachable, a missing extra: the jobs are still worth listing
        return _FleetControls({}, str(exc) or type(exc).__name__)


def _narrow_jobs(scheduler: Scheduler[Any], title: str, count: int, fleet: _FleetControls) -> Table:
    """The jobs in four columns: the key under the name when it differs, the zone in the
    schedule, the overrides with the options, the state ("paused", "disabled") instead of
    the next runs (under them when the fleet's controls could not be read)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("name", overflow="fold", ratio=2)
    table.add_column("schedule", overflow="fold", ratio=3)
    table.add_column("options", overflow="fold", ratio=3)
    table.add_column(f"next {count} runs", no_wrap=True)
    for job in scheduler.jobs():
        zone = _zone(job.schedule)
        name = job.name if job.key == job.name else f"{job.name}\n(key {job.key})"
        schedule = job.describe()
        if timezone_name(zone) not in schedule and zone is not UTC:
            schedule += f"\n{timezone_name(zone)}"
        options = _options(job)
        if job.overrides:
            overridden = [f"override {line}" for line in _shown_overrides(job).splitlines()]
            options = "\n".join(([] if options == "-" else [options]) + overridden)
        state = fleet.state(scheduler, job)
        upcoming = fleet.upcoming(scheduler, job, count)
        runs = "\n".join(local_time(when, zone) for when in upcoming) or "-"
        if state != "enabled":
            runs = f"{fleet.shown_state(scheduler, job)}\n{runs}" if upcoming else state
        elif (shown := fleet.shown_state(scheduler, job)) != state:
            runs = f"{shown}\n{runs}"
        table.add_row(name, schedule, redact_text(options), runs)
    return table


def _job_json(
    scheduler: Scheduler[Any], job: Job, count: int, fleet: _FleetControls
) -> dict[str, Any]:
    """A job as ``jobs --json`` prints it; every key always there. ``data`` is only said to be
    there (``"***"``), as in the admin API. ``enabled`` and ``next_runs`` are the
    application's; ``state`` adds the fleet's controls (``enabled``, ``paused``,
    ``disabled``), read when ``controls_read``; ``control`` is the job's control record as
    the backend keeps it (a pause's end, a pending skip, who changed what), or null.
    ``trigger`` (the schedule as data, ``triggers.spec``) and ``claim`` are what
    ``brokersched plan`` reads back from a saved listing."""
    zone = _zone(job.schedule)
    enabled = job.enabled and scheduler.enabled
    options: dict[str, Any] = {}
    for name in sorted(job.options.model_fields_set - {"timezone", "offset", "key"}):
        value = getattr(job.options, name)
        if name == "data":
            value = MASK
        elif isinstance(value, timedelta):
            value = format_duration(value)
        elif isinstance(value, datetime):
            value = iso(value)
        elif not isinstance(value, str | int | float | bool | None):
            value = str(value)
        options[name] = value
    overrides = {
        name: value if isinstance(value, str | int | float | bool | None) else str(value)
        for name, value in job.overrides.items()
    }
    return {
        "name": job.name,
        "key": job.key,
        "kind": job.kind,
        "schedule": job.describe(),
        "zone": timezone_name(zone),
        "options": json.loads(redact_text(json.dumps(options))),
        "overrides": json.loads(redact_text(json.dumps(overrides, default=str))),
        "enabled": enabled,
        "next_runs": [iso(when) for when in job.next_runs(count)] if enabled else [],
        "state": fleet.state(scheduler, job).removesuffix("?"),
        "controls_read": fleet.unread is None,
        "control": control.to_dict() if (control := fleet.by_key.get(job.key)) else None,
        "trigger": trigger_spec(job.schedule),
        "claim": job.settings.claim,
    }


def _shown_overrides(job: Job) -> str:
    shown = [f"{name}={json.dumps(value, default=str)}" for name, value in job.overrides.items()]
    return "\n".join(shown) or "-"


def _zone(trigger: Trigger) -> tzinfo:
    return trigger.timezone if isinstance(trigger, CronTrigger) else UTC


def _options(job: Job) -> str:
    """The options given at registration, except those the schedule column already shows."""
    shown: list[str] = []
    for name in sorted(job.options.model_fields_set - {"timezone", "offset", "key"}):
        value = getattr(job.options, name)
        if isinstance(value, timedelta):
            text = format_duration(value)
        elif name == "data":
            text = json.dumps(value, separators=(",", ":"))
        else:
            text = str(value)
        shown.append(f"{name}={text}")
    return "\n".join(shown) or "-"


@cli.command("next", epilog=EPILOG)
@click.argument("expression", required=False)
@click.option("--timezone", "-z", "zone_name", default="UTC", show_default=True)
@click.option("-n", "count", type=click.IntRange(1, 1000), default=5, show_default=True)
@click.option("--after", help="ISO 8601 instant to start from (default: now); naive = --timezone.")
@click.option("--every", help="Preview an interval instead of a cron expression, e.g. 6h.")
@click.option("--offset", help="With --every: shift the grid, e.g. 1m.")
@click.option(
    "--dst",
    type=click.Choice(DST_POLICIES),
    help="The cron job's daylight-saving policy for a local time the switch skips or repeats "
    "(the job option dst=); default run-once.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run and line.")
def next_(
    expression: str | None,
    zone_name: str,
    count: int,
    after: str | None,
    every: str | None,
    offset: str | None,
    dst: DstPolicy | None,
    as_json: bool,
) -> None:
    """Preview a schedule: a cron EXPRESSION in --timezone, or --every INTERVAL. A cron
    expression's daylight-saving rule is shown: its --dst policy, or "real time" when its
    minute or hour field starts with '*'."""
    try:
        zone = parse_timezone(zone_name)
        trigger = _preview_trigger(expression, zone, every, offset, dst)
        start = _parse_after(after, zone)
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None
    rule = {"dst": trigger.dst_rule} if isinstance(trigger, CronTrigger) else {}
    if as_json:
        for number, when in enumerate(trigger.next_runs(count, start), 1):
            local = when.astimezone(zone)
            row = {
                "n": number,
                "local": local.isoformat(timespec="milliseconds"),
                "zone": timezone_name(zone),
                "utc_offset": _offset(local),
                "utc": iso(when),
                **rule,
            }
            click.echo(json.dumps(row, separators=(",", ":")))
        return
    title = trigger.describe()
    if isinstance(trigger, CronTrigger) and trigger.dst is None:  # else describe() shows it
        title += f"; daylight saving: {trigger.dst_rule}"
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column(f"local ({timezone_name(zone)})")
    table.add_column("UTC offset")
    table.add_column("UTC")
    for number, when in enumerate(trigger.next_runs(count, start), 1):
        local = when.astimezone(zone)
        table.add_row(
            str(number), f"{local:%a} {clock_time(local)}", _offset(local), utc_time(when)
        )
    make_console().print(table)


def _preview_trigger(
    expression: str | None,
    zone: tzinfo,
    every: str | None,
    offset: str | None,
    dst: DstPolicy | None,
) -> Trigger:
    if every is not None:
        if expression is not None:
            raise CLIError("give a cron EXPRESSION or --every, not both")
        if dst is not None:
            raise CLIError("--dst goes with a cron EXPRESSION")
        period = parse_duration(every, name="--every")
        shift = parse_duration(offset, name="--offset") if offset is not None else timedelta(0)
        return IntervalTrigger(period, shift)
    if expression is None:
        raise CLIError("give a cron EXPRESSION (e.g. '0 8 * * MON-FRI') or --every INTERVAL")
    if offset is not None:
        raise CLIError("--offset goes with --every")
    return parse_cron(expression, zone, dst=dst)


def _parse_after(after: str | None, zone: tzinfo) -> datetime | None:
    if after is None:
        return None
    try:
        value = datetime.fromisoformat(after)
    except ValueError:
        raise CLIError(f"--after {after!r} is not an ISO 8601 time (2027-01-15T08:00)") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=zone)


def _offset(local: datetime) -> str:
    delta = local.utcoffset() or timedelta(0)
    sign = "-" if delta < timedelta(0) else "+"
    minutes = abs(int(delta.total_seconds())) // 60
    return f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@override_option
def check(app: str, overrides: tuple[str, ...]) -> None:
    """Report every configuration error of the application's jobs and overrides (no
    connection)."""
    # What registration logs (a past at()) is printed below as a warning, with the others.
    configure_logging("text", "ERROR", quiet_clients=True)
    try:
        with collect_errors() as collected:
            scheduler = load_app(app, overrides, collect=True)
    except AppConfigurationError as exc:
        for error in [*collected, *exc.error.all_errors]:
            click.echo(redact_text(f"error: {error}"), err=True)
        if exc.error.job is None:  # a backend's or the scheduler's own options, not a job
            fail(f"{app} could not be loaded, so its jobs were not checked; fix it and check again")
        fail(
            "registration stopped at this job, so the jobs after it were not checked; "
            "fix it and run check again"
        )
    errors = scheduler.check()
    for error in errors:
        click.echo(redact_text(f"error: {error}"), err=True)
    if errors:
        fail(f"{len(errors)} configuration error{'s' if len(errors) > 1 else ''}")
    for warning in _warnings(scheduler):
        click.echo(redact_text(f"warning: {warning}"), err=True)
    count = len(scheduler.jobs())
    if count == 0:
        click.echo(f"warning: {app} registers no jobs", err=True)
    click.echo(f"{count} job{'' if count == 1 else 's'} OK")


def _warnings(scheduler: Scheduler[Any]) -> list[str]:
    """What will not work as the application may think, though it is no error: an ``at()``
    job whose instant passed more than ``max_late`` ago never runs."""
    now_ms = scheduler.clock.now_ms()
    return [text for job in scheduler.jobs() if (text := past_at(job, now_ms)) is not None]

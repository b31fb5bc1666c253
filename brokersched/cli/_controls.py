"""The commands that change a job's fleet-wide control beside a running fleet: ``pause``
(``--until``/``--for``), ``resume``, ``disable``, ``enable`` and ``skip``, each with who
(``--by``) and why (``--note``). They write the job's control record through the backend, as
``Job.pause()`` does, without starting a scheduler: every instance honours the change before
its next slot's claim, within a heartbeat."""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from .._clock import ms_to_datetime
from .._controls import control_change
from .._durations import parse_duration
from .._exceptions import ConfigurationError
from .._fleetrecords import ControlAction, ControlChange, JobControl, asked
from .._scheduler import Job, Scheduler
from ..abc import Backend
from ._app import (
    CLIError,
    find_job,
    load_app,
    override_option,
    parse_instant,
    parse_zone,
    run_async,
)
from ._group import EPILOG, cli
from ._output import shown_backend, utc_time

__all__ = ["cli_actor", "disable_job", "enable_job", "pause_job", "resume_job", "skip_job"]

# What a change did, by its action.
_DONE = {
    "pause": "paused",
    "resume": "resumed",
    "disable": "disabled",
    "enable": "enabled",
    "skip": "skipped",
}


def cli_actor() -> str:
    """Who changes it, unless ``--by`` says: the user and host running the command."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


def _common(function: Callable[..., None]) -> Callable[..., None]:
    """APP JOB, --note, --by, --json and --override."""
    for decorator in reversed(
        (
            click.argument("app", metavar="APP"),
            click.argument("job_name", metavar="JOB"),
            click.option("--note", help="Why (kept with who and when in the job's audit trail)."),
            click.option("--by", "actor", help="Who, in the audit trail [default: cli:USER@HOST]."),
            click.option("--json", "as_json", is_flag=True, help="The control record as JSON."),
            override_option,
        )
    ):
        function = decorator(function)
    return function


@cli.command("pause", epilog=EPILOG)
@_common
@click.option("--until", "until_text", help="ISO 8601 instant the pause ends by itself at.")
@click.option("--for", "for_text", metavar="DURATION", help="The pause ends after this (2h).")
@click.option("--timezone", "-z", "zone_name", default="UTC", show_default=True)
def pause_job(
    app: str,
    job_name: str,
    note: str | None,
    actor: str | None,
    as_json: bool,
    overrides: tuple[str, ...],
    until_text: str | None,
    for_text: str | None,
    zone_name: str,
) -> None:
    """Pause JOB for the whole fleet: no instance runs its slots until `resume`, or, with
    --until or --for, until that instant (its slots before it are skipped, the first at or
    after it runs, on every instance, with nothing more to do)."""
    until = _until(until_text, for_text, zone_name)
    _change(app, job_name, "pause", overrides, note, actor, as_json, until=until)


def _plain(action: ControlAction, summary: str) -> click.Command:
    """The command of a change that takes nothing but who and why."""

    def command(
        app: str,
        job_name: str,
        note: str | None,
        actor: str | None,
        as_json: bool,
        overrides: tuple[str, ...],
    ) -> None:
        _change(app, job_name, action, overrides, note, actor, as_json)

    command.__doc__ = summary
    return cli.command(action, epilog=EPILOG)(_common(command))


resume_job = _plain("resume", "Resume JOB for the whole fleet (its next slot runs).")
disable_job = _plain(
    "disable", "Disable JOB for the whole fleet: as a pause, and manual runs are refused too."
)
enable_job = _plain("enable", "Enable JOB again for the whole fleet.")


@cli.command("skip", epilog=EPILOG)
@_common
@click.argument("count", metavar="[N]", type=int, default=1, required=False)
def skip_job(
    app: str,
    job_name: str,
    note: str | None,
    actor: str | None,
    as_json: bool,
    overrides: tuple[str, ...],
    count: int,
) -> None:
    """Skip JOB's next N slots (1 by default; 0 cancels a pending skip) on the whole fleet:
    each is skipped wherever it falls due, the slots after them run; a later skip replaces a
    pending one."""
    _change(app, job_name, "skip", overrides, note, actor, as_json, count=count)


def _until(until_text: str | None, for_text: str | None, zone_name: str) -> datetime | None:
    if until_text is not None and for_text is not None:
        raise CLIError("give --until or --for, not both")
    if until_text is not None:
        return parse_instant("--until", until_text, parse_zone(zone_name))
    if for_text is not None:
        try:
            return datetime.now(UTC) + parse_duration(for_text, name="--for")
        except ConfigurationError as exc:
            raise CLIError(str(exc)) from None
    return None


def _change(
    app: str,
    job_name: str,
    action: ControlAction,
    overrides: tuple[str, ...],
    note: str | None,
    actor: str | None,
    as_json: bool,
    *,
    until: datetime | None = None,
    count: int | None = None,
) -> None:
    scheduler = load_app(app, overrides)
    job = find_job(scheduler, job_name, app)
    if not scheduler.backend.fleet:
        raise CLIError(
            f"{shown_backend(scheduler)} keeps no fleet records: a {action} from here would"
            f" reach no instance (call Job.{action}() in the application instead)"
        )
    now = scheduler.clock.now()
    try:
        extra = asked(action, now=now, note=note, until=until, count=count)
        change = control_change(
            job.name, job.key, job.schedule, action, actor or cli_actor(), now, extra
        )
    except ValueError as exc:
        raise CLIError(f"cannot {action} job '{job.name}': {exc}") from None
    control = run_async(_write(scheduler, change))
    if as_json:
        click.echo(json.dumps(control.to_dict(), separators=(",", ":")))
        return
    click.echo(_said(job, change, control, scheduler.clock.now()))


async def _write(scheduler: Scheduler[Any], change: ControlChange) -> JobControl:
    backend: Backend = scheduler.backend
    await backend.start(scheduler.clock)
    try:
        return await backend.change_control(change)
    finally:
        await backend.stop()


def _said(job: Job, change: ControlChange, control: JobControl, now: datetime) -> str:
    """What the change did, in one line."""
    said = f"{_DONE[change.action]} job '{job.name}' for the fleet"
    if change.action == "pause" and change.until is not None:
        said += f" until {utc_time(change.until)}"
    if change.action == "skip":
        window = control.skip
        if window is None:
            said = f"no slot of job '{job.name}' is skipped any more"
        else:
            first = job.schedule.next_ms(window.after_ms)
            slots = "slot" if window.count == 1 else f"{window.count} slots"
            shown = utc_time(ms_to_datetime(first)) if first is not None else "?"
            said += f": the next {slots}, {shown}"
            if window.count > 1:
                said += f" to {utc_time(ms_to_datetime(window.through_ms))}"
    if control.disabled and change.action in ("pause", "resume", "skip"):
        said += " (it is disabled: nothing runs until `enable`)"
    if change.action == "enable" and control.paused_at(now):
        said += " (it is still paused: `resume` it to run)"
    if change.note:
        said += f" - {change.note}"
    return said + f" (by {change.actor}; instances honour it within a heartbeat)"

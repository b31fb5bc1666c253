"""The commands that run a job by hand, through the claim: ``trigger`` and ``backfill``."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from .._backfill import BackfillSlot
from .._events import SkipEvent
from .._logging import LogFormat, configure_logging
from .._redact import redact_text
from .._scheduler import Job, Scheduler
from ..abc import FAILURES, Backend, RunRecord
from ._app import (
    EXIT_FAILED,
    CLIError,
    fail,
    find_job,
    load_app,
    log_options,
    override_option,
    parse_instant,
    parse_zone,
    run_async,
)
from ._group import EPILOG, cli
from ._output import duration_of, utc_time

if TYPE_CHECKING:
    from .._events import Event

__all__ = ["backfill", "trigger"]

_SKIP_EXPLAINED = {
    "not-acquired": "another instance holds this slot",
    "overlap": "a run of this job is still going on",
    "late": "the claim answered too late",
    "paused": "the job is paused",
    "backend-error": "the backend failed",
    "clock-skew": "this instance's clock is too far from the backend's",
}


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.argument("job_name", metavar="JOB")
@override_option
@log_options
def trigger(
    app: str, job_name: str, overrides: tuple[str, ...], log_format: LogFormat, log_level: str
) -> None:
    """Run JOB once now, through the claim; nothing else runs meanwhile."""
    configure_logging(log_format, log_level, quiet_clients=True)
    scheduler = load_app(app, overrides)
    job = find_job(scheduler, job_name, app)
    record, skips = run_async(_trigger(scheduler, job))
    if record is None:
        reason = skips[-1] if skips else "the claim was refused"
        fail(f"job '{job.name}' did not run: {reason}")
    summary = f"job '{job.name}' {record.outcome} in {duration_of(record)}"
    summary += f" (run {record.run_id} on {record.instance_id})"
    if record.outcome != "completed":
        fail(f"{summary}: {record.error}")
    click.echo(summary)


async def _trigger(scheduler: Scheduler[Any], job: Job) -> tuple[RunRecord | None, list[str]]:
    skips: list[str] = []

    def on_skip(event: Event) -> None:
        if isinstance(event, SkipEvent) and event.job == job.name:
            detail = event.detail or _SKIP_EXPLAINED.get(event.reason, "")
            skips.append(f"skipped ({event.reason}: {detail})")

    scheduler.on("skip", on_skip)
    # A scheduler that does not schedule arms no timer and makes no catch-up or take-over: only
    # the manual run happens (pausing the jobs would pause them for the whole fleet).
    scheduler.enabled = False
    await scheduler.start()
    try:
        return await job.trigger(), skips
    finally:
        await scheduler.stop()


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.argument("job_name", metavar="JOB")
@click.option("--from", "start", required=True, help="ISO 8601 instant; naive = --timezone.")
@click.option("--to", "end", required=True, help="ISO 8601 instant, or 'now'; in the past.")
@click.option("--timezone", "-z", "zone_name", default="UTC", show_default=True)
@click.option(
    "--rate", default="1/s", show_default=True, help="Slots started at most: N/s, N/m or N/h."
)
@click.option("--dry-run", is_flag=True, help="List the slots that would run; run nothing.")
@override_option
@log_options
def backfill(
    app: str,
    job_name: str,
    start: str,
    end: str,
    zone_name: str,
    rate: str,
    dry_run: bool,
    overrides: tuple[str, ...],
    log_format: LogFormat,
    log_level: str,
) -> None:
    """Run JOB's slots from --from to --to that have not run, one after the other, each
    claimed like any slot (ctx.reason == "backfill"); nothing else runs meanwhile. A slot
    already run is not run again where the backend remembers it (see the README)."""
    configure_logging(log_format, log_level, quiet_clients=True)
    zone = parse_zone(zone_name)
    first, last = parse_instant("--from", start, zone), parse_instant("--to", end, zone)
    per_s = _rate(rate)
    scheduler = load_app(app, overrides)
    job = find_job(scheduler, job_name, app)
    if dry_run and (missing := run_async(_missing_store(scheduler.backend, job))) is not None:
        fail(missing)
    steps = run_async(_backfill(scheduler, job, first, last, per_s, dry_run))
    counts: dict[str, int] = {}
    for step in steps:
        key = step.record.outcome if step.record is not None else step.status
        counts[key] = counts.get(key, 0) + 1
    said = ", ".join(f"{count} {key}" for key, count in counts.items()) or "no slot in the range"
    verb = "would backfill" if dry_run else "backfilled"
    click.echo(f"{verb} job '{job.name}': {said}")
    if any(key in FAILURES or key in ("skipped", "stopped") for key in counts):
        sys.exit(EXIT_FAILED)


_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _rate(text: str) -> float:
    number, _, unit = text.strip().partition("/")
    try:
        value = float(number) / _PER[unit or "s"]
    except (ValueError, KeyError):
        raise CLIError(f"--rate {text!r} is not a rate: use N/s, N/m or N/h (2/s, 30/m)") from None
    if not value > 0 or value == float("inf"):
        raise CLIError(f"--rate {text!r} must be more than 0")
    return value


async def _missing_store(backend: Backend, job: Job) -> str | None:
    """Why a dry run has nothing to answer from, when the prefix holds nothing on the backend
    (its inventory, which creates nothing): no instance ever ran there, most likely a mistyped
    or retired prefix. Starting the scheduler would create the store (tables, streams,
    buckets), which a dry run must not. ``None``: the store is there, or nothing tells (a
    backend without an inventory)."""
    try:
        found = await backend.inventory(jobs=[job.key])
    except NotImplementedError:
        return None
    if found.objects:
        return None
    notes = "".join(f"; {note}" for note in found.unknown)
    return (
        f"dry run refused: {found.backend} {found.namespace!r} holds nothing brokersched made "
        f"(no table, stream, queue or bucket of it{notes}): no instance ever ran with this "
        f"prefix, so neither did job '{job.name}'; check the application's backend and prefix "
        "(a dry run creates nothing; `brokersched purge APP --dry-run` lists what a prefix holds)"
    )


async def _backfill(
    scheduler: Scheduler[Any],
    job: Job,
    start: datetime,
    end: datetime,
    rate: float,
    dry_run: bool,
) -> list[BackfillSlot]:
    def show(step: BackfillSlot) -> None:
        width = len(str(step.total))
        line = f"[{step.index:>{width}}/{step.total}] {utc_time(step.at)} {step.status}"
        if step.record is not None:
            line += f": {step.record.outcome} in {duration_of(step.record)}"
            if step.record.error:
                line += f" ({step.record.error})"
        elif step.detail:
            line += f": {step.detail}"
        click.echo(redact_text(line))

    # A scheduler that does not schedule arms no timer and makes no catch-up or take-over: only
    # the backfill runs (pausing the jobs would pause them for the whole fleet).
    scheduler.enabled = False
    await scheduler.start()
    try:
        return await scheduler.backfill(
            job.name, start, end, rate=rate, dry_run=dry_run, progress=show
        )
    finally:
        await scheduler.stop()

"""The commands that read what the backend recorded: ``history`` (the runs) and ``instances``
(the fleet's presence)."""

from __future__ import annotations

import json
from datetime import UTC
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._clock import ms_to_datetime
from .._json import record_json, shown_error, shown_result
from .._logging import configure_logging
from .._redact import redact_text
from .._scheduler import Job, Scheduler
from ..abc import Backend, Instance, RunRecord
from ._app import CLIError, find_job, load_app, override_option, run_async
from ._group import EPILOG, cli
from ._output import WIDE, ago, duration_of, make_console, shown_backend, utc_time

__all__ = ["history", "instances"]

_OUTCOME_STYLE = {
    "completed": "green",
    "failed": "red",
    "timed-out": "yellow",
    "missed": "bold red",
    "replaced": "cyan",
}
#: From this many columns the runs of every job show their slot too.
_ROOMY = 150


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.argument("job_name", metavar="[JOB]", required=False)
@click.option(
    "-n", "--limit", "limit", type=click.IntRange(1, 10_000), default=20, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="One JSON record per line.")
@click.option(
    "--traceback",
    "tracebacks",
    is_flag=True,
    help="After the table, the traceback of each failed or timed-out run.",
)
@override_option
def history(
    app: str,
    job_name: str | None,
    limit: int,
    as_json: bool,
    tracebacks: bool,
    overrides: tuple[str, ...],
) -> None:
    """Show the recorded runs of JOB (kept under its key), newest first; without JOB, the
    latest runs of every job, merged."""
    configure_logging("text", "WARNING", quiet_clients=True)
    scheduler = load_app(app, overrides)
    chosen = [find_job(scheduler, job_name, app)] if job_name is not None else scheduler.jobs()
    records = run_async(_read_histories(scheduler, chosen, limit))
    by_key = {job.key: job for job in chosen}
    if as_json:
        for record in records:
            row = record_json(record, by_key.get(record.job), duration=True)
            click.echo(json.dumps(row, separators=(",", ":")))
        return
    if not records:
        whose = f"job '{chosen[0].name}'" if job_name is not None else f"any job of {app}"
        click.echo(f"no runs recorded for {whose}")
        return
    if job_name is not None:
        title = f"{chosen[0].name}: last {len(records)} runs"
    else:
        title = f"{app}: last {len(records)} runs of {len(chosen)} jobs"
    console = make_console()
    every_job = job_name is None
    if console.width < WIDE:
        console.print(_narrow_history(records, by_key, title, every_job=every_job))
    else:
        console.print(
            _wide_history(records, by_key, title, every_job=every_job, width=console.width)
        )
    if tracebacks:
        _print_tracebacks(console, records, by_key)


def _wide_history(
    records: list[RunRecord],
    by_key: dict[str, Job],
    title: str,
    *,
    every_job: bool,
    width: int,
) -> Table:
    """The runs for a terminal of ``WIDE`` columns or more, a row a line (a table whose every
    cell wrapped was unreadable from 120 to 200 columns): the times, outcome, duration,
    reason (with the attempt after the first) and run id whole (``no_wrap``); the job,
    instance and error (or the handler's result) take what is left, the longest narrowed
    first, and end in an ellipsis when cut (the whole error is in ``--json`` and
    ``--traceback``, the whole result in ``--json``). The slot is its time of
    day when it falls on the day the run started; the runs of every job leave it out below
    ``_ROOMY`` columns (it is in ``--json``), for the job's name."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    with_slot = not every_job or width >= _ROOMY
    table.add_column("started (UTC)", no_wrap=True)
    if every_job:
        table.add_column("job")
    if with_slot:
        table.add_column("slot (UTC)", no_wrap=True)
    for column in ("outcome", "duration", "reason"):
        table.add_column(column, no_wrap=True)
    table.add_column("instance")
    table.add_column("run id", no_wrap=True)
    table.add_column("error / result")
    for record in records:
        style = _OUTCOME_STYLE.get(record.outcome, "magenta")
        reason = record.reason if record.attempt <= 1 else f"{record.reason} #{record.attempt}"
        cells: list[str | Text] = [utc_time(record.started_at)]
        if every_job:
            cells.append(_one_line(_job_name(record, by_key)))
        if with_slot:
            cells.append(_slot_time(record))
        cells += [
            f"[{style}]{record.outcome}[/]",
            "-" if record.outcome == "missed" else duration_of(record),  # a report, not a run
            reason,
            _one_line(record.instance_id),
            record.run_id,
            _one_line(_error_or_result(record, by_key.get(record.job))),
        ]
        table.add_row(*cells)
    return table


def _slot_time(record: RunRecord) -> str:
    """The slot's time of day when it is on the day the run started (the slot column says
    UTC), else its date and time."""
    slot = ms_to_datetime(record.slot_ms)
    if slot.date() == record.started_at.astimezone(UTC).date():
        return utc_time(slot).partition(" ")[2].removesuffix("Z")
    return utc_time(slot)


def _one_line(text: str) -> Text:
    """A cell kept to one line, cut with an ellipsis where its column ends."""
    return Text(" ".join(text.split()), no_wrap=True, overflow="ellipsis")


def _narrow_history(
    records: list[RunRecord], by_key: dict[str, Job], title: str, *, every_job: bool
) -> Table:
    """The runs for an 80-column terminal: the slot, instance and run id are left out (they
    are in ``--json``, and the run id heads its ``--traceback``), the year too; the reason is
    said only when it is not the schedule, with the attempt after the first."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("started UTC", no_wrap=True)
    if every_job:
        table.add_column("job", overflow="fold", min_width=10, ratio=1)
    table.add_column("outcome", no_wrap=True)
    table.add_column("took", no_wrap=True, justify="right")
    table.add_column("why", no_wrap=True)
    table.add_column("error / result", overflow="fold", min_width=20, ratio=2)
    for record in records:
        style = _OUTCOME_STYLE.get(record.outcome, "magenta")
        why: str = "" if record.reason == "schedule" else record.reason
        if record.attempt > 1:
            why = f"{why} #{record.attempt}".strip()
        cells = [
            record.started_at.astimezone(UTC).strftime("%m-%d %H:%M:%S"),
            f"[{style}]{record.outcome}[/]",
            duration_of(record),
            why,
            _error_or_result(record, by_key.get(record.job)),
        ]
        if every_job:
            cells.insert(1, _job_name(record, by_key))
        table.add_row(*cells)
    return table


def _job_name(record: RunRecord, by_key: dict[str, Job]) -> str:
    job = by_key.get(record.job)
    return job.name if job is not None else record.job


async def _read_histories(
    scheduler: Scheduler[Any], chosen: list[Job], limit: int
) -> list[RunRecord]:
    """The newest ``limit`` runs of the ``chosen`` jobs, newest first."""
    await scheduler.backend.start(scheduler.clock)
    try:
        histories = [await job.history(limit) for job in chosen]
    finally:
        await scheduler.backend.stop()
    if len(histories) == 1:
        return histories[0]
    merged = [record for records in histories for record in records]
    merged.sort(key=lambda record: record.started_at, reverse=True)
    return merged[:limit]


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per instance and line.")
@override_option
def instances(app: str, as_json: bool, overrides: tuple[str, ...]) -> None:
    """List the fleet's instances as they publish themselves through the backend: liveness
    (alive; late after 1.5 heartbeats without one; dead after 3; stopped), host, pid,
    version, last seen, and the runs each has in progress."""
    configure_logging("text", "WARNING", quiet_clients=True)
    scheduler = load_app(app, overrides)
    if not scheduler.backend.fleet:
        raise CLIError(f"{shown_backend(scheduler)} keeps no presence of the fleet's instances")
    found = run_async(_read_instances(scheduler))
    now = scheduler.clock.now()
    if as_json:
        for instance in found:
            row = instance.to_dict(now)
            row["host"] = redact_text(row["host"])
            click.echo(json.dumps(row, separators=(",", ":")))
        return
    if not found:
        click.echo(f"no instance of {app} published itself in the last 10 minutes")
        return
    count = f"{len(found)} instance{'' if len(found) == 1 else 's'}"
    title = f"{app} on {shown_backend(scheduler)}: {count}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("instance", overflow="fold", ratio=3)
    table.add_column("liveness", no_wrap=True)
    table.add_column("seen", no_wrap=True, justify="right")
    table.add_column("up", no_wrap=True, justify="right")
    table.add_column("running now", overflow="fold", ratio=2)
    for instance in found:
        liveness = instance.liveness(now)
        style = {"alive": "green", "late": "yellow", "dead": "red"}.get(liveness, "dim")
        running = "\n".join(
            f"{run.job} {run.run_id}"
            + (" (lease held)" if run.leased and liveness == "dead" else "")
            for run in instance.running
        )
        table.add_row(
            f"{instance.id}\n[dim]{redact_text(instance.host)} pid {instance.pid} "
            f"v{instance.version}[/]",
            f"[{style}]{liveness}[/]",
            f"{ago(now - instance.last_seen)} ago",
            ago(instance.last_seen - instance.started_at),
            running or "-",
        )
    make_console().print(table)


async def _read_instances(scheduler: Scheduler[Any]) -> list[Instance]:
    """The fleet's presence as ``Scheduler.instances()`` answers it: a dead instance's runs
    that are over (taken over and recorded ``interrupted``) are left out."""
    backend: Backend = scheduler.backend
    await backend.start(scheduler.clock)
    try:
        return await scheduler.instances()
    finally:
        await backend.stop()


def _shown(text: str | None, job: Job | None) -> str:
    """An error or a traceback as the CLI shows it (redacted as the admin API shows it;
    ``""``: none)."""
    return shown_error(text, job) if text else ""


def _error_or_result(record: RunRecord, job: Job | None) -> str:
    """A run's error, else what its handler returned as compact JSON (redacted as the admin
    API shows it; whole in ``--json``); ``""``: neither."""
    if record.error or record.result is None:
        return _shown(record.error, job)
    return json.dumps(shown_result(record.result, job), ensure_ascii=False, separators=(",", ":"))


def _print_tracebacks(console: Console, records: list[RunRecord], by_key: dict[str, Job]) -> None:
    failed = [record for record in records if record.traceback]
    if not failed:
        console.print("no tracebacks in these runs", markup=False)
    for record in failed:
        console.print()
        heading = f"{record.outcome} run {record.run_id} of {record.job}"
        console.print(f"{heading}, started {utc_time(record.started_at)}:", markup=False)
        # Printed as is (no markup, no highlighting), folded to the terminal's width.
        text = _shown(record.traceback, by_key.get(record.job))
        console.print(text, markup=False, overflow="fold")

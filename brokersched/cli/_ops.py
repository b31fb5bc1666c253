"""Operations on the backend: ``purge``, ``doctor``, and ``simulate`` (on a model of it)."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from rich.table import Table

from .._durations import format_duration
from .._exceptions import BackendError
from .._logging import configure_logging
from .._redact import redact_text
from .._scheduler import Scheduler
from ..abc import Backend, Finding, Instance, Inventory, Slot
from ._app import EXIT_FAILED, CLIError, fail, load_app, override_option, run_async
from ._group import EPILOG, cli
from ._output import ago, make_console, shown_backend, utc_time

__all__ = ["doctor", "purge", "simulate"]


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option(
    "--prefix",
    "namespace",
    metavar="P",
    help="Another prefix than the application's (a retired fleet's): the backend's prefix, "
    "schema (PostgreSQL), table prefix (SQLite) or bucket (NATSLeaseBackend).",
)
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Remove even while an instance of the prefix seems to run, or nothing tells whether "
    "one does (it may then run a slot twice).",
)
def purge(app: str, namespace: str | None, dry_run: bool, force: bool) -> None:
    """Remove everything the prefix made on its backend (queues, exchanges, streams, keys,
    tables); refuses while an instance of the prefix seems to run (its presence, as
    `brokersched instances` shows it, or a recent claim, lease or run), or when its presence
    cannot be read. Exit 1: refused, or something was left."""
    configure_logging("text", "WARNING", quiet_clients=True)
    scheduler = load_app(app, ())
    backend: Backend = scheduler.backend
    jobs = [job.key for job in scheduler.jobs()]
    found, presence = run_async(_survey(backend, namespace, jobs, _recent_slots(scheduler)))
    running = (
        _running_instances(presence, scheduler.clock.now()) if isinstance(presence, list) else []
    )
    _show_inventory(found, "would remove" if dry_run else "found")
    for line in running:
        click.echo(redact_text(f"live: {line}"))
    if isinstance(presence, str):
        click.echo(redact_text(f"presence: cannot tell whether an instance runs: {presence}"))
    if dry_run:
        return
    live = bool(found.live or running)
    if live and not force:
        fail(
            "refused: an instance of the prefix seems to run (see above); stop every instance "
            "and run purge again a minute later, or pass --force"
        )
    if isinstance(presence, str) and not force:
        fail(
            "refused: cannot tell whether an instance of the prefix runs (see above); stop "
            "every instance, then pass --force"
        )
    if live or isinstance(presence, str):
        click.echo("warning: --force: removing while an instance may run", err=True)
    if not found.objects:
        click.echo("nothing to remove")
        return
    left = run_async(_purge(backend, found))
    # What the backend kept on purpose says so in a note ("schema app kept: it holds ...").
    kept = {item for item in found.objects if any(f" {item.name} kept" in n for n in left.unknown)}
    removed = len({*found.objects} - {*left.objects} - kept)
    click.echo(f"removed {removed} object{'' if removed == 1 else 's'}")
    for note in left.unknown:
        click.echo(redact_text(f"not removed: {note}"))
    if left.objects:
        _show_inventory(left, "left")
        fail(f"{len(left.objects)} object(s) could not be removed")


async def _survey(
    backend: Backend, namespace: str | None, jobs: list[str], slots: list[Slot]
) -> tuple[Inventory, list[Instance] | str]:
    """What the prefix made, and the presence of its instances (or why it cannot be read)."""
    found = await _inventory(backend, namespace, jobs, slots)
    try:
        return found, await backend.presence(namespace=namespace)
    except NotImplementedError as exc:
        return found, str(exc)
    except BackendError as exc:
        return found, f"its presence could not be read ({exc})"


def _running_instances(instances: list[Instance], now: datetime) -> list[str]:
    """The instances that count as running, each a sentence: alive, or late (a beat or two
    behind: a loaded host, a slow link), as `brokersched instances` judges them. Not those that
    said they stopped, nor the dead (three heartbeats without one)."""
    signs: list[str] = []
    for instance in instances:
        liveness = instance.liveness(now)
        if liveness not in ("alive", "late"):
            continue
        seen = instance.last_seen
        signs.append(
            f"instance {instance.id!r} (host {instance.host}, pid {instance.pid}) is {liveness}: "
            f"last seen {ago(now - seen)} ago, at {utc_time(seen)} (heartbeat "
            f"{format_duration(instance.heartbeat)})"
        )
    return signs


async def _inventory(
    backend: Backend, namespace: str | None, jobs: list[str], slots: list[Slot]
) -> Inventory:
    try:
        return await backend.inventory(namespace=namespace, jobs=jobs, slots=slots)
    except NotImplementedError as exc:
        raise CLIError(str(exc)) from None


async def _purge(backend: Backend, found: Inventory) -> Inventory:
    try:
        return await backend.purge(found)
    except NotImplementedError as exc:
        raise CLIError(str(exc)) from None


_MAX_RECENT_SLOTS = 1000  # per job: an every-second job with a 5-minute slot memory has 300


def _recent_slots(scheduler: Scheduler[Any]) -> list[Slot]:
    """The slots of the application's jobs that the backend may still remember (those of the
    last slot memory, and a minute more): a backend that names its objects from them
    (RabbitMQ's claim queues, without a management API) looks for them."""
    memory = scheduler.backend.capabilities.slot_memory
    if memory is None:
        return []
    now = datetime.now(UTC)
    start = now - memory - timedelta(minutes=1)
    slots: list[Slot] = []
    for job in scheduler.jobs():
        for when in job.schedule.next_runs(_MAX_RECENT_SLOTS, start):
            if when > now + timedelta(seconds=2):
                break
            slots.append(Slot(job.key, round(when.timestamp() * 1000)))
    return slots


_MAX_SLOTS_AHEAD = 65_536  # per job: an every-second job with a 5-minute slot memory has 300


def _slots_ahead(scheduler: Scheduler[Any]) -> list[Slot]:
    """The slots of the application's claimed jobs within one slot memory from now: what a
    claim backend keeps alive at once (RabbitMQ's doctor sizes the node's open files by it)."""
    memory = scheduler.backend.capabilities.slot_memory
    if memory is None:
        return []
    now = datetime.now(UTC)
    slots: list[Slot] = []
    for job in scheduler.jobs():
        if not job.options.claim:
            continue
        count = 16  # asked for in growing batches: a daily cron job's thousandth run is far
        runs = job.schedule.next_runs(count, now)
        while len(runs) == count and runs[-1] <= now + memory and count < _MAX_SLOTS_AHEAD:
            count *= 4
            runs = job.schedule.next_runs(count, now)
        slots += [
            Slot(job.key, round(when.timestamp() * 1000)) for when in runs if when <= now + memory
        ]
    return slots


def _show_inventory(found: Inventory, verb: str) -> None:
    click.echo(redact_text(f"{found.backend} {found.namespace!r}: {verb} {len(found.objects)}"))
    for item in found.objects:
        click.echo(redact_text(f"  {item.kind} {item.name}"))
    for note in found.unknown:
        click.echo(redact_text(f"not enumerated: {note}"))
    for sign in found.live:
        click.echo(redact_text(f"live: {sign}"))


_SEVERITY_STYLE = {"error": "red", "warning": "yellow", "ok": "green"}


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option("--json", "as_json", is_flag=True, help="The findings as one JSON object.")
def doctor(app: str, as_json: bool) -> None:
    """Check the live backend against brokersched's guarantees: each finding with its
    consequence and the fix. Exit 1 on an error (a slot could run twice, or the server hang)."""
    configure_logging("text", "ERROR", quiet_clients=True)
    scheduler = load_app(app, ())
    backend: Backend = scheduler.backend
    findings: list[Finding] = run_async(backend.doctor(slots=_slots_ahead(scheduler)))
    errors = sum(finding.severity == "error" for finding in findings)
    if as_json:
        report = {
            "backend": shown_backend(scheduler),
            "errors": errors,
            "findings": [finding.to_dict() for finding in findings],
        }
        click.echo(redact_text(json.dumps(report, indent=2)))
    else:
        table = Table(title=f"{app} on {shown_backend(scheduler)}", title_justify="left")
        for column in ("severity", "check", "found", "consequence", "fix"):
            table.add_column(column, overflow="fold")
        for finding in findings:
            style = _SEVERITY_STYLE[finding.severity]
            table.add_row(
                f"[{style}]{finding.severity}[/]",
                finding.check,
                *(redact_text(text) for text in (finding.found, finding.consequence, finding.fix)),
            )
        make_console().print(table)
    if errors:
        fail(
            f"{errors} error{'s' if errors > 1 else ''}: a slot could run twice or the server hang"
        )


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option(
    "--instances", type=click.IntRange(1, 16), default=3, show_default=True,
    help="At most this many instances at once (kills and deploys start more).",
)  # fmt: skip
@click.option(
    "--hours", type=click.FloatRange(0.01, 24 * 7), default=1.0, show_default=True,
    help="Virtual hours per seed; time with nothing due is skipped.",
)  # fmt: skip
@click.option(
    "--start", metavar="ISO-8601",
    help="The fleet's first instant, with a UTC offset (for at() jobs, DST changes); default: "
    "a fixed one, the same every run, shown in the report.",
)  # fmt: skip
@click.option("--seeds", type=click.IntRange(1), default=10, show_default=True)
@click.option("--first", type=click.IntRange(0), default=0, help="The first seed of --seeds.")
@click.option("--seed", type=click.IntRange(0), help="Replay one seed, printing its steps.")
@click.option(
    "--real-handlers", is_flag=True,
    help="Call the application's handlers, in virtual time, in place of timed stand-ins.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
@override_option
def simulate(
    app: str,
    instances: int,
    hours: float,
    seeds: int,
    first: int,
    seed: int | None,
    start: str | None,
    real_handlers: bool,
    as_json: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run APP's jobs through the fleet simulator: instances killed, deployed, cut off from
    the backend, their clocks stepped, under manual runs, backfills and pauses, on a model of
    APP's backend, in virtual time; no server is used. Report per job the slots that ran
    twice, never, or overlapped, with the seed that replays each. Exit 1 if any did."""
    from ..testing import _sim_app

    configure_logging("text", "ERROR", quiet_clients=True)
    scheduler = load_app(app, overrides)
    try:
        read = _sim_app.read_app(scheduler)
    except ValueError as exc:
        raise CLIError(f"{app}: {exc}") from None
    begins = _sim_app.START if start is None else _aware(start)
    chosen = [seed] if seed is not None else list(range(first, first + seeds))
    say = _sim_app.progress(app, verbose=seed is not None) if not as_json else None
    report = _sim_app.simulate_app(
        read, chosen, hours=hours, instances=instances, real_handlers=real_handlers,
        start=begins, keep_steps=seed is not None and as_json, each=say,
    )  # fmt: skip
    if as_json:
        click.echo(redact_text(json.dumps(report.to_json(), indent=2)))
    else:
        make_console().print(_sim_app.table(report, app))
        click.echo(_sim_app.summary(report, app))
    if not report.ok:
        sys.exit(EXIT_FAILED)


def _aware(text: str) -> datetime:
    """``--start``: an ISO-8601 instant with its UTC offset."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CLIError(f"--start {text!r} is not an ISO-8601 date and time") from None
    if when.tzinfo is None:
        raise CLIError(f"--start {text!r} has no UTC offset: add one (+00:00, Z)")
    return when

"""``brokersched plan OLD NEW``: the slots a rolling deploy from OLD to NEW runs twice, never,
or under another owner while both versions run side by side (the model is ``_plan``'s); exit
1 when there is one, so that a pipeline can gate the deploy on it.

OLD and NEW are each an APP or a listing saved by ``brokersched jobs APP --json``. Two APPs are
often two checkouts of one application (``old/app.py:scheduler``, ``new/app.py:scheduler``),
whose modules have the same names: the application's own modules are forgotten once its jobs
are read, so that the second one is imported afresh rather than found already imported.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from .._clock import datetime_to_ms, ms_to_datetime
from .._exceptions import ConfigurationError
from .._json import iso
from .._plan import Hazard, HazardSlot, JobPlan, PlannedJob, plan_deploy
from ._app import EXIT_FAILED, CLIError, load_app, parse_instant
from ._group import EPILOG, cli
from ._output import make_console, utc_time

__all__ = ["plan"]

#: Slots of one hazard listed: by ``--json`` (with their count), and in the table.
_JSON_SLOTS = 100
_TABLE_SLOTS = 3


@cli.command(epilog=EPILOG)
@click.argument("old", metavar="OLD")
@click.argument("new", metavar="NEW")
@click.option(
    "--hours",
    type=click.IntRange(1, 24 * 31),
    default=24,
    show_default=True,
    help="How long both versions may run side by side: the slots of this window are compared.",
)
@click.option(
    "--from",
    "start",
    metavar="INSTANT",
    help="ISO 8601 instant the window starts at (default: now); naive = UTC.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job and line.")
def plan(old: str, new: str, hours: int, start: str | None, as_json: bool) -> None:
    """List, per job, the slots that run twice, never, or under another owner while instances
    of OLD and NEW run side by side (a renamed key, a moved grid, another time zone or cron
    expression, a claim changed), with how to avoid each. OLD and NEW: an APP, or a file
    saved by 'brokersched jobs APP --json'. Exit 1 when there is a hazard."""
    start_at = parse_instant("--from", start, UTC) if start else datetime.now(UTC)
    start_ms = datetime_to_ms(start_at)
    end_ms = start_ms + hours * 3_600_000
    plans = plan_deploy(_version(old), _version(new), start_ms, end_ms)
    if as_json:
        for job_plan in plans:
            click.echo(json.dumps(_plan_json(job_plan), separators=(",", ":")))
    else:
        _print_table(old, new, plans, start_ms, end_ms)
    if any(job_plan.hazards for job_plan in plans):
        sys.exit(EXIT_FAILED)


def _version(source: str) -> list[PlannedJob]:
    """The jobs of OLD or NEW: a saved listing (an existing file that is not Python), or an
    APP."""
    path = Path(source)
    if path.is_file() and path.suffix != ".py":
        return _read_listing(path)
    with _forgetting_application_modules():
        scheduler = load_app(source, ())
        return [
            PlannedJob.of(job.name, job.key, job.settings.claim, job.enabled, job.schedule)
            for job in scheduler.jobs()
        ]


def _read_listing(path: Path) -> list[PlannedJob]:
    jobs: list[PlannedJob] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row: Any = json.loads(line)
            if not isinstance(row, dict):
                raise ConfigurationError(f"{row!r} is not a JSON object")
            jobs.append(PlannedJob.from_listing(row))
        except (ValueError, ConfigurationError) as exc:
            raise CLIError(
                f"{path}, line {number}: not a job of 'brokersched jobs APP --json': {exc}"
            ) from None
    return jobs


@contextmanager
def _forgetting_application_modules() -> Iterator[None]:
    """Once the block ends, forget the modules imported from the directories it put on
    ``sys.path`` (the application's own: a second version's modules of the same names are then
    imported afresh), and put ``sys.path`` back. brokersched's own modules are kept, wherever
    they are installed from: the jobs read hold its objects."""
    modules = set(sys.modules)
    path = list(sys.path)
    try:
        yield
    finally:
        roots = [Path(entry or ".").resolve() for entry in sys.path if entry not in path]
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None)
            if file is None or name.partition(".")[0] == "brokersched":
                continue
            if any(Path(file).resolve().is_relative_to(root) for root in roots):
                del sys.modules[name]
        sys.path[:] = path


def _plan_json(job_plan: JobPlan) -> dict[str, Any]:
    """A job as ``plan --json`` prints it; every key always there."""
    return {
        "job": job_plan.name,
        "old": _job_json(job_plan.old),
        "new": _job_json(job_plan.new),
        "changes": list(job_plan.changes),
        "compared_until": iso(ms_to_datetime(job_plan.compared_until_ms)),
        "hazards": [_hazard_json(hazard) for hazard in job_plan.hazards],
    }


def _job_json(job: PlannedJob | None) -> dict[str, Any] | None:
    if job is None:
        return None
    return {
        "name": job.name,
        "key": job.key,
        "claim": job.claim,
        "enabled": job.enabled,
        "schedule": job.schedule,
        "trigger": dict(job.spec),
    }


def _hazard_json(hazard: Hazard) -> dict[str, Any]:
    return {
        "kind": hazard.kind,
        "cause": hazard.cause,
        "count": len(hazard.slots),
        "slots": [
            {"old": _iso_ms(slot.old_ms), "new": _iso_ms(slot.new_ms)}
            for slot in hazard.slots[:_JSON_SLOTS]
        ],
        "advice": hazard.advice,
    }


def _iso_ms(ms: int) -> str:
    return iso(ms_to_datetime(ms))


def _print_table(old: str, new: str, plans: list[JobPlan], start_ms: int, end_ms: int) -> None:
    window = f"{utc_time(ms_to_datetime(start_ms))} to {utc_time(ms_to_datetime(end_ms))}"
    console = make_console()
    table = Table(title=f"plan {old} -> {new}, slots from {window}", title_justify="left")
    for column in ("job", "changes", "hazard", "slots", "advice"):
        table.add_column(column, overflow="fold")
    for job_plan in plans:
        changes = _shown_changes(job_plan)
        if not job_plan.hazards and changes is not None:
            table.add_row(job_plan.name, changes, "none", "-", "-")
        for hazard in job_plan.hazards:
            kind = f"{hazard.kind} ({hazard.cause})"
            table.add_row(job_plan.name, changes or "-", kind, _shown_slots(hazard), hazard.advice)
    console.print(table)
    count = sum(len(job_plan.hazards) for job_plan in plans)
    jobs = sum(1 for job_plan in plans if job_plan.hazards)
    if count:
        console.print(f"{count} hazard{'s' * (count > 1)} in {jobs} job{'s' * (jobs > 1)}")
    else:
        console.print("no hazard: the two versions may run side by side")
    for job_plan in plans:
        if job_plan.compared_until_ms < end_ms:
            until = utc_time(ms_to_datetime(job_plan.compared_until_ms))
            console.print(f"job '{job_plan.name}': too many slots, compared until {until}")


def _shown_changes(job_plan: JobPlan) -> str | None:
    """What changed; ``None`` for a job the same in both versions."""
    if job_plan.old is None:
        return "added"
    if job_plan.new is None:
        return "removed"
    return "\n".join(job_plan.changes) or None


def _shown_slots(hazard: Hazard) -> str:
    lines = [_shown_slot(slot) for slot in hazard.slots[:_TABLE_SLOTS]]
    if len(hazard.slots) > _TABLE_SLOTS:
        lines.append(f"... {len(hazard.slots)} in all")
    return "\n".join(lines)


def _shown_slot(slot: HazardSlot) -> str:
    old = utc_time(ms_to_datetime(slot.old_ms))
    if slot.old_ms == slot.new_ms:
        return old
    return f"old {old}, new {utc_time(ms_to_datetime(slot.new_ms))}"

"""``brokersched schedules APP list|get|put|delete|export|import``: the fleet's stored schedules
(``scheduler.schedules``), read and written through the application's backend without starting
a scheduler (as ``pause`` does). A write applies to every instance's slots from 3 s after it is
made; each one takes ``--if-version`` (optimistic concurrency) and ``--by`` (who).

Exit codes: 0 done; 1 no such schedule, an ``--if-version`` conflict, or entries of an import
refused; 2 a usage or configuration error (the schedule is refused, nothing written); 3 the
backend is unavailable. What is printed passes through ``redact_text``: a URL's password or a
``password=`` pair in a schedule's data is shown as ``***`` (``export --reveal`` prints the
data as stored, for a backup ``import`` restores)."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import IO, Any, TypeVar, get_args

import click
from rich import box
from rich.table import Table

from .._exceptions import BrokerschedError, ConfigurationError
from .._redact import redact_json, redact_text
from .._scheduler import Scheduler
from .._schedules import ScheduleConflictError, Schedules
from .._stored import StoredSchedule, TriggerKind
from ..backends.memory import MemoryBackend
from ..triggers.spec import trigger_from_spec
from ._app import EXIT_FAILED, CLIError, fail, load_app, run_async
from ._controls import cli_actor
from ._group import EPILOG, cli
from ._output import make_console, shown_backend, utc_time

__all__ = ["describe_trigger", "put_arguments", "schedules"]

T = TypeVar("T")

#: ``put``'s own arguments: not job options (``--option``).
_OWN = frozenset(
    name
    for name, parameter in inspect.signature(Schedules.put).parameters.items()
    if parameter.kind is not parameter.VAR_KEYWORD and name != "self"
)


@cli.group(epilog=EPILOG, subcommand_metavar="list|get|put|delete|export|import ...")
@click.argument("app", metavar="APP")
@click.pass_context
def schedules(ctx: click.Context, app: str) -> None:
    """The stored schedules of APP's fleet (schedules as data): list, get, put, delete,
    export, import. They are kept in the application's backend; every instance that has the
    task (@scheduler.task) runs each slot once for the fleet. A write applies from 3 s after it
    is made."""
    ctx.obj = app


def _by_option(function: Callable[..., None]) -> Callable[..., None]:
    return click.option("--by", "actor", help="Who writes it [default: cli:USER@HOST].")(function)


def _if_version_option(function: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--if-version",
        type=click.IntRange(min=0),
        help="Only if the schedule is at this version (0: only if there is none); else exit 1.",
    )(function)


# -- the backend -----------------------------------------------------------------------------


def _load() -> tuple[str, Scheduler[Any]]:
    """The APP given to the group, and its scheduler."""
    app = click.get_current_context().find_object(str)
    assert app is not None
    scheduler = load_app(app, ())
    if not scheduler.backend.fleet:
        raise CLIError(
            f"{shown_backend(scheduler)} keeps no fleet records: it holds no stored schedules"
        )
    return app, scheduler


def _with_store(scheduler: Scheduler[Any], work: Callable[[Schedules], Awaitable[T]]) -> T:
    """``work`` on the application's stored schedules, its backend started for the call (no
    scheduler started); a conflict ends the command (exit 1)."""

    async def run() -> T:
        backend = scheduler.backend
        await backend.start(scheduler.clock)
        try:
            return await work(scheduler.schedules)
        finally:
            await backend.stop()

    try:
        return run_async(run())
    except ScheduleConflictError as exc:
        fail(f"conflict: {exc}")
    except BrokerschedError as exc:
        raise CLIError(str(exc)) from None


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(redact_json(value), separators=(",", ":")))


# -- how a schedule is shown -----------------------------------------------------------------


def describe_trigger(schedule: StoredSchedule) -> str:
    """Its trigger as ``brokersched jobs`` describes a job's (``every 10s``, ``cron 0 8 * * *
    (Europe/Paris)``); a trigger this release cannot read, as written and why."""
    trigger = dict(schedule.trigger)
    if "error" in trigger:
        return (
            f"{trigger.get('kind')} {trigger.get('schedule')} (not valid here: {trigger['error']})"
        )
    try:
        return trigger_from_spec(trigger).describe()
    except ConfigurationError as exc:
        return f"{trigger.get('kind')} ({exc})"


def _said(schedule: StoredSchedule) -> str:
    return (
        f"schedule '{schedule.id}' version {schedule.version}: task {schedule.task}, "
        f"{describe_trigger(schedule)}, effective {utc_time(schedule.effective_at)}"
        f" (by {schedule.updated_by or '-'})"
    )


def _details(schedule: StoredSchedule) -> str:
    lines = [
        f"id:            {schedule.id}",
        f"task:          {schedule.task}",
        f"trigger:       {describe_trigger(schedule)}",
        f"options:       {json.dumps(redact_json(dict(schedule.options)), sort_keys=True)}",
        f"data:          {json.dumps(redact_json(schedule.data), sort_keys=True)}",
        f"version:       {schedule.version}",
        f"updated:       {utc_time(schedule.updated_at)} by {schedule.updated_by or '-'}",
        f"effective at:  {utc_time(schedule.effective_at)}",
    ]
    return "\n".join(lines)


def _table(found: list[StoredSchedule], title: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("id", "task", "trigger", "version", "updated (UTC)", "by", "effective (UTC)"):
        # an id is folded, never cut short: it is what the other commands take
        table.add_column(
            column,
            no_wrap=column in ("version", "updated (UTC)", "effective (UTC)"),
            overflow="fold" if column == "id" else "ellipsis",
        )
    for schedule in found:
        table.add_row(
            schedule.id,
            schedule.task,
            redact_text(describe_trigger(schedule)),
            str(schedule.version),
            utc_time(schedule.updated_at),
            schedule.updated_by or "-",
            utc_time(schedule.effective_at),
        )
    return table


# -- reading ---------------------------------------------------------------------------------


async def _all(store: Schedules, prefix: str) -> list[StoredSchedule]:
    return [schedule async for schedule in store.list(prefix)]


@schedules.command("list", epilog=EPILOG)
@click.option("--prefix", default="", help="Only the schedules whose id starts with this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_schedules(prefix: str, as_json: bool) -> None:
    """List the stored schedules, by id."""
    app, scheduler = _load()
    found = _with_store(scheduler, lambda store: _all(store, prefix))
    if as_json:
        for schedule in found:
            _echo_json(schedule.to_json())
        return
    if not found:
        whose = f" whose id starts with '{prefix}'" if prefix else ""
        click.echo(f"no stored schedules{whose} on {shown_backend(scheduler)}")
        return
    make_console().print(_table(found, f"{app}: {len(found)} stored schedules"))


@schedules.command("get", epilog=EPILOG)
@click.argument("schedule_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="The schedule as JSON.")
def get_schedule(schedule_id: str, as_json: bool) -> None:
    """Show schedule ID's latest version (exit 1 if there is none)."""
    _app, scheduler = _load()
    found = _with_store(scheduler, lambda store: store.get(schedule_id))
    if found is None:
        fail(f"no schedule '{schedule_id}' on {shown_backend(scheduler)}")
    if as_json:
        _echo_json(found.to_json())
    else:
        click.echo(_details(found))


# -- writing ---------------------------------------------------------------------------------


def _json_value(option: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CLIError(
            f"{option} {text!r} is not JSON ({exc}): quote a string, '\"acme\"'"
        ) from None


def _instant(text: str) -> datetime:
    """``--at``: ISO 8601 with an offset, as UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CLIError(
            f"--at {text!r} is not an ISO 8601 time with an offset (2027-01-15T08:00+01:00)"
        ) from None
    if value.tzinfo is None:
        raise CLIError(f"--at {text} has no offset: give one (2027-01-15T08:00+01:00, or Z)")
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise CLIError(f"--at {text} is out of range (years 1 to 9999, UTC)") from None


def _options(given: tuple[str, ...]) -> dict[str, Any]:
    """``--option NAME=VALUE`` (repeatable): VALUE is JSON when it parses as JSON, else text."""
    options: dict[str, Any] = {}
    for text in given:
        name, sep, raw = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise CLIError(
                f"--option {text!r} is not NAME=VALUE, such as 'timeout=30s' or 'max_attempts=3'"
            )
        if name in _OWN:
            raise CLIError(
                f"--option {name}=... is not a job option: use --{name.replace('_', '-')}"
            )
        try:
            options[name] = json.loads(raw)
        except ValueError:
            options[name] = raw
    return options


@schedules.command("put", epilog=EPILOG)
@click.argument("schedule_id", metavar="ID")
@click.option("--task", required=True, help="The task it runs (@scheduler.task(name)).")
@click.option("--every", metavar="DURATION", help="Run every this long (10s, 5m, 1h30m).")
@click.option("--cron", metavar="EXPR", help="Run on this cron expression ('0 8 * * MON-FRI').")
@click.option("--at", "at_text", metavar="ISO", help="Run once at this instant, with its offset.")
@click.option("--timezone", help="The cron expression's time zone (Europe/Paris).")
@click.option("--data", "data_text", metavar="JSON", help="The task's ctx.data, as JSON.")
@click.option(
    "--option",
    "option_texts",
    metavar="NAME=VALUE",
    multiple=True,
    help="A job option (repeatable): timeout=30s, max_late=1m, jitter=5s; VALUE is JSON when "
    "it parses as JSON.",
)
@_if_version_option
@_by_option
@click.option("--json", "as_json", is_flag=True, help="The schedule written, as JSON.")
def put_schedule(
    schedule_id: str,
    task: str,
    every: str | None,
    cron: str | None,
    at_text: str | None,
    timezone: str | None,
    data_text: str | None,
    option_texts: tuple[str, ...],
    if_version: int | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Write schedule ID: create it, or its next version. Give exactly one of --every, --cron
    or --at. Refused (exit 2, nothing written) as registration would refuse the job."""
    given = [
        name for name, value in (("--every", every), ("--cron", cron), ("--at", at_text)) if value
    ]
    if len(given) != 1:
        raise CLIError(
            f"schedule '{schedule_id}' needs exactly one of --every, --cron or --at "
            f"(given: {', '.join(given) or 'none'})"
        )
    at = None if at_text is None else _instant(at_text)
    data = None if data_text is None else _json_value("--data", data_text)
    options = _options(option_texts)
    _app, scheduler = _load()

    async def write(store: Schedules) -> StoredSchedule:
        return await store.put(
            schedule_id,
            task=task,
            every=every,
            cron=cron,
            at=at,
            timezone=timezone,
            data=data,
            if_version=if_version,
            by=actor or cli_actor(),
            **options,
        )

    written = _with_store(scheduler, write)
    if as_json:
        _echo_json(written.to_json())
    else:
        click.echo(redact_text(f"wrote {_said(written)}"))


@schedules.command("delete", epilog=EPILOG)
@click.argument("schedule_id", metavar="ID")
@_if_version_option
@_by_option
def delete_schedule(schedule_id: str, if_version: int | None, actor: str | None) -> None:
    """Delete schedule ID: no slot of it runs from 3 s after (exit 1 if there is none)."""
    _app, scheduler = _load()
    by = actor or cli_actor()
    deleted = _with_store(
        scheduler, lambda store: store.delete(schedule_id, if_version=if_version, by=by)
    )
    if not deleted:
        fail(f"no schedule '{schedule_id}' on {shown_backend(scheduler)}")
    click.echo(f"deleted schedule '{schedule_id}': no slot of it from 3 s from now (by {by})")


# -- export and import -----------------------------------------------------------------------


@schedules.command("export", epilog=EPILOG)
@click.option("--prefix", default="", help="Only the schedules whose id starts with this.")
@click.option("--array", "as_array", is_flag=True, help="One JSON array, not one per line.")
@click.option(
    "--reveal",
    is_flag=True,
    help="Print the data as stored, passwords in URLs included (a backup to import).",
)
def export_schedules(prefix: str, as_array: bool, reveal: bool) -> None:
    """Print the stored schedules as JSON, one per line (or --array): what `import` reads."""
    _app, scheduler = _load()
    found = [s.to_json() for s in _with_store(scheduler, lambda store: _all(store, prefix))]
    texts = [_dumps(entry) for entry in found]
    shown = texts if reveal else [_dumps(redact_json(entry)) for entry in found]
    if as_array:
        click.echo("[" + ",\n".join(shown) + "]")
    else:
        for text in shown:
            click.echo(text)
    if masked := sum(a != b for a, b in zip(texts, shown, strict=True)):
        click.echo(
            f"warning: {masked} schedules had a secret masked as ***: --reveal to export "
            "them as stored",
            err=True,
        )


def _dumps(entry: Any) -> str:
    return json.dumps(entry, separators=(",", ":"), sort_keys=True)


def put_arguments(entry: Any) -> dict[str, Any]:
    """The arguments of ``Schedules.put`` (all but the id) for one entry of an export: its
    ``task``, ``trigger`` (as ``StoredSchedule.to_json`` gives it), ``options`` and ``data``;
    its version and who wrote it are not written again. Raises ``ConfigurationError``."""
    if not isinstance(entry, Mapping):
        raise ConfigurationError(f"{type(entry).__name__} is not a schedule (a JSON object)")
    trigger = entry.get("trigger")
    if not isinstance(trigger, Mapping):
        raise ConfigurationError(f"'trigger' {trigger!r} is not an object: {{'kind': ...}}")
    kind = trigger.get("kind")
    options = entry.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"'options' {options!r} is not an object")
    if taken := sorted(_OWN & options.keys() - {"timezone"}):
        raise ConfigurationError(f"options.{taken[0]} is not a job option", option=taken[0])
    if not isinstance(kind, str) or kind not in get_args(TriggerKind):
        raise ConfigurationError(
            f"trigger kind {kind!r} is not one of {', '.join(get_args(TriggerKind))}",
            option="trigger",
        )
    arguments: dict[str, Any] = {**options, "task": entry.get("task"), "data": entry.get("data")}
    if "schedule" in trigger:  # as written, by a release that could not read it
        arguments[kind] = trigger["schedule"]
    elif kind == "every":
        arguments[kind] = timedelta(milliseconds=int(trigger.get("interval_ms", 0)))
    else:
        arguments[kind] = trigger.get("expression" if kind == "cron" else "at")
    return arguments


def _read_entries(source: IO[str], name: str) -> list[Any]:
    """The entries of an export: one JSON array, or one JSON object per line."""
    text = source.read()
    if text.lstrip().startswith("["):
        try:
            entries = json.loads(text)
        except ValueError as exc:
            raise CLIError(f"{name}: not a JSON array of schedules ({exc})") from None
        if not isinstance(entries, list):
            raise CLIError(f"{name}: not a JSON array of schedules")
        return entries
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except ValueError as exc:
            raise CLIError(f"{name}, line {number}: not JSON ({exc}); nothing written") from None
    return entries


def _entry_id(entry: Any, index: int) -> str:
    found = entry.get("id") if isinstance(entry, Mapping) else None
    return found if isinstance(found, str) else f"#{index + 1}"


@schedules.command("import", epilog=EPILOG)
@click.argument("source", metavar="FILE|-", type=click.File("r"))
@_by_option
@click.option("--dry-run", is_flag=True, help="Validate every entry; write nothing.")
def import_schedules(source: IO[str], actor: str | None, dry_run: bool) -> None:
    """Write each schedule of FILE (what `export` printed; - for stdin), each one's next
    version. An entry refused (not valid, or the backend failed) is named on stderr, the
    others are written; exit 1 when any was refused. --dry-run: validates each one as a
    write would, on a scratch store, without reaching the backend."""
    entries = _read_entries(source, getattr(source, "name", "-"))
    _app, scheduler = _load()
    by = actor or cli_actor()

    async def write(store: Schedules) -> list[tuple[str, str]]:
        refused: list[tuple[str, str]] = []
        for index, entry in enumerate(entries):
            schedule_id = _entry_id(entry, index)
            try:
                if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
                    raise ConfigurationError("an entry needs an 'id' (a string)")
                await store.put(schedule_id, by=by, **put_arguments(entry))
            except (BrokerschedError, TypeError, ValueError) as exc:
                refused.append((schedule_id, str(exc)))
        return refused

    refused = run_async(_dry_run(scheduler, write)) if dry_run else _with_store(scheduler, write)
    for schedule_id, why in refused:
        click.echo(redact_text(f"refused: {schedule_id}: {why}"), err=True)
    done = len(entries) - len(refused)
    verb = "would write" if dry_run else "wrote"
    click.echo(f"{verb} {done} of {len(entries)} schedules")
    if refused:
        names = ", ".join(schedule_id for schedule_id, _ in refused)
        click.echo(f"refused {len(refused)}: {names}", err=True)
        sys.exit(EXIT_FAILED)


async def _dry_run(scheduler: Scheduler[Any], work: Callable[[Schedules], Awaitable[T]]) -> T:
    """``work`` on a scratch store in memory, the entries checked by the application's own
    rules (its backend's capabilities, its defaults)."""
    scratch = MemoryBackend()
    await scratch.start(scheduler.clock)
    try:
        return await work(Schedules(lambda: scratch, scheduler.clock, scheduler.schedules.checker))
    finally:
        await scratch.stop()

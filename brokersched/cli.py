"""The ``brokersched`` command (``pip install 'brokersched[cli]'``).

``run`` serves a scheduler until SIGINT/SIGTERM; ``jobs``, ``next`` and ``check`` only read the
application (they never connect to the backend); ``history`` and ``trigger`` connect for one
request. An application is named ``module:attribute`` (``app:scheduler``) or
``path/to/file.py:attribute`` (``./app.py:scheduler``), where the attribute is a ``Scheduler``
or a function of no arguments that returns one. A module is searched from the current directory
first, as ``python -m`` would; a file is imported under its module name with the directory above
its package (or its own directory) first on ``sys.path``, as Flask's ``--app`` does, so that
its imports of its neighbours work as they do under ``python path/to/file.py``.

User mistakes end in one line on stderr and an exit code, never a traceback; only an exception
raised by the application's own code while it is imported (or while its factory runs) shows its
traceback: it is a bug to find there.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Coroutine, Generator
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard, TypeVar

import click
from rich import box
from rich.console import Console
from rich.table import Table

from ._backfill import BackfillSlot
from ._clock import ms_to_datetime
from ._durations import format_duration, parse_duration
from ._events import SkipEvent
from ._exceptions import BackendError, BackendUnavailableError, BrokerschedError, ConfigurationError
from ._json import iso, record_json, shown_error
from ._logging import LogFormat, configure_logging
from ._overrides import cli_override
from ._redact import MASK, redact_text
from ._registry import collect_errors, past_at
from ._scheduler import Job, Scheduler
from ._timezones import parse_timezone, timezone_name
from .abc import FAILURES, Backend, Finding, Instance, Inventory, RunRecord, Slot
from .triggers.base import Trigger
from .triggers.cron import CronTrigger, parse_cron
from .triggers.interval import IntervalTrigger

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from ._events import Event
    from .web._serve import HTTPServer

__all__ = ["cli", "load_scheduler", "main"]

T = TypeVar("T")
logger = logging.getLogger("brokersched.cli")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BACKEND = 0, 1, 2, 3

EPILOG = """\b
APP: MODULE:ATTR (app:scheduler) or FILE.py:ATTR (./app.py:scheduler)
\b
Exit codes:
  0  success
  1  trigger: the job failed or did not run; backfill: a slot failed or was skipped,
     or a dry run found nothing of the prefix on the backend;
     check: configuration errors found;
     run: a second signal cut the drain short; run, trigger: the application's lifespan raised;
     purge: refused, or objects left; doctor: an error found;
     simulate: a promise of the README broke in a seed
  2  usage or configuration error (bad APP, unknown job, invalid option)
  3  the backend is unavailable
"""

_SKIP_EXPLAINED = {
    "not-acquired": "another instance holds this slot",
    "overlap": "a run of this job is still going on",
    "late": "the claim answered too late",
    "paused": "the job is paused",
    "backend-error": "the backend failed",
    "clock-skew": "this instance's clock is too far from the backend's",
}


class CLIError(click.ClickException):
    """One line on stderr and exit code 2; the message is redacted of credentials."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


class BackendDownError(CLIError):
    exit_code = EXIT_BACKEND


class AppFailedError(CLIError):
    """The application's own code (its lifespan) raised while the command ran: exit code 1."""

    exit_code = EXIT_FAILED


class AppConfigurationError(CLIError):
    """The application refused its own configuration while it was being loaded."""

    def __init__(self, spec: str, error: ConfigurationError) -> None:
        super().__init__(f"{spec}: {error}")
        self.error = error


# -- loading the application ---------------------------------------------------------------


# What every loading error ends with: how to name an application.
_HOW = "write MODULE:ATTR (app:scheduler) or path/to/file.py:ATTR (./app.py:scheduler)"


def load_scheduler(spec: str) -> Scheduler[Any]:
    """The ``Scheduler`` named by ``module:attribute`` or ``path/to/file.py:attribute`` (an
    attribute path, or a factory). The one loader of every command."""
    target, _, attribute = spec.rpartition(":")  # a path may hold ':' (C:\\), an attribute not
    if not target or not attribute:
        raise CLIError(f"'{spec}' is not MODULE:ATTR nor FILE.py:ATTR; {_HOW}")
    with _configuration_errors(spec):
        if _is_path(target):
            module = _import_file(target)
            shown = f"'{target}'"
        else:
            module = _import(target)
            shown = f"module '{target}'"
        found: object = module
        for part in attribute.split("."):
            try:
                found = getattr(found, part)
            except AttributeError:
                raise CLIError(
                    f"{shown} has no attribute '{attribute}'{_schedulers_in(module)}"
                ) from None
        if isinstance(found, type) and issubclass(found, Scheduler):
            # Called as a factory it would make a new, empty scheduler: 0 jobs, silently.
            raise CLIError(
                f"'{spec}' is the class {found.__name__}, not the Scheduler object your jobs "
                f"are registered on{_schedulers_in(module)}; {_HOW}"
            )
        if not _is_scheduler(found) and callable(found):
            found = _call_factory(found, spec)
    if not _is_scheduler(found):
        raise CLIError(
            f"'{spec}' is of type {type(found).__name__}, not a brokersched.Scheduler "
            "(or a function of no arguments returning one)"
        )
    return found


def _is_scheduler(value: object) -> TypeGuard[Scheduler[Any]]:
    return isinstance(value, Scheduler)


@contextlib.contextmanager
def _configuration_errors(spec: str) -> Generator[None]:
    try:
        yield
    except ConfigurationError as exc:  # registration refused a job
        raise AppConfigurationError(spec, exc) from None
    except BrokerschedError as exc:
        raise CLIError(f"{spec}: {exc}") from None


def _schedulers_in(module: object) -> str:
    """`` (Scheduler objects in it: a, b)``, when there are some: what the user may have meant."""
    names = sorted(name for name, value in vars(module).items() if _is_scheduler(value))
    return f" (its Scheduler objects: {', '.join(names)})" if names else ""


def _is_path(target: str) -> bool:
    separators = {"/", os.sep, os.altsep or "/"}
    return target.endswith(".py") or any(separator in target for separator in separators)


def _import_file(target: str) -> Any:
    """The module of the file (or package directory) ``target``, imported by its dotted name."""
    path = Path(target).resolve()
    if path.is_dir() and (path / "__init__.py").is_file():
        path = path / "__init__.py"
    if not path.is_file() or path.suffix != ".py":
        raise CLIError(f"no Python file '{target}' (from {os.getcwd()}); {_HOW}")
    root, module_name = _module_name(path)
    module = _import(module_name, root)
    loaded = getattr(module, "__file__", None)
    if loaded is None or Path(loaded).resolve() != path:
        raise CLIError(
            f"'{target}' would be imported as '{module_name}', a name already taken by"
            f" {loaded or 'a built-in module'}: rename the file, or {_HOW}"
        )
    return module


def _module_name(path: Path) -> tuple[Path, str]:
    """``(directory for sys.path, dotted name)`` of ``path``: up through its packages (the
    directories with an ``__init__.py``), as Flask's ``prepare_import`` does."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    directory = path.parent
    while (directory / "__init__.py").is_file() and directory.parent != directory:
        parts.insert(0, directory.name)
        directory = directory.parent
    return directory, ".".join(parts)


def _import(module_name: str, root: Path | None = None) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the project directory first
    if root is not None and (not sys.path or sys.path[0] != str(root)):
        sys.path.insert(0, str(root))  # a file's own directory comes first, as for `python file`
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(f"{exc.name}.")):
            raise CLIError(
                f"no module named '{exc.name}' (searched from {os.getcwd()}); {_HOW}"
            ) from None
        raise CLIError(f"importing '{module_name}' failed: {exc}") from None  # a missing dependency
    except (BrokerschedError, click.ClickException):
        raise
    except Exception as exc:
        traceback.print_exc()  # a bug in the application: its traceback is what helps
        raise CLIError(f"importing '{module_name}' failed: {type(exc).__name__}: {exc}") from None


def _call_factory(factory: Callable[..., object], spec: str) -> object:
    """A create_app-style factory, called with no arguments."""
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise CLIError(f"'{spec}' needs arguments; the CLI calls it with none") from None
    except ValueError:  # no signature to inspect (some builtins): just try
        pass
    try:
        return factory()
    except (BrokerschedError, click.ClickException):
        raise
    except Exception as exc:
        traceback.print_exc()
        raise CLIError(f"calling '{spec}' failed: {type(exc).__name__}: {exc}") from None


def _job(scheduler: Scheduler[Any], name: str, spec: str) -> Job:
    job = scheduler.get(name)
    if job is None:
        names = ", ".join(sorted(job.name for job in scheduler.jobs())) or "none"
        raise CLIError(f"no job named '{name}' in {spec} (jobs: {names})")
    return job


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, with backend and configuration errors as CLI errors."""
    try:
        return asyncio.run(coro)
    except BackendUnavailableError as exc:
        raise BackendDownError(f"backend unavailable: {exc}") from None
    except BackendError as exc:
        raise BackendDownError(f"backend error: {exc}") from None
    except ConfigurationError as exc:  # e.g. a missing extra, found when the backend starts
        raise CLIError(str(exc)) from None
    except (BrokerschedError, click.ClickException):
        raise
    except Exception as exc:  # the application's lifespan raised: its traceback helps there
        sys.stderr.write(redact_text(traceback.format_exc()))
        raise AppFailedError(f"the application failed: {type(exc).__name__}: {exc}") from None


# -- output helpers ------------------------------------------------------------------------


def _console() -> Console:
    # Piped output is not cut at 80 columns: a table row stays one line for grep.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=200 if wide else None, highlight=False)


def _clock_time(value: datetime) -> str:
    """``2027-01-15 08:00:00``, with milliseconds only when there are some."""
    text = value.strftime("%Y-%m-%d %H:%M:%S")
    return f"{text}.{value.microsecond // 1000:03d}" if value.microsecond else text


def _when(value: datetime, zone: tzinfo) -> str:
    local = value.astimezone(zone)
    return f"{_clock_time(local)} {local.strftime('%Z')}".strip()


def _utc(value: datetime) -> str:
    return f"{_clock_time(value.astimezone(UTC))}Z"


def _backend(scheduler: Scheduler[Any]) -> str:
    backend: Backend = scheduler.backend
    if "__repr__" not in vars(type(backend)):  # no useful repr: the class name will do
        return f"{backend.name}()"
    return redact_text(repr(backend))


def _duration_of(record: RunRecord) -> str:
    if record.finished_at is None:
        return "-"
    elapsed = record.finished_at - record.started_at
    if elapsed < timedelta(seconds=1):  # "0ms" rather than format_duration's "0s"
        return f"{elapsed // timedelta(milliseconds=1)}ms"
    return format_duration(elapsed)


_OUTCOME_STYLE = {"completed": "green", "failed": "red", "timed-out": "yellow"}


# -- the commands --------------------------------------------------------------------------


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="brokersched", prog_name="brokersched")
def cli() -> None:
    """Run scheduled jobs on every instance; each occurrence runs on exactly one.

    APP names the application's scheduler: MODULE:ATTR (app:scheduler, myapp.tasks:scheduler)
    or FILE.py:ATTR (./app.py:scheduler); ATTR may also be a function of no arguments that
    returns the scheduler.
    """


def _override_option(function: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--override",
        "overrides",
        metavar="JOB.OPTION=VALUE",
        multiple=True,
        help="Override a job's schedule or option (repeatable), over the application's "
        "overrides and BROKERSCHED_OVERRIDES: 'digest.daily.cron=0 * * * *', "
        "'purge.enabled=false', 'sync.jitter=5s'; VALUE is JSON when it parses as JSON.",
    )(function)


def _load(app: str, overrides: tuple[str, ...], *, collect: bool = False) -> Scheduler[Any]:
    """``load_scheduler`` and the ``--override`` options applied; an override naming no job
    is an error (unless ``collect``: ``check`` reports it with the others)."""
    scheduler = load_scheduler(app)
    given: dict[str, dict[str, Any]] = {}
    try:
        for text in overrides:
            job, option, value = cli_override(text)
            given.setdefault(job, {})[option] = value
        scheduler.add_overrides(given)
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None
    if not collect and (unknown := scheduler.override_errors()):
        raise CLIError(str(unknown[0]))
    return scheduler


def _log_options(function: Callable[..., None]) -> Callable[..., None]:
    function = click.option(
        "--log-level",
        default="info",
        show_default=True,
        type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    )(function)
    return click.option(
        "--log-format",
        default="text",
        show_default=True,
        type=click.Choice(["text", "json"]),
        help="json: one object per line, with the run's fields (job, run_id, outcome...).",
    )(function)


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (0: any free port, logged at start).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option(
    "--http",
    "http",
    metavar="HOST:PORT",
    help="Serve the admin API and dashboard (brokersched[web]), e.g. 127.0.0.1:8080; "
    "another address than loopback needs BROKERSCHED_ADMIN_TOKEN.",
)
@click.option(
    "--no-schedule",
    is_flag=True,
    help="Arm no job here (as BROKERSCHED_ENABLED=false): jobs stay listed and run on "
    "trigger (--http), e.g. on web replicas.",
)
@_override_option
@_log_options
def run(
    app: str,
    metrics_port: int | None,
    metrics_host: str,
    http: str | None,
    no_schedule: bool,
    overrides: tuple[str, ...],
    log_format: LogFormat,
    log_level: str,
) -> None:
    """Run the scheduler until SIGINT or SIGTERM, then drain running jobs."""
    configure_logging(log_format, log_level)
    scheduler = _load(app, overrides)
    if no_schedule:
        scheduler.enabled = False
    metrics = (metrics_host, metrics_port) if metrics_port is not None else None
    web = _admin_server(scheduler, http) if http is not None else None
    _run_async(_serve(scheduler, metrics, web, app))


def _admin_server(scheduler: Scheduler[Any], address: str) -> HTTPServer:
    try:
        from .web._serve import HTTPServer, parse_address
    except ImportError as exc:
        raise CLIError(f"--http needs {exc.name}: pip install 'brokersched[web]'") from None
    try:
        return HTTPServer(scheduler, *parse_address(address))
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None


async def _start_admin(web: HTTPServer) -> None:
    try:
        url = await web.start()
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise CLIError(f"cannot serve --http {web.address}: {why}") from None
    logger.info("serving the admin API and dashboard on %s", url, extra={"http_url": url})
    # How the buttons are used; never the token itself (this line goes to the logs).
    if web.token_set:
        logger.info(
            "dashboard buttons: sign in on the page with the admin token (the value of "
            "BROKERSCHED_ADMIN_TOKEN)"
        )
    else:
        logger.info(
            "dashboard read-only: set BROKERSCHED_ADMIN_TOKEN (16+ characters) for its "
            "trigger, pause and resume buttons"
        )


async def _serve(
    scheduler: Scheduler[Any],
    metrics: tuple[str, int] | None,
    web: HTTPServer | None = None,
    app: str = "the application",
) -> None:
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():  # a second signal: the user does not want to wait for the drain
            logger.warning("second %s: exiting now, without waiting for running jobs", name)
            _exit_now(EXIT_FAILED)
        logger.info("%s: stopping", name)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    server = _serve_metrics(scheduler, *metrics) if metrics is not None else None
    try:
        if web is not None:
            await _start_admin(web)
        await scheduler.start()
        _log_started(scheduler, app)
        stopped = asyncio.ensure_future(scheduler.wait_stopped())
        requested = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, requested}, return_when=asyncio.FIRST_COMPLETED)
        requested.cancel()
        stopped.cancel()
        drain = format_duration(scheduler.options.drain_timeout)
        logger.info(
            "draining running jobs (up to %s)", drain, extra={"running": _running(scheduler)}
        )
        await scheduler.stop()
        logger.info("stopped")
    finally:
        if web is not None:
            await web.stop()
        if server is not None:
            server.shutdown()
            server.server_close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if left := _running(scheduler):
        # stop() recorded them as abandoned; a sync handler's thread cannot be cancelled, and
        # the interpreter would wait for it at exit.
        logger.warning(
            "runs of %d job(s) outlived drain_timeout: exiting without waiting for them", left
        )
        _exit_now(EXIT_OK)


def _exit_now(code: int) -> NoReturn:
    logging.shutdown()  # flush the log lines written so far
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _running(scheduler: Scheduler[Any]) -> int:
    """How many jobs have a run going here."""
    return sum(job.is_running for job in scheduler.jobs())


def _log_started(scheduler: Scheduler[Any], app: str) -> None:
    backend = _backend(scheduler)
    jobs = scheduler.jobs()
    if not jobs:
        logger.warning(
            "%s registers no jobs: nothing will run (are the jobs registered on another "
            "Scheduler, or in a module %s does not import?)",
            app,
            app.rpartition(":")[0],
        )
    logger.info(
        "started %d job(s) on %s as instance %s%s",
        len(jobs),
        backend,
        scheduler.instance_id,
        "" if scheduler.enabled else " with scheduling disabled (jobs run on trigger only)",
        extra={
            "backend": backend,
            "jobs": [job.name for job in jobs],
            "instance_id": scheduler.instance_id,
            "enabled": scheduler.enabled,
        },
    )


def _serve_metrics(scheduler: Scheduler[Any], host: str, port: int) -> WSGIServer:
    from ._metrics import PrometheusMetrics

    try:
        import prometheus_client
    except ImportError:
        raise CLIError(
            "--metrics-port needs prometheus-client: pip install 'brokersched[prometheus]'"
        ) from None
    # The process-wide registry: the application's own metrics are served too.
    PrometheusMetrics(registry=prometheus_client.REGISTRY).attach(scheduler)
    try:
        server, _ = prometheus_client.start_http_server(
            port, addr=host, registry=prometheus_client.REGISTRY
        )
    except OSError as exc:
        raise CLIError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    bound = server.server_port
    logger.info(
        "serving metrics on http://%s:%d/metrics", host, bound, extra={"metrics_port": bound}
    )
    return server


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option("-n", "count", type=click.IntRange(0, 100), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job and line.")
@_override_option
def jobs(app: str, count: int, as_json: bool, overrides: tuple[str, ...]) -> None:
    """List the jobs, their keys, schedules, non-default options, overrides, whether they are
    enabled, and their next runs (no connection)."""
    scheduler = _load(app, overrides)
    if as_json:
        for job in scheduler.jobs():
            click.echo(json.dumps(_job_json(scheduler, job, count), separators=(",", ":")))
        return
    title = f"{app} on {_backend(scheduler)}"
    if not scheduler.enabled:
        title += " (scheduling disabled: jobs run on trigger only)"
    console = _console()
    if console.width < _WIDE:
        console.print(_narrow_jobs(scheduler, title, count))
        return
    table = Table(title=title, title_justify="left")
    columns = ("name", "key", "kind", "schedule", "zone", "options", "overrides", "enabled")
    for column in (*columns, f"next {count} runs"):
        table.add_column(column, overflow="fold")
    for job in scheduler.jobs():
        zone = _zone(job.schedule)
        enabled = job.enabled and scheduler.enabled
        upcoming = job.next_runs(count) if enabled else []
        runs = "\n".join(_when(when, zone) for when in upcoming) or "-"
        table.add_row(
            job.name,
            job.key,
            job.kind,
            job.describe(),
            timezone_name(zone),
            redact_text(_options(job)),  # data may hold a URL with its password
            redact_text(_shown_overrides(job)),
            "yes" if enabled else "no",
            runs,
        )
    console.print(table)


# Below this many columns (an 80-column terminal), tables drop or merge their less important
# columns; piped output is 200 wide and keeps them all (see _console).
_WIDE = 120


def _narrow_jobs(scheduler: Scheduler[Any], title: str, count: int) -> Table:
    """The jobs in four columns: the key under the name when it differs, the zone in the
    schedule, the overrides with the options, "disabled" instead of the next runs."""
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
        enabled = job.enabled and scheduler.enabled
        runs = "\n".join(_when(when, zone) for when in job.next_runs(count)) if enabled else ""
        table.add_row(
            name, schedule, redact_text(options), runs or ("-" if enabled else "disabled")
        )
    return table


def _job_json(scheduler: Scheduler[Any], job: Job, count: int) -> dict[str, Any]:
    """A job as ``jobs --json`` prints it; every key always there. ``data`` is only said to be
    there (``"***"``), as in the admin API."""
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
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run and line.")
def next_(
    expression: str | None,
    zone_name: str,
    count: int,
    after: str | None,
    every: str | None,
    offset: str | None,
    as_json: bool,
) -> None:
    """Preview a schedule: a cron EXPRESSION in --timezone, or --every INTERVAL."""
    try:
        zone = parse_timezone(zone_name)
        trigger = _preview_trigger(expression, zone, every, offset)
        start = _parse_after(after, zone)
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None
    if as_json:
        for number, when in enumerate(trigger.next_runs(count, start), 1):
            local = when.astimezone(zone)
            row = {
                "n": number,
                "local": local.isoformat(timespec="milliseconds"),
                "zone": timezone_name(zone),
                "utc_offset": _offset(local),
                "utc": iso(when),
            }
            click.echo(json.dumps(row, separators=(",", ":")))
        return
    table = Table(title=trigger.describe(), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column(f"local ({timezone_name(zone)})")
    table.add_column("UTC offset")
    table.add_column("UTC")
    for number, when in enumerate(trigger.next_runs(count, start), 1):
        local = when.astimezone(zone)
        table.add_row(str(number), f"{local:%a} {_clock_time(local)}", _offset(local), _utc(when))
    _console().print(table)


def _preview_trigger(
    expression: str | None, zone: tzinfo, every: str | None, offset: str | None
) -> Trigger:
    if every is not None:
        if expression is not None:
            raise CLIError("give a cron EXPRESSION or --every, not both")
        period = parse_duration(every, name="--every")
        shift = parse_duration(offset, name="--offset") if offset is not None else timedelta(0)
        return IntervalTrigger(period, shift)
    if expression is None:
        raise CLIError("give a cron EXPRESSION (e.g. '0 8 * * MON-FRI') or --every INTERVAL")
    if offset is not None:
        raise CLIError("--offset goes with --every")
    return parse_cron(expression, zone)


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
@_override_option
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
    scheduler = _load(app, overrides)
    chosen = [_job(scheduler, job_name, app)] if job_name is not None else scheduler.jobs()
    records = _run_async(_read_histories(scheduler, chosen, limit))
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
    console = _console()
    every_job = job_name is None
    if console.width < _WIDE:
        console.print(_narrow_history(records, by_key, title, every_job=every_job))
    else:
        console.print(_wide_history(records, by_key, title, every_job=every_job))
    if tracebacks:
        _print_tracebacks(console, records, by_key)


def _wide_history(
    records: list[RunRecord], by_key: dict[str, Job], title: str, *, every_job: bool
) -> Table:
    table = Table(title=title, title_justify="left")
    columns = ["started (UTC)", "slot (UTC)", "outcome", "duration", "reason", "attempt"]
    if every_job:
        columns.insert(1, "job")
    for column in columns:
        table.add_column(column)
    for column in ("instance", "run id", "error"):
        table.add_column(column, overflow="fold")
    for record in records:
        style = _OUTCOME_STYLE.get(record.outcome, "magenta")
        cells = [
            _utc(record.started_at),
            _utc(ms_to_datetime(record.slot_ms)),
            f"[{style}]{record.outcome}[/]",
            _duration_of(record),
            record.reason,
            str(record.attempt),
            record.instance_id,
            record.run_id,
            _shown(record.error, by_key.get(record.job)),
        ]
        if every_job:
            cells.insert(1, _job_name(record, by_key))
        table.add_row(*cells)
    return table


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
    table.add_column("error", overflow="fold", min_width=20, ratio=2)
    for record in records:
        style = _OUTCOME_STYLE.get(record.outcome, "magenta")
        why: str = "" if record.reason == "schedule" else record.reason
        if record.attempt > 1:
            why = f"{why} #{record.attempt}".strip()
        cells = [
            record.started_at.astimezone(UTC).strftime("%m-%d %H:%M:%S"),
            f"[{style}]{record.outcome}[/]",
            _duration_of(record),
            why,
            _shown(record.error, by_key.get(record.job)),
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
@_override_option
def instances(app: str, as_json: bool, overrides: tuple[str, ...]) -> None:
    """List the fleet's instances as they publish themselves through the backend: liveness
    (alive; late after 1.5 heartbeats without one; dead after 3; stopped), host, pid,
    version, last seen, and the runs each has in progress."""
    configure_logging("text", "WARNING", quiet_clients=True)
    scheduler = _load(app, overrides)
    if not scheduler.backend.fleet:
        raise CLIError(f"{_backend(scheduler)} keeps no presence of the fleet's instances")
    found = _run_async(_read_instances(scheduler))
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
    title = f"{app} on {_backend(scheduler)}: {len(found)} instances"
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
            f"{_ago(now - instance.last_seen)} ago",
            _ago(instance.last_seen - instance.started_at),
            running or "-",
        )
    _console().print(table)


def _ago(elapsed: timedelta) -> str:
    seconds = max(0, int(elapsed.total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    return format_duration(timedelta(minutes=seconds // 60))


async def _read_instances(scheduler: Scheduler[Any]) -> list[Instance]:
    backend: Backend = scheduler.backend
    await backend.start(scheduler.clock)
    try:
        return await backend.instances()
    finally:
        await backend.stop()


def _shown(text: str | None, job: Job | None) -> str:
    """An error or a traceback as the CLI shows it (redacted as the admin API shows it;
    ``""``: none)."""
    return shown_error(text, job) if text else ""


def _print_tracebacks(console: Console, records: list[RunRecord], by_key: dict[str, Job]) -> None:
    failed = [record for record in records if record.traceback]
    if not failed:
        console.print("no tracebacks in these runs", markup=False)
    for record in failed:
        console.print()
        heading = f"{record.outcome} run {record.run_id} of {record.job}"
        console.print(f"{heading}, started {_utc(record.started_at)}:", markup=False)
        # Printed as is (no markup, no highlighting), folded to the terminal's width.
        text = _shown(record.traceback, by_key.get(record.job))
        console.print(text, markup=False, overflow="fold")


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.argument("job_name", metavar="JOB")
@_override_option
@_log_options
def trigger(
    app: str, job_name: str, overrides: tuple[str, ...], log_format: LogFormat, log_level: str
) -> None:
    """Run JOB once now, through the claim; nothing else runs meanwhile."""
    configure_logging(log_format, log_level, quiet_clients=True)
    scheduler = _load(app, overrides)
    job = _job(scheduler, job_name, app)
    record, skips = _run_async(_trigger(scheduler, job))
    if record is None:
        reason = skips[-1] if skips else "the claim was refused"
        _fail(f"job '{job.name}' did not run: {reason}")
    summary = f"job '{job.name}' {record.outcome} in {_duration_of(record)}"
    summary += f" (run {record.run_id} on {record.instance_id})"
    if record.outcome != "completed":
        _fail(f"{summary}: {record.error}")
    click.echo(summary)


def _fail(message: str) -> NoReturn:
    click.echo(redact_text(message), err=True)
    sys.exit(EXIT_FAILED)


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
@_override_option
@_log_options
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
    zone = _zone_option(zone_name)
    first, last = _instant("--from", start, zone), _instant("--to", end, zone)
    per_s = _rate(rate)
    scheduler = _load(app, overrides)
    job = _job(scheduler, job_name, app)
    if dry_run and (missing := _run_async(_missing_store(scheduler.backend, job))) is not None:
        _fail(missing)
    steps = _run_async(_backfill(scheduler, job, first, last, per_s, dry_run))
    counts: dict[str, int] = {}
    for step in steps:
        key = step.record.outcome if step.record is not None else step.status
        counts[key] = counts.get(key, 0) + 1
    said = ", ".join(f"{count} {key}" for key, count in counts.items()) or "no slot in the range"
    verb = "would backfill" if dry_run else "backfilled"
    click.echo(f"{verb} job '{job.name}': {said}")
    if any(key in FAILURES or key in ("skipped", "stopped") for key in counts):
        sys.exit(EXIT_FAILED)


def _zone_option(name: str) -> tzinfo:
    try:
        return parse_timezone(name)
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None


def _instant(option: str, text: str, zone: tzinfo) -> datetime:
    if text.strip().lower() == "now":
        return datetime.now(UTC)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CLIError(f"{option} {text!r} is not an ISO 8601 time (2027-01-15T08:00)") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=zone)


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
        line = f"[{step.index:>{width}}/{step.total}] {_utc(step.at)} {step.status}"
        if step.record is not None:
            line += f": {step.record.outcome} in {_duration_of(step.record)}"
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


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@_override_option
def check(app: str, overrides: tuple[str, ...]) -> None:
    """Report every configuration error of the application's jobs and overrides (no
    connection)."""
    # What registration logs (a past at()) is printed below as a warning, with the others.
    configure_logging("text", "ERROR", quiet_clients=True)
    try:
        with collect_errors() as collected:
            scheduler = _load(app, overrides, collect=True)
    except AppConfigurationError as exc:
        for error in [*collected, *exc.error.all_errors]:
            click.echo(redact_text(f"error: {error}"), err=True)
        if exc.error.job is None:  # a backend's or the scheduler's own options, not a job
            _fail(
                f"{app} could not be loaded, so its jobs were not checked; fix it and check again"
            )
        _fail(
            "registration stopped at this job, so the jobs after it were not checked; "
            "fix it and run check again"
        )
    errors = scheduler.check()
    for error in errors:
        click.echo(redact_text(f"error: {error}"), err=True)
    if errors:
        _fail(f"{len(errors)} configuration error{'s' if len(errors) > 1 else ''}")
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


# -- operations: purge and doctor -------------------------------------------------------------


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
    scheduler = _load(app, ())
    backend: Backend = scheduler.backend
    jobs = [job.key for job in scheduler.jobs()]
    found, presence = _run_async(_survey(backend, namespace, jobs, _recent_slots(scheduler)))
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
        _fail(
            "refused: an instance of the prefix seems to run (see above); stop every instance "
            "and run purge again a minute later, or pass --force"
        )
    if isinstance(presence, str) and not force:
        _fail(
            "refused: cannot tell whether an instance of the prefix runs (see above); stop "
            "every instance, then pass --force"
        )
    if live or isinstance(presence, str):
        click.echo("warning: --force: removing while an instance may run", err=True)
    if not found.objects:
        click.echo("nothing to remove")
        return
    left = _run_async(_purge(backend, found))
    # What the backend kept on purpose says so in a note ("schema app kept: it holds ...").
    kept = {item for item in found.objects if any(f" {item.name} kept" in n for n in left.unknown)}
    removed = len({*found.objects} - {*left.objects} - kept)
    click.echo(f"removed {removed} object{'' if removed == 1 else 's'}")
    for note in left.unknown:
        click.echo(redact_text(f"not removed: {note}"))
    if left.objects:
        _show_inventory(left, "left")
        _fail(f"{len(left.objects)} object(s) could not be removed")


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
            f"last seen {_ago(now - seen)} ago, at {_utc(seen)} (heartbeat "
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
    scheduler = _load(app, ())
    backend: Backend = scheduler.backend
    findings: list[Finding] = _run_async(backend.doctor(slots=_slots_ahead(scheduler)))
    errors = sum(finding.severity == "error" for finding in findings)
    if as_json:
        report = {
            "backend": _backend(scheduler),
            "errors": errors,
            "findings": [finding.to_dict() for finding in findings],
        }
        click.echo(redact_text(json.dumps(report, indent=2)))
    else:
        table = Table(title=f"{app} on {_backend(scheduler)}", title_justify="left")
        for column in ("severity", "check", "found", "consequence", "fix"):
            table.add_column(column, overflow="fold")
        for finding in findings:
            style = _SEVERITY_STYLE[finding.severity]
            table.add_row(
                f"[{style}]{finding.severity}[/]",
                finding.check,
                *(redact_text(text) for text in (finding.found, finding.consequence, finding.fix)),
            )
        _console().print(table)
    if errors:
        _fail(
            f"{errors} error{'s' if errors > 1 else ''}: a slot could run twice or the server hang"
        )


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option(
    "--instances", type=click.IntRange(1, 16), default=3, show_default=True,
    help="At most this many instances at once (kills and deploys start more).",
)  # fmt: skip
@click.option(
    "--hours", type=click.FloatRange(0.01, 24 * 31), default=1.0, show_default=True,
    help="Virtual hours per seed; time with nothing due is skipped.",
)  # fmt: skip
@click.option("--seeds", type=click.IntRange(1), default=10, show_default=True)
@click.option("--first", type=click.IntRange(0), default=0, help="The first seed of --seeds.")
@click.option("--seed", type=click.IntRange(0), help="Replay one seed, printing its steps.")
@click.option(
    "--real-handlers", is_flag=True,
    help="Call the application's handlers, in virtual time, in place of timed stand-ins.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
@_override_option
def simulate(
    app: str,
    instances: int,
    hours: float,
    seeds: int,
    first: int,
    seed: int | None,
    real_handlers: bool,
    as_json: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run APP's jobs through the fleet simulator: instances killed, deployed, cut off from
    the backend, their clocks stepped, under manual runs, backfills and pauses, on a model of
    APP's backend, in virtual time; no server is used. Report per job the slots that ran
    twice, never, or overlapped, with the seed that replays each. Exit 1 if any did."""
    from .testing import _sim_app

    configure_logging("text", "ERROR", quiet_clients=True)
    scheduler = _load(app, overrides)
    try:
        read = _sim_app.read_app(scheduler)
    except ValueError as exc:
        raise CLIError(f"{app}: {exc}") from None
    chosen = [seed] if seed is not None else list(range(first, first + seeds))
    say = _sim_app.progress(app, verbose=seed is not None) if not as_json else None
    report = _sim_app.simulate_app(
        read, chosen, hours=hours, instances=instances, real_handlers=real_handlers, each=say
    )
    if as_json:
        click.echo(redact_text(json.dumps(report.to_json(), indent=2)))
    else:
        _console().print(_sim_app.table(report, app))
        click.echo(_sim_app.summary(report, app))
    if not report.ok:
        sys.exit(EXIT_FAILED)


def main() -> None:
    """The console script: ``brokersched``."""
    cli(prog_name="brokersched")


if __name__ == "__main__":  # pragma: no cover - `python -m brokersched` goes through __main__
    main()

"""Loading the application named by APP (with its ``--override`` options), the errors that end a
command in one line on stderr, and the exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Coroutine, Generator
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import Any, NoReturn, TypeGuard, TypeVar

import click

from .._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ConfigurationError,
)
from .._overrides import cli_override
from .._redact import redact_text
from .._scheduler import Job, Scheduler
from .._timezones import parse_timezone

__all__ = [
    "EXIT_BACKEND",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "AppConfigurationError",
    "AppFailedError",
    "BackendDownError",
    "CLIError",
    "fail",
    "find_job",
    "load_app",
    "load_scheduler",
    "log_options",
    "override_option",
    "parse_instant",
    "parse_zone",
    "run_async",
]

T = TypeVar("T")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BACKEND = 0, 1, 2, 3


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


def find_job(scheduler: Scheduler[Any], name: str, spec: str) -> Job:
    job = scheduler.get(name)
    if job is None:
        names = ", ".join(sorted(job.name for job in scheduler.jobs())) or "none"
        raise CLIError(f"no job named '{name}' in {spec} (jobs: {names})")
    return job


def run_async(coro: Coroutine[Any, Any, T]) -> T:
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


def override_option(function: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--override",
        "overrides",
        metavar="JOB.OPTION=VALUE",
        multiple=True,
        help="Override a job's schedule or option (repeatable), over the application's "
        "overrides and BROKERSCHED_OVERRIDES: 'digest.daily.cron=0 * * * *', "
        "'purge.enabled=false', 'sync.jitter=5s'; VALUE is JSON when it parses as JSON.",
    )(function)


def load_app(app: str, overrides: tuple[str, ...], *, collect: bool = False) -> Scheduler[Any]:
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


def log_options(function: Callable[..., None]) -> Callable[..., None]:
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


def parse_zone(name: str) -> tzinfo:
    """A ``--timezone`` option's zone."""
    try:
        return parse_timezone(name)
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None


def parse_instant(option: str, text: str, zone: tzinfo) -> datetime:
    """An instant option's value: ISO 8601 (naive: in ``zone``) or ``now``."""
    if text.strip().lower() == "now":
        return datetime.now(UTC)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CLIError(f"{option} {text!r} is not an ISO 8601 time (2027-01-15T08:00)") from None
    if value.tzinfo is not None:
        return value
    local = value.replace(tzinfo=zone)
    # A wall time the clocks skip (spring forward) does not come back from UTC as itself; one
    # they repeat (fall back) has two offsets: neither is guessed.
    if local.astimezone(UTC).astimezone(zone).replace(tzinfo=None) != value:
        raise CLIError(
            f"{option} {text} does not exist in {zone} (the clocks go forward over it): give"
            " an offset (2027-03-28T03:30+02:00)"
        )
    if local.utcoffset() != local.replace(fold=1).utcoffset():
        raise CLIError(
            f"{option} {text} happens twice in {zone} (the clocks go back over it): give an"
            " offset to say which"
        )
    return local


def fail(message: str) -> NoReturn:
    click.echo(redact_text(message), err=True)
    sys.exit(EXIT_FAILED)

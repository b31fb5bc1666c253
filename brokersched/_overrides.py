"""Per-deployment overrides: a job's schedule and options replaced from configuration.

``Scheduler(overrides={"digest.daily": {"cron": "0 * * * *"}, "purge": {"enabled": False}})``,
``BROKERSCHED_OVERRIDES`` (the same, as JSON) or ``brokersched ... --override
digest.daily.cron='0 * * * *'``. An override holds the job's schedule under the name of its
kind (``every``, ``cron``, ``at``, ``after``'s ``delay``), ``enabled``, and job options; it is
validated with the rules of registration when the job registers.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ._exceptions import ConfigurationError

__all__ = [
    "SCHEDULE_KEYS",
    "Overrides",
    "check_override_options",
    "cli_override",
    "overrides_from_env",
    "parse_overrides",
    "unknown_jobs",
]

Overrides = dict[str, dict[str, Any]]
ENV = "BROKERSCHED_OVERRIDES"
# The key that replaces the schedule of each kind of job.
SCHEDULE_KEYS = {"every": "every", "cron": "cron", "at": "at", "after": "delay"}
_EXAMPLE = '{"digest.daily": {"cron": "0 * * * *"}, "purge": {"enabled": false}}'


def parse_overrides(value: object, source: str = "overrides") -> Overrides:
    """Check the shape (a mapping of job names to mappings of options) and copy it."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{source} must map job names to their overrides, such as {_EXAMPLE}; "
            f"got {type(value).__name__}",
            option="overrides",
        )
    parsed: Overrides = {}
    for job, options in value.items():
        if not isinstance(job, str) or not isinstance(options, Mapping):
            raise ConfigurationError(
                f"{source}[{job!r}] must be a mapping of options, such as "
                f'{{"cron": "0 * * * *"}} or {{"enabled": false}}; got {options!r}',
                option="overrides",
                job=job if isinstance(job, str) else None,
            )
        parsed[job] = {str(option): option_value for option, option_value in options.items()}
    return parsed


def overrides_from_env(environ: Mapping[str, str]) -> Overrides:
    """``BROKERSCHED_OVERRIDES``: a JSON object; unset or empty: no overrides."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"{ENV} is not valid JSON ({exc}); expected an object such as {_EXAMPLE}",
            option="overrides",
        ) from None
    return parse_overrides(value, ENV)


def cli_override(text: str) -> tuple[str, str, Any]:
    """``JOB.OPTION=VALUE`` (``--override``): the value is JSON when it parses as JSON
    (``3``, ``false``, ``{"a": 1}``), a string otherwise (``0 * * * *``, ``5m``)."""
    target, sep, raw = text.partition("=")
    job, dot, option = target.strip().rpartition(".")
    if not sep or not dot or not job or not option:
        raise ConfigurationError(
            f"--override {text!r} is not JOB.OPTION=VALUE, such as "
            "'digest.daily.cron=0 * * * *' or 'purge.enabled=false'",
            option="overrides",
        )
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return job, option, value


def unknown_jobs(overrides: Overrides, names: Iterable[str]) -> list[ConfigurationError]:
    """An error per override that names no registered job, with the closest name."""
    known = list(names)
    errors = []
    for job in overrides:
        if job in known:
            continue
        close = difflib.get_close_matches(job, known, n=1, cutoff=0.6)
        hint = (
            f"; did you mean '{close[0]}'?" if close else f" (jobs: {', '.join(known) or 'none'})"
        )
        errors.append(
            ConfigurationError(f"overrides: no job '{job}'{hint}", option="overrides", job=job)
        )
    return errors


def check_override_options(
    job: str, schedule_key: str, override: Iterable[str], options: Iterable[str]
) -> None:
    """Refuse a key of ``job``'s override that is neither its schedule, ``enabled`` nor a job
    option, naming the closest one and every key an override of that job takes."""
    valid = [schedule_key, "enabled", *options]
    for option in override:
        if option in valid:
            continue
        close = difflib.get_close_matches(option, valid, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigurationError(
            f"job '{job}': override '{option}' is not an option{hint} (an override of this "
            f"job takes: {', '.join(valid)})",
            option=option,
            job=job,
        )

"""Scheduler and job options, and the validation matrix.

Options are frozen pydantic models; durations become ``timedelta`` once, here, at the edge. The
matrix reads only the backend's ``Capabilities``, never its class, so a third-party backend gets
the same checks by declaring what it can do.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta, tzinfo
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
)

from ._durations import format_duration, parse_duration, to_ms
from ._exceptions import ConfigurationError
from ._retry import Retry, parse_retry
from ._timezones import parse_timezone
from .abc import Capabilities, JobPolicy
from .triggers.cron import parse_dst

__all__ = [
    "NAME_PATTERN",
    "JobOptions",
    "JobSettings",
    "Kind",
    "SchedulerOptions",
    "check_name",
    "check_scheduler_options",
    "enabled_from_env",
    "job_errors",
    "parse_job_options",
    "parse_scheduler_options",
    "resolve_job",
    "validation_error",
]

# A fleet boot run is claimed under "<key>:start", itself a name (see _boot).
_BOOT_KEY_MAX = 128 - len(":start")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_$][A-Za-z0-9_.:$-]{0,127}")
_NAME_RULE = (
    "use 1-128 characters, letters, digits and '_' '$' (first), then also '.' ':' '-' "
    "(pattern ^[A-Za-z0-9_$][A-Za-z0-9_.:$-]{0,127}$)"
)
Kind = Literal["every", "cron", "at", "after"]
# after() runs once, when its delay has passed: no schedule to be late on, nothing to catch up.
NOT_AFTER = ("jitter", "max_late", "overlap", "max_attempts", "catch_up")
LEASE_ONLY = ("overlap", "max_attempts", "catch_up")


def _duration(value: Any, info: Any) -> timedelta:
    return parse_duration(value, name=info.field_name)


def _timezone(value: Any) -> tzinfo:
    return parse_timezone(value)


DurationOption = Annotated[timedelta, BeforeValidator(_duration)]
TimezoneOption = Annotated[Any, BeforeValidator(_timezone)]
RetryOption = Annotated[Any, BeforeValidator(parse_retry)]
DstOption = Annotated[Any, BeforeValidator(parse_dst)]


class SchedulerOptions(BaseModel):
    """``Scheduler(...)``'s keyword options; job options fall back on these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    jitter: DurationOption = timedelta(seconds=2)
    max_late: DurationOption = timedelta(seconds=60)
    timezone: TimezoneOption = "UTC"
    history_size: int = Field(default=1000, ge=1)
    history_ttl: DurationOption | None = None
    drain_timeout: DurationOption = timedelta(seconds=10)
    instance_id: str | None = Field(default=None, min_length=1, max_length=200)
    record_buffer: int = Field(default=1000, ge=1)
    #: Whether a run's record keeps what its handler returned (``RunRecord.result``).
    record_results: StrictBool = True
    #: How often the instance publishes its presence and reads the fleet's controls.
    heartbeat: DurationOption = timedelta(seconds=5)

    @field_validator("heartbeat")
    @classmethod
    def _heartbeat_range(cls, value: timedelta) -> timedelta:
        if not HEARTBEAT_MIN <= value <= HEARTBEAT_MAX:
            raise ConfigurationError(
                f"heartbeat ({format_duration(value)}) must be between "
                f"{format_duration(HEARTBEAT_MIN)} and {format_duration(HEARTBEAT_MAX)}",
                option="heartbeat",
            )
        return value


HEARTBEAT_MIN = timedelta(milliseconds=100)
HEARTBEAT_MAX = timedelta(seconds=60)


class JobOptions(BaseModel):
    """What the user passed to ``every``/``cron``/``at``; ``None`` means "the default"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    jitter: DurationOption | None = None
    max_late: DurationOption | None = None
    timeout: DurationOption | None = None
    overlap: Literal["skip", "allow", "replace"] | None = None
    max_attempts: int | None = Field(default=None, ge=1)
    catch_up: DurationOption | None = None
    history_size: int | None = Field(default=None, ge=1)
    history_ttl: DurationOption | None = None
    offset: DurationOption | None = None
    timezone: TimezoneOption | None = None
    dst: DstOption | None = None
    data: Any = None
    claim: StrictBool = True
    key: str | None = None
    run_on_start: StrictBool = False
    retry: RetryOption = None


@dataclass(frozen=True, slots=True)
class JobSettings:
    """A job's options with every default applied and every rule checked."""

    policy: JobPolicy
    jitter_ms: int
    max_late_ms: int
    timeout: timedelta | None
    catch_up_ms: int
    data: Any
    claim: bool
    key: str  # claims, leases, fencing and history are kept under it (default: the name)
    retry: Retry | None = None  # how a failed run is run again (``_runner``)


def validation_error(
    exc: ValidationError,
    model: type[BaseModel],
    job: str | None = None,
    *,
    backend: str | None = None,
) -> ConfigurationError:
    """Pydantic's first error as ours, prefixed with the job, the backend or ``Scheduler`` it
    belongs to. A validator's own ``ConfigurationError`` of a backend is raised as it is: its
    message names the backend already."""
    owner = f"job '{job}'" if job is not None else backend or "Scheduler"
    error = exc.errors()[0]
    option = str(error["loc"][0]) if error["loc"] else None
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigurationError) and backend is not None:
        return cause
    if isinstance(cause, ConfigurationError):
        message = str(cause)
    elif error["type"] == "extra_forbidden" and option is not None:
        close = difflib.get_close_matches(option, list(model.model_fields), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        valid = ", ".join(model.model_fields)
        message = f"unknown option '{option}'{hint} (valid options: {valid})"
    else:
        message = f"option '{option}' = {error.get('input')!r} is invalid: {error['msg']}"
    return ConfigurationError(f"{owner}: {message}", option=option, job=job, backend=backend)


def parse_job_options(job: str, options: dict[str, Any]) -> JobOptions:
    """Validate the raw keyword options of one job."""
    try:
        return JobOptions(**options)
    except ValidationError as exc:
        raise validation_error(exc, JobOptions, job) from None


def parse_scheduler_options(options: dict[str, Any]) -> SchedulerOptions:
    try:
        return SchedulerOptions(**options)
    except ValidationError as exc:
        raise validation_error(exc, SchedulerOptions, None) from None


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ConfigurationError(
            f"job name {name!r} is not valid: {_NAME_RULE}",
            option="name",
            job=name if isinstance(name, str) else None,
        )
    return name


def check_scheduler_options(options: SchedulerOptions, caps: Capabilities, backend: str) -> None:
    if options.history_ttl is not None and not caps.history_ttl:
        raise ConfigurationError(
            f"Scheduler: option 'history_ttl' is not supported by {backend}: it trims history by "
            "count only; use history_size",
            option="history_ttl",
            backend=backend,
        )


def resolve_job(
    job: str,
    kind: Kind,
    gap: timedelta | None,
    options: JobOptions,
    defaults: SchedulerOptions,
    caps: Capabilities,
    backend: str,
) -> JobSettings:
    """Apply defaults and check every rule; raises the first ``ConfigurationError`` found."""
    errors = job_errors(job, kind, gap, options, defaults, caps, backend)
    if errors:
        errors[0].all_errors = errors
        raise errors[0]
    return _settings(job, gap, options, defaults, caps)


def _default_jitter(
    gap: timedelta | None, options: JobOptions, defaults: SchedulerOptions
) -> timedelta:
    if options.jitter is not None:
        return options.jitter
    return defaults.jitter if gap is None else min(defaults.jitter, gap / 4)


def _settings(
    job: str,
    gap: timedelta | None,
    options: JobOptions,
    defaults: SchedulerOptions,
    caps: Capabilities,
) -> JobSettings:
    catch_up = options.catch_up
    if catch_up is None:
        catch_up = timedelta(minutes=5) if caps.leases and options.claim else timedelta(0)
    policy = JobPolicy(
        name=options.key or job,
        history_size=options.history_size or defaults.history_size,
        history_ttl=options.history_ttl or defaults.history_ttl,
        overlap=options.overlap or "skip",
        max_attempts=options.max_attempts or 3,
        retry_window=max(catch_up, options.max_late or defaults.max_late),
    )
    return JobSettings(
        policy=policy,
        jitter_ms=to_ms(_default_jitter(gap, options, defaults)),
        max_late_ms=to_ms(options.max_late or defaults.max_late),
        timeout=options.timeout,
        catch_up_ms=to_ms(catch_up),
        data=options.data,
        claim=options.claim,
        key=options.key or job,
        retry=options.retry,
    )


def job_errors(
    job: str,
    kind: Kind,
    gap: timedelta | None,
    options: JobOptions,
    defaults: SchedulerOptions,
    caps: Capabilities,
    backend: str,
) -> list[ConfigurationError]:
    """Every rule of the option table that ``options`` break on this backend, in table order."""
    errors: list[ConfigurationError] = []

    def refuse(option: str, message: str, *, with_backend: bool = False) -> None:
        errors.append(
            ConfigurationError(
                f"job '{job}': {message}",
                option=option,
                backend=backend if with_backend else None,
                job=job,
            )
        )

    given = options.model_fields_set
    if kind == "after":
        for option in NOT_AFTER:
            if option in given and getattr(options, option) is not None:
                refuse(
                    option,
                    f"option '{option}' does not apply to after(): it runs once, when its delay "
                    "has passed",
                )
    for option in LEASE_ONLY:
        if kind == "after":
            break
        if option in given and getattr(options, option) is not None and not caps.leases:
            refuse(
                option,
                f"option '{option}' ({_shown(getattr(options, option))}) needs a lease backend; "
                f"{backend} only claims slots (use SQLiteBackend, PostgresBackend, "
                "RedisLeaseBackend or NATSLeaseBackend, or guard inside the job)",
                with_backend=True,
            )
    if kind == "at" and options.overlap is not None:
        refuse(
            "overlap", "option 'overlap' does not apply to at(): a one-off job has no previous run"
        )
    if not options.claim:
        for option in ("max_attempts", "catch_up"):
            if getattr(options, option) is not None:
                refuse(option, f"option '{option}' needs claim=True: an unclaimed job has no lease")
    if options.offset is not None and kind != "every":
        refuse("offset", f"option 'offset' applies to every() only, not to {kind}()")
    if options.run_on_start and kind not in ("every", "cron"):
        refuse(
            "run_on_start",
            f"option 'run_on_start' applies to every() and cron() only, not to {kind}()",
        )
    if options.timezone is not None and kind != "cron":
        refuse("timezone", f"option 'timezone' applies to cron() only, not to {kind}()")
    if options.dst is not None and kind != "cron":
        refuse("dst", f"option 'dst' applies to cron() only, not to {kind}()")
    if options.key is not None and not NAME_PATTERN.fullmatch(options.key):
        refuse("key", f"option 'key' {options.key!r} is not valid: {_NAME_RULE}")
    key = options.key or job
    if options.claim and (kind == "after" or options.run_on_start) and len(key) > _BOOT_KEY_MAX:
        refuse(
            "key",
            f"key '{key}' is too long for a boot run claimed once per fleet: it is claimed under "
            f"'<key>:start', at most 128 characters; give it a key of at most {_BOOT_KEY_MAX}",
        )
    history_ttl = options.history_ttl or defaults.history_ttl
    if history_ttl is not None and not caps.history_ttl:
        refuse(
            "history_ttl",
            f"option 'history_ttl' is not supported by {backend}: it trims history by count "
            "only; use history_size",
            with_backend=True,
        )
    for option in ("max_late", "timeout", "history_ttl"):
        value = getattr(options, option)
        if value is not None and value <= timedelta(0):
            refuse(option, f"{option} ({format_duration(value)}) must be greater than 0")
    if options.data is not None:
        try:
            json.dumps(options.data)
        except (TypeError, ValueError) as exc:
            refuse("data", f"option 'data' must be JSON-serialisable: {exc}")
    if kind != "after":  # no slot to be late on; its boot windows are claimed apart
        errors.extend(_timing_errors(job, gap, options, defaults, caps, backend))
    retry_error = _retry_error(job, gap, options, caps)
    if retry_error is not None:
        errors.append(retry_error)
    return errors


def _retry_error(
    job: str, gap: timedelta | None, options: JobOptions, caps: Capabilities
) -> ConfigurationError | None:
    """With ``overlap="skip"`` enforced (a lease backend, or ``claim=False`` on this instance),
    the retries of a slot hold it (its lease) until the last one ends: a schedule whose worst
    case reaches the next slot would skip that slot, so it is refused."""
    retry: Retry | None = options.retry
    if retry is None or gap is None or retry.attempts == 1:
        return None
    if (options.overlap or "skip") != "skip" or not (caps.leases or not options.claim):
        return None
    worst, said = retry.worst_case(options.timeout)
    if worst < gap:
        return None
    return ConfigurationError(
        f"job '{job}': retry's worst case ({said}) does not end before the next slot "
        f"({format_duration(gap)} apart) with overlap='skip': the retries would hold the slot "
        "and skip the next one; lower attempts, backoff or max_backoff, set a deadline under "
        f"{format_duration(gap)} with a timeout, or use overlap='allow'",
        option="retry",
        job=job,
    )


def _timing_errors(
    job: str,
    gap: timedelta | None,
    options: JobOptions,
    defaults: SchedulerOptions,
    caps: Capabilities,
    backend: str,
) -> list[ConfigurationError]:
    jitter = _default_jitter(gap, options, defaults)
    max_late = options.max_late or defaults.max_late
    errors: list[ConfigurationError] = []
    if gap is not None and jitter >= gap / 2:
        errors.append(
            ConfigurationError(
                f"job '{job}': jitter ({format_duration(jitter)}) must be under half the time "
                f"between runs ({format_duration(gap)}), i.e. under {format_duration(gap / 2)}",
                option="jitter",
                job=job,
            )
        )
    if max_late <= jitter:
        errors.append(
            ConfigurationError(
                f"job '{job}': max_late ({format_duration(max_late)}) must be greater than "
                f"jitter ({format_duration(jitter)})",
                option="max_late",
                job=job,
            )
        )
    memory = caps.slot_memory
    margin = caps.claim_margin
    if options.claim and memory is not None and jitter + margin >= memory:
        errors.append(
            ConfigurationError(
                f"job '{job}': slot_ttl ({format_duration(memory)}) of {backend} leaves no time "
                f"to claim a slot: claims stop {format_duration(margin)} before it ends (its "
                "max_clock_skew, and the flight of a claim), and jitter "
                f"({format_duration(jitter)}) comes first; raise slot_ttl above "
                f"{format_duration(jitter + margin)}, or lower max_clock_skew or jitter",
                option="slot_ttl",
                backend=backend,
                job=job,
            )
        )
    if options.claim and memory is not None and jitter + max_late >= memory:
        errors.append(
            ConfigurationError(
                f"job '{job}': jitter ({format_duration(jitter)}) + max_late "
                f"({format_duration(max_late)}) must be shorter than slot_ttl "
                f"({format_duration(memory)}) of {backend}, or a late instance could win the same "
                "slot again; raise slot_ttl or lower max_late",
                option="max_late",
                backend=backend,
                job=job,
            )
        )
    return errors


def _shown(value: object) -> str:
    """An option's value as a message shows it: ``1h``, ``'allow'``, ``3``."""
    return format_duration(value) if isinstance(value, timedelta) else repr(value)


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def enabled_from_env(environ: Mapping[str, str]) -> bool:
    """``BROKERSCHED_ENABLED``: true unless set to a false spelling; any other value refused."""
    raw = environ.get("BROKERSCHED_ENABLED")
    if raw is None or raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigurationError(
        f"BROKERSCHED_ENABLED={raw!r} is not a boolean: use true or false "
        f"(also {'/'.join(_TRUE[1:])} or {'/'.join(_FALSE[1:])}), or leave it unset",
        option="enabled",
    )

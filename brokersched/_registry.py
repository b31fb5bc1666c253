"""Registration: what a job's schedule and options become once validated against the backend
and the scheduler's defaults, with its override (if any) applied; the checks of names and keys;
``collect_errors()`` for ``brokersched check``. The only owner of the overrides and of the
errors kept while collecting, and the only writer of a job's ``JobSpec``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Protocol

from . import _boot
from ._backfill import backfill_key
from ._clock import datetime_to_ms
from ._durations import format_duration, parse_duration
from ._exceptions import ConfigurationError
from ._job import JobSpec, JobState
from ._options import (
    JobOptions,
    JobSettings,
    Kind,
    SchedulerOptions,
    check_name,
    job_errors,
    parse_job_options,
    resolve_job,
)
from ._overrides import (
    SCHEDULE_KEYS,
    Overrides,
    check_override_options,
    parse_overrides,
    unknown_jobs,
)
from .abc import Backend
from .triggers.after import AfterTrigger
from .triggers.at import AtTrigger, parse_when
from .triggers.base import Trigger
from .triggers.cron import parse_cron
from .triggers.interval import IntervalTrigger

__all__ = ["MakeTrigger", "Registry", "TriggerMaker", "collect_errors", "past_at"]

#: What builds a job's trigger from its options (the schedule given, or its override's).
MakeTrigger = Callable[[JobOptions], Trigger]

# The errors collect_errors() keeps (None: not collecting).
_COLLECTING: ContextVar[list[ConfigurationError] | None] = ContextVar(
    "brokersched_collecting", default=None
)


@contextmanager
def collect_errors() -> Iterator[list[ConfigurationError]]:
    """While active, the decorator form of registration keeps a refused job's errors (in the
    list it gives, and for ``check()``) instead of raising them, so that ``brokersched check``
    reports every error of every job at once. A refused job is not registered. The direct form
    (``every(name, interval, handler)``) still raises: it has no ``Job`` to return."""
    errors: list[ConfigurationError] = []
    token = _COLLECTING.set(errors)
    try:
        yield errors
    finally:
        _COLLECTING.reset(token)


def boots(kind: Kind, options: JobOptions) -> bool:
    """Whether a job has boot runs claimed once per fleet (under ``<key>:start``)."""
    return options.claim and (kind == "after" or options.run_on_start)


@dataclasses.dataclass(frozen=True)
class TriggerMaker:
    """Builds a job's trigger from its ``schedule`` as given (an interval, a cron expression,
    an instant, a delay: kept, so that the job can be registered again elsewhere as it was)
    and its options; ``timezone`` is the scheduler's, for a cron job without one."""

    kind: Kind
    schedule: Any
    timezone: Callable[[], Any]

    def __call__(self, job_options: JobOptions) -> Trigger:
        schedule = self.schedule
        if self.kind == "every":
            period = parse_duration(schedule, name="interval")
            return IntervalTrigger(period, job_options.offset or timedelta(0))
        if self.kind == "cron":
            zone = job_options.timezone or self.timezone()
            return parse_cron(schedule, zone, dst=job_options.dst)
        if self.kind == "after":
            return AfterTrigger(parse_duration(schedule, name="delay"))
        return AtTrigger(parse_when(schedule))


class Registry:
    """Turns what ``every()``, ``cron()``, ``at()``, ``after()``, ``job.update()`` and overrides
    say into a job's ``JobSpec``. ``states`` gives the registered jobs by name (the
    scheduler's), for the checks of names and keys; ``scheduler`` the scheduler's options and
    backend as they are now (an application may set ``scheduler.backend`` after registering,
    and ``check()`` then checks the jobs against it)."""

    def __init__(
        self,
        scheduler: Callable[[], tuple[SchedulerOptions, Backend]],
        overrides: Overrides,
        states: Callable[[], Mapping[str, JobState]],
    ) -> None:
        self._scheduler = scheduler
        self._overrides = overrides
        self._states = states
        self._refused: list[ConfigurationError] = []  # see collect_errors()

    def maker(self, kind: Kind, schedule: Any) -> TriggerMaker:
        """What builds a job's trigger from its schedule (given, or from overrides) and
        options."""
        return TriggerMaker(kind, schedule, lambda: self._scheduler()[0].timezone)

    def spec(
        self, name: str, kind: Kind, make_trigger: MakeTrigger, options: dict[str, Any]
    ) -> JobSpec:
        """A new job's spec, its override applied; everything is validated now, never at the
        first run. Raises ``ConfigurationError``."""
        origin = (make_trigger, options)
        overridden, merged, enabled = self._overridden(name, kind, make_trigger, options)
        name, trigger, settings, job_options = self._validate(name, kind, overridden, merged)
        return JobSpec(
            name,
            kind,
            trigger,
            settings,
            job_options,
            overridden,
            enabled=enabled,
            overrides=self._overrides.get(name, {}),
            origin=origin,
        )

    def refused(self, errors: list[ConfigurationError]) -> bool:
        """Keep ``errors`` of a refused registration for ``check()`` if ``collect_errors()``
        is active (``True``); ``False``: the caller raises them."""
        collected = _COLLECTING.get()
        if collected is None:
            return False
        self._refused.extend(errors)
        collected.extend(errors)
        return True

    def stored(
        self,
        name: str,
        kind: Kind,
        make_trigger: MakeTrigger,
        options: dict[str, Any],
        replacing: JobState | None,
    ) -> tuple[JobSpec, Trigger]:
        """The spec of a stored schedule's job (``_storedjobs``), validated as a job's: its
        name not taken by another job (``replacing``: its own job, if it has one), its options
        against the backend and the scheduler's defaults. Raises ``ConfigurationError``."""
        name, trigger, settings, job_options = self._validate(
            name, kind, make_trigger, options, replacing=replacing
        )
        spec = JobSpec(name, kind, trigger, settings, job_options, make_trigger)
        return spec, trigger

    def update(self, job: JobState, options: dict[str, Any]) -> None:
        """``job.update(**options)``: the merged options validated as at registration; on a
        ``ConfigurationError`` nothing changes."""
        spec = job.spec
        merged = {**spec.options.model_dump(exclude_unset=True), **options}
        _, trigger, settings, job_options = self._validate(
            spec.name, spec.kind, spec.make_trigger, merged, replacing=job
        )
        job.spec = _replaced(spec, schedule=trigger, settings=settings, options=job_options)

    def add_overrides(self, more: Mapping[str, Mapping[str, Any]]) -> None:
        """Overrides given after the jobs registered, merged over the scheduler's option by
        option, validated and applied to the jobs at once (``Scheduler.add_overrides``)."""
        states = self._states()
        for name, override in parse_overrides(more).items():
            before = self._overrides.get(name)
            merged = self._overrides[name] = {**(before or {}), **override}
            job = states.get(name)
            if job is None:
                continue
            spec = job.spec
            assert spec.origin is not None  # set by spec()
            origin_trigger, origin_options = spec.origin
            try:
                make_trigger, options, enabled = self._overridden(
                    name, spec.kind, origin_trigger, origin_options
                )
                _, trigger, settings, job_options = self._validate(
                    name, spec.kind, make_trigger, options, replacing=job
                )
            except ConfigurationError as exc:  # refused: the job and its override stay
                if before is None:
                    del self._overrides[name]
                else:
                    self._overrides[name] = before
                if not self.refused(exc.all_errors):  # brokersched check: with the rest
                    raise
                continue
            job.spec = _replaced(
                spec,
                schedule=trigger,
                settings=settings,
                options=job_options,
                make_trigger=make_trigger,
                enabled=enabled,
                overrides=merged,
            )

    def override_errors(self) -> list[ConfigurationError]:
        """The overrides that name no registered job, each with a suggestion."""
        return unknown_jobs(self._overrides, self._states())

    def check(self) -> list[ConfigurationError]:
        """The errors kept while collecting, the overrides naming no job, and every registered
        job checked again against the backend and the scheduler's defaults."""
        options, backend = self._scheduler()
        caps, name = backend.capabilities, backend.name
        errors: list[ConfigurationError] = list(self._refused) + self.override_errors()
        for job in self._states().values():
            gap = job.schedule.min_gap()
            errors += job_errors(job.name, job.kind, gap, job.options, options, caps, name)
        return errors

    def _validate(
        self,
        name: str,
        kind: Kind,
        make_trigger: MakeTrigger,
        options: dict[str, Any],
        replacing: JobState | None = None,
    ) -> tuple[str, Trigger, JobSettings, JobOptions]:
        name = check_name(name)
        taken = self._states().get(name)
        if taken is not None and taken is not replacing:
            raise ConfigurationError(
                f"job name '{name}' is taken: Job({name!r}, {taken.schedule.describe()}) is "
                "registered already",
                option="name",
                job=name,
            )
        job_options = parse_job_options(name, options)
        try:
            trigger = make_trigger(job_options)
        except ConfigurationError as exc:
            raise ConfigurationError(f"job '{name}': {exc}", option=exc.option, job=name) from None
        defaults, backend = self._scheduler()
        caps = backend.capabilities
        settings = resolve_job(
            name, kind, trigger.min_gap(), job_options, defaults, caps, backend.name
        )
        self._check_key(name, settings.key, boots(kind, job_options), replacing)
        return name, trigger, settings, job_options

    def _overridden(
        self, name: str, kind: Kind, make_trigger: MakeTrigger, options: dict[str, Any]
    ) -> tuple[MakeTrigger, dict[str, Any], bool]:
        """The trigger maker, options and enabled state of ``name`` once its override (if any)
        is applied; a schedule under another kind's key is refused: the kind never changes."""
        override = dict(self._overrides.get(name, {}))
        if not override:
            return make_trigger, options, True
        enabled = override.pop("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigurationError(
                f"job '{name}': override 'enabled' = {enabled!r} must be true or false",
                option="enabled",
                job=name,
            )
        schedule_key = SCHEDULE_KEYS[kind]
        for other in SCHEDULE_KEYS.values():
            if other in override and other != schedule_key:
                article = "a" if kind == "cron" else "an"
                raise ConfigurationError(
                    f"job '{name}' is {article} {kind}() job: override '{other}' does not apply "
                    f"(its schedule is '{schedule_key}'); the kind of a job never changes",
                    option=other,
                    job=name,
                )
        check_override_options(name, schedule_key, override, JobOptions.model_fields)
        if schedule_key in override:
            make_trigger = self.maker(kind, override.pop(schedule_key))
        return make_trigger, {**options, **override}, enabled

    def _check_key(self, name: str, key: str, boots_: bool, replacing: JobState | None) -> None:
        """Two jobs of one scheduler never share a key (they would claim each other's slots),
        nor does one take the key of another's fleet boot runs (``<key>:start``, see
        ``_boot``; ``boots_``: the job has such runs) or backfills (``<key>:backfill``)."""
        for other in self._states().values():
            if other is replacing or other.name == name:
                continue
            if other.settings.key == key:
                why = f"is taken by job '{other.name}'"
            elif key == _boot.boot_key(other.settings.key) and boots(other.kind, other.options):
                why = f"is where job '{other.name}' claims its boot runs ('<key>:start')"
            elif other.settings.key == _boot.boot_key(key) and boots_:
                why = f"would claim its boot runs under the key of job '{other.name}'"
            elif key == backfill_key(other.settings.key):
                why = f"is where job '{other.name}' claims its backfills ('<key>:backfill')"
            elif other.settings.key == backfill_key(key):
                why = f"would claim its backfills under the key of job '{other.name}'"
            else:
                continue
            raise ConfigurationError(
                f"job '{name}': key '{key}' {why}; two jobs of one scheduler need different "
                "keys (claims and history are kept under the key)",
                option="key",
                job=name,
            )


def _replaced(spec: JobSpec, **changes: Any) -> JobSpec:
    return dataclasses.replace(spec, **changes)


class _Scheduled(Protocol):
    """A registered job as ``past_at`` reads it (a ``Job`` or a ``JobSpec``)."""

    @property
    def name(self) -> str: ...
    @property
    def schedule(self) -> Trigger: ...
    @property
    def settings(self) -> JobSettings: ...


def past_at(job: _Scheduled, now_ms: int) -> str | None:
    """Why an ``at()`` job will never run: its instant passed more than ``max_late`` ago (a
    start within ``max_late`` of it still runs it, late). ``None`` for every other job."""
    schedule = job.schedule
    if not isinstance(schedule, AtTrigger):
        return None
    max_late_ms = job.settings.max_late_ms
    late_ms = now_ms - datetime_to_ms(schedule.when)
    if late_ms <= max_late_ms:
        return None
    unit_ms = next(ms for ms in (86_400_000, 3_600_000, 60_000, 1000, 1) if late_ms >= ms)
    ago = format_duration(timedelta(milliseconds=late_ms // unit_ms * unit_ms))
    late = format_duration(timedelta(milliseconds=max_late_ms))
    return (
        f"job '{job.name}': at {schedule.when.isoformat()} passed {ago} ago, more than its "
        f"max_late ({late}): it will never run (give a later time, or trigger it by hand)"
    )

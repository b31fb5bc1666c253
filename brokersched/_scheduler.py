"""``Scheduler`` and ``Job``: registration, the timer heap that arms every job, catch-up and
take-over, manual runs, the life cycle (``start``, ``stop``, ``serve``). A slot's life from its
timer on is ``_runner.py``'s."""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeAlias, TypeVar, Unpack, overload

from . import _boot, _runner
from ._clock import Clock, SystemClock, Timer, datetime_to_ms, ms_to_datetime
from ._durations import Duration, format_duration, parse_duration, to_ms
from ._events import (
    ClaimEvent,
    EventName,
    Events,
    RecordDroppedEvent,
    RunEvent,
    SkipEvent,
    StartEvent,
)
from ._exceptions import BackendError, ConfigurationError
from ._job import AroundRun, Handler, JobState, check_handler
from ._options import (
    JobOptions,
    JobSettings,
    Kind,
    check_name,
    check_scheduler_options,
    enabled_from_env,
    job_errors,
    parse_job_options,
    parse_scheduler_options,
    resolve_job,
)
from ._overrides import (
    SCHEDULE_KEYS,
    Overrides,
    check_override_options,
    overrides_from_env,
    parse_overrides,
    unknown_jobs,
)
from ._recorder import Recorder
from ._tasks import TaskSet, cancel_requests, raise_if_cancelled_since
from ._thread import SchedulerThread
from ._typing import (
    AfterOptions,
    ClaimAtOptions,
    ClaimCronOptions,
    ClaimEveryOptions,
    LeaseAtOptions,
    LeaseCronOptions,
    LeaseEveryOptions,
)
from .abc import Backend, ClaimBackend, Lease, LeaseBackend, RunRecord
from .backends.memory import MemoryBackend
from .triggers.after import AfterTrigger
from .triggers.at import AtTrigger, parse_when
from .triggers.base import Trigger
from .triggers.cron import parse_cron
from .triggers.interval import IntervalTrigger

__all__ = ["Job", "Scheduler", "collect_errors", "past_at"]

B = TypeVar("B", bound=Backend)
LB = TypeVar("LB", bound=LeaseBackend)
H = TypeVar("H", bound=Handler)
T = TypeVar("T")
Lifespan: TypeAlias = Callable[["Scheduler[Any]"], AbstractAsyncContextManager[object]]
"""``Scheduler(lifespan=...)``: called with the scheduler, entered by ``start()`` before the
backend connects and exited after ``stop()`` (as Starlette's ``lifespan``)."""
# Listeners, per event (concrete types, so that a lambda's parameter is typed too).
OnSkip = Callable[[SkipEvent], Awaitable[None] | None]
OnStart = Callable[[StartEvent], Awaitable[None] | None]
OnRun = Callable[[RunEvent], Awaitable[None] | None]
OnClaim = Callable[[ClaimEvent], Awaitable[None] | None]
OnRecordDropped = Callable[[RecordDroppedEvent], Awaitable[None] | None]

logger = logging.getLogger("brokersched")

# stop() writes the run records still waiting for what is left of drain_timeout plus this grace
# (a record being written as drain_timeout ends is not cut, as a run releasing its lease is not).
_FLUSH_GRACE_S = 2.0
# start(wait=False): the waits between attempts to reach the backend.
_CONNECT_RETRIES_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# job.history() first waits this long at most for the records being written.
_HISTORY_WAIT_S = 5.0
# A jittered slot fires up to a sixteenth of its jitter early (never before the slot itself),
# at most this much, with the slots due just before it: a fleet with jitter spreads the claims
# of one instant over the jitter, and slots fired in one turn of the loop are claimed in one
# batch (one statement, one write) for one wake-up, not one each. Moving a random delay a few
# ms earlier changes nothing for the fleet. Measured with bench/fleet.py, 3 processes x 20
# jobs every second, default jitter (250 ms), with NATS claim_many: CPU per run 1.85 -> ~1.4 ms.
_MAX_FIRE_EARLY_MS = 20


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


def _unchanged(function: H) -> H:
    return function


def _callable_or_none(value: T, option: str) -> T:
    if value is not None and not callable(value):
        raise ConfigurationError(
            f"Scheduler: {option} {value!r} is not callable; pass a function, or None",
            option=option,
        )
    return value


def _context_factory(value: T, option: str, *, sync: bool) -> T:
    """``around_run`` makes a context manager, ``lifespan`` an async one: a factory of the other
    kind would fail at every run (or at start) with a TypeError, so it is refused here."""
    _callable_or_none(value, option)
    function = inspect.unwrap(value) if callable(value) else None
    if sync and (inspect.isasyncgenfunction(function) or inspect.iscoroutinefunction(function)):
        why = "is async; around_run is entered in the handler's own thread: pass a context manager"
        why += " factory (@contextlib.contextmanager)"
    elif not sync and inspect.isgeneratorfunction(function):
        why = "makes a sync context manager; pass an async one (@contextlib.asynccontextmanager)"
    else:
        return value
    name = getattr(value, "__qualname__", repr(value))
    raise ConfigurationError(f"Scheduler: {option} '{name}' {why}", option=option)


def _boots(kind: Kind, options: JobOptions) -> bool:
    """Whether a job has boot runs claimed once per fleet (under ``<key>:start``)."""
    return options.claim and (kind == "after" or options.run_on_start)


def _fire_early_ms(job: JobState) -> int:
    return min(job.settings.jitter_ms // 16, _MAX_FIRE_EARLY_MS)


def _default_instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


class Scheduler(Generic[B]):
    """Runs jobs on this instance; each slot runs on exactly one instance of the fleet.

    ``Scheduler`` is generic in its backend: on a ``Scheduler[RabbitMQBackend]`` the type checker
    already refuses the options that need a lease (``overlap``, ``max_attempts``, ``catch_up``).
    """

    @overload
    def __init__(
        self: Scheduler[MemoryBackend],
        backend: None = None,
        *,
        jitter: Duration = ...,
        max_late: Duration = ...,
        timezone: str = ...,
        history_size: int = ...,
        history_ttl: Duration | None = ...,
        drain_timeout: Duration = ...,
        record_buffer: int = ...,
        instance_id: str | None = ...,
        clock: Clock | None = ...,
        lifespan: Lifespan | None = ...,
        around_run: AroundRun | None = ...,
        enabled: bool | None = ...,
        overrides: Mapping[str, Mapping[str, Any]] | None = ...,
    ) -> None: ...
    @overload
    def __init__(
        self,
        backend: B,
        *,
        jitter: Duration = ...,
        max_late: Duration = ...,
        timezone: str = ...,
        history_size: int = ...,
        history_ttl: Duration | None = ...,
        drain_timeout: Duration = ...,
        record_buffer: int = ...,
        instance_id: str | None = ...,
        clock: Clock | None = ...,
        lifespan: Lifespan | None = ...,
        around_run: AroundRun | None = ...,
        enabled: bool | None = ...,
        overrides: Mapping[str, Mapping[str, Any]] | None = ...,
    ) -> None: ...
    def __init__(
        self,
        backend: Any = None,
        *,
        clock: Clock | None = None,
        lifespan: Lifespan | None = None,
        around_run: AroundRun | None = None,
        enabled: bool | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        # Scheduler() is a Scheduler[MemoryBackend] (see the overloads)
        self.backend: B = MemoryBackend() if backend is None else backend  # type: ignore[assignment]
        if not isinstance(self.backend, ClaimBackend | LeaseBackend):
            raise ConfigurationError(
                f"backend {self.backend!r} is not a brokersched backend (a ClaimBackend or "
                "LeaseBackend such as RabbitMQBackend, NATSBackend, SQLiteBackend, "
                "PostgresBackend, MemoryBackend)",
                option="backend",
            )
        self.options = parse_scheduler_options(options)
        check_scheduler_options(self.options, self.backend.capabilities, self.backend.name)
        self.clock: Clock = clock or SystemClock()
        if enabled is None:
            enabled = enabled_from_env(os.environ)
        elif not isinstance(enabled, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ConfigurationError(
                f"Scheduler: enabled={enabled!r} must be True or False", option="enabled"
            )
        self._enabled = enabled  # False: jobs are registered and listed, nothing is armed
        self._overrides: Overrides = (
            overrides_from_env(os.environ) if overrides is None else parse_overrides(overrides)
        )
        self.instance_id = self.options.instance_id or _default_instance_id()
        self._identity_pid = os.getpid()  # the process instance_id and the jitter RNG belong to
        self._jobs: dict[str, Job] = {}
        self._heap: list[tuple[int, int, int, JobState]] = []  # (due_ms, seq, slot_ms, job)
        self._seq = itertools.count()
        self._timer: Timer | None = None
        self._timer_ms: int | None = None
        self._sweep_timer: Timer | None = None
        self._tasks = TaskSet(self.clock)
        self._random = self.clock.random()
        self._started = False
        self._stopping = False
        self._stopped = asyncio.Event()
        self._lifecycle = asyncio.Lock()
        self._events = Events(self._tasks)
        self._recorder = Recorder(
            self.clock, self.backend, self.options.record_buffer, self._events
        )
        self._runner = _runner.Runner(
            self.clock, self.backend, self.instance_id, self._events, self._tasks, self._recorder
        )
        self._runner.around_run = _context_factory(around_run, "around_run", sync=True)
        self._lifespan = _context_factory(lifespan, "lifespan", sync=False)
        self._lifespan_exit: AsyncExitStack | None = None  # the lifespan entered, until stop()
        self._refused: list[ConfigurationError] = []  # see collect_errors()
        self._started_ms: int | None = None
        self._start_requested_ms: int | None = None
        self._connecting: asyncio.Task[None] | None = None  # start(wait=False)'s attempts
        self._watcher: asyncio.Task[None] | None = None
        self._stopper: asyncio.Task[None] | None = None  # a stop() begun by a handler

    # -- registration ------------------------------------------------------------------------

    @overload
    def every(
        self: Scheduler[LB],
        name: str,
        interval: Duration,
        handler: H,
        **options: Unpack[LeaseEveryOptions],
    ) -> Job: ...
    @overload
    def every(
        self: Scheduler[LB],
        name: str,
        interval: Duration,
        handler: None = None,
        **options: Unpack[LeaseEveryOptions],
    ) -> Callable[[H], H]: ...
    @overload
    def every(
        self, name: str, interval: Duration, handler: H, **options: Unpack[ClaimEveryOptions]
    ) -> Job: ...
    @overload
    def every(
        self,
        name: str,
        interval: Duration,
        handler: None = None,
        **options: Unpack[ClaimEveryOptions],
    ) -> Callable[[H], H]: ...
    def every(
        self, name: str, interval: Duration, handler: Handler | None = None, **options: Any
    ) -> Job | Callable[[H], H]:
        """Run ``handler`` every ``interval``, on a grid aligned to the Unix epoch (+ offset)."""
        return self._register(name, "every", self._maker("every", interval), handler, options)

    @overload
    def cron(
        self: Scheduler[LB],
        name: str,
        expression: str,
        handler: H,
        **options: Unpack[LeaseCronOptions],
    ) -> Job: ...
    @overload
    def cron(
        self: Scheduler[LB],
        name: str,
        expression: str,
        handler: None = None,
        **options: Unpack[LeaseCronOptions],
    ) -> Callable[[H], H]: ...
    @overload
    def cron(
        self, name: str, expression: str, handler: H, **options: Unpack[ClaimCronOptions]
    ) -> Job: ...
    @overload
    def cron(
        self,
        name: str,
        expression: str,
        handler: None = None,
        **options: Unpack[ClaimCronOptions],
    ) -> Callable[[H], H]: ...
    def cron(
        self, name: str, expression: str, handler: Handler | None = None, **options: Any
    ) -> Job | Callable[[H], H]:
        """Run ``handler`` on a cron schedule, in ``timezone`` (default: the scheduler's)."""
        return self._register(name, "cron", self._maker("cron", expression), handler, options)

    @overload
    def at(
        self: Scheduler[LB],
        name: str,
        when: datetime,
        handler: H,
        **options: Unpack[LeaseAtOptions],
    ) -> Job: ...
    @overload
    def at(
        self: Scheduler[LB],
        name: str,
        when: datetime,
        handler: None = None,
        **options: Unpack[LeaseAtOptions],
    ) -> Callable[[H], H]: ...
    @overload
    def at(
        self, name: str, when: datetime, handler: H, **options: Unpack[ClaimAtOptions]
    ) -> Job: ...
    @overload
    def at(
        self, name: str, when: datetime, handler: None = None, **options: Unpack[ClaimAtOptions]
    ) -> Callable[[H], H]: ...
    def at(
        self, name: str, when: datetime, handler: Handler | None = None, **options: Any
    ) -> Job | Callable[[H], H]:
        """Run ``handler`` once, at ``when`` (an aware datetime)."""
        return self._register(name, "at", self._maker("at", when), handler, options)

    @overload
    def after(
        self, name: str, delay: Duration, handler: H, **options: Unpack[AfterOptions]
    ) -> Job: ...
    @overload
    def after(
        self, name: str, delay: Duration, handler: None = None, **options: Unpack[AfterOptions]
    ) -> Callable[[H], H]: ...
    def after(
        self, name: str, delay: Duration, handler: Handler | None = None, **options: Any
    ) -> Job | Callable[[H], H]:
        """Run ``handler`` once, ``delay`` after ``start()`` (``ctx.reason == "start"``); a job
        added to a running scheduler, ``delay`` after it is added. With ``claim=True`` (the
        default) instances that start together run it once between them; with ``claim=False``
        every instance runs it (see ``brokersched._boot``)."""
        return self._register(name, "after", self._maker("after", delay), handler, options)

    def _maker(self, kind: Kind, schedule: Any) -> Callable[[JobOptions], Trigger]:
        """What builds a job's trigger from its schedule (given, or from overrides) and options."""

        def make(job_options: JobOptions) -> Trigger:
            if kind == "every":
                period = parse_duration(schedule, name="interval")
                return IntervalTrigger(period, job_options.offset or timedelta(0))
            if kind == "cron":
                return parse_cron(schedule, job_options.timezone or self.options.timezone)
            if kind == "after":
                return AfterTrigger(parse_duration(schedule, name="delay"))
            return AtTrigger(parse_when(schedule))

        return make

    def _register(
        self,
        name: str,
        kind: Kind,
        make_trigger: Callable[[JobOptions], Trigger],
        handler: Handler | None,
        options: dict[str, Any],
    ) -> Job | Callable[[H], H]:
        # Everything is validated now, before the decorator form returns: never at the first run.
        origin = (make_trigger, options)
        try:
            make_trigger, options, enabled = self._overridden(name, kind, make_trigger, options)
            name, trigger, settings, job_options = self._validate(name, kind, make_trigger, options)
        except ConfigurationError as exc:
            if handler is not None or (collected := _COLLECTING.get()) is None:
                raise
            self._refused.extend(exc.all_errors)
            collected.extend(exc.all_errors)
            return _unchanged

        def add(function: Handler) -> Job:
            check_handler(name, function)
            if name in self._jobs:
                raise ConfigurationError(f"job name '{name}' is taken", option="name", job=name)
            state = JobState(name, kind, trigger, function, settings, job_options, make_trigger)
            state.origin, state.enabled = origin, enabled
            state.overrides = self._overrides.get(name, {})
            job = self._jobs[name] = Job(self, state)
            if (warning := past_at(job, self.clock.now_ms())) is not None:
                logger.warning("%s", warning)
            if self._started and not self._stopping:
                self._spawn(self._prepare_and_arm(state), name=f"brokersched:add:{name}")
            return job

        if handler is not None:
            return add(handler)

        def decorator(function: H) -> H:
            try:
                add(function)
            except ConfigurationError as exc:
                if (collected := _COLLECTING.get()) is None:
                    raise
                self._refused.append(exc)
                collected.append(exc)
            return function

        return decorator

    def _validate(
        self,
        name: str,
        kind: Kind,
        make_trigger: Callable[[JobOptions], Trigger],
        options: dict[str, Any],
        replacing: JobState | None = None,
    ) -> tuple[str, Trigger, JobSettings, JobOptions]:
        name = check_name(name)
        if name in self._jobs and self._jobs[name]._state is not replacing:
            raise ConfigurationError(
                f"job name '{name}' is taken: {self._jobs[name]!r} is registered already",
                option="name",
                job=name,
            )
        job_options = parse_job_options(name, options)
        try:
            trigger = make_trigger(job_options)
        except ConfigurationError as exc:
            raise ConfigurationError(f"job '{name}': {exc}", option=exc.option, job=name) from None
        caps, backend = self.backend.capabilities, self.backend.name
        settings = resolve_job(
            name, kind, trigger.min_gap(), job_options, self.options, caps, backend
        )
        self._check_key(name, settings.key, _boots(kind, job_options), replacing)
        return name, trigger, settings, job_options

    def _overridden(
        self,
        name: str,
        kind: Kind,
        make_trigger: Callable[[JobOptions], Trigger],
        options: dict[str, Any],
    ) -> tuple[Callable[[JobOptions], Trigger], dict[str, Any], bool]:
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
            make_trigger = self._maker(kind, override.pop(schedule_key))
        return make_trigger, {**options, **override}, enabled

    def add_overrides(self, more: Mapping[str, Mapping[str, Any]]) -> None:
        """Overrides given after the jobs registered (the CLI's ``--override``): merged over
        the scheduler's, option by option, validated and applied to the jobs at once. One
        naming no job is reported by ``check()`` and refused by ``start()``; under
        ``collect_errors()`` a refused one is kept for ``check()`` too. Before ``start()``
        only: a running job changes with ``job.update()``, ``pause()`` and ``resume()``."""
        if self._started or self._connecting is not None:
            raise RuntimeError(
                "add_overrides() must be called before start(): armed jobs would keep their old "
                "schedule for a slot; change a running job with job.update(), pause() or resume()"
            )
        more = parse_overrides(more)
        for name, override in more.items():
            before = self._overrides.get(name)
            merged = self._overrides[name] = {**(before or {}), **override}
            job = self._jobs.get(name)
            if job is None:
                continue
            state = job._state
            assert state.origin is not None  # set by _register
            origin_trigger, origin_options = state.origin
            try:
                make_trigger, options, enabled = self._overridden(
                    name, state.kind, origin_trigger, origin_options
                )
                _, trigger, settings, job_options = self._validate(
                    name, state.kind, make_trigger, options, replacing=state
                )
            except ConfigurationError as exc:  # refused: the job and its override stay
                if before is None:
                    del self._overrides[name]
                else:
                    self._overrides[name] = before
                if (collected := _COLLECTING.get()) is None:
                    raise
                self._refused.extend(exc.all_errors)  # brokersched check: reported with the rest
                collected.extend(exc.all_errors)
                continue
            state.schedule, state.settings, state.options = trigger, settings, job_options
            state.make_trigger, state.enabled, state.overrides = make_trigger, enabled, merged

    def override_errors(self) -> list[ConfigurationError]:
        """The overrides that name no registered job, each with a suggestion."""
        return unknown_jobs(self._overrides, self._jobs)

    def _check_key(self, name: str, key: str, boots: bool, replacing: JobState | None) -> None:
        """Two jobs of one scheduler never share a key (they would claim each other's slots),
        nor does one take the key of another's fleet boot runs (``<key>:start``, see
        ``_boot``); ``boots``: the job has such runs."""
        for other in self._states():
            if other is replacing or other.name == name:
                continue
            if other.settings.key == key:
                why = f"is taken by job '{other.name}'"
            elif key == _boot.boot_key(other.settings.key) and _boots(other.kind, other.options):
                why = f"is where job '{other.name}' claims its boot runs ('<key>:start')"
            elif other.settings.key == _boot.boot_key(key) and boots:
                why = f"would claim its boot runs under the key of job '{other.name}'"
            else:
                continue
            raise ConfigurationError(
                f"job '{name}': key '{key}' {why}; two jobs of one scheduler need different "
                "keys (claims and history are kept under the key)",
                option="key",
                job=name,
            )

    def _update(self, job: JobState, options: dict[str, Any]) -> None:
        merged = {**job.options.model_dump(exclude_unset=True), **options}
        _, trigger, settings, job_options = self._validate(
            job.name, job.kind, job.make_trigger, merged, replacing=job
        )
        job.schedule, job.settings, job.options = trigger, settings, job_options
        if job.armed_ms is not None:  # re-arm: the schedule or the jitter may have changed
            self._rearm(job)
        if self._started and not self._stopping:
            self._spawn(
                self.backend.prepare([settings.policy]), name=f"brokersched:update:{job.name}"
            )

    def check(self) -> list[ConfigurationError]:
        """Every configuration error of every job, all at once (none: ``[]``): the jobs refused
        while ``collect_errors()`` was active, and the registered jobs checked again against
        the scheduler's current backend and defaults."""
        caps, backend = self.backend.capabilities, self.backend.name
        errors: list[ConfigurationError] = list(self._refused) + self.override_errors()
        for job in self._states():
            gap = job.schedule.min_gap()
            errors += job_errors(job.name, job.kind, gap, job.options, self.options, caps, backend)
        return errors

    # -- lookup ----------------------------------------------------------------------------

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def _states(self) -> list[JobState]:
        return [job._state for job in self._jobs.values()]

    def remove(self, name: str, abort: bool = False) -> Job:
        """Unregister ``name``; with ``abort``, its runs here are aborted (reason ``removed``)."""
        job = self._jobs.pop(name, None)
        if job is None:
            raise KeyError(f"no job named '{name}' (registered: {', '.join(self._jobs) or 'none'})")
        state = job._state
        state.armed_ms = None
        state.removed = True
        if abort:
            for run in list(state.runs.values()):
                self._runner.abort(run, "removed")
        return job

    # -- events ----------------------------------------------------------------------------

    @overload
    def on(self, event: Literal["skip"], listener: OnSkip) -> OnSkip: ...
    @overload
    def on(self, event: Literal["start"], listener: OnStart) -> OnStart: ...
    @overload
    def on(self, event: Literal["complete", "fail"], listener: OnRun) -> OnRun: ...
    @overload
    def on(self, event: Literal["claim"], listener: OnClaim) -> OnClaim: ...
    @overload
    def on(
        self, event: Literal["record-dropped"], listener: OnRecordDropped
    ) -> OnRecordDropped: ...
    def on(self, event: EventName, listener: Any) -> Any:
        """Call ``listener`` (sync or async) for every ``event``: ``skip`` (a ``SkipEvent``),
        ``start`` (a ``StartEvent``), ``complete`` and ``fail`` (a ``RunEvent``), ``claim`` (a
        ``ClaimEvent``: how long each claim took), ``record-dropped`` (a
        ``RecordDroppedEvent``: a run's record never reached the backend)."""
        self._events.on(event, listener)
        return listener

    def overdue(self) -> list[Job]:
        """Armed jobs whose second slot after their last handled run (or the start) has passed
        by more than ``max_late``: the base of a health check.

        A slot counts as handled when it completed here or another instance claimed it.
        """
        if not self._enabled:
            return []  # nothing is scheduled here: nothing can be late
        now = self.clock.now_ms()
        late: list[Job] = []
        # Not connected yet (start(wait=False)): every job misses its slots since the start.
        connecting = not self._started and self._connecting is not None
        since = self._start_requested_ms if connecting else self._started_ms
        for job in self._jobs.values():
            state = job._state
            if state.paused or not state.enabled or since is None:
                continue
            if state.armed_ms is None and not connecting:
                continue
            first = state.schedule.next_ms(max(state.last_ok_ms or 0, since))
            second = state.schedule.next_ms(first) if first is not None else None
            if second is not None and now > second + state.settings.max_late_ms:
                late.append(job)
        return late

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, *, wait: bool = True) -> None:
        """Enter the lifespan, connect the backend and arm every job.

        ``wait=False`` returns once the lifespan is entered and connects in the background,
        retrying an unreachable backend (0.5 s, 1 s, 2 s, ... then every 30 s) until it
        answers: a web app starts while its broker is down. Until then ``ready`` is false, no
        slot runs (never one unclaimed), ``trigger()`` is refused and ``overdue()`` lists the
        jobs whose slots are being missed. ``stop()`` ends the attempts."""
        async with self._lifecycle:
            if self._started or self._connecting is not None:
                raise RuntimeError(
                    "the scheduler is started already: call start() once (or use "
                    "`async with scheduler`, not both), and stop() before starting it again"
                )
            if errors := self.override_errors():  # every job is registered by now
                raise errors[0]
            self._stopped = asyncio.Event()  # bound to this start's event loop
            self._start_requested_ms = self.clock.now_ms()
            await self._enter_lifespan()
            if wait:
                try:
                    await self._start()
                except BaseException as exc:
                    await self._exit_lifespan(exc)
                    raise
            else:
                self._connecting = asyncio.get_running_loop().create_task(
                    self._connect(), name="brokersched:connect"
                )
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch_exit(), name="brokersched:unstopped"
            )

    async def _connect(self) -> None:
        """``start(wait=False)``'s attempts, until the backend answers or ``stop()``."""
        delays = itertools.chain(_CONNECT_RETRIES_S, itertools.repeat(_CONNECT_RETRIES_S[-1]))
        attempts = 0
        while True:
            attempts += 1
            try:
                await self._start()
            except BackendError as exc:
                delay = next(delays)
                logger.warning(
                    "backend %s not reachable (attempt %d): %s; retrying in %gs; no job runs "
                    "until it answers",
                    self.backend.name,
                    attempts,
                    exc,
                    delay,
                )
                await self.clock.sleep(delay)
                continue
            except Exception:  # not an outage (a missing extra, a bug): retrying would not help
                logger.exception("cannot start: backend %s; not retried", self.backend.name)
                return
            if attempts > 1:
                logger.info("backend %s answered: started", self.backend.name)
            return

    @property
    def ready(self) -> bool:
        """Connected and running: false while ``start(wait=False)`` still tries to reach the
        backend, and once ``stop()`` has begun (the base of a readiness probe)."""
        return self.running

    async def _enter_lifespan(self) -> None:
        if self._lifespan is None:
            return
        stack = AsyncExitStack()
        await stack.enter_async_context(self._lifespan(self))
        self._lifespan_exit = stack

    async def _exit_lifespan(self, exc: BaseException | None = None) -> None:
        stack, self._lifespan_exit = self._lifespan_exit, None
        if stack is not None:
            if exc is None:
                await stack.aclose()
            else:
                await stack.__aexit__(type(exc), exc, exc.__traceback__)

    async def _watch_exit(self) -> None:
        """Says so when the event loop ends while the scheduler runs: ``asyncio.run()`` cancels
        the tasks it leaves, and armed jobs and running handlers vanish without a word."""
        try:
            await self._stopped.wait()
        except asyncio.CancelledError:
            if self._started:
                logger.warning(
                    "the event loop is closing but the scheduler was never stopped: runs in "
                    "progress are cut off unrecorded; call `await scheduler.stop()` before "
                    "leaving, or use `async with scheduler:` or `await scheduler.serve()`"
                )
            raise

    def _own_identity(self) -> None:
        """A scheduler made before a fork (``gunicorn --preload``, ``multiprocessing``) gets an
        identity of its own in each process: its ``instance_id`` (unless one was given) and its
        jitter, so pre-forked workers neither share a name nor fire at the same instant."""
        if self._identity_pid == os.getpid():
            return
        self._identity_pid = os.getpid()
        if self.options.instance_id is None:
            self.instance_id = self._runner.instance_id = _default_instance_id()
        self._random = self.clock.random()  # seeded afresh from os.urandom

    async def _start(self) -> None:
        self._own_identity()
        cancels = cancel_requests()
        await self.backend.start(self.clock)
        try:
            await self.backend.prepare([job.settings.policy for job in self._states()])
            raise_if_cancelled_since(cancels)  # one a client library swallowed (Python 3.11)
        except BaseException:
            await self.backend.stop()
            raise
        self._started, self._stopping = True, False
        self._runner.stopping = False
        self._started_ms = self.clock.now_ms()
        for job in self._states():
            self._arm(job)
            self._arm_boot(job, self._started_ms)
        if isinstance(self.backend, LeaseBackend) and self._enabled:
            self._catch_up()
            self._spawn(self._sweep(), name="brokersched:take-over")  # hand-overs wait for no one
            self._schedule_sweep()

    async def stop(self) -> None:
        """Disarm, abort running handlers (``shutdown``), drain up to ``drain_timeout``.

        Called from a handler (or an event listener), it begins the stop and returns: the drain
        waits for that handler, which is told ``shutdown`` like the others."""
        if self._tasks.is_drained(asyncio.current_task()):
            if self._started and not self._stopping:
                self._stopper = asyncio.get_running_loop().create_task(
                    self.stop(), name="brokersched:stop"
                )
            return
        await self._stop_connecting()
        async with self._lifecycle:  # a second caller waits for the first one's drain
            if self._started:
                await self._stop()

    async def _stop_connecting(self) -> None:
        """End ``start(wait=False)``'s attempts; if none succeeded, leave the lifespan here."""
        connecting = self._connecting
        if connecting is None:
            return
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        if self._connecting is not connecting:
            return  # another stop() has done it meanwhile
        self._connecting = None
        if not self._started:
            try:
                await self._exit_lifespan()
            finally:
                self._stopped.set()

    async def _stop(self) -> None:
        self._stopping = True
        for timer in (self._timer, self._sweep_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._sweep_timer = self._timer_ms = None
        self._heap.clear()
        for job in self._states():
            job.armed_ms = None
            if job.boot_timer is not None:  # a boot run not yet due never comes
                job.boot_timer.cancel()
            job.boot_ms = job.boot_timer = None
        drain_s = self.options.drain_timeout.total_seconds()
        began_ms = self.clock.monotonic_ms()
        try:
            await self._runner.drain(drain_s)
        finally:
            try:
                left_s = drain_s - (self.clock.monotonic_ms() - began_ms) / 1000
                await self._recorder.flush(max(left_s, 0) + _FLUSH_GRACE_S)
                await self.backend.stop()
            except Exception:
                logger.exception("backend %s failed to stop cleanly", self.backend.name)
            finally:
                self._started = self._stopping = False
                try:
                    await self._exit_lifespan()
                finally:
                    self._stopped.set()

    async def wait_stopped(self) -> None:
        """Wait until ``stop()`` has finished."""
        if not self._started and self._connecting is None and not self._stopped.is_set():
            raise RuntimeError(
                "wait_stopped() before start() would wait for ever: start the scheduler first "
                "(`async with scheduler: await scheduler.wait_stopped()`)"
            )
        await self._stopped.wait()

    async def serve(self) -> None:
        """Start, run until SIGINT or SIGTERM (or ``stop()``), then stop and drain: the main of a
        process that only schedules, ``asyncio.run(scheduler.serve())``. A signal during the
        start stops the scheduler once it has started (a connection is never cut half-made);
        after the first signal the default handlers are back, so a second Ctrl-C interrupts the
        drain. A backend that cannot be reached at start is one error line and exit status 3."""
        loop = asyncio.get_running_loop()
        requested = asyncio.Event()
        installed: dict[signal.Signals, Any] = {}  # signal -> the handler it had before

        def restore() -> None:
            for signum, previous in installed.items():
                loop.remove_signal_handler(signum)
                if previous is not None:
                    signal.signal(signum, previous)
            installed.clear()

        def on_signal(signum: signal.Signals) -> None:
            logger.info("%s: stopping, draining running jobs", signum.name)
            restore()
            requested.set()

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous = signal.getsignal(signum)
                loop.add_signal_handler(signum, on_signal, signum)
                installed[signum] = previous
        try:
            try:
                await self.start()
            except BackendError as exc:
                logger.error("cannot start: %s", exc)
                raise SystemExit(3) from None
            waits = {
                loop.create_task(self._stopped.wait()),
                loop.create_task(requested.wait()),
            }
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                restore()
                for each in waits:
                    each.cancel()
                await self.stop()
        finally:
            restore()

    def start_in_thread(self, *, name: str = "brokersched") -> SchedulerThread:
        """Start the scheduler on an event loop of its own, in a new thread, for code without
        an event loop; returns once it has started (or raises its start error). Stop it with
        the handle's ``stop()``, or use the handle as a context manager::

            with scheduler.start_in_thread():
                serve_forever()
        """
        return SchedulerThread(self, name=name).start()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def enabled(self) -> bool:
        """Whether this instance schedules: ``False`` (``Scheduler(enabled=False)``,
        ``BROKERSCHED_ENABLED=false``, ``brokersched run --no-schedule``) keeps the jobs
        registered, listed and runnable with ``trigger()``, but arms no timer: no slot, no
        catch-up, no take-over of other instances' slots runs here."""
        return self._enabled

    @enabled.setter
    def enabled(self, enabled: bool) -> None:
        if self._started or self._connecting is not None:
            raise RuntimeError("Scheduler.enabled can only be set before start()")
        self._enabled = enabled

    @property
    def running(self) -> bool:
        return self._started and not self._stopping

    @property
    def stopping(self) -> bool:
        """``stop()`` has begun: no new run starts."""
        return self._stopping

    # -- arming: one timer for every job --------------------------------------------------

    def _spawn(self, coro: Any, *, name: str) -> asyncio.Task[Any]:
        """Start a task that ``stop()`` waits for."""
        return self._tasks.spawn(coro, name=name)

    async def _prepare_and_arm(self, job: JobState) -> None:
        try:
            await self.backend.prepare([job.settings.policy])
        except Exception:
            logger.exception("backend could not prepare job %s; its slots are skipped", job.name)
        self._arm(job)
        self._arm_boot(job, self.clock.now_ms())

    def _arm_boot(self, job: JobState, since_ms: int) -> None:
        """Arm the boot run of an ``after()`` job, or of a ``run_on_start`` job."""
        if not self._started or self._stopping or job.removed or job.paused:
            return  # a job paused at start has no boot run (a CLI trigger pauses them all)
        if not (self._enabled and job.enabled):
            return
        if isinstance(job.schedule, AfterTrigger):
            delay_ms = job.schedule.delay_ms
        elif job.options.run_on_start:
            delay_ms = 0
        else:
            return
        due = job.boot_ms = since_ms + delay_ms

        def fire() -> None:
            job.boot_ms = job.boot_timer = None
            self._spawn(_boot.run_boot(self._runner, job, due), name=f"start:{job.name}")

        job.boot_timer = self.clock.call_at(due, fire)

    def _arm(self, job: JobState, after_ms: int | None = None) -> None:
        if not self._started or self._stopping or job.paused or job.removed:
            return
        if not (self._enabled and job.enabled):
            return
        now = self.clock.now_ms()
        if after_ms is None:
            # An at() instant that passed less than max_late ago still runs, late (the slot's
            # life, step 3); the missed slots of a periodic job are catch-up's (lease backends).
            after_ms = now - job.settings.max_late_ms - 1 if job.kind == "at" else now
        slot = job.schedule.next_ms(after_ms)
        job.armed_ms = slot
        if slot is None:
            return
        jitter = self._random.randint(0, job.settings.jitter_ms) if job.settings.jitter_ms else 0
        if len(self._heap) > 2 * len(self._jobs) + 64:
            self._compact_heap()
        job.armed_seq = next(self._seq)
        heapq.heappush(self._heap, (slot + jitter, job.armed_seq, slot, job))
        if self._timer_ms is None or slot + jitter < self._timer_ms:
            self._set_timer(slot + jitter)

    def _rearm(self, job: JobState) -> None:
        """Arm ``job`` again after ``update()`` or ``resume()``, keeping a slot whose jitter
        window is still open (the fleet may be claiming it right now) unless it fired here."""
        if job.armed_ms is not None:
            after = job.armed_ms - 1  # the slot it waited for has not fired yet
        else:
            after = self.clock.now_ms() - job.settings.jitter_ms - 1
            if job.fired_ms is not None:
                after = max(after, job.fired_ms)
            if self._started_ms is not None:  # never a slot from before this start
                after = max(after, self._started_ms)
        job.armed_ms = None
        self._arm(job, after_ms=after)

    def _compact_heap(self) -> None:
        """Drop the entries that pause/resume/remove left behind (they are skipped lazily)."""
        self._heap = [entry for entry in self._heap if self._armed(entry[3], entry[1])]
        heapq.heapify(self._heap)

    def _armed(self, job: JobState, seq: int) -> bool:
        """Whether a heap entry is the job's current one (not left by pause/remove/re-arm)."""
        return job.armed_seq == seq and job.armed_ms is not None and not job.removed

    def _set_timer(self, when_ms: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_ms = when_ms
        self._timer = self.clock.call_at(when_ms, self._on_timer)

    def _on_timer(self) -> None:
        now = self.clock.now_ms()
        # While it fires, _arm() sets no timer for a later slot: the timer is set once, below.
        self._timer, self._timer_ms = None, now
        while self._heap:
            due, seq, slot_ms, job = self._heap[0]
            if due > now and (slot_ms > now or due - now > _fire_early_ms(job)):
                break
            heapq.heappop(self._heap)
            if not self._armed(job, seq):
                continue  # disarmed (paused, removed, re-armed) since it was pushed
            job.fired_ms = slot_ms
            self._spawn(self._runner.run_slot(job, slot_ms, "schedule"), name=f"slot:{job.name}")
            # A frozen process wakes to many past slots: skip straight to those still in time.
            self._arm(job, after_ms=max(slot_ms, now - job.settings.max_late_ms))
        if self._heap:
            self._set_timer(self._heap[0][0])
        else:
            self._timer_ms = None

    # -- lease backends: catch-up and take-over ------------------------------------------

    def _catch_up(self) -> None:
        now = self.clock.now_ms()
        for job in self._states():
            if not job.settings.claim or job.settings.catch_up_ms <= 0 or job.paused:
                continue
            if job.kind == "at":
                continue  # its one instant is armed (late, within max_late) or was run
            if not job.enabled:
                continue
            latest = job.schedule.latest_ms(now, job.settings.catch_up_ms)
            if latest is not None:
                coro = self._runner.run_slot(job, latest, "catch-up")
                self._spawn(coro, name=f"catch-up:{job.name}")

    def _schedule_sweep(self) -> None:
        """Look for dead runners' slots every ``lease_ttl / 2`` (monotonic)."""
        assert isinstance(self.backend, LeaseBackend)
        period = max(to_ms(self.backend.lease_ttl) // 2, 50)

        def sweep() -> None:
            self._spawn(self._sweep(), name="brokersched:take-over")
            self._schedule_sweep()

        if not self._stopping:
            self._sweep_timer = self.clock.call_later(period, sweep)

    async def _sweep(self) -> None:
        backend = self.backend
        assert isinstance(backend, LeaseBackend)
        jobs = [s for s in self._states() if s.settings.claim and not s.paused and s.enabled]
        if not jobs:
            return
        leased_ms = self.clock.monotonic_ms()
        try:
            leases = await backend.take_over(
                [job.settings.policy for job in jobs], instance_id=self.instance_id
            )
        except Exception as exc:
            logger.warning("take-over sweep failed: %s", exc)
            return
        by_key = {job.settings.key: job for job in self._states()}
        for lease in leases:
            state = by_key.get(lease.job)  # leases are kept under the job's key
            if state is None or self._stopping or self._running_here(state, lease):
                # A sync handler whose lease was lost may still be running here: not twice.
                await self._runner.release(lease, handover=True)
                continue
            run = self._runner.execute(state, lease.slot_ms, lease, leased_ms=leased_ms)
            self._spawn(run, name=f"retry:{lease.job}")

    @staticmethod
    def _running_here(job: JobState, lease: Lease) -> bool:
        return any(run.ctx.slot_ms == lease.slot_ms for run in job.runs.values())

    # -- manual runs -----------------------------------------------------------------------

    async def _run_manual(self, job: JobState) -> RunRecord | None:
        if not self._started or self._stopping:
            why = (
                "the backend is not reachable yet (start(wait=False) is still trying)"
                if self._connecting is not None and not self._stopping
                else "the scheduler is not running (start it first: async with scheduler)"
            )
            raise RuntimeError(f"cannot trigger job '{job.name}': {why}")
        task = self._spawn(
            self._runner.run_slot(job, self.clock.now_ms(), "manual"), name=f"manual:{job.name}"
        )
        # Shielded: a caller that gives up waiting must not cut the run short.
        record: RunRecord | None = await asyncio.shield(task)
        return record


class Job:
    """A registered job, as the application sees it: its schedule and options, and its runs on
    this instance. ``scheduler.every()`` and friends return it; ``scheduler.get(name)`` finds it."""

    __slots__ = ("_scheduler", "_state")

    def __init__(self, scheduler: Scheduler[Any], state: JobState) -> None:
        self._scheduler = scheduler
        self._state = state

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def key(self) -> str:
        """What claims, leases, fencing and history are kept under: the ``key`` option, or
        the name."""
        return self._state.settings.key

    @property
    def kind(self) -> Kind:
        return self._state.kind

    @property
    def schedule(self) -> Trigger:
        """The trigger: ``describe()``, ``next_runs()``."""
        return self._state.schedule

    @property
    def options(self) -> JobOptions:
        """The options as given (validated)."""
        return self._state.options

    @property
    def settings(self) -> JobSettings:
        """The options as resolved against the scheduler's defaults and the backend."""
        return self._state.settings

    @property
    def next_run(self) -> datetime | None:
        """When the next slot falls (before jitter), or ``None`` when paused, removed, done, or
        when the scheduler is not enabled."""
        state = self._state
        if state.boot_ms is not None and not state.paused:  # its boot run comes first
            return ms_to_datetime(state.boot_ms)
        if state.armed_ms is not None:
            return ms_to_datetime(state.armed_ms)
        if state.paused or state.removed or not (self._scheduler.enabled and state.enabled):
            return None
        nxt = state.schedule.next_ms(self._scheduler.clock.now_ms())
        return None if nxt is None else ms_to_datetime(nxt)

    def next_runs(self, n: int, after: datetime | None = None) -> list[datetime]:
        """The next ``n`` slots after ``after`` (default: now on the scheduler's clock)."""
        return self._state.schedule.next_runs(n, after or self._scheduler.clock.now())

    @property
    def is_running(self) -> bool:
        """Whether a run of this job is going on this instance."""
        return bool(self._state.runs)

    @property
    def enabled(self) -> bool:
        """``False`` when an override (``{"enabled": False}``) switched the job off: it stays
        registered and runs on ``trigger()``, but no slot of it is armed. (Whether the whole
        scheduler schedules is ``scheduler.enabled``.)"""
        return self._state.enabled

    @property
    def overrides(self) -> dict[str, Any]:
        """The override applied to this job (``Scheduler(overrides=...)``, the environment or
        the CLI), as given; ``{}`` when none."""
        return dict(self._state.overrides)

    @property
    def paused(self) -> bool:
        """Whether ``pause()`` stopped arming this job's slots on this instance."""
        return self._state.paused

    def pause(self) -> None:
        """Stop arming slots on this instance (other instances are not affected)."""
        self._state.paused = True
        self._state.armed_ms = None

    def resume(self) -> None:
        """Arm the next slot again (one whose jitter window is still open included)."""
        if self._state.paused:
            self._state.paused = False
            self._scheduler._rearm(self._state)

    def update(self, **options: Any) -> None:
        """Change options at run time (``job.update(jitter="5s", timeout="1m")``).

        The merged options are validated exactly as at registration, against the backend and the
        scheduler's defaults; on a ``ConfigurationError`` nothing changes. Runs in progress keep
        the options they started with.
        """
        self._scheduler._update(self._state, options)

    async def trigger(self) -> RunRecord | None:
        """Run the job now, through the claim (``ctx.reason == "manual"``).

        Returns the run's record, or ``None`` when the claim was refused (another instance, an
        overlap) or the backend failed.
        """
        return await self._scheduler._run_manual(self._state)

    async def history(self, limit: int = 20) -> list[RunRecord]:
        """The job's recorded runs, newest first, at most ``limit``."""
        scheduler = self._scheduler
        await scheduler._recorder.wait_written(_HISTORY_WAIT_S)
        backend: Backend = scheduler.backend
        return await backend.history(self._state.settings.policy, limit)

    def describe(self) -> str:
        return self._state.schedule.describe()

    def __repr__(self) -> str:
        return f"Job({self.name!r}, {self.describe()})"


def past_at(job: Job, now_ms: int) -> str | None:
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

"""``Scheduler`` and ``Job``: the façade the application holds, and the scheduler's life cycle
(``start``, ``stop``, ``serve``), one state machine. The rooms behind it: registration and
overrides (``_registry``), the timer heap (``_timers``), catch-up and the take-over of dead
runners (``_sweeper``), the life of a slot from its timer on (``_runner``)."""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import itertools
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypeAlias, TypeVar, Unpack, overload

from . import _boot
from ._backfill import BackfillSlot, check_range, check_rate, run_backfill
from ._clock import Clock, SystemClock, ms_to_datetime
from ._durations import Duration
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
from ._fleet import Change, Fleet, FleetLink, run_in_progress
from ._fleetrecords import ControlAction, ControlChange, JobControl, RunInProgress
from ._job import AroundRun, Handler, JobState, check_handler
from ._options import (
    JobOptions,
    JobSettings,
    Kind,
    check_scheduler_options,
    enabled_from_env,
    parse_scheduler_options,
)
from ._overrides import overrides_from_env, parse_overrides
from ._recorder import Recorder
from ._registry import MakeTrigger, Registry, past_at
from ._runner import JOB_DATA, Runner
from ._sweeper import Sweeper
from ._tasks import TaskSet, cancel_requests, raise_if_cancelled_since
from ._thread import SchedulerThread
from ._timers import Timers
from ._typing import (
    AfterOptions,
    ClaimAtOptions,
    ClaimCronOptions,
    ClaimEveryOptions,
    LeaseAtOptions,
    LeaseCronOptions,
    LeaseEveryOptions,
)
from .abc import Backend, ClaimBackend, Instance, LeaseBackend, RunRecord
from .triggers.base import Trigger

if TYPE_CHECKING:
    from .backends.memory import MemoryBackend

__all__ = ["Job", "Scheduler", "use_default_backend"]

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

#: What ``Scheduler()`` runs on when given no backend: the public layer chooses it
#: (``brokersched`` sets ``MemoryBackend``), so the scheduler names no concrete backend.
_default_backend: Callable[[], Backend] | None = None


def use_default_backend(factory: Callable[[], Backend]) -> None:
    """Make ``Scheduler()`` without a backend run on ``factory()``."""
    global _default_backend
    _default_backend = factory


class RunState(enum.Enum):
    """Where a scheduler is in its life: ``start()`` and ``stop()`` move it along, and every
    question of the life cycle (may jobs be armed, may ``start()`` be called) reads it."""

    STOPPED = "stopped"  # never started, or stopped: start() may be called
    STARTING = "starting"  # start() enters the lifespan and connects the backend
    CONNECTING = "connecting"  # start(wait=False): the backend is being reached, in the background
    RUNNING = "running"  # connected, jobs armed
    STOPPING = "stopping"  # stop() has begun: nothing new starts, running jobs drain


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
        heartbeat: Duration = ...,
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
        heartbeat: Duration = ...,
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
        self.backend: B = _default() if backend is None else backend
        if not isinstance(self.backend, ClaimBackend | LeaseBackend):
            raise ConfigurationError(
                f"backend {self.backend!r} is not a brokersched backend (a ClaimBackend or "
                "LeaseBackend such as RabbitMQBackend, NATSBackend, RedisBackend, "
                "RedisLeaseBackend, NATSLeaseBackend, SQLiteBackend, PostgresBackend, "
                "MemoryBackend)",
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
        self.instance_id = self.options.instance_id or _default_instance_id()
        self._identity_pid = os.getpid()  # the process instance_id and the jitter RNG belong to
        self._jobs: dict[str, Job] = {}
        self._registry = Registry(
            lambda: (self.options, self.backend),
            overrides_from_env(os.environ) if overrides is None else parse_overrides(overrides),
            self._states_by_name,
        )
        self._tasks = TaskSet(self.clock)
        self._timers = Timers(
            self.clock, fire=self._fire, fire_boot=self._fire_boot, job_count=self._jobs.__len__
        )
        self._events = Events(self._tasks)
        self._recorder = Recorder(
            self.clock, self.backend, self.options.record_buffer, self._events
        )
        self._around_run = _context_factory(around_run, "around_run", sync=True)
        # The slots ended here whose releases came late (Runner.ended_here): every start's.
        self._ended: dict[str, int] = {}
        self._lifespan = _context_factory(lifespan, "lifespan", sync=False)
        # The life cycle: its state, what start() opened (closed in reverse by stop()), and
        # what each start made (a runner, on a lease backend a sweeper).
        self._state = RunState.STOPPED
        self._lifecycle = asyncio.Lock()  # one start() or stop() at a time
        self._stopped = asyncio.Event()
        self._opened = AsyncExitStack()
        self._runner: Runner | None = None
        self._sweeper: Sweeper | None = None
        self._fleet: Fleet | None = None
        self._unsent: list[tuple[JobState, ControlAction, str]] = []  # changes before start()
        self._local_control_said = False
        self._touches = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the last start
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

    def _register(
        self,
        name: str,
        kind: Kind,
        make_trigger: MakeTrigger,
        handler: Handler | None,
        options: dict[str, Any],
    ) -> Job | Callable[[H], H]:
        # Everything is validated now, before the decorator form returns: never at the first run.
        try:
            spec = self._registry.spec(name, kind, make_trigger, options)
        except ConfigurationError as exc:
            if handler is not None or not self._registry.refused(exc.all_errors):
                raise
            return _unchanged

        def add(function: Handler) -> Job:
            check_handler(spec.name, function)
            if spec.name in self._jobs:
                raise ConfigurationError(
                    f"job name '{spec.name}' is taken", option="name", job=spec.name
                )
            state = JobState(spec, function)
            job = self._jobs[spec.name] = Job(self, state)
            if (warning := past_at(spec, self.clock.now_ms())) is not None:
                logger.warning("%s", warning)
            if self._state is RunState.RUNNING:
                self._spawn(self._prepare_and_arm(state), name=f"brokersched:add:{spec.name}")
            return job

        if handler is not None:
            return add(handler)

        def decorator(function: H) -> H:
            try:
                add(function)
            except ConfigurationError as exc:
                if not self._registry.refused([exc]):
                    raise
            return function

        return decorator

    def _maker(self, kind: Kind, schedule: Any) -> MakeTrigger:
        return self._registry.maker(kind, schedule)

    def add_overrides(self, more: Mapping[str, Mapping[str, Any]]) -> None:
        """Overrides given after the jobs registered (the CLI's ``--override``): merged over
        the scheduler's, option by option, validated and applied to the jobs at once. One
        naming no job is reported by ``check()`` and refused by ``start()``; under
        ``collect_errors()`` a refused one is kept for ``check()`` too. Before ``start()``
        only: a running job changes with ``job.update()``, ``pause()`` and ``resume()``."""
        if self._state in (RunState.CONNECTING, RunState.RUNNING, RunState.STOPPING):
            raise RuntimeError(
                "add_overrides() must be called before start(): armed jobs would keep their old "
                "schedule for a slot; change a running job with job.update(), pause() or resume()"
            )
        self._registry.add_overrides(more)

    def override_errors(self) -> list[ConfigurationError]:
        """The overrides that name no registered job, each with a suggestion."""
        return self._registry.override_errors()

    def _update(self, job: JobState, options: dict[str, Any]) -> None:
        self._registry.update(job, options)
        if job.arming.armed_ms is not None:  # re-arm: the schedule or the jitter may have changed
            self._timers.rearm(job)
        if self._state is RunState.RUNNING:
            self._spawn(
                self.backend.prepare([job.settings.policy]), name=f"brokersched:update:{job.name}"
            )

    def check(self) -> list[ConfigurationError]:
        """Every configuration error of every job, all at once (none: ``[]``): the jobs refused
        while ``collect_errors()`` was active, and the registered jobs checked again against
        the scheduler's current backend and defaults."""
        return self._registry.check()

    # -- lookup ----------------------------------------------------------------------------

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def _states(self) -> list[JobState]:
        return [job._state for job in self._jobs.values()]

    def _states_by_name(self) -> dict[str, JobState]:
        return {name: job._state for name, job in self._jobs.items()}

    def remove(self, name: str, abort: bool = False) -> Job:
        """Unregister ``name``; with ``abort``, its runs here are aborted (reason ``removed``)."""
        job = self._jobs.pop(name, None)
        if job is None:
            raise KeyError(f"no job named '{name}' (registered: {', '.join(self._jobs) or 'none'})")
        state = job._state
        self._timers.disarm(state)
        state.removed = True
        if abort and self._runner is not None:
            for run in list(state.runs.values()):
                self._runner.abort(run, "removed")
        return job

    async def backfill(
        self,
        name: str,
        start: datetime,
        end: datetime,
        *,
        rate: float = 1.0,
        dry_run: bool = False,
        progress: Callable[[BackfillSlot], object] | None = None,
    ) -> list[BackfillSlot]:
        """Run the slots of job ``name`` in the past range ``[start, end]`` (aware datetimes)
        that have not run, one after the other, each claimed like any slot, at most ``rate``
        a second (``ctx.reason == "backfill"``). ``dry_run``: only say which would run.
        ``progress`` is called with each slot's ``BackfillSlot`` as it is done; the list of
        them is returned. A slot already run is not run again where the backend remembers it
        (``brokersched._backfill``: the history; a lease backend's fence; a claim-only
        backend's slot memory). Raises ``ConfigurationError`` for a range in the future or
        backwards, ``KeyError`` for an unknown job, ``RuntimeError`` when not running."""
        job = self._jobs.get(name)
        if job is None:
            raise KeyError(f"no job named '{name}' (registered: {', '.join(self._jobs) or 'none'})")
        state = job._state
        slots = check_range(state, start, end, self.clock.now_ms())
        rate = check_rate(rate)
        runner = self._runner
        if self._state is not RunState.RUNNING or runner is None:
            raise RuntimeError(
                f"cannot backfill job '{name}': the scheduler is not running (start it first)"
            )
        await self._recorder.wait_written(_HISTORY_WAIT_S)
        policy = state.settings.policy

        def history() -> Awaitable[list[RunRecord]]:
            return self.backend.history(policy, policy.history_size)

        def spawn(run: Coroutine[Any, Any, RunRecord | None]) -> asyncio.Task[RunRecord | None]:
            return self._spawn(run, name=f"backfill:{name}")

        return await run_backfill(
            runner,
            state,
            slots,
            history,
            rate=rate,
            dry_run=dry_run,
            spawn=spawn,
            progress=progress,
        )

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
        connecting = self._state is RunState.CONNECTING
        since = self._start_requested_ms if connecting else self._started_ms
        for job in self._jobs.values():
            state = job._state
            if state.halted or not state.spec.enabled or since is None:
                continue
            if state.arming.armed_ms is None and not connecting:
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
            if self._state is not RunState.STOPPED:
                raise RuntimeError(
                    "the scheduler is started already: call start() once (or use "
                    "`async with scheduler`, not both), and stop() before starting it again"
                )
            if errors := self.override_errors():  # every job is registered by now
                raise errors[0]
            self._stopped = asyncio.Event()  # bound to this start's event loop
            self._start_requested_ms = self.clock.now_ms()
            self._state = RunState.STARTING
            opened = self._opened = AsyncExitStack()  # stop() closes it, in reverse
            try:
                if self._lifespan is not None:
                    await opened.enter_async_context(self._lifespan(self))
            except BaseException:
                self._state = RunState.STOPPED
                raise
            opened.callback(self._set_stopped)  # once the backend stopped, before the lifespan
            if wait:
                try:
                    await self._start()
                except BaseException as exc:
                    await opened.__aexit__(type(exc), exc, exc.__traceback__)
                    raise
            else:
                self._state = RunState.CONNECTING
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

    async def _watch_exit(self) -> None:
        """Says so when the event loop ends while the scheduler runs: ``asyncio.run()`` cancels
        the tasks it leaves, and armed jobs and running handlers vanish without a word."""
        try:
            await self._stopped.wait()
        except asyncio.CancelledError:
            if self._state in (RunState.RUNNING, RunState.STOPPING):
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
            self.instance_id = _default_instance_id()
        self._timers.reseed()

    async def _start(self) -> None:
        """Connect the backend and arm the jobs: what is opened here goes on ``_opened``, so
        that ``stop()`` closes it in reverse (disarm, drain, flush the records, disconnect)."""
        self._own_identity()
        cancels = cancel_requests()
        async with AsyncExitStack() as attempt:
            await self.backend.start(self.clock)
            attempt.push_async_callback(self._stop_backend)
            await self.backend.prepare([job.settings.policy for job in self._states()])
            raise_if_cancelled_since(cancels)  # one a client library swallowed (Python 3.11)
            self._opened.push_async_exit(attempt.pop_all())
        runner = self._runner = Runner(
            self.clock,
            self.backend,
            self.instance_id,
            self._events,
            self._tasks,
            self._recorder,
            self._around_run,
            self._ended,
        )
        self._loop = asyncio.get_running_loop()
        fleet = self._fleet = self._make_fleet(runner)
        self._opened.push_async_callback(fleet.close)  # after the drain, before the backend
        self._opened.push_async_callback(self._drain, runner)
        # The fleet's controls before any job is armed: a job paused fleet-wide stays paused.
        for job, action, actor in self._unsent:
            written = fleet.change(job, action, actor)
            await asyncio.wait([written])
            self._control_written(job, action, written)
        self._unsent.clear()
        await fleet.refresh(self.clock.now_ms())
        runner.fleet = fleet
        self._state = RunState.RUNNING
        started_ms = self._started_ms = self.clock.now_ms()
        self._opened.callback(self._disarm)
        if not self._enabled:
            return  # no timer at all: nor heartbeats (the instance is not one of the fleet's)
        fleet.start()
        self._timers.open(started_ms)
        for job in self._states():
            self._timers.arm(job)
            self._timers.arm_boot(job, started_ms)
        if isinstance(self.backend, LeaseBackend):
            sweeper = self._sweeper = Sweeper(
                self.clock, self.backend, runner, jobs=self._states, spawn=self._spawn_named
            )
            sweeper.start()

    async def stop(self) -> None:
        """Disarm, abort running handlers (``shutdown``), drain up to ``drain_timeout``.

        Called from a handler (or an event listener), it begins the stop and returns: the drain
        waits for that handler, which is told ``shutdown`` like the others."""
        if self._tasks.is_drained(asyncio.current_task()):
            if self._state is RunState.RUNNING:
                self._stopper = asyncio.get_running_loop().create_task(
                    self.stop(), name="brokersched:stop"
                )
            return
        await self._stop_connecting()
        async with self._lifecycle:  # a second caller waits for the first one's drain
            if self._state is RunState.RUNNING:
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
        if self._state is RunState.CONNECTING:
            try:
                await self._opened.aclose()
            finally:
                self._set_stopped()
                self._stopped.set()

    async def _stop(self) -> None:
        self._state = RunState.STOPPING
        try:
            await self._opened.aclose()
        finally:
            self._set_stopped()
            self._stopped.set()

    def _set_stopped(self) -> None:
        self._state = RunState.STOPPED

    def _make_fleet(self, runner: Runner) -> Fleet:
        from . import __version__

        if not self._touches:  # once per scheduler: a run that starts or ends is published soon
            self._touches = True
            for event in ("start", "complete", "fail"):
                self._events.on(event, self._touch_fleet)
        link = FleetLink(
            clock=self.clock,
            backend=self.backend,
            instance_id=self.instance_id,
            heartbeat=self.options.heartbeat,
            jobs=self._states,
            runs=lambda: runner.runs,
            apply=self._apply_control,
            spawn=lambda coro, name: self._tasks.spawn(coro, name=name, drained=False),
        )
        return Fleet(link, version=__version__)

    def _touch_fleet(self, event: object) -> None:
        if self._fleet is not None:
            self._fleet.touch()

    def _apply_control(self, job: JobState, control: JobControl) -> None:
        """The fleet's control record of ``job`` (read, or written here) takes effect here."""
        was = job.halted
        job.control = control
        job.paused, job.disabled = control.paused, control.disabled
        if job.halted and not was:
            self._timers.disarm(job)
        elif was and not job.halted:
            self._timers.rearm(job)
        runner = self._runner
        if job.runs and runner is not None:
            aborts = control.aborts(self.clock.now())
            for run in list(job.runs.values()):
                if run.ctx.run_id in aborts:
                    runner.abort(run, "aborted")

    def _control(self, job: JobState, action: ControlAction, by: str | None) -> Change:
        """``Job.pause()`` and friends: applied here at once, and written through the backend
        for the whole fleet (at start, when the scheduler is not running)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # another thread (start_in_thread's caller): on the scheduler's loop
            loop = self._loop
            if loop is not None and self._state is RunState.RUNNING and not loop.is_closed():
                loop.call_soon_threadsafe(self._control, job, action, by)
                return Change()
        actor = by or f"code@{self.instance_id}"
        change = ControlChange(job.settings.key, action, actor, self.clock.now())
        self._apply_control(job, (job.control or JobControl(job.settings.key)).apply(change))
        fleet = self._fleet
        if not self.backend.fleet:
            if not self._local_control_said:
                self._local_control_said = True
                logger.warning(
                    "%s keeps no fleet records: %s of job %s applies to this instance only",
                    self.backend.name,
                    action,
                    job.name,
                )
            return Change()
        if fleet is None or self._state is not RunState.RUNNING:
            self._unsent.append((job, action, actor))
            return Change()
        written = fleet.change(job, action, actor)
        written.add_done_callback(functools.partial(self._control_written, job, action))
        return Change(written)

    def _control_written(
        self, job: JobState, action: ControlAction, written: asyncio.Future[JobControl]
    ) -> None:
        if not written.cancelled() and (exc := written.exception()) is not None:
            logger.error(
                "could not %s job %s for the fleet through %s: %s; it applies to this "
                "instance only until the backend answers",
                action,
                job.name,
                self.backend.name,
                exc,
            )

    async def change_control(
        self, name: str, action: ControlAction, *, by: str, run_id: str | None = None
    ) -> JobControl:
        """Change job ``name``'s fleet-wide control through the backend and wait for it
        (the admin API): raises ``BackendError`` when the backend did not take it, and
        ``RuntimeError`` when the scheduler is not running or its backend keeps no fleet
        records (then ``Job.pause()`` pauses this instance only)."""
        job = self._jobs[name]._state
        fleet = self._fleet
        if fleet is None or self._state is not RunState.RUNNING or not fleet.enabled:
            if not self.backend.fleet:
                raise RuntimeError(f"{self.backend.name} keeps no fleet records")
            raise RuntimeError("the scheduler is not running")
        if action == "abort":
            for run in list(job.runs.values()):
                if run.ctx.run_id == run_id and self._runner is not None:
                    self._runner.abort(run, "aborted")  # here: at once
        return await fleet.change(job, action, by, run_id)

    async def instances(self) -> list[Instance]:
        """The fleet's instances as they last published themselves (``[]`` on a backend that
        keeps no fleet records); judge each with ``instance.liveness(scheduler.clock.now())``."""
        if not self.backend.fleet:
            return []
        return await self.backend.instances()

    async def runs_in_progress(self) -> list[tuple[Instance, RunInProgress]]:
        """The runs going on anywhere in the fleet, as the instances last published them
        (this instance's own as they are now), oldest first."""
        here = self._fleet
        found: list[tuple[Instance, RunInProgress]] = []
        for instance in await self.instances():
            if here is not None and instance.id == self.instance_id and self.running:
                instance = here.presence()
            found += [(instance, run) for run in instance.running]
        found.sort(key=lambda pair: pair[1].started_at)
        return found

    async def abort(self, run_id: str, *, by: str | None = None) -> RunInProgress | None:
        """Ask the run ``run_id``, wherever it runs in the fleet, to stop: its context is
        aborted (``ctx.abort_reason == "aborted"``; an async handler is cancelled at its next
        ``await``) when its instance next reads the fleet's controls, within a heartbeat (at
        once when it runs here). Answers the run, or ``None`` when no instance shows it."""
        actor = by or f"code@{self.instance_id}"
        for state in self._states():
            here = state.runs.get(run_id)
            if here is None:
                continue
            if self._runner is not None:
                self._runner.abort(here, "aborted")
            if self.backend.fleet and self.running:  # kept in the job's audit trail
                await self.change_control(state.name, "abort", by=actor, run_id=run_id)
            return run_in_progress(here)
        for instance, run in await self.runs_in_progress():
            if run.run_id != run_id or instance.stopped:
                continue
            job = self._jobs.get(run.job)
            if job is None:
                raise KeyError(f"run {run_id} is a run of job {run.job!r}, unknown here")
            await self.change_control(job.name, "abort", by=actor, run_id=run_id)
            return run
        return None

    def _disarm(self) -> None:
        """No slot, boot run or sweep starts from now on (the first step of a stop)."""
        if self._sweeper is not None:
            self._sweeper.close()
            self._sweeper = None
        self._timers.close(self._states())

    async def _drain(self, runner: Runner) -> None:
        """Let running jobs finish (``drain_timeout``), then write the records still waiting
        for what is left of it (plus a grace)."""
        drain_s = self.options.drain_timeout.total_seconds()
        began_ms = self.clock.monotonic_ms()
        try:
            await runner.drain(drain_s)
        finally:
            left_s = drain_s - (self.clock.monotonic_ms() - began_ms) / 1000
            try:
                await self._recorder.flush(max(left_s, 0) + _FLUSH_GRACE_S)
            except Exception:
                logger.exception("backend %s failed to stop cleanly", self.backend.name)

    async def _stop_backend(self) -> None:
        # What began after the drain (a presence a run's end asked for) ends before the backend.
        await self._tasks.cut(self._tasks.background(), _FLUSH_GRACE_S)
        try:
            await self.backend.stop()
        except Exception:
            logger.exception("backend %s failed to stop cleanly", self.backend.name)

    async def wait_stopped(self) -> None:
        """Wait until ``stop()`` has finished."""
        if self._state in (RunState.STOPPED, RunState.STARTING) and not self._stopped.is_set():
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

    def start_in_thread(self, *, name: str = "brokersched") -> SchedulerThread[Self]:
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
        if self._state in (RunState.CONNECTING, RunState.RUNNING, RunState.STOPPING):
            raise RuntimeError("Scheduler.enabled can only be set before start()")
        self._enabled = enabled

    @property
    def running(self) -> bool:
        return self._state is RunState.RUNNING

    @property
    def stopping(self) -> bool:
        """``stop()`` has begun: no new run starts."""
        return self._state is RunState.STOPPING

    # -- what the rooms hand back ----------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        """Start a task that ``stop()`` waits for."""
        return self._tasks.spawn(coro, name=name)

    def _spawn_named(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.spawn(coro, name=name)

    def _fire(self, job: JobState, slot_ms: int) -> None:
        """A slot fell due (``Timers``): its life is the runner's from here."""
        assert self._runner is not None
        self._spawn(self._runner.run_slot(job, slot_ms, "schedule"), name=f"slot:{job.name}")

    def _fire_boot(self, job: JobState, due_ms: int) -> None:
        assert self._runner is not None
        self._spawn(_boot.run_boot(self._runner, job, due_ms), name=f"start:{job.name}")

    async def _prepare_and_arm(self, job: JobState) -> None:
        try:
            await self.backend.prepare([job.settings.policy])
        except Exception:
            logger.exception("backend could not prepare job %s; its slots are skipped", job.name)
        self._timers.arm(job)
        self._timers.arm_boot(job, self.clock.now_ms())

    async def _run_manual(self, job: JobState, data: Any = JOB_DATA) -> RunRecord | None:
        runner = self._runner
        if self._state is not RunState.RUNNING or runner is None:
            why = (
                "the backend is not reachable yet (start(wait=False) is still trying)"
                if self._state is RunState.CONNECTING
                else "the scheduler is not running (start it first: async with scheduler)"
            )
            raise RuntimeError(f"cannot trigger job '{job.name}': {why}")
        task = self._spawn(
            runner.run_slot(job, self.clock.now_ms(), "manual", data), name=f"manual:{job.name}"
        )
        # Shielded: a caller that gives up waiting must not cut the run short.
        record: RunRecord | None = await asyncio.shield(task)
        return record


def _default() -> Any:
    if _default_backend is None:
        raise ConfigurationError(
            "Scheduler() needs a backend: pass one (Scheduler(MemoryBackend()))", option="backend"
        )
    return _default_backend()


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
        state, arming = self._state, self._state.arming
        if arming.boot_ms is not None and not state.halted:  # its boot run comes first
            return ms_to_datetime(arming.boot_ms)
        if arming.armed_ms is not None:
            return ms_to_datetime(arming.armed_ms)
        if state.halted or state.removed or not (self._scheduler.enabled and state.spec.enabled):
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
        """``False`` when an override (``{"enabled": False}``) switched the job off here (it
        stays registered and runs on ``trigger()``, but no slot of it is armed), or
        ``disable()`` switched it off for the fleet (``disabled``). (Whether the whole
        scheduler schedules is ``scheduler.enabled``.)"""
        return self._state.spec.enabled and not self._state.disabled

    @property
    def overrides(self) -> dict[str, Any]:
        """The override applied to this job (``Scheduler(overrides=...)``, the environment or
        the CLI), as given; ``{}`` when none."""
        return dict(self._state.spec.overrides)

    @property
    def paused(self) -> bool:
        """Whether the job is paused: for the whole fleet (``pause()`` here or on any other
        instance, as last read from the backend), or here only on a backend that keeps no
        fleet records."""
        return self._state.paused

    @property
    def disabled(self) -> bool:
        """Whether ``disable()`` (here or on any instance) switched the job off."""
        return self._state.disabled

    @property
    def control(self) -> JobControl | None:
        """The job's fleet-wide control record as last read or written here: paused,
        disabled, and its ``changes`` (who did what when, newest last); ``None`` when never
        read (not started, or a backend that keeps no fleet records and no change here)."""
        return self._state.control

    def pause(self, *, by: str | None = None) -> Change:
        """Pause the job for the whole fleet: no instance runs its slots (nor catch-up or
        take-over) until ``resume()``; a manual ``trigger()`` still runs. Applies here at once;
        other instances honour it before their next slot's claim. ``by`` names who paused it
        (default ``code@<instance_id>``), kept in ``control.changes``. ``await`` the answer to
        know the change reached the backend. On a backend that keeps no fleet records
        (``backend.fleet`` is false) it pauses this instance only."""
        return self._scheduler._control(self._state, "pause", by)

    def resume(self, *, by: str | None = None) -> Change:
        """Undo ``pause()`` for the whole fleet (the next slot whose jitter window is still
        open included)."""
        return self._scheduler._control(self._state, "resume", by)

    def disable(self, *, by: str | None = None) -> Change:
        """Switch the job off for the whole fleet: as ``pause()``, and ``trigger()`` is
        refused too, until ``enable()``."""
        return self._scheduler._control(self._state, "disable", by)

    def enable(self, *, by: str | None = None) -> Change:
        """Undo ``disable()`` for the whole fleet."""
        return self._scheduler._control(self._state, "enable", by)

    def update(self, **options: Any) -> None:
        """Change options at run time (``job.update(jitter="5s", timeout="1m")``).

        The merged options are validated exactly as at registration, against the backend and the
        scheduler's defaults; on a ``ConfigurationError`` nothing changes. Runs in progress keep
        the options they started with.
        """
        self._scheduler._update(self._state, options)

    async def trigger(self, data: Any = JOB_DATA) -> RunRecord | None:
        """Run the job now, through the claim (``ctx.reason == "manual"``); ``data`` (JSON-like)
        is the run's ``ctx.data`` instead of the job's.

        Returns the run's record, or ``None`` when the claim was refused (another instance, an
        overlap), the job is disabled, or the backend failed.
        """
        return await self._scheduler._run_manual(self._state, data)

    async def history(self, limit: int = 20) -> list[RunRecord]:
        """The job's recorded runs, newest first, at most ``limit``."""
        scheduler = self._scheduler
        await scheduler._recorder.wait_written(_HISTORY_WAIT_S)
        backend: Backend = scheduler.backend
        return await backend.history(self._state.settings.policy, limit)

    def describe(self) -> str:
        return self._state.schedule.describe()

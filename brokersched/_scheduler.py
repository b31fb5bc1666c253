"""``Scheduler``: the façade the application holds. Its methods say what the scheduler offers
(their overloads type each job's options against the backend) and hand the work to the rooms
behind it: registration (``_registration``, over the ``_registry``), the life cycle
(``_lifecycle``: start, stop, serve, the timer heap, health), the fleet's controls
(``_controls``); ``Job`` (``_jobhandle``) is a registered job as the application holds it.
Further in: the life of a slot from its timer on (``_runner``), catch-up and the take-over of
dead runners (``_sweeper``), backfills (``_backfill``)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypeAlias, TypeVar, Unpack, overload

from ._backfill import BackfillSlot, check_range, check_rate, run_backfill
from ._clock import Clock, SystemClock
from ._controls import FleetControls
from ._durations import Duration
from ._events import (
    ClaimEvent,
    EventName,
    Events,
    MissedEvent,
    RecordDroppedEvent,
    RunEvent,
    SkipEvent,
    StartEvent,
)
from ._exceptions import ConfigurationError
from ._fleet import Change
from ._fleetrecords import Asked, ControlAction, JobControl, RunInProgress, asked
from ._job import AroundRun, Handler, JobState, check_handler
from ._jobhandle import Job, state_of
from ._lifecycle import LifeCycle, default_instance_id
from ._options import (
    Kind,
    check_name,
    check_scheduler_options,
    enabled_from_env,
    parse_scheduler_options,
)
from ._overrides import overrides_from_env, parse_overrides
from ._recorder import Recorder
from ._registration import Registration
from ._registry import MakeTrigger
from ._runner import Runner
from ._schedules import Schedules
from ._stored import Spec
from ._storedjobs import StoredJobs, StoredRoom
from ._tasks import TaskSet
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
OnMissed = Callable[[MissedEvent], Awaitable[None] | None]

logger = logging.getLogger("brokersched")

# job.history() and backfill() first wait this long at most for the records being written.
_HISTORY_WAIT_S = 5.0

#: What ``Scheduler()`` runs on when given no backend: the public layer chooses it
#: (``brokersched`` sets ``MemoryBackend``), so the scheduler names no concrete backend.
_default_backend: Callable[[], Backend] | None = None


def use_default_backend(factory: Callable[[], Backend]) -> None:
    """Make ``Scheduler()`` without a backend run on ``factory()``."""
    global _default_backend
    _default_backend = factory


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
        record_results: bool = ...,
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
        record_results: bool = ...,
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
        self.instance_id = self.options.instance_id or default_instance_id()
        self._tasks = TaskSet(self.clock)
        self._events = Events(self._tasks)
        self._recorder = Recorder(
            self.clock, self.backend, self.options.record_buffer, self._events
        )
        # The rooms: each is told of the others' work through callbacks, read when called.
        owner = _JobOwner(self)
        registration = self._registration = Registration(
            self,
            overrides_from_env(os.environ) if overrides is None else parse_overrides(overrides),
            make_job=lambda state: Job(owner, state),
            added=lambda state: self._life.added(state),
        )
        around_run = _context_factory(around_run, "around_run", sync=True)
        lifespan = _context_factory(lifespan, "lifespan", sync=False)
        self._life = LifeCycle(
            self,
            enabled=enabled,
            lifespan=None if lifespan is None else lambda: lifespan(self),
            around_run=around_run,
            tasks=self._tasks,
            events=self._events,
            recorder=self._recorder,
            jobs=registration.states,
            job_count=registration.count,
            override_errors=registration.override_errors,
            apply_control=lambda job, control: self._controls.apply(job, control),
            send_unsent=lambda fleet: self._controls.send_unsent(fleet),
            open_stored=self._open_stored,
        )
        self._timers = self._life.timers
        self._controls = FleetControls(self, self._life, registration.states_by_name)
        self._task_handlers: dict[str, Handler] = {}  # @scheduler.task(name)
        self.schedules = Schedules(lambda: self.backend, self.clock, registration.stored_trigger)

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

    def task(self, name: str) -> Callable[[H], H]:
        """Register the decorated function as task ``name``: what a stored schedule runs
        (``scheduler.schedules.put(id, task=name, ...)``), its ``ctx.data`` the schedule's."""
        check_name(name)

        def decorator(function: H) -> H:
            check_handler(name, function)
            if name in self._task_handlers:
                raise ConfigurationError(f"task name '{name}' is taken", option="task")
            self._task_handlers[name] = function
            return function

        return decorator

    async def _open_stored(self, runner: Runner) -> Callable[[], None] | None:
        """Follow the stored schedules while running (with a task registered, on a backend
        that keeps the fleet's records); answers what stops it."""
        if not self._task_handlers or not self.backend.fleet:
            return None
        registration = self._registration

        def put_job(name: str, spec: Spec, handler: Handler, trigger: Trigger) -> None:
            state, new = registration.put_stored(name, spec, handler, trigger)
            if not new:
                self._life.updated(state, anew=True)

        room = StoredRoom(
            tasks=self._task_handlers,
            trigger_of=registration.stored_trigger,
            put_job=put_job,
            remove_job=lambda name: self.remove(name),
            job=lambda name: state_of(job) if (job := registration.get(name)) is not None else None,
        )
        stored = runner.stored = StoredJobs(self.backend, self.clock, room)
        await stored.open()
        return stored.close

    def _register(
        self,
        name: str,
        kind: Kind,
        make_trigger: MakeTrigger,
        handler: Handler | None,
        options: dict[str, Any],
    ) -> Job | Callable[[H], H]:
        return self._registration.register(name, kind, make_trigger, handler, options)

    def _maker(self, kind: Kind, schedule: Any) -> MakeTrigger:
        return self._registration.maker(kind, schedule)

    def add_overrides(self, more: Mapping[str, Mapping[str, Any]]) -> None:
        """Overrides given after the jobs registered (the CLI's ``--override``): merged over
        the scheduler's, option by option, validated and applied to the jobs at once. One
        naming no job is reported by ``check()`` and refused by ``start()``; under
        ``collect_errors()`` a refused one is kept for ``check()`` too. Before ``start()``
        only: a running job changes with ``job.update()``, ``pause()`` and ``resume()``."""
        if self._life.started:
            raise RuntimeError(
                "add_overrides() must be called before start(): armed jobs would keep their old "
                "schedule for a slot; change a running job with job.update(), pause() or resume()"
            )
        self._registration.add_overrides(more)

    def override_errors(self) -> list[ConfigurationError]:
        """The overrides that name no registered job, each with a suggestion."""
        return self._registration.override_errors()

    def check(self) -> list[ConfigurationError]:
        """Every configuration error of every job, all at once (none: ``[]``): the jobs refused
        while ``collect_errors()`` was active, and the registered jobs checked again against
        the scheduler's current backend and defaults."""
        return self._registration.check()

    # -- lookup ----------------------------------------------------------------------------

    def get(self, name: str) -> Job | None:
        return self._registration.get(name)

    def jobs(self) -> list[Job]:
        return self._registration.jobs()

    def remove(self, name: str, abort: bool = False) -> Job:
        """Unregister ``name``; with ``abort``, its runs here are aborted (reason ``removed``)."""
        job = self._registration.remove(name)
        self._life.removed(state_of(job), abort)
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
        state = self._registration.state(name)
        slots = check_range(state, start, end, self.clock.now_ms())
        rate = check_rate(rate)
        runner = self._life.runner
        if not self._life.running or runner is None:
            raise RuntimeError(
                f"cannot backfill job '{name}': the scheduler is not running (start it first)"
            )
        await self._recorder.wait_written(_HISTORY_WAIT_S)
        policy = state.settings.policy

        def history() -> Awaitable[list[RunRecord]]:
            return self.backend.history(policy, policy.history_size)

        def spawn(run: Coroutine[Any, Any, RunRecord | None]) -> asyncio.Task[RunRecord | None]:
            return self._tasks.spawn(run, name=f"backfill:{name}")

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
    @overload
    def on(self, event: Literal["missed"], listener: OnMissed) -> OnMissed: ...
    def on(self, event: EventName, listener: Any) -> Any:
        """Call ``listener`` (sync or async) for every ``event``: ``skip`` (a ``SkipEvent``),
        ``start`` (a ``StartEvent``), ``complete`` and ``fail`` (a ``RunEvent``), ``claim`` (a
        ``ClaimEvent``: how long each claim took), ``record-dropped`` (a
        ``RecordDroppedEvent``: a run's record never reached the backend), ``missed`` (a
        ``MissedEvent``: a slot no instance ran within ``max_late``, emitted by the one instance
        that reports it for the fleet)."""
        self._events.on(event, listener)
        return listener

    def overdue(self) -> list[Job]:
        """Armed jobs whose second slot after their last handled run (or the start) has passed
        by more than ``max_late``: the base of a health check.

        A slot counts as handled when it completed here or another instance claimed it.
        """
        return self._life.overdue(self._registration.jobs())

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, *, wait: bool = True) -> None:
        """Enter the lifespan, connect the backend and arm every job.

        ``wait=False`` returns once the lifespan is entered and connects in the background,
        retrying an unreachable backend (0.5 s, 1 s, 2 s, ... then every 30 s) until it
        answers: a web app starts while its broker is down. Until then ``ready`` is false, no
        slot runs (never one unclaimed), ``trigger()`` is refused and ``overdue()`` lists the
        jobs whose slots are being missed. ``stop()`` ends the attempts."""
        await self._life.start(wait=wait)

    @property
    def ready(self) -> bool:
        """Connected and running: false while ``start(wait=False)`` still tries to reach the
        backend, and once ``stop()`` has begun (the base of a readiness probe)."""
        return self.running

    async def stop(self) -> None:
        """Disarm, abort running handlers (``shutdown``), drain up to ``drain_timeout``.

        Called from a handler (or an event listener), it begins the stop and returns: the drain
        waits for that handler, which is told ``shutdown`` like the others."""
        await self._life.stop()

    async def wait_stopped(self) -> None:
        """Wait until ``stop()`` has finished."""
        await self._life.wait_stopped()

    async def serve(self) -> None:
        """Start, run until SIGINT or SIGTERM (or ``stop()``), then stop and drain: the main of a
        process that only schedules, ``asyncio.run(scheduler.serve())``. A signal during the
        start stops the scheduler once it has started (a connection is never cut half-made);
        after the first signal the default handlers are back, so a second Ctrl-C interrupts the
        drain. A backend that cannot be reached at start is one error line and exit status 3."""
        await self._life.serve()

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
        return self._life.enabled

    @enabled.setter
    def enabled(self, enabled: bool) -> None:
        if self._life.started:
            raise RuntimeError("Scheduler.enabled can only be set before start()")
        self._life.enabled = enabled

    @property
    def running(self) -> bool:
        return self._life.running

    @property
    def stopping(self) -> bool:
        """``stop()`` has begun: no new run starts."""
        return self._life.stopping

    @property
    def _runner(self) -> Runner | None:
        """The runner of the current (or last) start."""
        return self._life.runner

    # -- the fleet -------------------------------------------------------------------------

    async def change_control(
        self,
        name: str,
        action: ControlAction,
        *,
        by: str,
        run_id: str | None = None,
        note: str | None = None,
        until: datetime | None = None,
        count: int | None = None,
    ) -> JobControl:
        """Change job ``name``'s fleet-wide control through the backend and wait for it
        (the admin API): ``note``, ``until`` (a pause's end) and ``count`` (a skip's slots)
        as ``Job.pause()`` and ``Job.skip()`` take them. Raises ``ValueError`` for a bad one,
        ``BackendError`` when the backend did not take it, and ``RuntimeError`` when the
        scheduler is not running or its backend keeps no fleet records (then ``Job.pause()``
        pauses this instance only)."""
        extra = asked(action, now=self.clock.now(), note=note, until=until, count=count)
        return await self._controls.change(name, action, by=by, run_id=run_id, extra=extra)

    async def instances(self) -> list[Instance]:
        """The fleet's instances as they last published themselves (``[]`` on a backend that
        keeps no fleet records); judge each with ``instance.liveness(scheduler.clock.now())``.
        An instance that is not alive lists only its runs that are not over yet: a run
        recorded in the history (a dead runner's, recorded ``interrupted`` by the instance
        that took its slot over), or whose lease is gone, is left out."""
        return await self._controls.instances()

    async def runs_in_progress(self) -> list[tuple[Instance, RunInProgress]]:
        """The runs going on anywhere in the fleet, as the instances last published them
        (this instance's own as they are now; without the runs that are over, as
        ``instances()``), oldest first."""
        return await self._controls.runs_in_progress()

    async def abort(self, run_id: str, *, by: str | None = None) -> RunInProgress | None:
        """Ask the run ``run_id``, wherever it runs in the fleet, to stop: its context is
        aborted (``ctx.abort_reason == "aborted"``; an async handler is cancelled at its next
        ``await``) when its instance next reads the fleet's controls, within a heartbeat (at
        once when it runs here). Answers the run, or ``None`` when no instance shows it."""
        return await self._controls.abort(run_id, by=by)


def _default() -> Any:
    if _default_backend is None:
        raise ConfigurationError(
            "Scheduler() needs a backend: pass one (Scheduler(MemoryBackend()))", option="backend"
        )
    return _default_backend()


class _JobOwner:
    """What a ``Job`` asks of its scheduler (``JobOwner``), handed to the room that does it."""

    __slots__ = ("_scheduler",)

    def __init__(self, scheduler: Scheduler[Any]) -> None:
        self._scheduler = scheduler

    @property
    def clock(self) -> Clock:
        return self._scheduler.clock

    @property
    def enabled(self) -> bool:
        return self._scheduler.enabled

    def control(self, job: JobState, action: ControlAction, by: str | None, extra: Asked) -> Change:
        return self._scheduler._controls.control(job, action, by, extra)

    def update(self, job: JobState, options: dict[str, Any]) -> None:
        self._scheduler._registration.update(job, options)
        self._scheduler._life.updated(job)

    async def trigger(self, job: JobState, data: Any) -> RunRecord | None:
        return await self._scheduler._life.run_manual(job, data)

    async def history(self, job: JobState, limit: int) -> list[RunRecord]:
        scheduler = self._scheduler
        await scheduler._recorder.wait_written(_HISTORY_WAIT_S)
        backend: Backend = scheduler.backend
        return await backend.history(job.settings.policy, limit)

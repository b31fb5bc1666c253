"""``Scheduler``: registration, the timer heap, the life of a slot, runs, drain."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import random
import secrets
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar, Unpack, overload

from . import _runner
from ._clock import Clock, SystemClock, Timer
from ._durations import Duration, parse_duration, to_ms
from ._events import Event, EventName, Listener, SkipEvent, SkipReason
from ._exceptions import ConfigurationError
from ._job import Handler, Job
from ._options import (
    JobOptions,
    JobSettings,
    check_name,
    check_scheduler_options,
    job_errors,
    parse_job_options,
    parse_scheduler_options,
    resolve_job,
)
from ._typing import (
    ClaimAtOptions,
    ClaimCronOptions,
    ClaimEveryOptions,
    LeaseAtOptions,
    LeaseCronOptions,
    LeaseEveryOptions,
)
from .abc import Backend, ClaimBackend, LeaseBackend, RunRecord
from .backends.memory import MemoryBackend
from .triggers.at import AtTrigger
from .triggers.base import Trigger
from .triggers.cron import parse_cron
from .triggers.interval import IntervalTrigger

__all__ = ["Scheduler"]

B = TypeVar("B", bound=Backend)
LB = TypeVar("LB", bound=LeaseBackend)
H = TypeVar("H", bound=Handler)

logger = logging.getLogger("brokersched")
_EVENTS: tuple[EventName, ...] = ("skip", "start", "complete", "fail")


_COLLECTING: ContextVar[bool] = ContextVar("brokersched_collecting", default=False)


@contextmanager
def collect_errors() -> Iterator[None]:
    """While active, registration keeps refused jobs' errors for ``check()`` instead of raising
    them, so that ``brokersched check`` reports every error of every job at once. A refused job
    is not registered (its direct form returns ``None``)."""
    token = _COLLECTING.set(True)
    try:
        yield
    finally:
        _COLLECTING.reset(token)


def _unchanged(function: H) -> H:
    return function


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
        instance_id: str | None = ...,
        clock: Clock | None = ...,
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
        instance_id: str | None = ...,
        clock: Clock | None = ...,
    ) -> None: ...
    def __init__(self, backend: Any = None, *, clock: Clock | None = None, **options: Any) -> None:
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
        self.instance_id = self.options.instance_id or _default_instance_id()
        self._jobs: dict[str, Job] = {}
        self._listeners: dict[EventName, list[Listener]] = {name: [] for name in _EVENTS}
        self._heap: list[tuple[int, int, int, Job]] = []  # (due_ms, seq, slot_ms, job)
        self._seq = itertools.count()
        self._timer: Timer | None = None
        self._timer_ms: int | None = None
        self._sweep_timer: Timer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()  # renewals: cancelled by stop()
        self._random = random.Random()
        self._started = False
        self._stopping = False
        self._stopped = asyncio.Event()
        self._lifecycle = asyncio.Lock()
        self._runner = _runner.Runner(self)
        self._claim_observers: list[Callable[[str, float], None]] = []
        self._refused: list[ConfigurationError] = []  # see collect_errors()
        self._started_ms: int | None = None

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

        def make(job_options: JobOptions) -> Trigger:
            period = parse_duration(interval, name="interval")
            return IntervalTrigger(period, job_options.offset or timedelta(0))

        return self._register(name, "every", make, handler, options)

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

        def make(job_options: JobOptions) -> Trigger:
            return parse_cron(expression, job_options.timezone or self.options.timezone)

        return self._register(name, "cron", make, handler, options)

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
        return self._register(name, "at", lambda _: AtTrigger(when), handler, options)

    def _register(
        self,
        name: str,
        kind: Literal["every", "cron", "at"],
        make_trigger: Callable[[JobOptions], Trigger],
        handler: Handler | None,
        options: dict[str, Any],
    ) -> Job | Callable[[H], H]:
        # Everything is validated now, before the decorator form returns: never at the first run.
        try:
            name, trigger, settings, job_options = self._validate(name, kind, make_trigger, options)
        except ConfigurationError as exc:
            if not _COLLECTING.get():
                raise
            self._refused.extend(exc.all_errors)
            return _unchanged if handler is None else None  # type: ignore[return-value]

        def add(function: Handler) -> Job:
            if not callable(function):
                raise ConfigurationError(
                    f"job '{name}': handler {function!r} is not callable",
                    option="handler",
                    job=name,
                )
            if name in self._jobs:
                raise ConfigurationError(f"job name '{name}' is taken", option="name", job=name)
            job = Job(self, name, kind, trigger, function, settings, job_options, make_trigger)
            self._jobs[name] = job
            if self._started and not self._stopping:
                self._spawn(self._prepare_and_arm(job), name=f"brokersched:add:{name}")
            return job

        if handler is not None:
            return add(handler)

        def decorator(function: H) -> H:
            add(function)
            return function

        return decorator

    def _validate(
        self,
        name: str,
        kind: Literal["every", "cron", "at"],
        make_trigger: Callable[[JobOptions], Trigger],
        options: dict[str, Any],
        replacing: Job | None = None,
    ) -> tuple[str, Trigger, JobSettings, JobOptions]:
        name = check_name(name)
        if name in self._jobs and self._jobs[name] is not replacing:
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
        return name, trigger, settings, job_options

    def _update(self, job: Job, options: dict[str, Any]) -> None:
        merged = {**job.options.model_dump(exclude_unset=True), **options}
        _, trigger, settings, job_options = self._validate(
            job.name, job.kind, job.make_trigger, merged, replacing=job
        )
        job.schedule, job.settings, job.options = trigger, settings, job_options
        if job.armed_ms is not None:  # re-arm: the schedule or the jitter may have changed
            job.armed_ms = None
            self._arm(job)
        if self._started and not self._stopping:
            self._spawn(
                self.backend.prepare([settings.policy]), name=f"brokersched:update:{job.name}"
            )

    def check(self) -> list[ConfigurationError]:
        """Every configuration error of every job, all at once (none: ``[]``): the jobs refused
        while ``collect_errors()`` was active, and the registered jobs checked again against
        the scheduler's current backend and defaults."""
        caps, backend = self.backend.capabilities, self.backend.name
        errors: list[ConfigurationError] = list(self._refused)
        for job in self._jobs.values():
            gap = job.schedule.min_gap()
            errors += job_errors(job.name, job.kind, gap, job.options, self.options, caps, backend)
        return errors

    # -- lookup ----------------------------------------------------------------------------

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def remove(self, name: str, abort: bool = False) -> Job:
        """Unregister ``name``; with ``abort``, its runs here are aborted (reason ``removed``)."""
        job = self._jobs.pop(name, None)
        if job is None:
            raise KeyError(f"no job named '{name}' (registered: {', '.join(self._jobs) or 'none'})")
        job.armed_ms = None
        if abort:
            for run in list(job.runs.values()):
                self._runner.abort(run, "removed")
        return job

    # -- events ----------------------------------------------------------------------------

    def on(self, event: EventName, listener: Listener) -> Listener:
        """Call ``listener`` (sync or async) for every ``event``: skip, start, complete, fail."""
        if event not in self._listeners:
            raise ConfigurationError(
                f"unknown event {event!r}; use one of {', '.join(_EVENTS)}", option="event"
            )
        self._listeners[event].append(listener)
        return listener

    def emit(self, name: EventName, event: Event) -> None:
        for listener in self._listeners[name]:
            try:
                result = listener(event)
                if asyncio.iscoroutine(result):
                    self._spawn(self._await_listener(result), name=f"brokersched:on:{name}")
            except Exception:
                logger.exception("event listener %r failed on %s", listener, name)

    async def _await_listener(self, awaitable: Any) -> None:
        try:
            await awaitable
        except Exception:
            logger.exception("async event listener failed")

    def skip(self, job: Job, slot_ms: int, reason: SkipReason, detail: str | None = None) -> None:
        level = logging.DEBUG if reason == "not-acquired" else logging.INFO
        if reason == "backend-error":
            level = logging.WARNING
        late_ms = self.clock.now_ms() - slot_ms
        logger.log(
            level,
            "skip job=%s slot=%d reason=%s late_ms=%d instance_id=%s%s",
            job.name,
            slot_ms,
            reason,
            late_ms,
            self.instance_id,
            f" detail={detail}" if detail else "",
            extra={
                "event": "skip",
                "job": job.name,
                "slot": slot_ms,
                "reason": reason,
                "late_ms": late_ms,
                "instance_id": self.instance_id,
            },
        )
        if reason == "not-acquired":  # another instance has it: the fleet is handling the job
            job.last_ok_ms = max(job.last_ok_ms or slot_ms, slot_ms)
        self.emit("skip", SkipEvent(job.name, slot_ms, reason, detail))

    def on_claim(self, observer: Callable[[str, float], None]) -> None:
        """Call ``observer(backend_name, seconds)`` after every claim (for metrics)."""
        self._claim_observers.append(observer)

    def observe_claim(self, seconds: float) -> None:
        for observer in self._claim_observers:
            try:
                observer(self.backend.name, seconds)
            except Exception:
                logger.exception("claim observer %r failed", observer)

    def overdue(self) -> list[Job]:
        """Armed jobs whose second slot after their last handled run (or the start) has passed
        by more than ``max_late``: the base of a health check.

        A slot counts as handled when it completed here or another instance claimed it.
        """
        now = self.clock.now_ms()
        late: list[Job] = []
        for job in self._jobs.values():
            if job.paused or job.armed_ms is None or self._started_ms is None:
                continue
            first = job.schedule.next_ms(max(job.last_ok_ms or 0, self._started_ms))
            second = job.schedule.next_ms(first) if first is not None else None
            if second is not None and now > second + job.settings.max_late_ms:
                late.append(job)
        return late

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the backend and arm every job."""
        async with self._lifecycle:
            if not self._started:
                await self._start()

    async def _start(self) -> None:
        await self.backend.start(self.clock)
        try:
            await self.backend.prepare([job.settings.policy for job in self._jobs.values()])
        except BaseException:
            await self.backend.stop()
            raise
        self._started, self._stopping = True, False
        self._started_ms = self.clock.now_ms()
        self._stopped.clear()
        for job in self._jobs.values():
            self._arm(job)
        if isinstance(self.backend, LeaseBackend):
            self._catch_up()
            self._spawn(self._sweep(), name="brokersched:take-over")  # hand-overs wait for no one
            self._schedule_sweep(self.clock.now_ms())

    async def stop(self) -> None:
        """Disarm, abort running handlers (``shutdown``), drain up to ``drain_timeout``."""
        async with self._lifecycle:  # a second caller waits for the first one's drain
            if self._started:
                await self._stop()

    async def _stop(self) -> None:
        self._stopping = True
        for timer in (self._timer, self._sweep_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._sweep_timer = self._timer_ms = None
        self._heap.clear()
        for job in self._jobs.values():
            job.armed_ms = None
        try:
            await self._runner.drain(self.options.drain_timeout.total_seconds())
        finally:
            try:
                await self.backend.stop()
            except Exception:
                logger.exception("backend %s failed to stop cleanly", self.backend.name)
            finally:
                self._started = self._stopping = False
                self._stopped.set()

    async def wait_stopped(self) -> None:
        """Wait until ``stop()`` has finished."""
        await self._stopped.wait()

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
    def running(self) -> bool:
        return self._started and not self._stopping

    @property
    def stopping(self) -> bool:
        """``stop()`` has begun: no new run starts."""
        return self._stopping

    # -- arming: one timer for every job --------------------------------------------------

    def _spawn(self, coro: Any, *, name: str, drained: bool = True) -> asyncio.Task[Any]:
        """Start a task; ``stop()`` waits for it (``drained``) or cancels it at once."""
        task = self.clock.spawn(coro, name=name)
        tasks = self._tasks if drained else self._background
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def _prepare_and_arm(self, job: Job) -> None:
        try:
            await self.backend.prepare([job.settings.policy])
        except Exception:
            logger.exception("backend could not prepare job %s; its slots are skipped", job.name)
        if self._jobs.get(job.name) is job:
            self._arm(job)

    def _arm(self, job: Job, after_ms: int | None = None) -> None:
        if not self._started or self._stopping or job.paused or self._jobs.get(job.name) is not job:
            return
        now = self.clock.now_ms()
        slot = job.schedule.next_ms(now if after_ms is None else after_ms)
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

    def _compact_heap(self) -> None:
        """Drop the entries that pause/resume/remove left behind (they are skipped lazily)."""
        self._heap = [entry for entry in self._heap if self._armed(entry[3], entry[1])]
        heapq.heapify(self._heap)

    def _armed(self, job: Job, seq: int) -> bool:
        """Whether a heap entry is the job's current one (not left by pause/remove/re-arm)."""
        return job.armed_seq == seq and job.armed_ms is not None and self._jobs.get(job.name) is job

    def _set_timer(self, when_ms: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_ms = when_ms
        self._timer = self.clock.call_at(when_ms, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_ms = None
        now = self.clock.now_ms()
        while self._heap and self._heap[0][0] <= now:
            _, seq, slot_ms, job = heapq.heappop(self._heap)
            if not self._armed(job, seq):
                continue  # disarmed (paused, removed, re-armed) since it was pushed
            self._spawn(self._runner.run_slot(job, slot_ms, "schedule"), name=f"slot:{job.name}")
            # A frozen process wakes to many past slots: skip straight to those still in time.
            self._arm(job, after_ms=max(slot_ms, now - job.settings.max_late_ms))
        if self._heap:
            self._set_timer(self._heap[0][0])

    # -- lease backends: catch-up and take-over ------------------------------------------

    def _catch_up(self) -> None:
        now = self.clock.now_ms()
        for job in self._jobs.values():
            if not job.settings.claim or job.settings.catch_up_ms <= 0 or job.paused:
                continue
            latest = job.schedule.latest_ms(now, job.settings.catch_up_ms)
            if latest is not None:
                coro = self._runner.run_slot(job, latest, "catch-up")
                self._spawn(coro, name=f"catch-up:{job.name}")

    def _schedule_sweep(self, now_ms: int) -> None:
        assert isinstance(self.backend, LeaseBackend)
        period = max(to_ms(self.backend.lease_ttl) // 2, 50)

        def sweep() -> None:
            self._spawn(self._sweep(), name="brokersched:take-over")
            self._schedule_sweep(self.clock.now_ms())

        if not self._stopping:
            self._sweep_timer = self.clock.call_at(now_ms + period, sweep)

    async def _sweep(self) -> None:
        backend = self.backend
        assert isinstance(backend, LeaseBackend)
        jobs = [job for job in self._jobs.values() if job.settings.claim and not job.paused]
        if not jobs:
            return
        leased_ms = self.clock.now_ms()
        try:
            leases = await backend.take_over(
                [job.settings.policy for job in jobs], instance_id=self.instance_id
            )
        except Exception as exc:
            logger.warning("take-over sweep failed: %s", exc)
            return
        for lease in leases:
            job = self._jobs.get(lease.job)
            if job is None or self._stopping:
                await self._runner._release(lease, handover=True)
                continue
            run = self._runner.execute(job, lease.slot_ms, lease, leased_ms=leased_ms)
            self._spawn(run, name=f"retry:{job.name}")

    # -- manual runs -----------------------------------------------------------------------

    async def _run_manual(self, job: Job) -> RunRecord | None:
        if not self._started or self._stopping:
            raise RuntimeError(
                f"cannot trigger job '{job.name}': the scheduler is not running "
                "(start it first: async with scheduler)"
            )
        task = self._spawn(
            self._runner.run_slot(job, self.clock.now_ms(), "manual"), name=f"manual:{job.name}"
        )
        # Shielded: a caller that gives up waiting must not cut the run short.
        record: RunRecord | None = await asyncio.shield(task)
        return record

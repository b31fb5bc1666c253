"""The scheduler's life cycle, one state machine (``RunState``): ``start()`` enters the lifespan,
connects the backend and arms the jobs; ``stop()`` disarms them, drains the running jobs and
closes in reverse what the start opened; ``serve()`` is the main of a process. What each start
makes (a runner, the fleet's presence, on a lease backend a sweeper) is kept here, with the
timer heap that fires the slots and the health check that reads both (``overdue()``)."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

from . import _boot
from ._events import Events
from ._exceptions import BackendError, ConfigurationError
from ._fleet import Fleet, FleetLink
from ._fleetrecords import JobControl
from ._host import Host
from ._job import AroundRun, JobState
from ._jobhandle import Job, state_of
from ._recorder import Recorder
from ._runner import JOB_DATA, Runner
from ._sweeper import Sweeper
from ._tasks import TaskSet, cancel_requests, raise_if_cancelled_since
from ._timers import Timers
from .abc import LeaseBackend, RunRecord

__all__ = ["LifeCycle", "RunState", "default_instance_id"]

logger = logging.getLogger("brokersched")

# stop() writes the run records still waiting for what is left of drain_timeout plus this grace
# (a record being written as drain_timeout ends is not cut, as a run releasing its lease is not).
_FLUSH_GRACE_S = 2.0
# start(wait=False): the waits between attempts to reach the backend.
_CONNECT_RETRIES_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class RunState(enum.Enum):
    """Where a scheduler is in its life: ``start()`` and ``stop()`` move it along, and every
    question of the life cycle (may jobs be armed, may ``start()`` be called) reads it."""

    STOPPED = "stopped"  # never started, or stopped: start() may be called
    STARTING = "starting"  # start() enters the lifespan and connects the backend
    CONNECTING = "connecting"  # start(wait=False): the backend is being reached, in the background
    RUNNING = "running"  # connected, jobs armed
    STOPPING = "stopping"  # stop() has begun: nothing new starts, running jobs drain


def default_instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


class LifeCycle:
    """The life cycle of ``host``. ``jobs`` gives its registered jobs; ``apply_control`` makes
    a fleet control record take effect here, ``send_unsent`` writes the controls changed before
    the start (both the fleet controls', ``_controls``)."""

    def __init__(
        self,
        host: Host,
        *,
        enabled: bool,
        lifespan: Callable[[], AbstractAsyncContextManager[object]] | None,
        around_run: AroundRun | None,
        tasks: TaskSet,
        events: Events,
        recorder: Recorder,
        jobs: Callable[[], list[JobState]],
        job_count: Callable[[], int],
        override_errors: Callable[[], list[ConfigurationError]],
        apply_control: Callable[[JobState, JobControl], None],
        send_unsent: Callable[[Fleet], Awaitable[None]],
        open_stored: Callable[[Runner], Awaitable[Callable[[], None] | None]],
    ) -> None:
        self._host = host
        self.enabled = enabled  # False: jobs are registered and listed, nothing is armed
        self._identity_pid = os.getpid()  # the process instance_id and the jitter RNG belong to
        self._lifespan = lifespan
        self._around_run = around_run
        self._tasks = tasks
        self._events = events
        self._recorder = recorder
        self._jobs = jobs
        self._override_errors = override_errors
        self._apply_control = apply_control
        self._send_unsent = send_unsent
        self._open_stored = open_stored
        self.timers = Timers(
            host.clock,
            fire=self._fire,
            fire_boot=self._fire_boot,
            job_count=job_count,
            passed=self._passed,
        )
        # The slots ended here whose releases came late (Runner.ended_here): every start's.
        self._ended: dict[str, int] = {}
        # The life cycle: its state, what start() opened (closed in reverse by stop()), and
        # what each start made (a runner, the fleet's presence, on a lease backend a sweeper).
        self.state = RunState.STOPPED
        self._lock = asyncio.Lock()  # one start() or stop() at a time
        self._stopped = asyncio.Event()
        self._opened = AsyncExitStack()
        self.runner: Runner | None = None
        self.fleet: Fleet | None = None
        self._sweeper: Sweeper | None = None
        self._touches = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop of the last start
        self._started_ms: int | None = None
        self._start_requested_ms: int | None = None
        self._connecting: asyncio.Task[None] | None = None  # start(wait=False)'s attempts
        self._watcher: asyncio.Task[None] | None = None
        self._stopper: asyncio.Task[None] | None = None  # a stop() begun by a handler

    @property
    def running(self) -> bool:
        return self.state is RunState.RUNNING

    @property
    def stopping(self) -> bool:
        return self.state is RunState.STOPPING

    @property
    def started(self) -> bool:
        """``start()`` has been called and ``stop()`` has not finished."""
        return self.state in (RunState.CONNECTING, RunState.RUNNING, RunState.STOPPING)

    # -- start -------------------------------------------------------------------------------

    async def start(self, *, wait: bool = True) -> None:
        async with self._lock:
            if self.state is not RunState.STOPPED:
                raise RuntimeError(
                    "the scheduler is started already: call start() once (or use "
                    "`async with scheduler`, not both), and stop() before starting it again"
                )
            if errors := self._override_errors():  # every job is registered by now
                raise errors[0]
            self._stopped = asyncio.Event()  # bound to this start's event loop
            self._start_requested_ms = self._host.clock.now_ms()
            self.state = RunState.STARTING
            opened = self._opened = AsyncExitStack()  # stop() closes it, in reverse
            try:
                if self._lifespan is not None:
                    await opened.enter_async_context(self._lifespan())
            except BaseException:
                self.state = RunState.STOPPED
                raise
            opened.callback(self._set_stopped)  # once the backend stopped, before the lifespan
            if wait:
                try:
                    await self._start()
                except BaseException as exc:
                    await opened.__aexit__(type(exc), exc, exc.__traceback__)
                    raise
            else:
                self.state = RunState.CONNECTING
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
                    self._host.backend.name,
                    attempts,
                    exc,
                    delay,
                )
                await self._host.clock.sleep(delay)
                continue
            except Exception:  # not an outage (a missing extra, a bug): retrying would not help
                logger.exception("cannot start: backend %s; not retried", self._host.backend.name)
                return
            if attempts > 1:
                logger.info("backend %s answered: started", self._host.backend.name)
            return

    async def _watch_exit(self) -> None:
        """Says so when the event loop ends while the scheduler runs: ``asyncio.run()`` cancels
        the tasks it leaves, and armed jobs and running handlers vanish without a word."""
        try:
            await self._stopped.wait()
        except asyncio.CancelledError:
            if self.state in (RunState.RUNNING, RunState.STOPPING):
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
        if self._host.options.instance_id is None:
            self._host.instance_id = default_instance_id()
        self.timers.reseed()

    async def _start(self) -> None:
        """Connect the backend and arm the jobs: what is opened here goes on ``_opened``, so
        that ``stop()`` closes it in reverse (disarm, drain, flush the records, disconnect)."""
        self._own_identity()
        host = self._host
        cancels = cancel_requests()
        async with AsyncExitStack() as attempt:
            await host.backend.start(host.clock)
            attempt.push_async_callback(self._stop_backend)
            await host.backend.prepare([job.settings.policy for job in self._jobs()])
            raise_if_cancelled_since(cancels)  # one a client library swallowed (Python 3.11)
            self._opened.push_async_exit(attempt.pop_all())
        runner = self.runner = Runner(
            host.clock,
            host.backend,
            host.instance_id,
            self._events,
            self._tasks,
            self._recorder,
            self._around_run,
            self._ended,
            record_results=host.options.record_results,
        )
        self.loop = asyncio.get_running_loop()
        fleet = self.fleet = self._make_fleet(runner)
        self._opened.push_async_callback(fleet.close)  # after the drain, before the backend
        self._opened.push_async_callback(self._drain, runner)
        # The fleet's controls before any job is armed: a job paused fleet-wide stays paused.
        await self._send_unsent(fleet)
        await fleet.refresh(host.clock.now_ms())
        runner.fleet = fleet
        self.state = RunState.RUNNING
        started_ms = self._started_ms = host.clock.now_ms()
        self._opened.callback(self._disarm)
        if not self.enabled:
            return  # no timer at all: nor heartbeats (the instance is not one of the fleet's)
        self._warn_if_halted()
        fleet.start()
        self.timers.open(started_ms)
        for job in self._jobs():
            self.timers.arm(job)
            self.timers.arm_boot(job, started_ms)
        # The stored schedules, read once (their jobs armed as they are made), then followed.
        close_stored = await self._open_stored(runner)
        if close_stored is not None:
            self._opened.callback(close_stored)
        if isinstance(host.backend, LeaseBackend):
            sweeper = self._sweeper = Sweeper(
                host.clock, host.backend, runner, jobs=self._jobs, spawn=self._spawn_named
            )
            sweeper.start()

    def _warn_if_halted(self) -> None:
        """Say it when every job is paused or disabled for the fleet as this instance starts:
        it runs, and nothing will until one is resumed or enabled (a fleet left paused by
        hand looks like a healthy, quiet one)."""
        jobs = [job for job in self._jobs() if job.spec.enabled]
        if not jobs or not all(job.halted for job in jobs):
            return
        names = ", ".join(job.name for job in jobs[:5]) + (", ..." if len(jobs) > 5 else "")
        logger.warning(
            "every job is paused or disabled for the fleet (%s): this instance runs nothing "
            "until one is resumed or enabled (Job.resume(), Job.enable(), the admin API or "
            "the dashboard)",
            names,
        )

    def _make_fleet(self, runner: Runner) -> Fleet:
        from . import __version__

        if not self._touches:  # once per scheduler: a run that starts or ends is published soon
            self._touches = True
            for event in ("start", "complete", "fail"):
                self._events.on(event, self._touch_fleet)
        host = self._host
        link = FleetLink(
            clock=host.clock,
            backend=host.backend,
            instance_id=host.instance_id,
            heartbeat=host.options.heartbeat,
            jobs=self._jobs,
            runs=lambda: runner.runs,
            apply=self._apply_control,
            spawn=lambda coro, name: self._tasks.spawn(coro, name=name, drained=False),
        )
        return Fleet(link, version=__version__)

    def _touch_fleet(self, event: object) -> None:
        if self.fleet is not None:
            self.fleet.touch()

    # -- stop --------------------------------------------------------------------------------

    async def stop(self) -> None:
        if self._tasks.is_drained(asyncio.current_task()):
            if self.state is RunState.RUNNING:
                self._stopper = asyncio.get_running_loop().create_task(
                    self.stop(), name="brokersched:stop"
                )
            return
        await self._stop_connecting()
        async with self._lock:  # a second caller waits for the first one's drain
            if self.state is RunState.RUNNING:
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
        if self.state is RunState.CONNECTING:
            try:
                await self._opened.aclose()
            finally:
                self._set_stopped()
                self._stopped.set()

    async def _stop(self) -> None:
        self.state = RunState.STOPPING
        try:
            await self._opened.aclose()
        finally:
            self._set_stopped()
            self._stopped.set()

    def _set_stopped(self) -> None:
        self.state = RunState.STOPPED

    def _disarm(self) -> None:
        """No slot, boot run or sweep starts from now on (the first step of a stop)."""
        if self._sweeper is not None:
            self._sweeper.close()
            self._sweeper = None
        self.timers.close(self._jobs())

    async def _drain(self, runner: Runner) -> None:
        """Let running jobs finish (``drain_timeout``), then write the records still waiting
        for what is left of it (plus a grace)."""
        clock = self._host.clock
        drain_s = self._host.options.drain_timeout.total_seconds()
        began_ms = clock.monotonic_ms()
        try:
            await runner.drain(drain_s)
        finally:
            left_s = drain_s - (clock.monotonic_ms() - began_ms) / 1000
            try:
                await self._recorder.flush(max(left_s, 0) + _FLUSH_GRACE_S)
            except Exception:
                logger.exception("backend %s failed to stop cleanly", self._host.backend.name)

    async def _stop_backend(self) -> None:
        # What began after the drain (a presence a run's end asked for) ends before the backend.
        await self._tasks.cut(self._tasks.background(), _FLUSH_GRACE_S)
        try:
            await self._host.backend.stop()
        except Exception:
            logger.exception("backend %s failed to stop cleanly", self._host.backend.name)

    async def wait_stopped(self) -> None:
        if self.state in (RunState.STOPPED, RunState.STARTING) and not self._stopped.is_set():
            raise RuntimeError(
                "wait_stopped() before start() would wait for ever: start the scheduler first "
                "(`async with scheduler: await scheduler.wait_stopped()`)"
            )
        await self._stopped.wait()

    async def serve(self) -> None:
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

    # -- while running -----------------------------------------------------------------------

    def _spawn_named(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.spawn(coro, name=name)

    def _fire(self, job: JobState, slot_ms: int) -> None:
        """A slot fell due (``Timers``): its life is the runner's from here."""
        assert self.runner is not None
        self._tasks.spawn(self.runner.run_slot(job, slot_ms, "schedule"), name=f"slot:{job.name}")

    def _passed(self, job: JobState, after_ms: int, through_ms: int) -> None:
        """The slots a frozen process woke too late for (``Timers``): skipped here unseen, so
        watched, as a late skip's slot is, in case no instance ran them."""
        if self.runner is not None:
            self.runner.missed.watch_passed(job, after_ms, through_ms)

    def _fire_boot(self, job: JobState, due_ms: int) -> None:
        assert self.runner is not None
        self._tasks.spawn(_boot.run_boot(self.runner, job, due_ms), name=f"start:{job.name}")

    def added(self, job: JobState) -> None:
        """A job registered while the scheduler runs is prepared and armed at once."""
        if self.state is RunState.RUNNING:
            self._tasks.spawn(self._prepare_and_arm(job), name=f"brokersched:add:{job.name}")

    async def _prepare_and_arm(self, job: JobState) -> None:
        try:
            await self._host.backend.prepare([job.settings.policy])
        except Exception:
            logger.exception("backend could not prepare job %s; its slots are skipped", job.name)
        self.timers.arm(job)
        self.timers.arm_boot(job, self._host.clock.now_ms())

    def updated(self, job: JobState, *, anew: bool = False) -> None:
        """``job.update()`` changed the job's options (``anew``: its slots too, a stored
        schedule's new version): re-armed, and prepared again."""
        if job.arming.armed_ms is not None or anew:  # the schedule or the jitter may have changed
            self.timers.rearm(job, anew=anew)
        if self.state is RunState.RUNNING:
            self._tasks.spawn(
                self._host.backend.prepare([job.settings.policy]),
                name=f"brokersched:update:{job.name}",
            )

    def removed(self, job: JobState, abort: bool) -> None:
        """``remove()`` took the job out: disarmed; with ``abort``, its runs here are aborted
        (reason ``removed``)."""
        self.timers.disarm(job)
        job.removed = True
        if abort and self.runner is not None:
            for run in list(job.runs.values()):
                self.runner.abort(run, "removed")

    async def run_manual(self, job: JobState, data: Any = JOB_DATA) -> RunRecord | None:
        runner = self.runner
        if self.state is not RunState.RUNNING or runner is None:
            why = (
                "the backend is not reachable yet (start(wait=False) is still trying)"
                if self.state is RunState.CONNECTING
                else "the scheduler is not running (start it first: async with scheduler)"
            )
            raise RuntimeError(f"cannot trigger job '{job.name}': {why}")
        task = self._tasks.spawn(
            runner.run_slot(job, self._host.clock.now_ms(), "manual", data),
            name=f"manual:{job.name}",
        )
        # Shielded: a caller that gives up waiting must not cut the run short.
        record: RunRecord | None = await asyncio.shield(task)
        return record

    def overdue(self, jobs: list[Job]) -> list[Job]:
        """Of ``jobs``, the armed ones whose second slot after their last handled run (or the
        start) has passed by more than ``max_late`` (see ``Scheduler.overdue``)."""
        if not self.enabled:
            return []  # nothing is scheduled here: nothing can be late
        now = self._host.clock.now_ms()
        late: list[Job] = []
        # Not connected yet (start(wait=False)): every job misses its slots since the start.
        connecting = self.state is RunState.CONNECTING
        since = self._start_requested_ms if connecting else self._started_ms
        for job in jobs:
            state = state_of(job)
            if state.halted or not state.spec.enabled or since is None:
                continue
            if state.arming.armed_ms is None and not connecting:
                continue
            first = state.schedule.next_ms(max(state.last_ok_ms or 0, since))
            second = state.schedule.next_ms(first) if first is not None else None
            if second is not None and now > second + state.settings.max_late_ms:
                late.append(job)
        return late

"""The fleet through the backend, for one scheduler: its presence, published every
heartbeat, and the fleet-wide control of its jobs (pause, disable, abort), read every heartbeat
and before each scheduled slot is claimed.

Reads of the control records are shared: a slot waits for a read that began at or after its
instant, so the slots of one instant cost one read, and a pause that reached the backend before
a slot fell due is honoured by every instance for that slot. When a read fails the last known
controls stay in force (the claim still decides who runs a slot: exactly-once never rests on
them). A backend that keeps no fleet records (``Backend.fleet`` is ``False``) leaves every
control local to its instance, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._clock import Clock, Timer, ms_to_datetime, resolve
from ._exceptions import BackendUnavailableError
from ._fleetrecords import ControlChange, Instance, JobControl, RunInProgress
from ._job import JobState, Run
from .abc import Backend

__all__ = ["Change", "Fleet", "FleetLink", "run_in_progress"]

logger = logging.getLogger("brokersched")

# A run that starts or ends is published this soon (coalesced) rather than at the next beat.
_SOON_MS = 1000
# One fleet call waits at most this long (or a heartbeat, if longer).
_CALL_S = 2.0
# A slot waits at most this long for the read of the controls before its claim: a backend that
# is slow must not make it late (the claim itself has the slot's max_late).
_SLOT_WAIT_MS = 1000


class Change:
    """What ``Job.pause()``, ``resume()``, ``disable()`` and ``enable()`` return: the change
    applies here at once; ``await`` it to know that it reached the backend (the fleet's
    ``JobControl``, or ``None`` when the scheduler is not running or its backend keeps no
    fleet records); it raises the backend's error when the backend did not take it. Not
    awaiting it is fine (a failure is logged)."""

    __slots__ = ("_written",)

    def __init__(self, written: asyncio.Future[JobControl] | None = None) -> None:
        self._written = written

    def __await__(self) -> Generator[Any, None, JobControl | None]:
        if self._written is None:
            return _none().__await__()
        return self._written.__await__()


async def _none() -> None:
    return None


def run_in_progress(run: Run) -> RunInProgress:
    """A run going on here, as the instance's presence shows it."""
    return RunInProgress(
        job=run.job.name,
        run_id=run.ctx.run_id,
        slot_ms=run.ctx.slot_ms,
        started_at=ms_to_datetime(run.started_ms),
        reason=run.ctx.reason,
        attempt=run.ctx.attempt,
        leased=run.lease is not None,
    )


@dataclass(slots=True)
class _Read:
    started_ms: int
    task: asyncio.Task[None]


@dataclass(slots=True)
class FleetLink:
    """What the fleet needs of its scheduler."""

    clock: Clock
    backend: Backend
    instance_id: str
    heartbeat: timedelta
    jobs: Callable[[], list[JobState]]
    runs: Callable[[], Iterable[Run]]
    apply: Callable[[JobState, JobControl], None]
    spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]


class Fleet:
    """Presence and control of one start of a scheduler."""

    def __init__(self, link: FleetLink, *, version: str) -> None:
        self.link = link
        self.enabled = link.backend.fleet
        self._version = version
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._started_ms = link.clock.now_ms()
        self._beat_ms = max(1, link.heartbeat // timedelta(milliseconds=1))
        self._timer: Timer | None = None
        self._soon: Timer | None = None
        self._read: _Read | None = None
        self._closed = False
        self._started = False
        self._failing: str | None = None  # the last failure logged (logged again on change)
        # Changes made here not yet written, by job key, and the keys being written.
        self._queued: dict[str, list[tuple[ControlChange, asyncio.Future[JobControl]]]] = {}
        self._writers: set[str] = set()

    # -- life ------------------------------------------------------------------------------

    def start(self) -> None:
        if not self.enabled:
            return
        self._started = True
        self._beat()

    async def close(self) -> None:
        """No more beats; the last record says the instance stopped."""
        self._closed = True
        for timer in (self._timer, self._soon):
            if timer is not None:
                timer.cancel()
        if self._started:
            await self._call(
                "publish its last presence",
                self.link.backend.publish_instance(self.presence(stopped=True)),
                timeout=_CALL_S,  # a stop waits no longer for a backend that is away
            )

    def _beat(self) -> None:
        if self._closed:
            return
        self.link.spawn(self._publish_and_read(), "brokersched:heartbeat")
        self._timer = self.link.clock.call_later(self._beat_ms, self._beat)

    def touch(self) -> None:
        """A run started or ended here: publish it soon (coalesced)."""
        if not self.enabled or self._closed or self._soon is not None:
            return

        def publish() -> None:
            self._soon = None
            if not self._closed:
                self.link.spawn(self._publish(), "brokersched:presence")

        self._soon = self.link.clock.call_later(min(_SOON_MS, self._beat_ms), publish)

    async def _publish_and_read(self) -> None:
        await self._publish()
        await self.refresh(self.link.clock.now_ms())

    async def _publish(self) -> None:
        presence = self.presence()
        await self._call("publish its presence", self.link.backend.publish_instance(presence))

    def presence(self, *, stopped: bool = False) -> Instance:
        link = self.link
        running = tuple(
            run_in_progress(run)
            for run in sorted(link.runs(), key=lambda run: run.started_ms)
            if not stopped
        )
        return Instance(
            id=link.instance_id,
            host=self._host,
            pid=self._pid,
            version=self._version,
            started_at=ms_to_datetime(self._started_ms),
            last_seen=link.clock.now(),
            heartbeat=link.heartbeat,
            running=running,
            stopped=stopped,
            jobs=len(link.jobs()),
        )

    # -- control ---------------------------------------------------------------------------

    async def refresh(self, since_ms: int, *, within_ms: int | None = None) -> None:
        """Wait for a read of the controls that began at or after ``since_ms`` (one is started
        if none did) and apply it: what a scheduled slot does before its claim. A slot waits
        ``within_ms`` at most (and at most ``_SLOT_WAIT_MS``; not at all while the backend
        fails the fleet's calls), then goes on with the last known controls; ``None``: as long
        as the read takes (at start)."""
        if not self.enabled:
            return
        read, now = self._read, self.link.clock.now_ms()
        if read is not None and not read.task.done() and now - read.started_ms >= _SLOT_WAIT_MS:
            return  # a read has gone on for a second: the backend is slow or away
        if read is None or read.started_ms < since_ms:
            task = self.link.spawn(self._read_controls(), "brokersched:controls")
            read = self._read = _Read(now, task)
        if read.task.done():
            return
        if within_ms is None:
            with self.link.clock.blocking():
                await asyncio.shield(read.task)
            return
        if within_ms <= 0:
            return
        if self._failing is not None and self._started:
            # The backend is away (its last call failed, a heartbeat ago at most): no slot is
            # made later by it. An instance without heartbeats (enabled=False: the CLI's
            # trigger) may have failed long ago: its read is waited for.
            return
        # A slot waits for the read at most _SLOT_WAIT_MS on the scheduler's clock, then goes on
        # with the last known controls (the read goes on, and applies what it finds).
        waited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wait_ms = max(0, min(within_ms, _SLOT_WAIT_MS))
        timer = self.link.clock.call_later(wait_ms, lambda: resolve(waited))
        try:
            with self.link.clock.blocking():  # waits on the read's task: a virtual clock settles
                await asyncio.wait({read.task, waited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()

    async def _read_controls(self) -> None:
        controls = await self._call("read the jobs' controls", self.link.backend.controls())
        if controls is None:
            return  # the last known controls stay in force
        for job in self.link.jobs():
            if job.settings.key in self._writers:
                continue  # a change made here is on its way: the record is older than it
            try:
                self.link.apply(job, controls.get(job.settings.key) or JobControl(job.settings.key))
            except Exception:  # one job's control must not stop the others', nor a slot
                logger.exception("fleet: could not apply the control of job %s", job.name)

    def change(self, job: JobState, change: ControlChange) -> asyncio.Future[JobControl]:
        """Write one change of ``job``'s control through the backend, then apply the record
        here; the future answers the record (or raises the backend's error). Changes of one
        job made here while one is written go together in the next write, in order. Until
        they are written, reads of the controls leave the job alone (they may be older)."""
        key = job.settings.key
        done: asyncio.Future[JobControl] = asyncio.get_running_loop().create_future()
        self._queued.setdefault(key, []).append((change, done))
        if key not in self._writers:
            self._writers.add(key)
            self.link.spawn(self._write(job, key), f"brokersched:control:{job.name}")
        return done

    async def _write(self, job: JobState, key: str) -> None:
        queued: list[tuple[ControlChange, asyncio.Future[JobControl]]] = []
        try:
            while queued := self._queued.pop(key, []):
                try:
                    control = await self.link.backend.change_control(*(c for c, _ in queued))
                except Exception as exc:
                    for _, done in queued:
                        done.set_exception(exc)
                    continue
                self.link.apply(job, control)
                for _, done in queued:
                    done.set_result(control)
        except asyncio.CancelledError:  # the stop cut the write: its waiters are told so
            for change, done in [*queued, *self._queued.pop(key, [])]:
                if not done.done():
                    done.set_exception(
                        BackendUnavailableError(
                            f"the scheduler stopped before the {change.action} of job "
                            f"{job.name} was written through {self.link.backend.name}"
                        )
                    )
            raise
        finally:
            self._writers.discard(key)

    # -- calls -----------------------------------------------------------------------------

    async def _call(self, what: str, call: Awaitable[Any], timeout: float | None = None) -> Any:
        """``call``'s answer, or ``None`` when it failed (logged once per kind of failure)."""
        try:
            async with self.link.clock.timeout(timeout or max(_CALL_S, self._beat_ms / 1000)):
                answer = await call
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            if why != self._failing:
                self._failing = why
                backend = self.link.backend.name
                logger.warning("fleet: could not %s through %s: %s", what, backend, why)
            return None
        if self._failing is not None:
            self._failing = None
            logger.info("fleet: %s answers again", self.link.backend.name)
        return answer

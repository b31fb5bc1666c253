"""A running scheduler's stored schedules: read from the backend at start, followed by polling
the fleet's log of changes (``POLL_MS``), and each one made a job of this scheduler when this
instance knows its task. The rule they follow is ``_stored``'s: the slots of a stored
schedule's job are those of the version in force at each slot's instant
(``VersionedTrigger``), and a slot is claimed only on a view read less than ``FRESH_MS``
before it (``fresh``). A slot runs the task and data of its own version (``version_at``); the
job's options are the version's in force now, switched at each version's effective time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._clock import Clock, Timer
from ._exceptions import BackendError, ConfigurationError
from ._job import Handler, JobState
from ._stored import FRESH_MS, LOG_KEY, Log, Record, Spec, VersionedTrigger
from .triggers.base import Trigger

if TYPE_CHECKING:
    from .abc import Backend

__all__ = ["POLL_MS", "StoredJobs", "StoredRoom"]

logger = logging.getLogger("brokersched")

#: How often an instance reads the fleet's log of changes.
POLL_MS = 500
#: A deleted schedule's job stays this long after its last slot's max_late (claims in flight).
_AFTER_LAST_MS = 5000
#: The schedules applied in one turn of the event loop.
_APPLIED_PER_TURN = 50
#: A slot waiting for a fresh view looks again this often.
_RECHECK_MS = 100
#: The versions' triggers kept built (a cron trigger takes milliseconds to build).
_BUILT_KEPT = 100_000
#: Every record is read again this often, whatever the log says (the safety net).
REREAD_MS = 60_000


@dataclass(frozen=True)
class StoredRoom:
    """What ``StoredJobs`` asks of its scheduler: its registered tasks, and registering,
    re-specifying and removing the job of a stored schedule (the registration's)."""

    tasks: Mapping[str, Handler]
    trigger_of: Callable[[str, Spec], Trigger]
    put_job: Callable[[str, Spec, Handler, Trigger], None]
    remove_job: Callable[[str], object]
    job: Callable[[str], JobState | None]


class StoredJobs:
    """The stored schedules of one started scheduler, on ``backend`` and ``clock``."""

    def __init__(self, backend: Backend, clock: Clock, room: StoredRoom) -> None:
        self._backend = backend
        self._clock = clock
        self._room = room
        self.records: dict[str, Record] = {}
        self._rev = -1  # the log's revision as last read (-1: never read)
        self._read_ms: int | None = None  # when the view was last known complete
        self._reread_ms = 0
        self._task: asyncio.Task[None] | None = None
        self._timers: dict[str, Timer] = {}
        self._unknown: set[tuple[str, str]] = set()  # (id, task) said once
        self._built: dict[tuple[str, str], Trigger | None] = {}  # each version's trigger

    # -- life ----------------------------------------------------------------------------------

    async def open(self) -> None:
        """Read every stored schedule, make jobs of those this instance can run, and follow
        the changes from then on."""
        try:
            await self.poll()
        except BackendError as exc:
            logger.warning("stored schedules could not be read at start (%s): trying again", exc)
        self._task = asyncio.get_running_loop().create_task(
            self._follow(), name="brokersched:schedules"
        )

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def _follow(self) -> None:
        failing = False
        while True:
            await self._clock.sleep(POLL_MS / 1000)
            try:
                await self.poll()
            except BackendError as exc:
                if not failing:
                    logger.warning("stored schedules could not be read (%s): trying again", exc)
                failing = True
            except Exception:
                logger.exception("stored schedules could not be applied")
            else:
                if failing:
                    logger.info("stored schedules read again")
                failing = False

    # -- reading -------------------------------------------------------------------------------

    async def poll(self) -> None:
        """One read of the log (and of every record when this instance fell behind it, or once
        a minute), its changes applied."""
        began_ms = self._clock.now_ms()
        backend = self._backend
        log = Log.loads((await backend.fleet_records("schedule-log")).get(LOG_KEY))
        changed: dict[str, Record] = {}
        whole = self._rev < 0 or log.first_rev > self._rev + 1 or began_ms >= self._reread_ms
        if whole:
            texts = await backend.fleet_records("schedule")
            for key, text in texts.items():
                changed[key] = Record.loads(text)
            self._reread_ms = began_ms + REREAD_MS
        log.merge_into(changed, after_rev=min(self._rev, log.first_rev - 1))
        self._rev = log.rev
        if whole:
            for schedule_id in [s for s in self.records if s not in changed]:
                self._forget(schedule_id)
        for n, (schedule_id, record) in enumerate(changed.items(), 1):
            held = self.records.get(schedule_id)
            if held is None or record.version > held.version:
                self.records[schedule_id] = record
                self.apply(schedule_id)
            if n % _APPLIED_PER_TURN == 0:
                await asyncio.sleep(0)  # a long read's work in turns: claims and presence go on
        self._read_ms = began_ms

    def _forget(self, schedule_id: str) -> None:
        """A schedule the store no longer has (a store that lost its data, a namespace purged):
        its job stops here at once, as a delete would stop it."""
        logger.warning(
            "stored schedule %s is no longer in the store: its job stops here", schedule_id
        )
        del self.records[schedule_id]
        self._rearm(schedule_id, None)
        if self._room.job(schedule_id) is not None:
            self._room.remove_job(schedule_id)

    async def fresh(self, slot_ms: int, within_ms: int) -> str | None:
        """``None`` when this instance's view may decide the slot at ``slot_ms`` (read less
        than ``FRESH_MS`` before it), waiting up to ``within_ms`` for a read; else why not."""
        deadline = self._clock.now_ms() + within_ms
        while self._read_ms is None or self._read_ms <= slot_ms - FRESH_MS:
            left_ms = deadline - self._clock.now_ms()
            if left_ms <= 0 or self._task is None:
                read = "never" if self._read_ms is None else f"{slot_ms - self._read_ms} ms before"
                return (
                    f"the stored schedules were last read {read} the slot (fail closed: a "
                    "change not seen could apply to it)"
                )
            await self._clock.sleep(min(left_ms, _RECHECK_MS) / 1000)
        return None

    def version_at(self, job: JobState, slot_ms: int) -> tuple[Handler, Any] | None:
        """The task and data of the version of ``job``'s schedule in force at ``slot_ms``
        (a slot runs its own version's, whenever its run begins); ``None``: not known here."""
        record = self.records.get(job.name)
        spec = None if record is None else record.in_force(slot_ms)
        if spec is None or spec.task not in self._room.tasks:
            return None
        return self._room.tasks[spec.task], spec.data

    # -- applying ------------------------------------------------------------------------------

    def apply(self, schedule_id: str) -> None:
        """Make the job of ``schedule_id`` what its record says now: its slots from every
        version this instance can run, its task, options and data from the version in force
        (else the next one); removed once deleted and past, or when no version's task is
        known here."""
        record = self.records[schedule_id]
        now_ms = self._clock.now_ms()
        parts: list[tuple[int, Trigger | None]] = []
        for effective_ms, spec in record.timeline:
            parts.append((effective_ms, self._trigger(schedule_id, spec)))
        pending = [e for e, _ in record.timeline if e > now_ms]
        self._rearm(schedule_id, min(pending) if pending else None)
        current = record.in_force(now_ms)
        if current is None or self._trigger(schedule_id, current) is None:
            current = next(
                (
                    spec
                    for e, spec in record.timeline
                    if e > now_ms and spec is not None and self._trigger(schedule_id, spec)
                ),
                None,
            )
        if current is None:
            job = self._room.job(schedule_id)
            if job is not None:
                # the slots before the delete may still be claimed, or run: kept until then
                until_ms = record.effective_ms + job.settings.max_late_ms + _AFTER_LAST_MS
                if now_ms < until_ms:
                    self._rearm(schedule_id, until_ms)
                else:
                    self._room.remove_job(schedule_id)
            return
        handler = self._room.tasks[current.task]
        try:
            self._room.put_job(schedule_id, current, handler, VersionedTrigger(parts))
        except ConfigurationError as exc:
            logger.error(
                "stored schedule %s version %d cannot run here: %s",
                schedule_id,
                record.version,
                exc,
            )

    def _trigger(self, schedule_id: str, spec: Spec | None) -> Trigger | None:
        """The trigger of one version here (``None``: no slot of it here), built once."""
        if spec is None:
            return None
        cache_key = (schedule_id, spec.cache_key())
        if cache_key not in self._built:
            if len(self._built) > _BUILT_KEPT:
                self._built.clear()
            self._built[cache_key] = self._build(schedule_id, spec)
        return self._built[cache_key]

    def _build(self, schedule_id: str, spec: Spec) -> Trigger | None:
        if spec.task not in self._room.tasks:
            if (schedule_id, spec.task) not in self._unknown:
                self._unknown.add((schedule_id, spec.task))
                logger.warning(
                    "stored schedule %s runs task %r, which this instance does not have "
                    "(@scheduler.task(%r)): its slots are left to the instances that do",
                    schedule_id,
                    spec.task,
                    spec.task,
                )
            return None
        try:
            return self._room.trigger_of(schedule_id, spec)
        except ConfigurationError as exc:
            logger.error("stored schedule %s cannot run here: %s", schedule_id, exc)
            return None

    def _rearm(self, schedule_id: str, when_ms: int | None) -> None:
        """Apply the record again when its next version comes into force."""
        old = self._timers.pop(schedule_id, None)
        if old is not None:
            old.cancel()
        if when_ms is not None:
            self._timers[schedule_id] = self._clock.call_at(when_ms, lambda: self._due(schedule_id))

    def _due(self, schedule_id: str) -> None:
        self._timers.pop(schedule_id, None)
        if schedule_id in self.records:
            self.apply(schedule_id)

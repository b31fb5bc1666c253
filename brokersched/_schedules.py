"""``scheduler.schedules``: schedules written, read and deleted at run time from any process,
kept in the backend (the fleet's records) and run by every instance that knows their task.
How they are kept and the rule that keeps a slot to one version: ``_stored``."""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ._clock import ms_to_datetime
from ._durations import Duration, format_duration
from ._exceptions import BackendError, BrokerschedError, ConfigurationError
from ._json import iso
from ._options import check_name
from ._stored import (
    EFFECTIVE_AFTER_MS,
    LOG_KEY,
    Log,
    Record,
    Spec,
    StoredSchedule,
    TriggerKind,
    newer,
    stored,
)
from .triggers.base import Trigger
from .triggers.spec import trigger_spec

if TYPE_CHECKING:
    from ._clock import Clock
    from .abc import Backend

__all__ = ["ScheduleConflictError", "Schedules", "check_stored_options"]

logger = logging.getLogger("brokersched")

#: Writers that came first are waited out this many times before a write gives up, each time
#: a random while longer (up to ten times ``_BACKOFF_S``).
_TRIES = 30
_BACKOFF_S = 0.02
#: A write whose compare-and-set took longer than this may land after instances decided slots
#: near its effective time on the previous version (``_stored``): it is said in the log.
_SLOW_WRITE_MS = 1000
#: Job options a stored schedule does not take, and why.
_NOT_STORED = {
    "key": "its id is its key",
    "claim": "each of its slots runs once on the fleet (claim=False would run it everywhere)",
    "run_on_start": "a stored schedule has no start of its own to run at",
}
#: The most a version may hold (task, trigger, options and data as JSON): every instance
#: keeps it, and every write carries it.
SPEC_MAX_BYTES = 16_384

#: Checks a version of a schedule as registration would, on this process's scheduler (its
#: backend's capabilities, its defaults); answers its trigger. Raises ``ConfigurationError``.
CheckSpec = Callable[[str, Spec], Trigger]


class ScheduleConflictError(BrokerschedError):
    """``if_version`` did not match: the schedule is at ``version`` (0: there is none)."""

    def __init__(self, message: str, *, schedule_id: str, version: int) -> None:
        super().__init__(message)
        self.schedule_id = schedule_id
        self.version = version


def check_stored_options(schedule_id: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The job options of a stored schedule as JSON (durations given as ``timedelta`` written
    as ``"1m30s"``); a value JSON cannot keep, or an option a stored schedule does not take,
    is refused naming it."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in _NOT_STORED:
            raise ConfigurationError(
                f"schedule '{schedule_id}': option '{name}' is not taken by a stored schedule "
                f"({_NOT_STORED[name]})",
                option=name,
                job=schedule_id,
            )
        if isinstance(value, timedelta):
            value = format_duration(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"schedule '{schedule_id}': option '{name}' = {value!r} cannot be stored: {exc} "
                "(give durations as '30s', instants as ISO 8601 text)",
                option=name,
                job=schedule_id,
            ) from None
        out[name] = value
    return out


def _check_task(schedule_id: str, task: object) -> None:
    try:
        check_name(task)
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"schedule '{schedule_id}': task {task!r} is not a task name: {exc}",
            option="task",
            job=schedule_id,
        ) from None


def _schedule_text(kind: TriggerKind, value: Any) -> str:
    if kind == "at":
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ConfigurationError(
                    f"at {value!r} is a naive datetime: give it a time zone", option="at"
                )
            return iso(value)
        return str(value)
    if kind == "every" and isinstance(value, timedelta):
        return format_duration(value)
    return str(value)


def _check_at(schedule_id: str, spec: Spec, trigger: Trigger, effective_ms: int) -> None:
    """An ``at=`` instant before the version would take effect never runs: refused, naming it
    (nothing is written)."""
    if trigger.next_ms(effective_ms - 1) is None:
        raise ConfigurationError(
            f"schedule '{schedule_id}': at {spec.schedule} is before "
            f"{iso(ms_to_datetime(effective_ms))}, when this version would take effect (a write "
            f"applies {EFFECTIVE_AFTER_MS // 1000} s after it is made): it would never run; give "
            "a later instant",
            option="at",
            job=schedule_id,
        )


class Schedules:
    """The fleet's stored schedules, through ``backend`` (started), on ``clock``. ``check``
    validates a version before it is written (``Scheduler.schedules`` passes the
    scheduler's)."""

    def __init__(self, backend: Callable[[], Backend], clock: Clock, check: CheckSpec) -> None:
        self._backend = backend
        self._clock = clock
        self._check = check

    @property
    def checker(self) -> CheckSpec:
        """How this store checks a version before writing it (the scheduler's rules): for a
        dry run over a store of its own (``brokersched schedules import --dry-run``)."""
        return self._check

    async def put(
        self,
        id: str,
        *,
        task: str,
        every: Duration | None = None,
        cron: str | None = None,
        at: datetime | str | None = None,
        timezone: str | None = None,
        data: Any = None,
        if_version: int | None = None,
        by: str | None = None,
        **options: Any,
    ) -> StoredSchedule:
        """Write schedule ``id``: run ``task`` ``every`` interval, on a ``cron`` expression
        (in ``timezone``) or once ``at`` an instant, with the job ``options``; ``data`` is the
        task's ``ctx.data``. ``if_version``: only if the schedule is at that version (0: only
        if there is none). Applies to the slots from 3 s after the write (``effective_at``).
        Raises ``ConfigurationError`` (nothing written), ``ScheduleConflictError``,
        ``BackendError``."""
        check_name(id)
        given = [(k, v) for k, v in (("every", every), ("cron", cron), ("at", at)) if v is not None]
        if len(given) != 1:
            raise ConfigurationError(
                f"schedule '{id}' needs exactly one of every=, cron= or at= "
                f"(given: {', '.join(k for k, _ in given) or 'none'})",
                option="trigger",
                job=id,
            )
        kind, value = given[0]
        _check_task(id, task)
        if timezone is not None:
            options["timezone"] = timezone
        stored_options = check_stored_options(id, options)
        if data is not None:
            check_stored_options(id, {"data": data})
        try:
            text = _schedule_text(kind, value)  # type: ignore[arg-type]
            spec = Spec(task, kind, text, stored_options, data)  # type: ignore[arg-type]
            trigger = self._check(id, spec)
        except ConfigurationError:
            raise
        except (OverflowError, ValueError) as exc:  # an instant at the end of the calendar
            raise ConfigurationError(
                f"schedule '{id}': {kind} {value!r} is not a usable instant: {exc}",
                option=kind,
                job=id,
            ) from None
        size = len(spec.cache_key().encode())
        if size > SPEC_MAX_BYTES:
            raise ConfigurationError(
                f"schedule '{id}' is {size} bytes as JSON (task, trigger, options, data), more "
                f"than {SPEC_MAX_BYTES}: keep large data elsewhere and put its key in data",
                option="data",
                job=id,
            )
        record = await self._write(id, spec, if_version, by, trigger)
        return stored(record, trigger_spec(trigger))

    async def delete(
        self,
        id: str,
        *,
        if_version: int | None = None,
        by: str | None = None,
    ) -> bool:
        """Delete schedule ``id``: no slot of it from 3 s after; ``False`` if there is none.
        Raises ``ScheduleConflictError`` (``if_version``), ``BackendError``."""
        check_name(id)
        current = await self._current(id)
        if current is None or current.deleted:
            if if_version not in (None, 0):
                raise self._conflict(id, if_version, 0)
            return False
        await self._write(id, None, if_version, by)
        return True

    async def get(self, id: str) -> StoredSchedule | None:
        """Schedule ``id``'s latest version, or ``None``."""
        check_name(id)
        record = await self._current(id)
        return None if record is None or record.deleted else self._answer(record)

    async def list(self, prefix: str = "") -> AsyncIterator[StoredSchedule]:
        """Every schedule whose id starts with ``prefix``, by id."""
        records = await self.read_all()
        for schedule_id in sorted(records):
            record = records[schedule_id]
            if schedule_id.startswith(prefix) and not record.deleted:
                yield self._answer(record)

    async def read_all(self) -> dict[str, Record]:
        """Every record (deleted ones included), the log's newer changes applied."""
        backend = self._backend()
        log = Log.loads(await self._log_text(backend))
        records = {
            key: Record.loads(text)
            for key, text in (await backend.fleet_records("schedule")).items()
        }
        log.merge_into(records)
        return records

    def _answer(self, record: Record) -> StoredSchedule:
        spec = record.latest
        assert spec is not None
        try:
            trigger: Mapping[str, Any] = trigger_spec(self._check(record.id, spec))
        except ConfigurationError as exc:  # written by another release: shown, not refused
            trigger = {"kind": spec.kind, "schedule": spec.schedule, "error": str(exc)}
        return stored(record, trigger)

    async def _current(self, schedule_id: str) -> Record | None:
        return (await self._read(schedule_id))[2]

    async def _read(self, schedule_id: str) -> tuple[str | None, Log, Record | None]:
        """The log as read (its text, for a compare-and-set) and the schedule's latest record:
        its own, or the log's when that is newer."""
        backend = self._backend()
        log_text = await self._log_text(backend)
        log = Log.loads(log_text)
        text = (await backend.fleet_records("schedule")).get(schedule_id)
        record = newer(None if text is None else Record.loads(text), log.latest(schedule_id))
        return log_text, log, record

    @staticmethod
    async def _log_text(backend: Backend) -> str | None:
        return (await backend.fleet_records("schedule-log")).get(LOG_KEY)

    def _conflict(self, schedule_id: str, expected: int, version: int) -> ScheduleConflictError:
        return ScheduleConflictError(
            f"schedule '{schedule_id}' is at version {version}, not {expected} (if_version): "
            "read it again and retry",
            schedule_id=schedule_id,
            version=version,
        )

    async def _write(
        self,
        schedule_id: str,
        spec: Spec | None,
        if_version: int | None,
        by: str | None,
        trigger: Trigger | None = None,
    ) -> Record:
        """One compare-and-set of the log with the schedule's next version, then the record
        under its own key (see ``_stored``)."""
        backend = self._backend()
        for attempt in range(_TRIES):
            if attempt:  # another writer came first: apart, so that the next try lands
                await self._clock.sleep(random.uniform(0, min(attempt, 10) * _BACKOFF_S))
            log_text, log, found = await self._read(schedule_id)
            current = found or Record.new(schedule_id)
            version = 0 if current.deleted and spec is not None else current.version
            if if_version is not None and if_version != version:
                raise self._conflict(schedule_id, if_version, version)
            began_ms = self._clock.now_ms()
            if spec is not None and spec.kind == "at" and trigger is not None:
                _check_at(schedule_id, spec, trigger, began_ms + EFFECTIVE_AFTER_MS)
            record = current.changed(spec, began_ms, by)
            new_log, dropped = log.appended(record, began_ms)
            for change in dropped:
                await self._keep(change.record)
            if await backend.swap_fleet_record("schedule-log", LOG_KEY, log_text, new_log.dumps()):
                took_ms = self._clock.now_ms() - began_ms
                if took_ms > _SLOW_WRITE_MS:
                    logger.warning(
                        "schedule %s version %d took %.1f s to write: instances may have "
                        "decided slots near %s on the version before",
                        schedule_id,
                        record.version,
                        took_ms / 1000,
                        iso(ms_to_datetime(record.effective_ms)),
                    )
                with contextlib.suppress(BackendError):  # kept by the log until it is kept
                    await self._keep(record)
                return record
        raise BackendError(
            f"schedule '{schedule_id}': the fleet's schedules kept changing under {_TRIES} "
            "tries to write it; try again"
        )

    async def _keep(self, record: Record) -> None:
        """``record`` under its own key, unless a later version is there already."""
        backend = self._backend()
        for _ in range(_TRIES):
            text = (await backend.fleet_records("schedule")).get(record.id)
            if text is not None and Record.loads(text).version >= record.version:
                return
            if await backend.swap_fleet_record("schedule", record.id, text, record.dumps()):
                return
        raise BackendError(f"schedule '{record.id}': its record kept changing; try again")

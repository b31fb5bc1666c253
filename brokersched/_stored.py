"""Schedules as data, as they are kept: a schedule's record, its timeline of versions, the
fleet's log of recent changes, and the trigger that gives a stored schedule's slots.

The rule every instance follows (so that a slot is decided from the same version everywhere)
    A write is *effective* ``EFFECTIVE_AFTER_MS`` after it is made (the writer's clock): a slot
    at an instant ``t`` is a slot of the version in force at ``t``, each record keeping the
    versions in force over the last day (its *timeline*). An instance decides a slot only on a
    view of the store read less than ``FRESH_MS`` before the slot's instant: a change it has not
    seen was made after that read, so it applies after the slot (the difference, 1.5 s, is what
    a write may take to land plus the clocks' skew). An instance whose view is older does not
    claim the slot (fail closed, said as a ``backend-error`` skip) until it has read the store.

Where it is kept (the fleet's records of every backend, ``Backend._fleet_*``)
    * kind ``schedule``, key the schedule's id: its record (``Record``), JSON;
    * kind ``schedule-log``, key ``log``: the recent changes, newest last, each with the record
      it wrote and a revision (``Log``). Every write is a compare-and-set of the log: that
      orders the fleet's writes, checks ``if_version`` against the latest, and is what
      instances poll (one small record) to see changes within a second. The record under the
      schedule's own key is written after (and again by whichever writer drops the change from
      the log, before it does): readers take the higher version of both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from ._clock import ms_to_datetime
from .triggers.base import Trigger

__all__ = [
    "EFFECTIVE_AFTER_MS",
    "FRESH_MS",
    "LOG_KEY",
    "LOG_MAX",
    "TIMELINE_MAX",
    "Log",
    "Record",
    "Spec",
    "StoredSchedule",
    "TriggerKind",
    "VersionedTrigger",
    "newer",
    "stored",
]

#: A write applies to the slots from this long after it is made.
EFFECTIVE_AFTER_MS = 3000
#: A slot is decided only on a view of the store read less than this long before it.
FRESH_MS = 1500
#: The log keeps the changes of the last minute, at most ``LOG_MAX`` of them: an instance
#: that read it longer ago, or fell further behind, reads every record again.
LOG_KEPT_MS = 60_000
LOG_MAX = 64
#: A record keeps the versions in force over the last day (slots decided late, catch-up).
TIMELINE_KEPT_MS = 86_400_000
#: And at most this many versions (a schedule rewritten all day long keeps its latest ones).
TIMELINE_MAX = 16
LOG_KEY = "log"

TriggerKind = Literal["every", "cron", "at"]


@dataclass(frozen=True, slots=True)
class Spec:
    """What one version of a schedule says: the task it runs, its trigger as given (the kind,
    and the interval, the cron expression or the instant as text), its job options (JSON, as
    the job options are given) and the ``data`` the task reads as ``ctx.data``."""

    task: str
    kind: TriggerKind
    schedule: str
    options: Mapping[str, Any] = field(default_factory=dict)
    data: Any = None

    def cache_key(self) -> str:
        """The version as one text: equal versions, equal texts."""
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    def job_options(self) -> dict[str, Any]:
        """Its job options as registration takes them: ``options`` and ``data``."""
        options = dict(self.options)
        if self.data is not None:
            options["data"] = self.data
        return options

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "kind": self.kind,
            "schedule": self.schedule,
            "options": dict(self.options),
            "data": self.data,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Spec:
        return cls(
            str(value["task"]),
            value["kind"],
            str(value["schedule"]),
            dict(value.get("options") or {}),
            value.get("data"),
        )


@dataclass(frozen=True, slots=True)
class Record:
    """A schedule as kept: ``timeline`` holds ``(effective_ms, spec)`` pairs, oldest first,
    the last one the latest version (``spec`` ``None``: deleted from then on)."""

    id: str
    version: int
    updated_ms: int
    updated_by: str | None
    timeline: tuple[tuple[int, Spec | None], ...]

    @property
    def latest(self) -> Spec | None:
        return self.timeline[-1][1] if self.timeline else None

    @property
    def effective_ms(self) -> int:
        return self.timeline[-1][0] if self.timeline else 0

    @property
    def deleted(self) -> bool:
        return self.latest is None

    def changed(self, spec: Spec | None, now_ms: int, by: str | None) -> Record:
        """The next version: ``spec`` (``None``: deleted) in force from ``EFFECTIVE_AFTER_MS``
        after ``now_ms``; the versions no slot of the last day can be of are dropped."""
        kept = list(self.timeline)
        horizon = now_ms - TIMELINE_KEPT_MS
        while len(kept) > 1 and (kept[1][0] <= horizon or len(kept) >= TIMELINE_MAX):
            kept.pop(0)  # in force for no slot of the last day, or one of too many kept
        kept.append((now_ms + EFFECTIVE_AFTER_MS, spec))
        return Record(self.id, self.version + 1, now_ms, by, tuple(kept))

    def in_force(self, at_ms: int) -> Spec | None:
        """The version in force at ``at_ms`` (``None``: none yet, or deleted)."""
        found: Spec | None = None
        for effective_ms, spec in self.timeline:
            if effective_ms > at_ms:
                break
            found = spec
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "version": self.version,
            "updated_ms": self.updated_ms,
            "updated_by": self.updated_by,
            "timeline": [
                [effective_ms, None if spec is None else spec.to_json()]
                for effective_ms, spec in self.timeline
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Record:
        timeline = tuple(
            (int(effective_ms), None if spec is None else Spec.from_json(spec))
            for effective_ms, spec in value["timeline"]
        )
        return cls(
            str(value["id"]),
            int(value["version"]),
            int(value["updated_ms"]),
            value.get("updated_by"),
            timeline,
        )

    @classmethod
    def loads(cls, text: str) -> Record:
        return cls.from_json(json.loads(text))

    @classmethod
    def new(cls, schedule_id: str) -> Record:
        """What a schedule never written is: version 0, nothing in force."""
        return cls(schedule_id, 0, 0, None, ())


def newer(a: Record | None, b: Record | None) -> Record | None:
    """The record of the higher version (a record and the log may each be ahead)."""
    if a is None:
        return b
    if b is None or a.version >= b.version:
        return a
    return b


@dataclass(frozen=True, slots=True)
class Change:
    """One entry of the log: its revision, when it was written (the writer's clock), and the
    record it wrote."""

    rev: int
    written_ms: int
    record: Record


@dataclass(frozen=True, slots=True)
class Log:
    """The fleet's recent changes (``rev`` the revision of the last one; ``changes`` newest
    last)."""

    rev: int = 0
    changes: tuple[Change, ...] = ()

    @property
    def first_rev(self) -> int:
        """The revision of the oldest change kept (``rev + 1`` when none is)."""
        return self.changes[0].rev if self.changes else self.rev + 1

    def latest(self, schedule_id: str) -> Record | None:
        for change in reversed(self.changes):
            if change.record.id == schedule_id:
                return change.record
        return None

    def since(self, rev: int) -> list[Change]:
        return [change for change in self.changes if change.rev > rev]

    def merge_into(self, records: dict[str, Record], after_rev: int = -1) -> None:
        """``records`` (by id, as read from their own keys) with the changes after
        ``after_rev`` applied where they are newer (a record may be ahead of the log, or
        behind it)."""
        for change in self.since(after_rev):
            record = change.record
            records[record.id] = newer(records.get(record.id), record) or record

    def appended(self, record: Record, now_ms: int) -> tuple[Log, list[Change]]:
        """The log with ``record`` written at ``now_ms`` (an earlier change of its schedule
        left out: ``record`` holds it), and the changes it no longer keeps (each must be in its
        schedule's own record before this log is written)."""
        # an earlier change of the same schedule is superseded (a record holds its versions)
        kept = [change for change in self.changes if change.record.id != record.id]
        changes = [*kept, Change(self.rev + 1, now_ms, record)]
        dropped: list[Change] = []
        while len(changes) > 1 and (
            len(changes) > LOG_MAX or changes[0].written_ms < now_ms - LOG_KEPT_MS
        ):
            dropped.append(changes.pop(0))
        return Log(self.rev + 1, tuple(changes)), dropped

    def dumps(self) -> str:
        return json.dumps(
            {
                "rev": self.rev,
                "changes": [
                    [change.rev, change.written_ms, change.record.to_json()]
                    for change in self.changes
                ],
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def loads(cls, text: str | None) -> Log:
        if text is None:
            return cls()
        value = json.loads(text)
        return cls(
            int(value["rev"]),
            tuple(
                Change(int(rev), int(written_ms), Record.from_json(record))
                for rev, written_ms, record in value["changes"]
            ),
        )


@dataclass(frozen=True, slots=True)
class StoredSchedule:
    """A schedule as ``scheduler.schedules`` answers it: its latest version.

    ``trigger`` is the schedule as data (``{"kind": "cron", "expression": ..., "timezone":
    ...}``, as ``brokersched jobs --json`` gives it); ``options`` the job options as written;
    ``effective_at`` when this version applies from (slots before it are the previous
    version's)."""

    id: str
    task: str
    trigger: Mapping[str, Any]
    options: Mapping[str, Any]
    data: Any
    version: int
    updated_at: datetime
    updated_by: str | None
    effective_at: datetime

    def to_json(self) -> dict[str, Any]:
        """As the CLI's ``--json``, the admin API and ``export`` give it."""
        from ._json import iso

        return {
            "id": self.id,
            "task": self.task,
            "trigger": dict(self.trigger),
            "options": dict(self.options),
            "data": self.data,
            "version": self.version,
            "updated_at": iso(self.updated_at),
            "updated_by": self.updated_by,
            "effective_at": iso(self.effective_at),
        }


def stored(record: Record, trigger: Mapping[str, Any]) -> StoredSchedule:
    spec = record.latest
    assert spec is not None  # a deleted schedule is not answered
    return StoredSchedule(
        id=record.id,
        task=spec.task,
        trigger=trigger,
        options=dict(spec.options),
        data=spec.data,
        version=record.version,
        updated_at=ms_to_datetime(record.updated_ms),
        updated_by=record.updated_by,
        effective_at=ms_to_datetime(record.effective_ms),
    )


class VersionedTrigger(Trigger):
    """A stored schedule's slots: each version's trigger over the time it is in force
    (``parts``: ``(effective_ms, trigger)``, oldest first; ``None``: no slot here then, the
    schedule deleted or its task unknown to this instance)."""

    def __init__(self, parts: Iterable[tuple[int, Trigger | None]]) -> None:
        self.parts = tuple(parts)
        current = next((t for _, t in reversed(self.parts) if t is not None), None)
        self.current = current
        self.kind = current.kind if current is not None else "at"

    def next_ms(self, after_ms: int) -> int | None:
        parts = self.parts
        for i, (start_ms, trigger) in enumerate(parts):
            end_ms = parts[i + 1][0] if i + 1 < len(parts) else None
            if trigger is None or (end_ms is not None and end_ms <= after_ms + 1):
                continue
            fire = trigger.next_ms(max(after_ms, start_ms - 1))
            if fire is not None and (end_ms is None or fire < end_ms):
                return fire
        return None

    def min_gap(self) -> timedelta | None:
        gaps = [g for _, t in self.parts if t is not None and (g := t.min_gap()) is not None]
        return min(gaps) if gaps else None

    def describe(self) -> str:
        return self.current.describe() if self.current is not None else "deleted"

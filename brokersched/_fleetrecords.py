"""What the fleet knows of itself through its backend: each instance's presence
(``Instance``, published every heartbeat) and each job's fleet-wide control (``JobControl``:
paused, disabled, the runs asked to abort, and who changed what when).

Both are JSON texts a backend keeps under a key in one of two kinds of record
(``Backend.fleet``): ``instance`` records expire (``FORGET``) and are written as they are;
``control`` records never expire and are changed by compare-and-set, so that no change (nor its
audit entry) is lost to a concurrent one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal, cast, get_args

from ._clock import datetime_to_ms
from ._redact import redact_text

__all__ = [
    "CONTROL_ACTIONS",
    "FORGET",
    "MISSED_KEPT",
    "NOTE_MAX",
    "SKIP_MAX",
    "UNTIL_MAX",
    "Asked",
    "ControlAction",
    "ControlChange",
    "FleetKind",
    "Instance",
    "JobControl",
    "Liveness",
    "RunInProgress",
    "SkipWindow",
    "asked",
    "runs_ahead",
]

FleetKind = Literal["instance", "control", "missed", "schedule", "schedule-log"]
Liveness = Literal["alive", "late", "dead", "stopped"]
ControlAction = Literal["pause", "resume", "disable", "enable", "skip", "abort"]
CONTROL_ACTIONS: tuple[ControlAction, ...] = get_args(ControlAction)

#: An instance record is kept this long after its last heartbeat (a dead instance stays listed
#: as ``dead`` for that long, then is forgotten).
FORGET = timedelta(minutes=10)
#: How long the record that a slot was reported missed is kept (``Backend.report_missed``).
MISSED_KEPT = timedelta(days=1)
#: Late after this many heartbeat periods without one; dead after ``_DEAD``.
_LATE = 1.5
_DEAD = 3.0
#: The changes kept in a job's control record (its audit trail), newest last.
AUDIT_KEPT = 50
#: An abort request is honoured for this long after it was made (a run started later is not
#: the one that was meant, and a record only grows by the requests it still honours).
ABORT_KEPT = timedelta(minutes=10)


#: The longest ``note=`` a change keeps (it is shown in every instance's audit trail).
NOTE_MAX = 500
#: The most slots one ``skip(n)`` skips.
SKIP_MAX = 1000
#: How far ahead a pause's ``until`` may be (a pause until resumed has none).
UNTIL_MAX = timedelta(days=36525)


@dataclass(frozen=True, slots=True)
class Asked:
    """What a change of a job's control asks beyond its action: why (``note``), until when (a
    pause's ``until``), how many slots (a skip's ``count``). Made by ``asked()``, checked."""

    note: str | None = None
    until: datetime | None = None
    count: int | None = None


def asked(
    action: ControlAction,
    *,
    now: datetime,
    note: str | None = None,
    until: datetime | None = None,
    count: int | None = None,
) -> Asked:
    """The extras of a change, checked: a ``ValueError`` names the one refused, its value and
    what is accepted (nothing is changed then)."""
    if note is not None and (not isinstance(note, str) or len(note) > NOTE_MAX):
        raise ValueError(f"note must be a text of at most {NOTE_MAX} characters, got {note!r:.80}")
    if until is not None:
        if action != "pause":
            raise ValueError(f"until= is for pause only, not {action}")
        if not isinstance(until, datetime) or until.tzinfo is None:
            raise ValueError(f"until must be an aware datetime (with a time zone), got {until!r}")
        if until <= now:
            raise ValueError(
                f"until {until.isoformat()} is not in the future (now {now.isoformat()}):"
                " a pause that ends before it begins pauses nothing"
            )
        if until - now > UNTIL_MAX:
            raise ValueError(
                f"until {until.isoformat()} is more than 100 years ahead: pause without"
                " until for a pause that lasts until resumed"
            )
    if action == "skip":
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= SKIP_MAX:
            raise ValueError(
                f"skip takes a number of slots from 0 (cancel a skip) to {SKIP_MAX}, got {count!r}"
            )
    elif count is not None:
        raise ValueError(f"a count of slots is for skip only, not {action}")
    # Shown to whoever reads the fleet's controls: a URL's password in it is masked, as in logs.
    return Asked(redact_text(note) if note else None, until, count)


def _time(value: datetime) -> str:
    return value.isoformat()


@dataclass(frozen=True, slots=True)
class RunInProgress:
    """A run going on an instance, as its presence shows it. ``leased``: it holds a lease (a
    lease backend), which outlives a dead runner until it expires and the slot is taken over."""

    job: str
    run_id: str
    slot_ms: int
    started_at: datetime
    reason: str
    attempt: int = 1
    leased: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "run_id": self.run_id,
            "slot_ms": self.slot_ms,
            "started_at": _time(self.started_at),
            "reason": self.reason,
            "attempt": self.attempt,
            "leased": self.leased,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunInProgress:
        return cls(
            job=data["job"],
            run_id=data["run_id"],
            slot_ms=data["slot_ms"],
            started_at=datetime.fromisoformat(data["started_at"]),
            reason=data.get("reason", "schedule"),
            attempt=data.get("attempt", 1),
            leased=data.get("leased", False),
        )


@dataclass(frozen=True, slots=True)
class Instance:
    """One instance of the fleet as it last published itself (``Backend.instances()``).

    ``heartbeat``: how often it publishes; ``liveness(now)`` judges ``last_seen`` against it.
    ``stopped``: it stopped gracefully (its last record says so).
    """

    id: str
    host: str
    pid: int
    version: str
    started_at: datetime
    last_seen: datetime
    heartbeat: timedelta
    running: tuple[RunInProgress, ...] = ()
    stopped: bool = False
    jobs: int = 0

    def liveness(self, now: datetime) -> Liveness:
        """``alive``; ``late`` (1.5 heartbeats without one); ``dead`` (3); ``stopped``."""
        if self.stopped:
            return "stopped"
        age = now - self.last_seen
        if age > self.heartbeat * _DEAD:
            return "dead"
        if age > self.heartbeat * _LATE:
            return "late"
        return "alive"

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "host": self.host,
                "pid": self.pid,
                "version": self.version,
                "started_at": _time(self.started_at),
                "last_seen": _time(self.last_seen),
                "heartbeat_ms": self.heartbeat // timedelta(milliseconds=1),
                "running": [run.to_dict() for run in self.running],
                "stopped": self.stopped,
                "jobs": self.jobs,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Instance:
        data = json.loads(text)
        return cls(
            id=data["id"],
            host=data["host"],
            pid=data["pid"],
            version=data["version"],
            started_at=datetime.fromisoformat(data["started_at"]),
            last_seen=datetime.fromisoformat(data["last_seen"]),
            heartbeat=timedelta(milliseconds=data["heartbeat_ms"]),
            running=tuple(RunInProgress.from_dict(run) for run in data.get("running", ())),
            stopped=data.get("stopped", False),
            jobs=data.get("jobs", 0),
        )

    def to_dict(self, now: datetime) -> dict[str, Any]:
        """For the admin API and ``--json``: the record and its liveness at ``now``."""
        return {
            **json.loads(self.to_json()),
            "liveness": self.liveness(now),
            "age_ms": (now - self.last_seen) // timedelta(milliseconds=1),
        }


@dataclass(frozen=True, slots=True)
class ControlChange:
    """One change of a job's fleet-wide control: who (``actor``) did what (``action``) when,
    and why (``note``, free text); ``run_id`` for an abort; ``until`` for a pause that ends by
    itself; for a skip, how many slots (``count``, 0 to cancel one) and the last of them
    (``through_ms``, found from the job's schedule by the instance that made the change); for
    an abort without ``run_id``, the slot that replaces the runs of earlier ones
    (``through_ms``: see ``replaces``)."""

    job: str
    action: ControlAction
    actor: str
    at: datetime
    run_id: str | None = None
    note: str | None = None
    until: datetime | None = None
    count: int | None = None
    through_ms: int | None = None

    @property
    def replaces(self) -> bool:
        """An abort of every run of the job whose slot is before ``through_ms``: asked by an
        instance whose claim of that slot a live run of an earlier slot blocked
        (``overlap="replace"``)."""
        return self.action == "abort" and self.run_id is None and self.through_ms is not None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"action": self.action, "actor": self.actor, "at": _time(self.at)}
        until = _time(self.until) if self.until is not None else None
        extra = (
            ("run_id", self.run_id),
            ("note", self.note),
            ("until", until),
            ("count", self.count),
            ("through_ms", self.through_ms),
        )
        data.update((name, value) for name, value in extra if value is not None)
        return data

    @classmethod
    def from_dict(cls, job: str, data: dict[str, Any]) -> ControlChange:
        until = data.get("until")
        return cls(
            job=job,
            action=cast(ControlAction, data["action"]),
            actor=data["actor"],
            at=datetime.fromisoformat(data["at"]),
            run_id=data.get("run_id"),
            note=data.get("note"),
            until=datetime.fromisoformat(until) if until else None,
            count=data.get("count"),
            through_ms=data.get("through_ms"),
        )


@dataclass(frozen=True, slots=True)
class SkipWindow:
    """``Job.skip(n)``: the job's slots after ``after_ms`` (when it was asked) up to and
    including ``through_ms`` (the n-th of them) are skipped by the whole fleet."""

    after_ms: int
    through_ms: int
    count: int

    def covers(self, slot_ms: int) -> bool:
        return self.after_ms < slot_ms <= self.through_ms

    def left(self, next_ms: Callable[[int], int | None], now_ms: int) -> int:
        """How many of its slots are still ahead of ``now_ms`` (``next_ms``: the schedule's
        next slot after an instant)."""
        left, after = 0, max(self.after_ms, now_ms)
        while left < self.count and (slot := next_ms(after)) is not None:
            if slot > self.through_ms:
                break
            left, after = left + 1, slot
        return left


@dataclass(frozen=True, slots=True)
class JobControl:
    """A job's fleet-wide control, kept by the backend under the job's key: ``paused``
    (``Job.pause()``; with ``until``, until that instant, when it resumes by itself) and
    ``disabled`` (``Job.disable()``) stop its slots on every instance, ``note`` says why (the
    note of the change that paused or disabled it); ``skip`` stops the next few
    (``Job.skip(n)``); ``changes`` (newest last, the latest ``AUDIT_KEPT``) says who changed
    what when and why, aborts included.

    What a slot honours is judged by its instant (``stops``): a pause until 06:00 stops the
    slots before 06:00 and lets the 06:00 slot run, on every instance, without a write."""

    job: str
    paused: bool = False
    disabled: bool = False
    changes: tuple[ControlChange, ...] = field(default=())
    until: datetime | None = None
    skip: SkipWindow | None = None
    note: str | None = None

    @property
    def stopped(self) -> bool:
        """Its slots do not run now (paused or disabled), a pause's end not considered."""
        return self.paused or self.disabled

    def paused_at(self, now: datetime) -> bool:
        """Paused at ``now``: a pause ``until`` an instant has ended from that instant."""
        return self.paused and (self.until is None or now < self.until)

    def stops(self, slot_ms: int) -> str | None:
        """Why the slot at ``slot_ms`` does not run (``disabled``, ``paused``, ``skipped``),
        or ``None`` when nothing here stops it."""
        if self.disabled:
            return "disabled"
        until = self.until
        if self.paused and (until is None or slot_ms < datetime_to_ms(until)):
            return "paused"
        if self.skip is not None and self.skip.covers(slot_ms):
            return "skipped"
        return None

    def aborts(self, now: datetime) -> set[str]:
        """The run ids asked to abort within ``ABORT_KEPT`` of ``now``."""
        return {
            c.run_id
            for c in self.changes
            if c.action == "abort" and c.run_id is not None and now - c.at <= ABORT_KEPT
        }

    def replaces(self, now: datetime) -> int | None:
        """The latest slot, asked within ``ABORT_KEPT`` of ``now``, that replaces the job's
        runs of earlier slots (``overlap="replace"``): those runs are cut wherever they go."""
        kept = [c.through_ms for c in self.changes if c.replaces and now - c.at <= ABORT_KEPT]
        return max((slot_ms for slot_ms in kept if slot_ms is not None), default=None)

    def apply(self, change: ControlChange) -> JobControl:
        if change.replaces and change.through_ms is not None:
            # Every instance whose claim of the slot was blocked asks: one entry is enough.
            asked = self.replaces(change.at)
            if asked is not None and asked >= change.through_ms:
                return self
        paused, disabled, until, skip = self.paused, self.disabled, self.until, self.skip
        note = self.note
        if change.action in ("pause", "resume"):
            paused = change.action == "pause"
            until = change.until if paused else None
        elif change.action in ("disable", "enable"):
            disabled = change.action == "disable"
        elif change.action == "skip":
            skip = None
            if change.count and change.through_ms is not None:
                skip = SkipWindow(datetime_to_ms(change.at), change.through_ms, change.count)
        if change.action in ("pause", "disable"):
            note = change.note
        elif change.action in ("resume", "enable") and not (paused or disabled):
            note = None
        return replace(
            self,
            paused=paused,
            disabled=disabled,
            until=until,
            skip=skip,
            note=note,
            changes=(*self.changes, change)[-AUDIT_KEPT:],
        )

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "job": self.job,
            "paused": self.paused,
            "disabled": self.disabled,
            "changes": [change.to_dict() for change in self.changes],
        }
        if self.until is not None:
            data["until"] = _time(self.until)
        if self.note is not None:
            data["note"] = self.note
        if self.skip is not None:
            skip = self.skip
            data["skip"] = {"after_ms": skip.after_ms, "through_ms": skip.through_ms}
            data["skip"]["count"] = skip.count
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> JobControl:
        data = json.loads(text)
        job = data["job"]
        changes = tuple(ControlChange.from_dict(job, c) for c in data.get("changes", ()))
        until, skip = data.get("until"), data.get("skip")
        return cls(
            job,
            bool(data["paused"]),
            bool(data["disabled"]),
            changes,
            until=datetime.fromisoformat(until) if until else None,
            skip=SkipWindow(skip["after_ms"], skip["through_ms"], skip["count"]) if skip else None,
            note=data.get("note"),
        )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.to_json())  # type: ignore[no-any-return]


def runs_ahead(
    next_ms: Callable[[int], int | None], control: JobControl | None, count: int, now_ms: int
) -> list[int]:
    """The next ``count`` slots after ``now_ms`` that ``control`` lets run (``next_ms``: the
    schedule's next slot after an instant): after a pause's end, skipped slots passed over;
    none while the job is disabled or paused without an end."""
    after = now_ms
    if control is not None:
        if control.disabled:
            return []
        if control.paused and control.until is not None:
            after = max(after, datetime_to_ms(control.until) - 1)
        elif control.paused:
            return []
    slots: list[int] = []
    while len(slots) < count and (slot := next_ms(after)) is not None:
        if control is None or control.stops(slot) is None:
            slots.append(slot)
        after = slot
    return slots

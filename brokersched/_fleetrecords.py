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
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal, cast, get_args

__all__ = [
    "CONTROL_ACTIONS",
    "FORGET",
    "ControlAction",
    "ControlChange",
    "FleetKind",
    "Instance",
    "JobControl",
    "Liveness",
    "RunInProgress",
]

FleetKind = Literal["instance", "control"]
Liveness = Literal["alive", "late", "dead", "stopped"]
ControlAction = Literal["pause", "resume", "disable", "enable", "abort"]
CONTROL_ACTIONS: tuple[ControlAction, ...] = get_args(ControlAction)

#: An instance record is kept this long after its last heartbeat (a dead instance stays listed
#: as ``dead`` for that long, then is forgotten).
FORGET = timedelta(minutes=10)
#: Late after this many heartbeat periods without one; dead after ``_DEAD``.
_LATE = 1.5
_DEAD = 3.0
#: The changes kept in a job's control record (its audit trail), newest last.
AUDIT_KEPT = 50
#: An abort request is honoured for this long after it was made (a run started later is not
#: the one that was meant, and a record only grows by the requests it still honours).
ABORT_KEPT = timedelta(minutes=10)


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
    """One change of a job's fleet-wide control: who (``actor``) did what (``action``) when;
    ``run_id`` for an abort."""

    job: str
    action: ControlAction
    actor: str
    at: datetime
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"action": self.action, "actor": self.actor, "at": _time(self.at)}
        if self.run_id is not None:
            data["run_id"] = self.run_id
        return data


@dataclass(frozen=True, slots=True)
class JobControl:
    """A job's fleet-wide control, kept by the backend under the job's key: ``paused``
    (``Job.pause()``) and ``disabled`` (``Job.disable()``) stop its slots on every instance;
    ``changes`` (newest last, the latest ``AUDIT_KEPT``) says who changed what when, aborts
    included."""

    job: str
    paused: bool = False
    disabled: bool = False
    changes: tuple[ControlChange, ...] = field(default=())

    @property
    def stopped(self) -> bool:
        """Its slots do not run (paused or disabled)."""
        return self.paused or self.disabled

    def aborts(self, now: datetime) -> set[str]:
        """The run ids asked to abort within ``ABORT_KEPT`` of ``now``."""
        return {
            c.run_id
            for c in self.changes
            if c.action == "abort" and c.run_id is not None and now - c.at <= ABORT_KEPT
        }

    def apply(self, change: ControlChange) -> JobControl:
        paused, disabled = self.paused, self.disabled
        if change.action in ("pause", "resume"):
            paused = change.action == "pause"
        elif change.action in ("disable", "enable"):
            disabled = change.action == "disable"
        return replace(
            self, paused=paused, disabled=disabled, changes=(*self.changes, change)[-AUDIT_KEPT:]
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "job": self.job,
                "paused": self.paused,
                "disabled": self.disabled,
                "changes": [change.to_dict() for change in self.changes],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> JobControl:
        data = json.loads(text)
        job = data["job"]
        changes = tuple(
            ControlChange(
                job=job,
                action=cast(ControlAction, c["action"]),
                actor=c["actor"],
                at=datetime.fromisoformat(c["at"]),
                run_id=c.get("run_id"),
            )
            for c in data.get("changes", ())
        )
        return cls(job, bool(data["paused"]), bool(data["disabled"]), changes)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.to_json())  # type: ignore[no-any-return]

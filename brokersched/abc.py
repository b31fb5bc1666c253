"""The backend contract.

A backend decides which instance runs a slot. Two kinds exist:

* ``ClaimBackend`` (RabbitMQ, NATS JetStream, Redis): ``claim()`` a slot once; the first claim
  wins and the backend remembers it for ``capabilities.slot_memory``. No leases, so no overlap
  control, no retries of dead runners and no catch-up.
* ``LeaseBackend`` (SQLite, PostgreSQL, Redis, memory): ``acquire()`` a slot with *occurrence
  fencing* and a lease the runner renews; dead runners are detected and their slot is taken over.

The scheduler reads only ``capabilities`` to validate options; it never looks at class names, so
a third-party backend gets the same checks by declaring its capabilities.

Client types (aio-pika, nats-py, redis-py, asyncpg, aiosqlite) never cross this module: every
method takes and returns the plain types defined here, and raises ``BackendError`` for anything
that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple

from ._clock import Clock
from ._exceptions import BackendError
from ._fleetrecords import (
    FORGET,
    MISSED_KEPT,
    ControlAction,
    ControlChange,
    FleetKind,
    Instance,
    JobControl,
    Liveness,
    RunInProgress,
)
from ._slotmemory import BOOT_MEMORY, DEFAULT_CLAIM_SKEW, margin_ms
from ._tasks import gather_each

__all__ = [
    "FAILURES",
    "Backend",
    "BrokerBudget",
    "Capabilities",
    "Claim",
    "ClaimBackend",
    "ControlAction",
    "ControlChange",
    "Finding",
    "FleetKind",
    "Instance",
    "Inventory",
    "JobControl",
    "JobPolicy",
    "Lease",
    "LeaseBackend",
    "LeaseOutcome",
    "LeaseState",
    "Liveness",
    "Outcome",
    "Overlap",
    "RunInProgress",
    "RunReason",
    "RunRecord",
    "Severity",
    "Slot",
    "StoredObject",
    "new_run_id",
]


_DEFAULT_SKEW_MS = round(DEFAULT_CLAIM_SKEW.total_seconds() * 1000)

Outcome = Literal["completed", "failed", "timed-out", "interrupted", "missed", "replaced"]
#: The outcomes that are failures (the dashboard's failures, the CLI's exit code).
FAILURES: frozenset[Outcome] = frozenset({"failed", "timed-out", "interrupted", "missed"})
RunReason = Literal["schedule", "catch-up", "retry", "manual", "start", "backfill", "missed"]
Overlap = Literal["skip", "allow", "replace"]


class Slot(NamedTuple):
    """One occurrence of a job: its name and its UTC instant in integer milliseconds."""

    job: str
    slot_ms: int

    @property
    def key(self) -> str:
        """``"<job>:<slot_ms>"``: the NATS message id, the AMQP message id, the SQL key."""
        return f"{self.job}:{self.slot_ms}"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do; the validation matrix reads nothing else.

    ``leases``: overlap control, retries of dead runners and catch-up are possible.
    ``slot_memory``: how long a claimed slot is remembered (``None``: for ever, by fencing).
    ``history_ttl``: history can be trimmed by age.
    ``history_size_per_job``: each job keeps its own history size (NATS keeps one for all).
    ``claim_margin``: see below.
    """

    leases: bool
    slot_memory: timedelta | None
    history_ttl: bool
    history_size_per_job: bool
    #: Claim-only: how long before a slot is ``slot_memory`` old its claims stop (the clocks'
    #: skew, a claim's flight, what the backend does ahead of a slot: ``_slotmemory.margin_ms``).
    claim_margin: timedelta = timedelta(0)


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """What a backend needs to know about a job. Lease fields are ignored by claim backends."""

    name: str
    history_size: int = 1000
    history_ttl: timedelta | None = None
    overlap: Overlap = "skip"
    max_attempts: int = 3
    # How long a slot handed over, or left by a dead runner, may wait for a new runner (on the
    # backend's clock, from the hand-over or the lease's expiry; never less than lease_ttl) and
    # still be restarted; None: no bound. The scheduler sets max(catch_up, max_late).
    retry_window: timedelta | None = None

    @property
    def exclusive(self) -> bool:
        """Whether two runs of the job never go at once: ``skip`` refuses a slot while a run
        of the job holds a live lease; ``replace`` too, until that run is cut and its lease
        released or expired."""
        return self.overlap != "allow"


def new_run_id() -> str:
    """A fresh run id: 16 hex digits."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run of a slot, as kept in the history (newest first when read back)."""

    job: str
    slot_ms: int
    run_id: str
    instance_id: str
    reason: RunReason
    attempt: int
    started_at: datetime
    finished_at: datetime | None
    outcome: Outcome
    error: str | None = None
    #: A failed or timed-out run's exception as Python prints it, with its cause chain (a
    #: timed-out async handler: where it was cut), passwords, URLs' secrets and the job's
    #: data masked, at most 4 KiB (its end kept: the innermost frames and the exception line,
    #: after a line saying what was cut). ``None`` for a run that did not fail, and in records
    #: written by earlier releases.
    traceback: str | None = None
    #: What the handler returned, as a JSON value (``Scheduler(record_results=True)``): its
    #: strings redacted as a traceback is (passwords, the job's data), at most 4 KiB of JSON, a
    #: larger one replaced by ``{"$cut": {"bytes": n, "limit": 4096}, "head": "<its start>"}``.
    #: ``None`` when it returned ``None`` or a value that is not JSON, when it did not return,
    #: when results are off, and in records written by earlier releases.
    result: Any = None

    def to_json(self) -> str:
        """The record as JSON (datetimes in ISO 8601); never pickled. ``traceback`` and
        ``result`` only when there is one: such records read as before in earlier releases
        (which ignore keys they do not know)."""
        # Field by field: ``dataclasses.asdict`` deep-copies each value first, which cost more
        # than the rest of recording a run.
        data: dict[str, Any] = {name: getattr(self, name) for name in _RECORD_FIELDS}
        data["started_at"] = self.started_at.isoformat()
        data["finished_at"] = self.finished_at.isoformat() if self.finished_at else None
        for optional in ("traceback", "result"):
            if data[optional] is None:
                del data[optional]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RunRecord:
        """A record from ``to_json``, of this release or an earlier one (no ``traceback``, no
        ``result``); keys a later release may add are ignored."""
        data = json.loads(text)
        data["started_at"] = datetime.fromisoformat(data["started_at"])
        if data["finished_at"] is not None:
            data["finished_at"] = datetime.fromisoformat(data["finished_at"])
        return cls(**{name: data[name] for name in _RECORD_FIELDS if name in data})


_RECORD_FIELDS = tuple(field.name for field in fields(RunRecord))


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted claim on a lease backend; ``token`` identifies this lease and no other."""

    job: str
    slot_ms: int
    token: str
    run_id: str
    attempt: int
    reason: RunReason

    @property
    def slot(self) -> Slot:
        return Slot(self.job, self.slot_ms)


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What a lease backend holds for one job now (``LeaseBackend.lease_state``).

    ``fence``: the latest scheduled, catch-up or retried slot claimed; ``manual_fence``: the
    latest manual one (``None``: none yet). ``leased``: the slots that hold a lease: running
    (live, or expired and not taken over yet) or handed over. A finished run's slot holds none.
    ``now_ms``: the store's clock when it was read (the clock claims are judged on), which a
    backfill judges a slot's age on (not compared; ``None``: a backend that does not say, whose
    backfills judge on the instance's clock; the conformance suite asks for it).
    """

    fence: int | None = None
    manual_fence: int | None = None
    leased: frozenset[int] = frozenset()
    now_ms: int | None = field(default=None, compare=False)


class Claim(NamedTuple):
    """One slot of a batch claimed at one instant (``acquire_many``, ``claim_many``): the slot,
    the run id its run gets, and (lease backends) the job's policy and why it is claimed."""

    slot: Slot
    run_id: str
    policy: JobPolicy
    reason: RunReason = "schedule"


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One thing a backend made on its server: ``kind`` (``queue``, ``exchange``, ``stream``,
    ``key``, ``table``, ``function``, ``schema``...) and its ``name`` there."""

    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class Inventory:
    """What a prefix (a schema, a table prefix) made on its backend (``Backend.inventory``).

    ``objects``: what was found. ``unknown``: what could not be enumerated, each a sentence
    (RabbitMQ over AMQP cannot list queues). ``live``: signs that an instance of the prefix
    runs (a live lease, a recent claim or run, a connection of the prefix), each a sentence:
    ``purge`` refuses while there are some, unless forced.
    """

    backend: str
    namespace: str
    objects: tuple[StoredObject, ...] = ()
    unknown: tuple[str, ...] = ()
    live: tuple[str, ...] = ()


Severity = Literal["error", "warning", "ok"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One check of ``Backend.doctor``: ``error`` (a slot can run twice, or the server can
    hang), ``warning`` or ``ok``; what was found, its consequence and the fix."""

    severity: Severity
    check: str
    found: str
    consequence: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in _FINDING_FIELDS}


_FINDING_FIELDS = ("severity", "check", "found", "consequence", "fix")


@dataclass(frozen=True, slots=True)
class BrokerBudget:
    """How much of its server's budget a backend's server uses, as last read (``Backend.budget``):
    ``used`` the share of the fullest part (0.0 to 1.0 and beyond), ``state`` ``ok``, ``warn``
    or ``shed`` (the backend creates no new server object and skips what needs one), and what
    was read (``detail``). ``shed_used``: the share of the fullest part whose exhaustion sheds
    (``None``: every part does, so ``used``); shedding lasts until it is back under 60 %."""

    used: float
    state: Literal["ok", "warn", "shed"]
    detail: str
    shed_used: float | None = None


_CONTROL_TRIES = 20


def _by_id(instance: Instance) -> str:
    return instance.id


#: What ``acquire()`` answers for one slot, or the error it raised for that slot alone.
LeaseOutcome = Lease | Literal["overlap", "not-acquired"] | Exception


class Backend(ABC):
    """What every backend does: lifecycle, capabilities, history.

    ``start()``/``stop()`` may be called by several schedulers sharing one backend object (a demo
    or a test running a "fleet" in one process): the backend opens on the first ``start()`` and
    closes on the last ``stop()``. Constructing a backend never connects.
    """

    def __init__(self) -> None:
        self._users = 0
        self._lifecycle = asyncio.Lock()

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports; constant for the life of the object."""

    @property
    def name(self) -> str:
        """The name errors and logs use for this backend (its class name)."""
        return type(self).__name__

    async def start(self, clock: Clock) -> None:
        """Connect (on the first call), creating whatever the backend needs on the server."""
        async with self._lifecycle:
            if self._users == 0:
                await self._open(clock)
            self._users += 1

    async def stop(self) -> None:
        """Disconnect (on the last call). Safe to call when not started."""
        async with self._lifecycle:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0:
                await self._close()

    @abstractmethod
    async def _open(self, clock: Clock) -> None:
        """Connect and prepare the server side. Raise ``BackendUnavailableError`` on failure."""

    @abstractmethod
    async def _close(self) -> None:
        """Release connections. Must not raise."""

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:  # noqa: B027 - optional hook
        """Called after ``start()`` with every job, and again with each job added later.

        A backend that sizes server objects from job settings (NATS history) does it here. The
        default does nothing.
        """

    @abstractmethod
    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        """Append ``record`` to the job's history, trimmed to ``job.history_size`` (and to
        ``job.history_ttl`` where ``capabilities.history_ttl``). Raises ``BackendError``."""

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """Append several records, in order, as ``record()`` would one after the other.

        A backend overrides it to write them in one round trip, all or none: when it raises,
        none of them was written, so the scheduler writes them again (it sends a batch, the
        records that waited while the previous write was going, only to a backend that
        overrides it). The default records them one by one.
        """
        for policy, record in records:
            await self.record(policy, record)

    @abstractmethod
    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        """At most ``limit`` records of the job, newest first, without consuming them."""

    @property
    def budget(self) -> BrokerBudget | None:
        """The server's budget as last read while the backend runs (``RabbitMQBackend`` with
        ``management_url``; the Redis, NATS and PostgreSQL backends on their own connection,
        ``backends/_budget.py``), exported as metrics; ``None``: not read."""
        return None

    # -- the fleet: presence and fleet-wide control -------------------------------------------

    @property
    def fleet(self) -> bool:
        """Whether this backend keeps the fleet's records (``Instance`` presence and
        ``JobControl``): it implements ``_fleet_read``, ``_fleet_put`` and ``_fleet_swap``.
        Without them an instance publishes no presence and ``Job.pause()`` pauses it alone."""
        return type(self)._fleet_read is not Backend._fleet_read

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        """Every live record of ``kind`` under this backend's prefix (schema, namespace): key
        to JSON text. An ``instance`` record whose ``ttl`` passed may be left out. Raises
        ``BackendError``. The default: not supported (``NotImplementedError``)."""
        raise NotImplementedError(f"{self.name} keeps no fleet records")

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        """Write the record ``key`` of ``kind``, whatever it held, kept at least ``ttl``
        (forgotten after, where the store expires keys). Raises ``BackendError``."""
        raise NotImplementedError(f"{self.name} keeps no fleet records")

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        """Compare-and-set: write ``new`` (kept for ever) only if the record holds ``old``
        (``None``: there is none); ``False`` when it held something else. Raises
        ``BackendError``."""
        raise NotImplementedError(f"{self.name} keeps no fleet records")

    async def publish_instance(self, instance: Instance) -> None:
        """Publish this instance's presence (every heartbeat); kept ``FORGET`` (10 minutes)."""
        await self._fleet_put("instance", instance.id, instance.to_json(), ttl=FORGET)

    async def instances(self) -> list[Instance]:
        """Every instance of the prefix that published itself within ``FORGET``, by id."""
        records = await self._fleet_read("instance")
        return sorted((Instance.from_json(text) for text in records.values()), key=_by_id)

    async def controls(self) -> dict[str, JobControl]:
        """Every job's fleet-wide control record, by job key (a job never controlled has
        none: it runs)."""
        records = await self._fleet_read("control")
        return {key: JobControl.from_json(text) for key, text in records.items()}

    async def change_control(self, *changes: ControlChange) -> JobControl:
        """Apply ``changes`` (of one job, in order) to its control record and keep them in
        its audit trail; answers the record written. Concurrent writers are applied one after
        the other (a compare-and-set, tried again when another came first)."""
        job = changes[0].job
        for _ in range(_CONTROL_TRIES):
            records = await self._fleet_read("control")
            old = records.get(job)
            new = JobControl(job) if old is None else JobControl.from_json(old)
            for change in changes:
                new = new.apply(change)
            if await self._fleet_swap("control", job, old, new.to_json()):
                return new
        raise BackendError(
            f"{self.name}: the control record of job {job!r} kept changing under "
            f"{_CONTROL_TRIES} tries to {changes[0].action} it; try again"
        )

    async def report_missed(self, slot: Slot, *, instance_id: str) -> bool:
        """Whether this instance is the first of the fleet to report ``slot`` missed (a fleet
        record of its own, put if there is none, then kept ``MISSED_KEPT``, a day, where the
        store expires records: the fleet's checks of a slot are over within minutes). Raises
        ``BackendError``."""
        if not await self._fleet_swap("missed", slot.key, None, instance_id):
            return False
        with contextlib.suppress(BackendError):  # reported all the same; the record stays
            await self._fleet_put("missed", slot.key, instance_id, ttl=MISSED_KEPT)
        return True

    async def fleet_records(self, kind: FleetKind) -> dict[str, str]:
        """The records of ``kind``: for the kinds the core keeps itself (``_stored``)."""
        return await self._fleet_read(kind)

    async def swap_fleet_record(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._fleet_swap(kind, key, old, new)

    # -- operations (``brokersched purge`` and ``doctor``): on a backend that is not started --

    async def presence(self, *, namespace: str | None = None) -> list[Instance]:
        """The presence of this prefix's (or ``namespace``'s) instances, by id, as
        ``instances()`` answers it: what ``brokersched purge`` judges a running fleet by.
        Connects for the call, on a backend that is not started, and creates nothing (no
        records: ``[]``). Raises ``BackendError`` when the records cannot be read, or one is
        not brokersched's; ``NotImplementedError`` when the backend keeps no presence that can
        be read that way (``_presence_records``)."""
        texts = await self._presence_records(namespace)
        try:
            return sorted((Instance.from_json(text) for text in texts), key=_by_id)
        except (ValueError, KeyError, TypeError) as exc:
            shown = repr(namespace) if namespace is not None else "its prefix"
            raise BackendError(
                f"{self.name}: a presence record of {shown} is not brokersched's ({exc!r})"
            ) from exc

    async def _presence_records(self, namespace: str | None) -> Sequence[str]:
        """The JSON texts of ``presence()``: every instance record of the prefix (or
        ``namespace``) not yet expired (``FORGET`` after its last heartbeat). The default:
        not supported."""
        if self.fleet:
            raise NotImplementedError(
                f"{self.name} does not implement reading its instances' presence without "
                "starting (Backend._presence_records)"
            )
        raise NotImplementedError(f"{self.name} keeps no presence of its instances")

    async def read_controls(self) -> dict[str, JobControl]:
        """The fleet-wide controls of this prefix's jobs, by job key, as ``controls()``
        answers them: what ``brokersched jobs`` says a job's state is by (paused, disabled).
        Connects for the call, on a backend that is not started, and creates nothing (no
        records: ``{}``). Raises ``BackendError`` when the records cannot be read, or one is
        not brokersched's; ``NotImplementedError`` when the backend keeps no fleet records,
        or cannot read them without starting (``_control_records``)."""
        texts = await self._control_records()
        try:
            controls = [JobControl.from_json(text) for text in texts]
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(
                f"{self.name}: a control record of its prefix is not brokersched's ({exc!r})"
            ) from exc
        return {control.job: control for control in controls}

    async def _control_records(self) -> Sequence[str]:
        """The JSON texts of ``read_controls()``: every control record of the prefix. The
        default: not supported."""
        if self.fleet:
            raise NotImplementedError(
                f"{self.name} does not implement reading its jobs' controls without starting "
                "(Backend._control_records)"
            )
        raise NotImplementedError(f"{self.name} keeps no fleet-wide controls")

    async def inventory(
        self,
        *,
        namespace: str | None = None,
        jobs: Sequence[str] = (),
        slots: Sequence[Slot] = (),
    ) -> Inventory:
        """Everything this backend's prefix (or ``namespace``: another prefix, schema or table
        prefix of the same kind) made on the server, and the signs that an instance of it
        runs. ``jobs`` (the application's job keys) and ``slots`` (its slots of the last slot
        memory): for a backend that cannot list its objects and names them (RabbitMQ over
        AMQP). Connects for the call, on a backend that is not started,
        and creates nothing. The default: not supported (raises ``NotImplementedError``)."""
        raise NotImplementedError(
            f"{self.name} does not implement inventory() and purge(): remove what it made on "
            "its server by hand"
        )

    async def purge(self, inventory: Inventory) -> Inventory:
        """Remove the objects of ``inventory`` (from ``inventory()``; the caller checked its
        ``live`` signs: removing what a running instance uses can run a slot twice). Answers
        the inventory taken again afterwards: what is left. Connects for the call. The
        default: not supported (raises ``NotImplementedError``)."""
        raise NotImplementedError(f"{self.name} does not implement purge()")

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        """Check the live server against the guarantees; one ``Finding`` per check. Connects
        for the call, on a backend that is not started, and creates nothing. ``slots``: the
        application's claimed slots of one slot memory ahead, for a backend whose server's
        need depends on them (RabbitMQ names the open-files limit its claim queues need).
        The default has no check to make."""
        return [
            Finding(
                "warning",
                "backend",
                f"{self.name} has no checks of its server",
                "nothing tells whether its server is set up to keep the guarantees",
                f"check {self.name}'s documentation, or implement Backend.doctor()",
            )
        ]


class ClaimBackend(Backend):
    """A backend that only claims slots (RabbitMQ, NATS JetStream, Redis).

    Its claims are remembered for a while, the fleet's slot memory; the rules that keep two
    claims of a slot from both winning across changes of that memory, lost records and skewed
    clocks are written once in ``brokersched._slotmemory`` (``FleetMemory``,
    ``claim_deadline_ms``) and followed by every claim-only backend of brokersched.
    """

    @abstractmethod
    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        """Claim ``slot`` for this instance; ``True`` when this claim won.

        Exactly one claim of a slot returns ``True`` while the backend remembers the slot
        (``capabilities.slot_memory`` from the first claim); every other claim, from any instance
        or connection, concurrent or later, returns ``False``.

        An answer that is not definite (the connection dropped before the server confirmed, the
        ``timeout`` in seconds passed) raises ``BackendError``: the scheduler then skips the slot,
        so a slot is never run on an ambiguous answer.
        """

    async def claim_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[bool | Exception]:
        """Claim several slots of distinct jobs, due at one instant; per claim, in order, what
        ``claim()`` would answer, or the error it would raise (one claim's error never fails
        the others). Every claim has the outcome a ``claim()`` of its own would have, racing
        the same claimers.

        The default sends the claims concurrently. A backend overrides it to claim them in
        fewer round trips (one pipelined write); the scheduler calls it for the slots of
        several jobs that fall due at one instant.
        """
        return await gather_each(
            [
                self.claim(c.slot, instance_id=instance_id, run_id=c.run_id, timeout=timeout)
                for c in claims
            ]
        )

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        """The last instant (this instance's wall clock, ms) at which ``slot`` may still be
        claimed safely: its claims must all land while the backend remembers the first one
        (``_slotmemory.claim_deadline_ms``). The scheduler sends no claim after it (the
        slot is skipped as ``late``). The default: the slot memory of ``capabilities`` less
        ``capabilities.claim_margin`` (or a margin for clocks one second apart); a backend with
        a fleet-wide record of its memory answers from that record."""
        caps = self.capabilities
        if caps.slot_memory is None:
            return None
        limit = round(caps.slot_memory.total_seconds() * 1000)
        margin = round(caps.claim_margin.total_seconds() * 1000)
        return slot.slot_ms + limit - (margin or margin_ms(limit, skew_ms=_DEFAULT_SKEW_MS))

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        """Claim a fleet boot run's window (see ``brokersched._boot``): as ``claim()``, but
        remembered for at least ``BOOT_MEMORY`` (three minutes) whatever the slot memory, so
        that instances whose boot runs fall a minute apart share one run. The default claims
        with ``claim()`` when the slot memory is that long, and fails closed otherwise."""
        memory = self.capabilities.slot_memory
        if memory is not None and memory < BOOT_MEMORY:
            raise BackendError(
                f"{self.name} cannot claim a fleet boot run: it remembers claims for "
                f"{memory}, less than the {BOOT_MEMORY} a boot window needs (implement "
                "claim_boot, or raise slot_ttl)"
            )
        return await self.claim(slot, instance_id=instance_id, run_id=run_id, timeout=timeout)

    async def prepare_claims(self, slots: Sequence[Slot]) -> None:
        """``slots`` will be claimed in a moment: the scheduler that won a job's slot calls
        this shortly before the job's next slot. A backend whose first claim of a slot creates
        something on the server (RabbitMQ's claim queue) may create it now, so that the claims
        made at the instant, often all at once, only ask who won. It never decides a claim, and
        a claim works the same without it; its errors are only logged. The default does
        nothing."""


class LeaseBackend(Backend):
    """A backend with leases and occurrence fencing (SQLite, PostgreSQL, Redis, memory).

    Lease expiry is judged on the backend's own clock (the database's), never the instance's.
    Every decision below is the lease protocol, written once as a pure function
    (``brokersched.backends._lease.decide``: a job's row and a request in, the new row and the
    answer out); ``MemoryBackend`` is that function, and ``LeaseBackendSuite`` checks any other
    backend against it on random programs of calls (``set_store_time`` drives its clock).
    """

    @property
    @abstractmethod
    def lease_ttl(self) -> timedelta:
        """How long a lease lives unless renewed; the scheduler renews every ``lease_ttl / 3``."""

    @property
    def max_clock_skew(self) -> timedelta:
        """How far apart the store's clock and the instances' may be (a backend's option);
        the default: one second."""
        return timedelta(seconds=1)

    @abstractmethod
    async def acquire(
        self,
        slot: Slot,
        *,
        policy: JobPolicy,
        instance_id: str,
        run_id: str,
        reason: RunReason,
        timeout: float,
    ) -> Lease | Literal["overlap", "not-acquired"]:
        """Claim ``slot`` and lease it, atomically.

        Granted only when ``slot.slot_ms`` is later than every slot of the job claimed before
        (occurrence fencing: a late instance can never run a slot that already ran, even after
        its lease expired) and, with ``policy.exclusive`` (``overlap`` ``"skip"`` or
        ``"replace"``), no lease on the job is live.
        Refused with ``"overlap"`` when the fencing test passed but a live lease blocked it, else
        ``"not-acquired"``. With ``reason == "catch-up"`` it is granted only for a job that was
        claimed before (a job never seen has missed nothing). The lease starts at attempt 1.
        Raises ``BackendError`` when it cannot answer within ``timeout`` seconds, retries
        included: the scheduler gives no longer than the lease it asks for is counted on, and
        runs no lease answered later (see ``backends/_lease.py``).
        """

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """Acquire several slots of distinct jobs, due at one instant; per claim, in order, what
        ``acquire()`` would answer, or the error it would raise for that claim (one claim's
        error never fails the others). Every claim has the outcome an ``acquire()`` of its own
        would have, racing the same claimers: a batch never grants a slot twice, nor refuses
        one that a single claim would have been granted.

        The default acquires them concurrently. A backend overrides it to decide them in one
        round trip (one statement on PostgreSQL, one transaction on SQLite); the scheduler calls
        it for the slots of several jobs that fall due at one instant.
        """
        return await gather_each(
            [
                self.acquire(
                    c.slot,
                    policy=c.policy,
                    instance_id=instance_id,
                    run_id=c.run_id,
                    reason=c.reason,
                    timeout=timeout,
                )
                for c in claims
            ]
        )

    @abstractmethod
    async def renew(self, lease: Lease) -> bool:
        """Extend ``lease`` by ``lease_ttl``; ``False`` when it expired or belongs to another
        token now (the runner must abort with ``lock-lost``). Raises ``BackendError``."""

    @abstractmethod
    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        """End ``lease``; the slot stays claimed. With ``handover`` (a graceful stop cut the run
        short), the slot is offered to ``take_over()`` at once, without counting an attempt.
        A stale lease (another token holds the slot now) is left untouched.

        ``record``, the run's, goes into its job's history with the release: in the same
        transaction (or script) where the store has one, and only if the release takes effect;
        where it has none (a stream beside a bucket), just before it, written once however
        often the release is tried. So a slot holds its lease or has its record, never
        neither: what a backfill reads to know whether it ran.

        A lease that has expired but that ``take_over()`` has not taken yet still holds its
        slot (its token is still the slot's): releasing it ends the run as if it had not
        expired (nothing restarts the slot, no attempt is recorded ``interrupted``), and a
        hand-over hands it over. The runner retries a release that failed past the lease's
        expiry (a store that was away as the run ended); it must land whenever no take-over
        came first."""

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[tuple[JobPolicy, RunRecord] | None] | None = None,
    ) -> list[Exception | None]:
        """End several leases of distinct slots (no hand-over), each with its record (``records``,
        in the order of ``leases``, if given), as ``release()`` would each; per lease, in order,
        ``None`` or the error its ``release()`` would raise (one lease's error never fails the
        others; a stale lease is left untouched, as by ``release()``).

        The default releases them concurrently. A backend overrides it to end them in one
        round trip; the scheduler calls it for the runs that finish within one turn of the
        event loop (the runs of one instant, on a fleet without jitter).
        """
        ends = records if records is not None else [None] * len(leases)
        return await gather_each(
            [self.release(lease, record=end) for lease, end in zip(leases, ends, strict=True)]
        )

    @abstractmethod
    async def lease_state(self, job: str) -> LeaseState:
        """The job's fences and the slots that hold a lease, as the store has them now (a job
        never claimed: the empty state). A read: it changes nothing. Raises ``BackendError``.

        A backfill reads it to leave alone a slot whose run still holds its lease, to say
        beforehand (a dry run) which slots an earlier backfill fenced, and (``now_ms``) to
        leave alone a slot not yet due, or still the fleet's to claim, by the store's clock."""

    @abstractmethod
    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """Take over slots whose runner died or handed them over, for the jobs in ``policies``.

        A slot qualifies when it is the latest claimed slot of its job and its lease expired
        while the run was going (the runner died), or it was handed over. If ``attempt <
        policy.max_attempts`` (or it was handed over) it is leased to this instance with
        ``reason="retry"`` and ``attempt + 1`` (the same attempt after a hand-over); otherwise
        the backend leaves it. The dead attempt is recorded ``interrupted`` in the history (error
        ``"runner lost its lease"``) by the backend, since its runner cannot. An expired slot that
        is no longer the latest of its job is only recorded. Each slot is taken over by exactly
        one caller.
        """

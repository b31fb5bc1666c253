"""The lease contract in one process: the embedded default for tests and demos.

Several ``MemoryBackend`` objects given the same ``MemoryStore`` behave like instances sharing one
database, which is how tests and demos run a "fleet" in one process. Every decision is the lease
protocol itself (``_lease.decide``) applied to the store's row of the job, with no ``await``
between reading the row and writing it back, so each is atomic on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import cast

from .._clock import Clock, host_time_ms
from .._durations import Duration, to_ms
from .._exceptions import BackendUnavailableError
from ..abc import (
    Claim,
    Finding,
    FleetKind,
    Inventory,
    JobPolicy,
    Lease,
    LeaseOutcome,
    LeaseState,
    RunRecord,
    Slot,
)
from ._keywords import checked_keywords
from ._lease import (
    DEFAULT_MAX_CLOCK_SKEW,
    Acquire,
    Answer,
    ClockName,
    Ending,
    Granted,
    JobRow,
    LeaseBackendBase,
    Release,
    Renew,
    Request,
    TakenOver,
    TakeOver,
    decide,
    new_token,
    outcome,
)
from ._ops import NamespaceInventory
from ._options import LeaseOptions

__all__ = ["MemoryBackend", "MemoryStore"]


@dataclass(slots=True)
class MemoryStore:
    """What the "database" holds; share one between backends to simulate a fleet."""

    jobs: dict[str, JobRow] = field(default_factory=dict)
    history: dict[str, deque[RunRecord]] = field(default_factory=dict)
    #: the fleet's records: (kind, key) -> (JSON text, expiry in ms on the store's clock)
    fleet: dict[tuple[str, str], tuple[str, int | None]] = field(default_factory=dict)


_IN_PROCESS = (
    "in this process's memory: nothing outlives the process, and no other process shares it"
)


class MemoryBackend(NamespaceInventory, LeaseBackendBase):
    """A lease backend in this process's memory; nothing survives the process.

    ``max_clock_skew``: how far ahead of this backend's clock a claimed slot may be. The
    backend's clock is ``store_clock`` if set (a fleet simulated in one process gives every
    backend the shared store's clock, which may disagree with the instances'), else the clock
    of the scheduler that started it.
    """

    clock_name = ClockName("MemoryBackend's clock", "the machine it runs on")

    @checked_keywords
    def __init__(
        self,
        *,
        lease_ttl: Duration = "30s",
        store: MemoryStore | None = None,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
        store_clock: Clock | None = None,
    ) -> None:
        super().__init__(LeaseOptions.parse(self.name, locals()))
        self.store = store if store is not None else MemoryStore()
        self.store_clock = store_clock
        self._clock: Clock | None = None

    async def _open(self, clock: Clock) -> None:
        self._clock = clock

    async def _close(self) -> None:
        self._clock = None

    def _now(self) -> int:
        if self._clock is None:
            raise BackendUnavailableError("MemoryBackend is not started")
        return (self.store_clock or self._clock).now_ms()

    def _instance_now(self) -> int:
        """The scheduler's clock, which history times are on (as on every backend)."""
        if self._clock is None:
            raise BackendUnavailableError("MemoryBackend is not started")
        return self._clock.now_ms()

    def _decide(self, job: str, request: Request) -> Answer:
        """Apply ``request`` to the job's row, as one atomic step."""
        now = self._now()
        row, answer = decide(job, self.store.jobs.get(job, JobRow()), request, self._store(now))
        self.store.jobs[job] = row
        if isinstance(request, Acquire):  # raises if the answer was TooFarAhead
            self._check_slot_time(Slot(job, request.slot_ms), now, self._clock)
        return answer

    async def _acquire(self, claim: Claim, instance_id: str, timeout: float) -> Granted:
        await asyncio.sleep(0)  # a real backend yields here; so do we, for honest races
        return self._grant(claim, instance_id)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """Every claim decided at one moment, as a database decides a batch in one statement."""
        await asyncio.sleep(0)
        return [outcome(self._grant, claim, instance_id) for claim in claims]

    def _grant(self, claim: Claim, instance_id: str) -> Granted:
        started = self._instance_now()
        request = Acquire(
            claim.slot.slot_ms, claim.reason, claim.policy.overlap, new_token(), claim.run_id,
            instance_id, started,
        )  # fmt: skip
        return cast(Granted, self._decide(claim.slot.job, request))

    async def renew(self, lease: Lease) -> bool:
        await asyncio.sleep(0)
        return self._decide(lease.job, Renew(lease.slot_ms, lease.token)) is True

    async def _end_lease(self, lease: Lease, handover: bool, record: Ending) -> None:
        """The release and its record at one moment: the record only if the lease was still
        this token's."""
        await asyncio.sleep(0)
        row = self.store.jobs.get(lease.job)
        held = row is not None and row.leases.get(lease.slot_ms)
        self._decide(lease.job, Release(lease.slot_ms, lease.token, handover))
        if held and held.token == lease.token and record is not None:
            self._append(*record)

    async def lease_state(self, job: str) -> LeaseState:
        await asyncio.sleep(0)
        now = self._now()  # raises when not started, as a real backend would
        return self.store.jobs.get(job, JobRow()).state(now)

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """Every job at one moment, as a database takes them over in one transaction."""
        await asyncio.sleep(0)
        return await super().take_over(policies, instance_id=instance_id)

    async def _take_over_job(self, policy: JobPolicy, instance_id: str) -> list[Lease]:
        if policy.name not in self.store.jobs:
            return []
        started = self._instance_now()
        taken = self._decide(policy.name, TakeOver(policy, instance_id, started))
        assert isinstance(taken, TakenOver)
        for record in taken.records:
            self._append(policy, record)
        return taken.leases

    def _append(self, job: JobPolicy, record: RunRecord) -> None:
        records = self.store.history.setdefault(job.name, deque())
        records.appendleft(record)
        while len(records) > job.history_size:
            records.pop()
        if job.history_ttl is not None:
            oldest = self._now() - to_ms(job.history_ttl)
            while records and records[-1].started_at.timestamp() * 1000 < oldest:
                records.pop()

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await asyncio.sleep(0)
        self._append(job, record)

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """At one moment, as a database writes a batch in one transaction."""
        await asyncio.sleep(0)
        for job, record in records:
            self._append(job, record)

    # -- the fleet's records, in the store: expiry on the store's clock --------------------

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        await asyncio.sleep(0)
        now = self._now()
        return {
            key: value
            for (k, key), (value, expires) in self.store.fleet.items()
            if k == kind and (expires is None or expires > now)
        }

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await asyncio.sleep(0)
        self.store.fleet[kind, key] = (value, self._now() + to_ms(ttl))

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        await asyncio.sleep(0)
        held = self.store.fleet.get((kind, key))
        if (held[0] if held is not None else None) != old:
            return False
        self.store.fleet[kind, key] = (new, None)
        return True

    async def _inventory(self, namespace: str | None) -> Inventory:
        """Nothing: its state lives in this process and ends with it."""
        return Inventory(self.name, namespace or "memory", unknown=(_IN_PROCESS,))

    async def _presence_records(self, namespace: str | None) -> list[str]:
        """The instances of this process's store (in ``brokersched purge``: none)."""
        return await self._records_of("instance")

    async def _control_records(self) -> list[str]:
        """The controls of this process's store (in ``brokersched jobs``: none)."""
        return await self._records_of("control")

    async def _records_of(self, wanted: FleetKind) -> list[str]:
        await asyncio.sleep(0)
        now = host_time_ms() if self._clock is None else self._now()
        return [
            value
            for (kind, _), (value, expires) in self.store.fleet.items()
            if kind == wanted and (expires is None or expires > now)
        ]

    async def purge(self, inventory: Inventory) -> Inventory:
        return Inventory(self.name, inventory.namespace, unknown=(_IN_PROCESS,))

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        return [Finding("ok", "backend", f"{self.name}: {_IN_PROCESS}")]

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        await asyncio.sleep(0)
        records = self.store.history.get(job.name, deque())
        if job.history_ttl is not None:
            oldest = self._now() - to_ms(job.history_ttl)
            records = deque(r for r in records if r.started_at.timestamp() * 1000 >= oldest)
        return list(records)[: max(0, min(limit, job.history_size))]

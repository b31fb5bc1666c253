"""The fleet simulator's lease store (PostgreSQL, SQLite, Redis leases): the lease protocol
itself (``MemoryBackend``), on the store's clock, behind the store's faults (``_sim_store``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

from ..abc import (
    Claim,
    JobPolicy,
    Lease,
    LeaseOutcome,
    LeaseState,
    RunReason,
    RunRecord,
    Slot,
)
from ..backends.memory import MemoryBackend, MemoryStore
from ._sim_store import SimFleet, Store

__all__ = ["SimLeaseBackend"]


class SimLeaseBackend(SimFleet, MemoryBackend):
    """A lease store (PostgreSQL, SQLite, Redis) as the lease protocol itself, on the store's
    clock, behind the store's faults."""

    def __init__(
        self, store: Store, rows: MemoryStore, *, lease_ttl: timedelta, instance: str
    ) -> None:
        super().__init__(lease_ttl=lease_ttl, store=rows, store_clock=store.clock)
        self.sim, self.instance = store, instance
        self.dead = False

    def _bound(self) -> float:
        return max(self.lease_ttl.total_seconds() / 3, 0.2)

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
        async def apply() -> Lease | Literal["overlap", "not-acquired"]:
            answer = await MemoryBackend.acquire(
                self, slot, policy=policy, instance_id=instance_id, run_id=run_id,
                reason=reason, timeout=timeout,
            )  # fmt: skip
            if isinstance(answer, Lease):
                self.sim.won(slot.job, slot.slot_ms, instance_id)
                self._expires(answer)
            return answer

        return await self.sim.call(self.dead, timeout, apply, write=True)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        async def apply() -> list[LeaseOutcome]:
            answers = await MemoryBackend.acquire_many(
                self, claims, instance_id=instance_id, timeout=timeout
            )
            for claim, answer in zip(claims, answers, strict=True):
                if isinstance(answer, Lease):
                    self.sim.won(claim.slot.job, claim.slot.slot_ms, instance_id)
                    self._expires(answer)
            return answers

        return await self.sim.call(self.dead, timeout, apply, write=True)

    async def renew(self, lease: Lease) -> bool:
        async def apply() -> bool:
            renewed = await MemoryBackend.renew(self, lease)
            if renewed:
                self._expires(lease)
            return renewed

        return await self.sim.call(self.dead, self._bound(), apply, write=True)

    def _expires(self, lease: Lease) -> None:
        """Note when ``lease`` expires, on the fleet's true time (the store's clock may be
        off): the simulator's invariants judge a release that came too late by it."""
        row = self.store.jobs.get(lease.job)
        held = row.leases.get(lease.slot_ms) if row is not None else None
        if held is not None:
            off = self.sim.clock.now_ms() - self.sim.fleet.now_ms()
            key = (lease.job, lease.slot_ms, held.instance_id, held.attempt)
            self.sim.expiry[key] = held.expires_ms - off
            self.sim.leased.add(held.run_id)
            self.sim.run_expiry[held.run_id] = held.expires_ms - off

    def _held(self, lease: Lease) -> bool:
        """Whether ``lease`` still holds its slot in the store (not taken over)."""
        row = self.store.jobs.get(lease.job)
        held = row.leases.get(lease.slot_ms) if row is not None else None
        return held is not None and held.token == lease.token

    async def _release(self, lease: Lease, record: tuple[JobPolicy, RunRecord] | None) -> None:
        """End ``lease`` (with its run's record) and note it released if that took effect: the
        memory backend yields before it decides, so a take-over may come first (the release
        is then stale)."""
        held = self._held(lease)
        await MemoryBackend.release(self, lease, record=record)
        row = self.store.jobs.get(lease.job)
        if held and (row is None or lease.slot_ms not in row.leases):
            self.sim.released.add((lease.job, lease.slot_ms, self.instance, lease.attempt))

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        async def apply() -> None:
            if handover:
                await MemoryBackend.release(self, lease, handover=handover, record=record)
            else:
                await self._release(lease, record)

        await self.sim.call(self.dead, self._bound(), apply, write=True)

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[tuple[JobPolicy, RunRecord] | None] | None = None,
    ) -> list[Exception | None]:
        ends = records if records is not None else [None] * len(leases)

        async def apply() -> list[Exception | None]:
            for lease, end in zip(leases, ends, strict=True):  # one transaction
                await self._release(lease, end)
            return [None for _ in leases]

        return await self.sim.call(self.dead, self._bound(), apply, write=True)

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        async def apply() -> list[Lease]:
            leases = await MemoryBackend.take_over(self, policies, instance_id=instance_id)
            for lease in leases:
                self.sim.won(lease.job, lease.slot_ms, instance_id)
                self._expires(lease)
            return leases

        return await self.sim.call(self.dead, 5.0, apply, write=True)

    async def lease_state(self, job: str) -> LeaseState:
        return await self.sim.call(
            self.dead, 5.0, lambda: MemoryBackend.lease_state(self, job), write=False
        )

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self.sim.call(
            self.dead, 5.0, lambda: MemoryBackend.record(self, job, record), write=True
        )

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        await self.sim.call(
            self.dead, 5.0, lambda: MemoryBackend.record_many(self, records), write=True
        )

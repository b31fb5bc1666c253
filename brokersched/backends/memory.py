"""The lease contract in one process: the embedded default for tests and demos.

Several ``MemoryBackend`` objects given the same ``MemoryStore`` behave like instances sharing one
database, which is how tests and demos run a "fleet" in one process. Every method is free of
``await`` between its reads and writes, so each is atomic on the event loop.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from .._clock import Clock, ms_to_datetime
from .._durations import Duration, parse_duration, to_ms
from .._exceptions import BackendUnavailableError, ConfigurationError
from ..abc import Capabilities, JobPolicy, Lease, LeaseBackend, RunReason, RunRecord, Slot

__all__ = ["MemoryBackend", "MemoryStore"]


@dataclass(slots=True)
class _Run:
    token: str
    run_id: str
    instance_id: str
    attempt: int
    reason: RunReason
    started_ms: int
    expires_ms: int
    state: Literal["running", "done", "handover"] = "running"


@dataclass(slots=True)
class MemoryStore:
    """What the "database" holds; share one between backends to simulate a fleet."""

    latest: dict[str, int] = field(default_factory=dict)  # job -> latest claimed slot_ms
    runs: dict[str, dict[int, _Run]] = field(default_factory=dict)  # job -> slot_ms -> run
    history: dict[str, deque[RunRecord]] = field(default_factory=dict)


class MemoryBackend(LeaseBackend):
    """A lease backend in this process's memory; nothing survives the process."""

    def __init__(self, *, lease_ttl: Duration = "30s", store: MemoryStore | None = None) -> None:
        super().__init__()
        self._lease_ttl = parse_duration(lease_ttl, name="lease_ttl")
        if self._lease_ttl <= timedelta(0):
            raise ConfigurationError("lease_ttl must be greater than 0", option="lease_ttl")
        self.store = store if store is not None else MemoryStore()
        self._clock: Clock | None = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            leases=True, slot_memory=None, history_ttl=True, history_size_per_job=True
        )

    @property
    def lease_ttl(self) -> timedelta:
        return self._lease_ttl

    async def _open(self, clock: Clock) -> None:
        self._clock = clock

    async def _close(self) -> None:
        self._clock = None

    def _now(self) -> int:
        if self._clock is None:
            raise BackendUnavailableError("MemoryBackend is not started")
        return self._clock.now_ms()

    def _live(self, run: _Run, now: int) -> bool:
        return run.state == "running" and run.expires_ms > now

    def _grant(
        self, slot: Slot, run_id: str, instance_id: str, attempt: int, reason: RunReason
    ) -> Lease:
        now = self._now()
        token = secrets.token_hex(16)
        self.store.runs.setdefault(slot.job, {})[slot.slot_ms] = _Run(
            token, run_id, instance_id, attempt, reason, now, now + to_ms(self._lease_ttl)
        )
        return Lease(slot.job, slot.slot_ms, token, run_id, attempt, reason)

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
        await asyncio.sleep(0)  # a real backend yields here; so do we, for honest races
        now = self._now()
        latest = self.store.latest.get(slot.job)
        if latest is not None and slot.slot_ms <= latest:
            return "not-acquired"
        if reason == "catch-up" and latest is None:
            return "not-acquired"
        runs = self.store.runs.get(slot.job, {})
        if policy.overlap == "skip" and any(self._live(run, now) for run in runs.values()):
            return "overlap"
        self.store.latest[slot.job] = slot.slot_ms
        for slot_ms in [ms for ms, run in runs.items() if run.state == "done"]:
            del runs[slot_ms]  # fencing refuses older slots already: no need to remember them
        return self._grant(slot, run_id, instance_id, 1, reason)

    def _current(self, lease: Lease) -> _Run | None:
        run = self.store.runs.get(lease.job, {}).get(lease.slot_ms)
        return run if run is not None and run.token == lease.token else None

    async def renew(self, lease: Lease) -> bool:
        await asyncio.sleep(0)
        now = self._now()
        run = self._current(lease)
        if run is None or not self._live(run, now):
            return False
        run.expires_ms = now + to_ms(self._lease_ttl)
        return True

    async def release(self, lease: Lease, *, handover: bool = False) -> None:
        await asyncio.sleep(0)
        run = self._current(lease)
        if run is not None:
            run.state = "handover" if handover else "done"
            run.expires_ms = self._now()

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        await asyncio.sleep(0)
        now = self._now()
        leases: list[Lease] = []
        for policy in policies:
            for slot_ms, run in list(self.store.runs.get(policy.name, {}).items()):
                if run.state != "done" and not self._live(run, now):
                    leases.extend(
                        self._take(policy, Slot(policy.name, slot_ms), run, now, instance_id)
                    )
        return leases

    def _take(
        self, policy: JobPolicy, slot: Slot, run: _Run, now: int, instance_id: str
    ) -> list[Lease]:
        handover = run.state == "handover"
        if not handover:
            self._append(policy, self._interrupted(slot, run, now))
        attempt = run.attempt if handover else run.attempt + 1
        if self.store.latest.get(slot.job) == slot.slot_ms and attempt <= policy.max_attempts:
            return [self._grant(slot, secrets.token_hex(8), instance_id, attempt, "retry")]
        run.state = "done"
        return []

    def _interrupted(self, slot: Slot, run: _Run, now: int) -> RunRecord:
        return RunRecord(
            job=slot.job,
            slot_ms=slot.slot_ms,
            run_id=run.run_id,
            instance_id=run.instance_id,
            reason=run.reason,
            attempt=run.attempt,
            started_at=ms_to_datetime(run.started_ms),
            finished_at=ms_to_datetime(now),
            outcome="interrupted",
            error="runner lost its lease",
        )

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

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        await asyncio.sleep(0)
        records = self.store.history.get(job.name, deque())
        if job.history_ttl is not None:
            oldest = self._now() - to_ms(job.history_ttl)
            records = deque(r for r in records if r.started_at.timestamp() * 1000 >= oldest)
        return list(records)[: max(0, min(limit, job.history_size))]

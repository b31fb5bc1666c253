"""The lease contract in one process: the embedded default for tests and demos.

Several ``MemoryBackend`` objects given the same ``MemoryStore`` behave like instances sharing one
database, which is how tests and demos run a "fleet" in one process. Every method is free of
``await`` between its reads and writes, so each is atomic on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._clock import Clock, ms_to_datetime
from .._durations import Duration, to_ms
from .._exceptions import BackendError, BackendUnavailableError
from ..abc import Claim, JobPolicy, Lease, LeaseOutcome, RunReason, RunRecord, Slot
from ._lease import (
    DEFAULT_MAX_CLOCK_SKEW,
    DeadRun,
    LeaseBackendBase,
    check_slot_time,
    interrupted,
    is_latest,
    new_run_id,
    new_token,
    restart_attempt,
    retry_window_ms,
)

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
    manual: dict[str, int] = field(default_factory=dict)  # job -> latest manual slot_ms
    runs: dict[str, dict[int, _Run]] = field(default_factory=dict)  # job -> slot_ms -> run
    history: dict[str, deque[RunRecord]] = field(default_factory=dict)


class MemoryBackend(LeaseBackendBase):
    """A lease backend in this process's memory; nothing survives the process.

    ``max_clock_skew``: how far ahead of this backend's clock (the scheduler's it was started
    with) a claimed slot may be.
    """

    def __init__(
        self,
        *,
        lease_ttl: Duration = "30s",
        store: MemoryStore | None = None,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
    ) -> None:
        super().__init__(lease_ttl=lease_ttl, max_clock_skew=max_clock_skew)
        self.store = store if store is not None else MemoryStore()
        self._clock: Clock | None = None

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
        token = new_token()
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
        return self._decide(Claim(slot, run_id, policy, reason), instance_id)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """Every claim decided at one moment, as a database decides a batch in one statement."""
        await asyncio.sleep(0)
        outcomes: list[LeaseOutcome] = []
        for claim in claims:
            try:
                outcomes.append(self._decide(claim, instance_id))
            except BackendError as exc:
                outcomes.append(exc)
        return outcomes

    def _decide(self, claim: Claim, instance_id: str) -> Lease | Literal["overlap", "not-acquired"]:
        slot, policy, reason = claim.slot, claim.policy, claim.reason
        now = self._now()
        check_slot_time(slot, now, self._max_clock_skew, backend=self.name, clock="its clock")
        fences = self.store.manual if reason == "manual" else self.store.latest
        fence = fences.get(slot.job)
        if fence is not None and slot.slot_ms <= fence:
            return "not-acquired"
        if reason == "catch-up" and fence is None:
            return "not-acquired"
        runs = self.store.runs.get(slot.job, {})
        if slot.slot_ms in runs and runs[slot.slot_ms].state != "done":
            return "not-acquired"  # a manual run at a scheduled slot's very instant
        if policy.overlap == "skip" and any(self._live(run, now) for run in runs.values()):
            return "overlap"
        fences[slot.job] = slot.slot_ms
        for slot_ms in [ms for ms, run in runs.items() if run.state == "done"]:
            del runs[slot_ms]  # fencing refuses older slots already: no need to remember them
        return self._grant(slot, claim.run_id, instance_id, 1, reason)

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
                    started = ms_to_datetime(run.started_ms)
                    dead = DeadRun(
                        policy.name, slot_ms, run.run_id, run.instance_id, run.reason,
                        run.attempt, run.state, started, now - run.expires_ms,
                    )  # fmt: skip
                    leases.extend(self._take(policy, dead, run, instance_id))
        return leases

    def _take(self, policy: JobPolicy, dead: DeadRun, run: _Run, instance_id: str) -> list[Lease]:
        fence, manual = self.store.latest.get(dead.job), self.store.manual.get(dead.job)
        latest = is_latest(dead.slot_ms, fence, manual)
        window_ms = retry_window_ms(policy, self._lease_ttl)
        attempt = restart_attempt(dead, latest=latest, policy=policy, window_ms=window_ms)
        now = ms_to_datetime(self._now())
        record = interrupted(
            dead,
            now,
            restarted=attempt is not None,
            window_ms=window_ms,
            max_attempts=policy.max_attempts,
        )
        if record is not None:
            self._append(policy, record)
        if attempt is None:
            run.state = "done"
            return []
        slot = Slot(dead.job, dead.slot_ms)
        return [self._grant(slot, new_run_id(), instance_id, attempt, "retry")]

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

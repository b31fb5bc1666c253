"""The leases of runs that finish within one turn of the event loop are ended together
(``release_many``), on virtual time; a lease whose release failed is retried on its own, so
no run is left looking like a dead runner's. The backends' side is in the conformance suites."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from brokersched import BackendError, JobContext, Scheduler
from brokersched.abc import JobPolicy, Lease
from brokersched.testing import TestClock
from tests.support.helpers import BatchNotingMemory

START = "2027-01-15T08:00:30+00:00"
JOBS = ("a", "b", "c", "d")


class ReleasingMemory(BatchNotingMemory):
    """Remembers each batch and each single release; ``fail`` fails one job's release once
    in a batch, ``down`` fails whole batches."""

    async def release(self, lease: Lease, **kwargs: Any) -> None:
        self.singles.append(lease.job)
        await super().release(lease, **kwargs)

    async def release_many(
        self, leases: Sequence[Lease], records: Sequence[Any] | None = None
    ) -> list[Exception | None]:
        self.batches.append(sorted(lease.job for lease in leases))
        if self.down:
            raise BackendError("database away")
        answers: list[Exception | None] = []
        for lease, record in zip(leases, records or [None] * len(leases), strict=True):
            if lease.job == self.fail:
                answers.append(BackendError(f"{lease.job} is broken"))
            else:
                await super().release(lease, record=record)
                answers.append(None)
        return answers


async def noop(ctx: JobContext) -> None:
    pass  # the runs claimed together finish together


async def fleet_of_jobs(backend: ReleasingMemory, minutes: int) -> list[str]:
    """Runs ``JOBS`` every minute for ``minutes``; the jobs a take-over would find dead."""
    clock = TestClock(START)
    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        for name in JOBS:
            sched.every(name, "1m", noop)
        await clock.advance(f"{minutes}m")
        policies = [JobPolicy(name) for name in JOBS]
        await clock.advance("2m")  # any lease left would be expired by now
        dead = await backend.take_over(policies, instance_id="other")
    return sorted(lease.job for lease in dead)


async def test_runs_finishing_together_are_released_in_one_batch() -> None:
    backend = ReleasingMemory()
    assert await fleet_of_jobs(backend, 1) == []
    assert backend.batches[0] == list(JOBS)
    assert backend.singles == []


async def test_a_release_that_failed_in_a_batch_is_retried_alone() -> None:
    backend = ReleasingMemory()
    backend.fail = "c"
    assert await fleet_of_jobs(backend, 1) == []
    assert backend.batches[0] == list(JOBS)
    assert backend.singles[0] == "c"


async def test_a_batch_that_failed_is_retried_lease_by_lease() -> None:
    backend = ReleasingMemory()
    backend.down = True
    assert await fleet_of_jobs(backend, 1) == []
    assert sorted(backend.singles[: len(JOBS)]) == list(JOBS)

"""A lease whose answer comes later than the lease lasts is never run, on virtual time: the
store granted it (so it may have expired, and another instance taken the slot over, by the time
the answer comes), the runner counts a lease only until a tenth of ``lease_ttl`` before it could
expire, measured from when its request was sent. Claims (one, and a batch of two), and a
take-over; sync and async handlers. The real servers are in test_late_lease_answer.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

from brokersched import JobContext, MemoryBackend, Scheduler, SkipEvent
from brokersched.abc import Claim, JobPolicy, Lease, LeaseOutcome, Slot
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock

START = "2027-01-15T08:00:30+00:00"
WHEN = datetime.fromisoformat("2027-01-15T08:01:00+00:00")
WHEN_MS = int(WHEN.timestamp() * 1000)
TTL_S = 30
# Later than the runner counts on a 30 s lease (27 s), within the claim's bound (27 s and a
# moment for the answer); and after that bound, which the runner stops waiting at.
DELAYS = {"valid-in-store": 27.1, "past-the-bound": 40}


class LateClaims(MemoryBackend):
    """Grants the leases a claim asks for at once, and answers ``delay_s`` later."""

    def __init__(self, delay_s: float, **options: Any) -> None:
        super().__init__(**options)
        self.delay_s = delay_s

    async def acquire(self, slot: Slot, **kwargs: Any) -> Any:
        lease = await super().acquire(slot, **kwargs)
        await self._late()
        return lease

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        outcomes = await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        await self._late()
        return outcomes

    async def _late(self) -> None:
        assert self._clock is not None
        await self._clock.sleep(self.delay_s)


class LateTakeOver(MemoryBackend):
    """Answers its first take-over that grants a lease ``delay_s`` late; the rest at once."""

    def __init__(self, delay_s: float, **options: Any) -> None:
        super().__init__(**options)
        self.delay_s = delay_s
        self.late: list[Lease] = []

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        leases = await super().take_over(policies, instance_id=instance_id)
        if leases and not self.late:
            self.late = leases
            assert self._clock is not None
            await self._clock.sleep(self.delay_s)
        return leases


Starts = list[tuple[str, str, int, str, str]]  # instance, job, attempt, reason, run id


def handler(kind: str, starts: Starts) -> Callable[[JobContext], Any]:
    def started(ctx: JobContext) -> None:
        starts.append((ctx.instance_id, ctx.job, ctx.attempt, ctx.reason, ctx.run_id))

    if kind == "sync":
        return started

    async def run(ctx: JobContext) -> None:
        started(ctx)
        await asyncio.sleep(0)

    return run


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("delay", DELAYS.values(), ids=DELAYS.keys())
@pytest.mark.parametrize("jobs", [["a"], ["a", "b"]], ids=["a claim", "a batch of claims"])
async def test_a_claim_answered_after_its_lease_could_expire_never_runs_there(
    kind: str, delay: float, jobs: list[str]
) -> None:
    clock, store = TestClock(START), MemoryStore()
    starts: Starts = []
    skips: list[SkipEvent] = []
    late = Scheduler(
        LateClaims(delay, store=store, lease_ttl=TTL_S), clock=clock, jitter=0, instance_id="A"
    )
    other = Scheduler(MemoryBackend(store=store, lease_ttl=TTL_S), clock=clock, instance_id="B")
    for name in jobs:  # jobs due at one instant: claimed as one batch
        late.at(name, WHEN, handler(kind, starts))
        other.at(name, WHEN + timedelta(days=1), handler(kind, starts))  # it sweeps their slots
    late.on("skip", skips.append)
    async with late, other:
        await clock.advance_to(WHEN)
        await clock.advance("2m")
    assert sorted(job for _, job, _, reason, _ in starts if reason == "retry") == jobs
    assert len(starts) == len(jobs)  # once each, and never on the late lease (a "schedule")
    assert [(s.job, s.reason) for s in skips] == [(name, "backend-error") for name in jobs]
    said = "could have expired" if delay < TTL_S else "TimeoutError"
    assert all(said in (s.detail or "") for s in skips), skips


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("delay", DELAYS.values(), ids=DELAYS.keys())
async def test_a_take_over_answered_after_its_lease_could_expire_never_runs_there(
    kind: str, delay: float
) -> None:
    clock, store = TestClock(START), MemoryStore()
    starts: Starts = []
    skips: list[SkipEvent] = []
    # A dead runner's lease of the job's latest slot: it expires 30 s from now.
    dead = MemoryBackend(store=store, lease_ttl=TTL_S)
    await dead.start(clock)
    slot = Slot("job", WHEN_MS - 60_000)
    policy = JobPolicy("job")
    await dead.acquire(
        slot, policy=policy, instance_id="dead", run_id="r0", reason="schedule", timeout=1
    )
    backend = LateTakeOver(delay, store=store, lease_ttl=TTL_S)
    late = Scheduler(backend, clock=clock, jitter=0, instance_id="A")
    other = Scheduler(MemoryBackend(store=store, lease_ttl=TTL_S), clock=clock, instance_id="B")
    for sched in (late, other):
        sched.every("job", "1h", handler(kind, starts), catch_up=0)
    late.on("skip", skips.append)
    async with late, other:
        await clock.advance("3m")
    await dead.stop()
    assert backend.late, "the first take-over was not the late one"
    late_runs = {lease.run_id for lease in backend.late}
    assert [(job, reason) for _, job, _, reason, _ in starts] == [("job", "retry")]
    assert not late_runs & {run_id for *_, run_id in starts}
    assert [(s.job, s.slot_ms, s.reason, s.run) for s in skips] == [
        ("job", slot.slot_ms, "backend-error", "retry")
    ]


async def test_a_claim_is_given_no_longer_than_its_lease_to_answer() -> None:
    """``max_late`` (here 10 minutes) bounds a claim only while it is shorter than the lease
    (here 30 s, counted on for 27 s)."""
    timeouts: list[float] = []

    class Timed(MemoryBackend):
        async def acquire(self, slot: Slot, **kwargs: Any) -> Any:
            timeouts.append(kwargs["timeout"])
            return await super().acquire(slot, **kwargs)

    clock = TestClock(START)
    sched = Scheduler(Timed(lease_ttl=TTL_S), clock=clock, jitter=0, max_late="10m")
    job = sched.at("a", WHEN, lambda ctx: None)
    async with sched:
        await clock.advance_to(WHEN)
        await job.trigger()
    assert timeouts and all(timeout <= 27 for timeout in timeouts)


async def test_a_lease_answered_late_but_in_time_is_renewed_at_once() -> None:
    """Answered 24 s after the claim was sent, a 30 s lease is counted on for 3 s more: its
    first renewal is due a third of lease_ttl after the claim was sent, so it goes at once, and
    the run keeps its lease (not lost 3 s later, then taken over and run again)."""
    clock, store = TestClock(START), MemoryStore()
    starts: Starts = []
    ends: list[str | None] = []

    async def long(ctx: JobContext) -> None:
        starts.append((ctx.instance_id, ctx.job, ctx.attempt, ctx.reason, ctx.run_id))
        await ctx.sleep(60)
        ends.append(ctx.abort_reason)

    late = Scheduler(
        LateClaims(24, store=store, lease_ttl=TTL_S), clock=clock, jitter=0, instance_id="A"
    )
    other = Scheduler(MemoryBackend(store=store, lease_ttl=TTL_S), clock=clock, instance_id="B")
    late.at("a", WHEN, long)
    other.at("a", WHEN + timedelta(days=1), long)
    async with late, other:
        await clock.advance_to(WHEN)
        await clock.advance("3m")
    assert [(instance, reason) for instance, _, _, reason, _ in starts] == [("A", "schedule")]
    assert ends == [None]  # it ran to its end, never told it lost its lease


async def test_a_backfill_whose_claim_is_answered_after_its_lease_could_expire_runs_nothing() -> (
    None
):
    clock = TestClock(START)
    starts: Starts = []
    backend = LateClaims(6, lease_ttl="5s")  # counted on for 4.5 s
    sched = Scheduler(backend, clock=clock, jitter=0, enabled=False)
    sched.every("report", "1m", handler("async", starts), catch_up=0, max_late="10s")
    async with sched:
        await clock.advance("10m")
        backfill = asyncio.ensure_future(
            sched.backfill("report", WHEN, WHEN + timedelta(minutes=1), rate=100)
        )
        while not backfill.done():
            await clock.advance("1s")
        steps = backfill.result()
    assert starts == []
    # The first slot's lease came too late; the backfill stops there rather than fence it away.
    assert [(step.status, step.detail) for step in steps] == [
        ("skipped", "the backend failed: its lease was answered too late"),
        (
            "skipped",
            f"an earlier slot ({WHEN.isoformat()}) could not be backfilled: run the backfill"
            " again from it (claiming a later slot would fence it away)",
        ),
    ]

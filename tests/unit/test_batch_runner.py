"""Slots of several jobs due at one instant are claimed in one batch, on virtual time;
each job keeps its own outcome. The backends' side is in the conformance suites."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from brokersched import BackendError, JobContext, MemoryBackend, Scheduler, SkipEvent
from brokersched.abc import Claim, JobPolicy, LeaseOutcome, Slot
from brokersched.backends._lease import BATCH_CHUNK, in_chunks
from brokersched.testing import TestClock
from tests.support.helpers import BatchNotingMemory, DictClaimBackend

SLOT_0801 = 1_800_000_060_000  # 2027-01-15T08:01:00Z


class BatchingMemory(BatchNotingMemory):
    """Remembers each batch and each single claim; ``fail`` makes one job's claims fail, and
    ``down`` the whole batch."""

    async def acquire(self, slot: Slot, **kwargs: Any) -> Any:
        self.singles.append(slot.job)
        return await super().acquire(slot, **kwargs)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        self.batches.append([claim.slot.job for claim in claims])
        if self.down:
            raise BackendError("database away")
        good = [claim for claim in claims if claim.slot.job != self.fail]
        outcomes = iter(await super().acquire_many(good, instance_id=instance_id, timeout=timeout))
        return [
            BackendError(f"{claim.slot.job} is broken")
            if claim.slot.job == self.fail
            else next(outcomes)
            for claim in claims
        ]


class Ran:
    def __init__(self) -> None:
        self.runs: list[tuple[str, str]] = []

    async def __call__(self, ctx: JobContext) -> None:
        self.runs.append((ctx.job, f"{ctx.scheduled_at:%H:%M}"))


def skips(sched: Scheduler[Any]) -> list[tuple[str, str, str | None]]:
    seen: list[tuple[str, str, str | None]] = []

    def on_skip(event: SkipEvent) -> None:
        seen.append((event.job, event.reason, event.detail))

    sched.on("skip", on_skip)
    return seen


JOBS = ("a", "b", "c", "d", "e")


async def test_slots_due_at_one_instant_are_claimed_in_one_batch(clock: TestClock) -> None:
    backend = BatchingMemory()
    ran = Ran()
    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        for name in JOBS:
            sched.every(name, "1m", ran)
        sched.every("hourly", "1h", ran)
        await clock.advance("2m")
    assert backend.batches == [list(JOBS), list(JOBS)]
    assert backend.singles == []
    assert sorted(ran.runs) == sorted((job, t) for job in JOBS for t in ("08:01", "08:02"))


async def test_a_slot_due_alone_is_claimed_alone(clock: TestClock) -> None:
    backend = BatchingMemory()
    ran = Ran()
    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        sched.every("alone", "1m", ran)
        sched.every("offset", "1m", ran, offset="30s")
        await clock.advance("1m")
    assert backend.batches == []
    assert backend.singles == ["alone", "offset"]
    assert ran.runs == [("alone", "08:01"), ("offset", "08:01")]


async def test_one_jobs_failed_claim_skips_only_that_job(clock: TestClock) -> None:
    backend = BatchingMemory()
    backend.fail = "c"
    ran = Ran()
    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        seen = skips(sched)
        for name in JOBS:
            sched.every(name, "1m", ran)
        await clock.advance("1m")
    assert sorted(ran.runs) == [(job, "08:01") for job in JOBS if job != "c"]
    assert seen == [("c", "backend-error", "c is broken")]


async def test_a_batch_that_fails_skips_each_of_its_slots(clock: TestClock) -> None:
    backend = BatchingMemory()
    ran = Ran()
    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        seen = skips(sched)
        for name in JOBS:
            sched.every(name, "1m", ran)
        backend.down = True
        await clock.advance("1m")
        assert ran.runs == []
        assert sorted(seen) == [(job, "backend-error", "database away") for job in JOBS]
        backend.down = False
        await clock.advance("1m")
    assert sorted(ran.runs) == [(job, "08:02") for job in JOBS]


async def test_a_backend_without_a_batch_method_claims_each_slot(clock: TestClock) -> None:
    backend = DictClaimBackend()
    ran = Ran()
    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        for name in JOBS:
            sched.every(name, "1m", ran)
        await clock.advance("1m")
    assert sorted(backend.claims) == [f"{job}:{SLOT_0801}" for job in JOBS]
    assert len(backend.timeouts) == len(JOBS)  # one claim() each
    assert sorted(ran.runs) == [(job, "08:01") for job in JOBS]


class BatchingDict(DictClaimBackend):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    async def claim_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[bool | Exception]:
        self.batches.append([claim.slot.job for claim in claims])
        return await super().claim_many(claims, instance_id=instance_id, timeout=timeout)


async def test_a_claim_backend_with_a_batch_method_gets_batches(clock: TestClock) -> None:
    one, two = BatchingDict(), BatchingDict()
    two.claims = one.claims  # one fleet
    ran = Ran()
    async with (
        Scheduler(one, clock=clock, jitter=0) as first,
        Scheduler(two, clock=clock, jitter=0) as second,
    ):
        for sched in (first, second):
            for name in JOBS:
                sched.every(name, "1m", ran)
        await clock.advance("1m")
    assert one.batches == [list(JOBS)] and two.batches == [list(JOBS)]
    assert sorted(ran.runs) == [(job, "08:01") for job in JOBS]  # each once, fleet-wide


async def test_with_jitter_slots_due_within_a_moment_share_a_batch(clock: TestClock) -> None:
    """50 jobs jittered over 320 ms: a slot fires up to 20 ms (a sixteenth of the jitter) early
    with those due just before it, so at most 17 batches go out, and every slot still runs once
    within its jitter, never before its time."""
    backend = BatchingMemory()
    started: list[tuple[str, int]] = []

    async def handler(ctx: JobContext) -> None:
        started.append((ctx.job, clock.now_ms() - ctx.slot_ms))

    async with Scheduler(backend, clock=clock, jitter="320ms") as sched:
        for n in range(50):
            sched.every(f"j{n}", "1m", handler)
        await clock.advance("1m")
    sent = len(backend.batches) + len(backend.singles)
    assert sent <= 17, (backend.batches, backend.singles)
    assert sorted(job for job, _ in started) == sorted(f"j{n}" for n in range(50))
    assert all(0 <= late_ms <= 320 for _, late_ms in started), started


class AnswersLate(MemoryBackend):
    """A store that decides a batch of claims only once ``answer`` is set: for a claimer that
    gave up waiting meanwhile, the lease it is granted has nobody to run it."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        assert self._clock is not None
        with self._clock.blocking():  # a virtual clock runs on meanwhile: the claims give up
            await self.answer.wait()
        return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)


async def test_a_lease_granted_after_its_claimer_gave_up_is_handed_over_and_runs(
    clock: TestClock,
) -> None:
    """Two jobs' slots go in one batch, which the store decides only after both claimers gave
    up waiting (their ``max_late`` of 500 ms). Each lease granted then is handed over, so the
    fleet's next sweep runs its slot, once (``retry``); ended as done instead, the slot would
    run nowhere."""
    backend = AnswersLate()
    ran: list[tuple[str, str, str]] = []

    async def handler(ctx: JobContext) -> None:
        ran.append((ctx.job, ctx.reason, f"{ctx.scheduled_at:%H:%M}"))

    def gave_up(event: SkipEvent) -> None:
        if len(seen) == 2:  # both claimers: the store answers now
            backend.answer.set()

    async with Scheduler(backend, clock=clock, jitter=0) as sched:
        seen = skips(sched)
        sched.on("skip", gave_up)
        for name in ("a", "b"):
            sched.every(name, "1m", handler, max_late="500ms", catch_up=0)
        await clock.advance("31s")  # 08:01: the claims give up, then the store answers
        assert sorted(seen) == [(job, "backend-error", "TimeoutError") for job in ("a", "b")]
        await clock.advance("15s")  # lease_ttl / 2: a sweep has looked for handed-over slots
    expected = [("a", "retry", "08:01"), ("b", "retry", "08:01")]
    assert sorted(ran) == expected, "a slot leased to a claimer that gave up did not run once"


async def test_sql_batches_go_in_random_chunks_answered_in_order() -> None:
    """A batch larger than one statement decides is cut in chunks of random jobs (so that the
    instances of a fleet share an instant's slots), each chunk in job order; the outcomes come
    back in the order of the claims, and a chunk that fails gives its error to its own claims."""
    claims = [Claim(Slot(f"j{n:02}", 0), f"r{n}", JobPolicy(f"j{n:02}")) for n in range(40)]
    chunks: list[list[str]] = []

    def answer(claim: Claim) -> LeaseOutcome:
        return "overlap" if claim.slot.job.endswith(("1", "3", "5")) else "not-acquired"

    async def decide(part: list[Claim]) -> list[LeaseOutcome]:
        chunks.append([claim.slot.job for claim in part])
        if "j07" in chunks[-1]:
            raise BackendError("this chunk failed")
        return [answer(claim) for claim in part]

    outcomes = await in_chunks(claims, decide)
    assert sorted(len(chunk) for chunk in chunks) == [8, BATCH_CHUNK, BATCH_CHUNK]
    assert sorted(job for chunk in chunks for job in chunk) == [c.slot.job for c in claims]
    failed = next(chunk for chunk in chunks if "j07" in chunk)
    for claim, outcome in zip(claims, outcomes, strict=True):
        if claim.slot.job in failed:
            assert isinstance(outcome, BackendError)
        else:
            assert outcome == answer(claim)
    orders = set()
    for _ in range(5):
        chunks.clear()
        await in_chunks(claims, decide)
        orders.add(tuple(map(tuple, chunks)))
    assert len(orders) > 1  # drawn at random each time


class PreparingDict(DictClaimBackend):
    def __init__(self) -> None:
        super().__init__()
        self.ahead: list[tuple[int, list[Slot]]] = []  # (when, slots)
        self.clock: TestClock | None = None

    async def prepare_claims(self, slots: Sequence[Slot]) -> None:
        assert self.clock is not None
        self.ahead.append((self.clock.now_ms(), list(slots)))


async def test_the_winner_prepares_the_next_slots_claims_together_before_them(
    clock: TestClock,
) -> None:
    """Two instances, three jobs every minute: only the instance that won a job's slot calls
    ``prepare_claims`` for the job's next slot, 500 ms before it, those of one moment in one
    call; a backend that does not override it is never called (no timer either)."""
    one, two = PreparingDict(), PreparingDict()
    one.clock = two.clock = clock
    two.claims = one.claims  # one fleet
    async with (
        Scheduler(one, clock=clock, jitter=0) as first,
        Scheduler(two, clock=clock, jitter=0) as second,
    ):
        for sched in (first, second):
            for name in JOBS:
                sched.every(name, "1m", Ran())
        await clock.advance("1m")
        assert one.ahead == two.ahead == []  # not yet: 500 ms before the next slot
        await clock.advance("1m")
    prepared = one.ahead + two.ahead
    next_ms = prepared[0][1][0].slot_ms
    assert next_ms % 60_000 == 0
    assert sorted(job for _, slots in prepared for job in (s.job for s in slots)) == sorted(JOBS)
    assert all(when == next_ms - 500 for when, _ in prepared), prepared
    assert all(slot.slot_ms == next_ms for _, slots in prepared for slot in slots)
    assert len(prepared) <= 2  # one call per instance for that moment

"""The public conformance suites every backend passes.

A backend's test module subclasses one suite and supplies ``make_backend``::

    class TestMyBackend(LeaseBackendSuite):
        def make_backend(self, namespace: str, **options: Any) -> MyBackend:
            return MyBackend(DSN, schema=namespace, **options)

``make_backend`` returns a new, unstarted backend object with its own connection; objects made
with the same ``namespace`` share the server state (they are instances of one fleet), other
namespaces are isolated. Races start N claimers at the same moment on N such objects. Requires
pytest and pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar, cast

import pytest
import pytest_asyncio

from .._clock import Clock, SystemClock
from .._exceptions import BackendError
from .._results import CUT_KEY, RESULT_LIMIT, dumps_result, run_result
from ..abc import (
    Backend,
    Claim,
    ClaimBackend,
    JobPolicy,
    Lease,
    LeaseBackend,
    LeaseState,
    Overlap,
    RunRecord,
    Slot,
)
from ._fleet_check import SLOT, Factory, FleetRecordsCheck
from ._protocol import LeaseProtocolCheck

__all__ = ["ClaimBackendSuite", "LeaseBackendSuite"]

B = TypeVar("B", bound=Backend)

RACERS = 8


def make_record(
    job: str,
    slot_ms: int,
    n: int = 0,
    *,
    now: datetime | None = None,
    age: timedelta = timedelta(0),
) -> RunRecord:
    started = (now or datetime.now(UTC)) - age
    return RunRecord(
        job=job,
        slot_ms=slot_ms,
        run_id=f"run-{n}",
        instance_id="conformance",
        reason="schedule",
        attempt=1,
        started_at=started,
        finished_at=started + timedelta(milliseconds=5),
        outcome="completed",
        error=None,
    )


class _Suite(FleetRecordsCheck, ABC, Generic[B]):
    @abstractmethod
    def make_backend(self, namespace: str, **options: Any) -> B:
        """A new, unstarted backend on the shared server state of ``namespace``."""

    def make_clock(self) -> Clock:
        """The clock backends are started with; a virtual one for in-process backends."""
        return SystemClock()

    async def elapse(self, clock: Clock, seconds: float) -> None:
        """Let ``seconds`` pass on the backend's clock (real time by default)."""
        await asyncio.sleep(seconds)

    @pytest_asyncio.fixture
    async def clock(self) -> Clock:
        return self.make_clock()

    @pytest_asyncio.fixture
    async def fleet(self, clock: Clock) -> AsyncIterator[Factory]:
        """``await fleet(**options)`` starts another instance's backend in this test's namespace."""
        namespace = "t" + secrets.token_hex(5)
        started: list[Backend] = []

        async def start(**options: Any) -> B:
            backend = self.make_backend(namespace, **options)
            await backend.start(clock)
            started.append(backend)
            return backend

        yield start
        for backend in reversed(started):
            await backend.stop()

    @pytest.mark.asyncio
    async def test_history_is_newest_first_and_limited(self, fleet: Factory) -> None:
        backend = await fleet()
        policy = JobPolicy("hist", history_size=10)
        await backend.prepare([policy])
        for n in range(5):
            await backend.record(policy, make_record("hist", SLOT + n, n))
        records = await backend.history(policy, 3)
        assert [r.run_id for r in records] == ["run-4", "run-3", "run-2"]
        again = await backend.history(policy, 10)
        assert [r.run_id for r in again] == [f"run-{n}" for n in (4, 3, 2, 1, 0)]

    @pytest.mark.asyncio
    async def test_history_is_trimmed_to_its_size(self, fleet: Factory) -> None:
        backend = await fleet()
        policy = JobPolicy("small", history_size=3)
        await backend.prepare([policy])
        for n in range(6):
            await backend.record(policy, make_record("small", SLOT + n, n))
        records = await backend.history(policy, 100)
        assert [r.run_id for r in records] == ["run-5", "run-4", "run-3"]

    @pytest.mark.asyncio
    async def test_records_written_together_are_kept_in_order_and_trimmed(
        self, fleet: Factory
    ) -> None:
        backend = await fleet()
        small, other = JobPolicy("many", history_size=3), JobPolicy("many.other")
        await backend.prepare([small, other])
        await backend.record(small, make_record("many", SLOT, 0))
        batch = [(small, make_record("many", SLOT + n, n)) for n in range(1, 5)]
        batch.insert(2, (other, make_record("many.other", SLOT, 9)))
        await backend.record_many(batch)
        assert [r.run_id for r in await backend.history(small, 10)] == ["run-4", "run-3", "run-2"]
        assert [r.run_id for r in await backend.history(other, 10)] == ["run-9"]

    @pytest.mark.asyncio
    async def test_history_is_per_job_and_round_trips(self, fleet: Factory) -> None:
        backend = await fleet()
        first, second = JobPolicy("a.job"), JobPolicy("a:job")
        await backend.prepare([first, second])
        record = make_record("a.job", SLOT, 7)
        await backend.record(first, record)
        (read,) = await backend.history(first, 10)
        fields = (
            "job",
            "slot_ms",
            "run_id",
            "instance_id",
            "reason",
            "attempt",
            "outcome",
            "error",
            "traceback",
        )
        assert [getattr(read, f) for f in fields] == [getattr(record, f) for f in fields]
        assert read.started_at.tzinfo is not None and read.finished_at is not None
        assert abs(read.started_at - record.started_at) < timedelta(milliseconds=1)
        assert await backend.history(second, 10) == []

    @pytest.mark.asyncio
    async def test_a_failed_runs_traceback_is_kept_whole(self, fleet: Factory) -> None:
        """A traceback of the largest size a record carries (4 KiB, multi-byte characters,
        quotes, new lines) reads back as written; a record without one reads ``None``."""
        backend = await fleet()
        policy = JobPolicy("tb")
        await backend.prepare([policy])
        line = '  File "/app/jobs.py", line 12, in sync\n    raise RuntimeError("ü \\ ✓")\n'
        text = (line * 100)[: 4096 // 2] + 'RuntimeError: ü ✓ "quoted"'
        assert len(text.encode()) <= 4096
        await backend.record(policy, make_record("tb", SLOT - 1, 0))
        failed = replace(
            make_record("tb", SLOT, 1), outcome="failed", error="RuntimeError: ü", traceback=text
        )
        await backend.record(policy, failed)
        newest, oldest = await backend.history(policy, 10)
        assert (newest.run_id, newest.traceback, newest.error) == ("run-1", text, failed.error)
        assert (oldest.run_id, oldest.traceback) == ("run-0", None)

    @pytest.mark.asyncio
    async def test_a_runs_result_reads_back_as_written(self, fleet: Factory) -> None:
        """Every JSON shape a handler may return (the largest a record carries: 4 KiB of
        JSON, a cut result's marker) reads back equal, written alone or in a batch; a record
        without one reads ``None``."""
        backend = await fleet()
        policy = JobPolicy("res")
        await backend.prepare([policy])
        big = {"rows": ['ü "q" \\ \n ✓'] * 200}
        results: list[Any] = [
            {"sent": 3, "ids": [1, 2.5, None, True], "note": 'ü "q" ✓', "nested": {"a": []}},
            "done",
            0,
            False,
            [],
            run_result(big)[0],
        ]
        assert CUT_KEY in results[-1] and len(dumps_result(results[-1])) <= RESULT_LIMIT
        await backend.record(policy, make_record("res", SLOT - 1, 0))
        records = [
            (policy, replace(make_record("res", SLOT + n, n + 1), result=result))
            for n, result in enumerate(results)
        ]
        await backend.record(*records[0])
        await backend.record_many(records[1:])
        read = await backend.history(policy, 10)
        assert [r.result for r in reversed(read)] == [None, *results]


class ClaimBackendSuite(_Suite[B]):
    """Claim semantics: exactly one claim per slot wins, remembered for ``slot_memory``."""

    async def claim(self, backend: Backend, slot: Slot, instance: str = "i1") -> bool:
        assert isinstance(backend, ClaimBackend)
        return await backend.claim(slot, instance_id=instance, run_id="r", timeout=5.0)

    @pytest.mark.asyncio
    async def test_capabilities_say_claim_only(self, fleet: Factory) -> None:
        caps = (await fleet()).capabilities
        assert caps.leases is False
        assert caps.slot_memory is not None and caps.slot_memory > timedelta(0)

    @pytest.mark.asyncio
    async def test_first_claim_wins_and_later_ones_lose(self, fleet: Factory) -> None:
        one, two = await fleet(), await fleet()
        slot = Slot("report", SLOT)
        assert await self.claim(one, slot) is True
        assert await self.claim(one, slot) is False
        assert await self.claim(two, slot, "i2") is False

    @pytest.mark.asyncio
    async def test_slots_and_jobs_are_independent(self, fleet: Factory) -> None:
        backend = await fleet()
        assert await self.claim(backend, Slot("a", SLOT))
        assert await self.claim(backend, Slot("a", SLOT + 1))
        assert await self.claim(backend, Slot("b", SLOT))
        # names that differ only in characters a naive escaping would merge
        for name in ("x.y", "x:y", "x_y", "x-y", "x$y", "X.Y"):
            assert await self.claim(backend, Slot(name, SLOT)), name

    @pytest.mark.asyncio
    async def test_long_job_names_claim(self, fleet: Factory) -> None:
        backend = await fleet()
        long_a, long_b = "a" * 127 + "1", "a" * 127 + "2"
        assert await self.claim(backend, Slot(long_a, SLOT))
        assert await self.claim(backend, Slot(long_b, SLOT))
        assert not await self.claim(backend, Slot(long_a, SLOT))

    @pytest.mark.asyncio
    async def test_racing_claimers_have_exactly_one_winner_per_slot(self, fleet: Factory) -> None:
        backends = [await fleet() for _ in range(RACERS)]
        slots = [Slot("race", SLOT + n * 1000) for n in range(10)]
        barrier = asyncio.Barrier(RACERS)

        async def racer(index: int) -> list[bool]:
            await barrier.wait()
            claims = [self.claim(backends[index], slot, f"i{index}") for slot in slots]
            return list(await asyncio.gather(*claims))

        results = await asyncio.gather(*(racer(i) for i in range(RACERS)))
        for column, slot in enumerate(slots):
            winners = [row[column] for row in results].count(True)
            assert winners == 1, f"{slot.key}: {winners} winners"

    @pytest.mark.asyncio
    async def test_a_batch_has_the_outcomes_of_single_claims(self, fleet: Factory) -> None:
        backend = await fleet()
        assert isinstance(backend, ClaimBackend)
        assert await self.claim(backend, Slot("b.taken", SLOT))
        slots = [Slot("b.taken", SLOT), Slot("b.fresh", SLOT), Slot("b.other", SLOT + 1000)]
        claims = [Claim(slot, f"r{n}", JobPolicy(slot.job)) for n, slot in enumerate(slots)]
        won = await backend.claim_many(claims, instance_id="i1", timeout=5.0)
        assert won == [False, True, True]
        again = await backend.claim_many(claims, instance_id="i2", timeout=5.0)
        assert again == [False, False, False]

    @pytest.mark.asyncio
    async def test_batches_racing_single_claims_have_one_winner_per_slot(
        self, fleet: Factory
    ) -> None:
        backends = [await fleet() for _ in range(RACERS)]
        slots = [Slot(f"batch.{n}", SLOT) for n in range(6)]
        barrier = asyncio.Barrier(RACERS)

        async def racer(index: int) -> list[bool]:
            backend = backends[index]
            assert isinstance(backend, ClaimBackend)
            await barrier.wait()
            if index % 2:  # every other instance claims one slot at a time
                return [await self.claim(backend, slot, f"i{index}") for slot in slots]
            claims = [Claim(slot, "r", JobPolicy(slot.job)) for slot in slots]
            won = await backend.claim_many(claims, instance_id=f"i{index}", timeout=5.0)
            assert all(isinstance(w, bool) for w in won), won
            return [w is True for w in won]

        results = await asyncio.gather(*(racer(i) for i in range(RACERS)))
        for column, slot in enumerate(slots):
            winners = [row[column] for row in results].count(True)
            assert winners == 1, f"{slot.key}: {winners} winners"


class LeaseBackendSuite(LeaseProtocolCheck, _Suite[B]):
    """Lease semantics: fencing, overlap, renewal, take-over of dead runners, catch-up."""

    lease_ttl = timedelta(seconds=1)

    async def acquire(
        self,
        backend: LeaseBackend,
        slot: Slot,
        policy: JobPolicy | None = None,
        *,
        instance: str = "i1",
        reason: Any = "schedule",
    ) -> Lease | str:
        return await backend.acquire(
            slot,
            policy=policy or JobPolicy(slot.job),
            instance_id=instance,
            run_id=secrets.token_hex(4),
            reason=reason,
            timeout=5.0,
        )

    async def started(self, fleet: Factory) -> LeaseBackend:
        backend = await fleet(lease_ttl=self.lease_ttl)
        assert isinstance(backend, LeaseBackend)
        return backend

    async def expire(self, clock: Clock) -> None:
        await self.elapse(clock, self.lease_ttl.total_seconds() * 1.5)

    @pytest.mark.asyncio
    async def test_capabilities_say_lease(self, fleet: Factory) -> None:
        backend = await self.started(fleet)
        assert backend.capabilities.leases is True
        assert backend.lease_ttl == self.lease_ttl

    @pytest.mark.asyncio
    async def test_acquire_grants_a_lease(self, fleet: Factory) -> None:
        backend = await self.started(fleet)
        lease = await self.acquire(backend, Slot("job", SLOT))
        assert isinstance(lease, Lease)
        assert (lease.job, lease.slot_ms, lease.attempt, lease.reason) == (
            "job",
            SLOT,
            1,
            "schedule",
        )
        assert await self.acquire(backend, Slot("job", SLOT)) == "not-acquired"

    @pytest.mark.asyncio
    async def test_fencing_refuses_older_slots_even_after_expiry(
        self, fleet: Factory, clock: Clock
    ) -> None:
        backend = await self.started(fleet)
        allow = JobPolicy("job", overlap="allow")
        newer = await self.acquire(backend, Slot("job", SLOT + 60_000), allow)
        assert isinstance(newer, Lease)
        await backend.release(newer)
        await self.expire(clock)
        assert await self.acquire(backend, Slot("job", SLOT), allow) == "not-acquired"
        assert await self.acquire(backend, Slot("job", SLOT + 60_000), allow) == "not-acquired"
        assert isinstance(await self.acquire(backend, Slot("job", SLOT + 120_000), allow), Lease)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("overlap", ["skip", "replace"])
    async def test_overlap_refuses_while_a_lease_is_live(
        self, fleet: Factory, overlap: Overlap
    ) -> None:
        """Never two runs of a job at once: ``replace`` is refused as ``skip`` is (the scheduler
        then cuts the run in the way, and asks again), until that run's lease is released."""
        one, two = await self.started(fleet), await self.started(fleet)
        policy = JobPolicy("job", overlap=overlap)
        first = await self.acquire(one, Slot("job", SLOT), policy)
        assert isinstance(first, Lease)
        later = Slot("job", SLOT + 1000)
        assert await self.acquire(two, later, policy, instance="i2") == "overlap"
        await one.release(first)
        assert isinstance(await self.acquire(two, later, policy, instance="i2"), Lease)

    @pytest.mark.asyncio
    async def test_overlap_allow_only_fences(self, fleet: Factory) -> None:
        backend = await self.started(fleet)
        allow = JobPolicy("job", overlap="allow")
        assert isinstance(await self.acquire(backend, Slot("job", SLOT), allow), Lease)
        assert isinstance(await self.acquire(backend, Slot("job", SLOT + 1000), allow), Lease)

    @pytest.mark.asyncio
    async def test_an_expired_lease_no_longer_blocks(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        assert isinstance(await self.acquire(backend, Slot("job", SLOT)), Lease)
        await self.expire(clock)
        assert isinstance(await self.acquire(backend, Slot("job", SLOT + 1000)), Lease)

    @pytest.mark.asyncio
    async def test_renewal_keeps_the_lease_live(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        lease = await self.acquire(backend, Slot("job", SLOT))
        assert isinstance(lease, Lease)
        for _ in range(4):  # well past one ttl in all
            await self.elapse(clock, self.lease_ttl.total_seconds() / 3)
            assert await backend.renew(lease) is True
        assert await self.acquire(backend, Slot("job", SLOT + 1000)) == "overlap"

    @pytest.mark.asyncio
    async def test_renewing_an_expired_lease_fails(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        lease = await self.acquire(backend, Slot("job", SLOT))
        assert isinstance(lease, Lease)
        await self.expire(clock)
        assert await backend.renew(lease) is False

    @pytest.mark.asyncio
    async def test_racing_claimers_have_exactly_one_winner(self, fleet: Factory) -> None:
        backends = [await self.started(fleet) for _ in range(RACERS)]
        barrier = asyncio.Barrier(RACERS)
        policy = JobPolicy("race", overlap="allow")

        async def racer(index: int, slot: Slot) -> Lease | str:
            await barrier.wait()
            return await self.acquire(backends[index], slot, policy, instance=f"i{index}")

        for n in range(5):  # the first race also creates the job's row
            slot = Slot("race", SLOT + n * 1000)
            results = await asyncio.gather(*(racer(i, slot) for i in range(RACERS)))
            assert sum(isinstance(r, Lease) for r in results) == 1, results

    @pytest.mark.asyncio
    async def test_racing_claimers_of_different_slots_respect_overlap(self, fleet: Factory) -> None:
        backends = [await self.started(fleet) for _ in range(RACERS)]
        barrier = asyncio.Barrier(RACERS)

        async def racer(index: int) -> Lease | str:
            await barrier.wait()
            return await self.acquire(
                backends[index], Slot("skip", SLOT + index), instance=f"i{index}"
            )

        results = await asyncio.gather(*(racer(i) for i in range(RACERS)))
        assert sum(isinstance(r, Lease) for r in results) == 1, results

    @pytest.mark.asyncio
    async def test_dead_runner_is_taken_over_once_with_the_next_attempt(
        self, fleet: Factory, clock: Clock
    ) -> None:
        backends = [await self.started(fleet) for _ in range(RACERS)]
        policy = JobPolicy("job", max_attempts=3)
        lease = await self.acquire(backends[0], Slot("job", SLOT), policy)
        assert isinstance(lease, Lease)
        assert await backends[1].take_over([policy], instance_id="i1") == []  # still live
        await self.expire(clock)
        barrier = asyncio.Barrier(RACERS)

        async def taker(index: int) -> list[Lease]:
            await barrier.wait()
            return await backends[index].take_over([policy], instance_id=f"i{index}")

        taken = [
            lease for found in await asyncio.gather(*map(taker, range(RACERS))) for lease in found
        ]
        assert len(taken) == 1, taken
        (retry,) = taken
        assert (retry.slot_ms, retry.attempt, retry.reason) == (SLOT, 2, "retry")
        assert retry.token != lease.token
        assert await backends[0].renew(lease) is False  # the dead runner's token is stale
        await backends[0].release(lease)  # ... and its release touches nothing
        assert await backends[1].renew(retry) is True
        history = await backends[1].history(policy, 10)
        assert [(r.outcome, r.attempt, r.error) for r in history] == [
            ("interrupted", 1, "runner lost its lease")
        ]

    @pytest.mark.asyncio
    async def test_attempts_run_out(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        policy = JobPolicy("job", max_attempts=2)
        assert isinstance(await self.acquire(backend, Slot("job", SLOT), policy), Lease)
        await self.expire(clock)
        (retry,) = await backend.take_over([policy], instance_id="i2")
        assert retry.attempt == 2
        await self.expire(clock)
        assert await backend.take_over([policy], instance_id="i3") == []
        await self.expire(clock)
        assert await backend.take_over([policy], instance_id="i3") == []
        records = await backend.history(policy, 10)
        assert [(r.outcome, r.attempt) for r in records] == [("interrupted", 2), ("interrupted", 1)]
        assert "max_attempts (2) reached" in (records[0].error or "")  # why it stopped there

    @pytest.mark.asyncio
    async def test_max_attempts_one_never_restarts(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        policy = JobPolicy("job", max_attempts=1)
        assert isinstance(await self.acquire(backend, Slot("job", SLOT), policy), Lease)
        await self.expire(clock)
        assert await backend.take_over([policy], instance_id="i2") == []
        assert [r.outcome for r in await backend.history(policy, 10)] == ["interrupted"]

    @pytest.mark.asyncio
    async def test_handover_is_taken_at_once_without_an_attempt(self, fleet: Factory) -> None:
        one, two = await self.started(fleet), await self.started(fleet)
        policy = JobPolicy("job", max_attempts=1)
        lease = await self.acquire(one, Slot("job", SLOT), policy)
        assert isinstance(lease, Lease)
        await one.release(lease, handover=True)
        (taken,) = await two.take_over([policy], instance_id="i2")
        assert (taken.slot_ms, taken.attempt, taken.reason) == (SLOT, 1, "retry")
        assert await two.take_over([policy], instance_id="i3") == []
        assert await one.history(policy, 10) == []  # a hand-over is not a dead attempt

    @pytest.mark.asyncio
    async def test_leases_released_together_end_as_released_one_by_one(
        self, fleet: Factory, clock: Clock
    ) -> None:
        one, two = await self.started(fleet), await self.started(fleet)
        leases = [await self.acquire(one, Slot(job, SLOT)) for job in ("r.c", "r.a", "r.b")]
        assert all(isinstance(lease, Lease) for lease in leases)
        kept = await self.acquire(one, Slot("r.kept", SLOT))
        assert isinstance(kept, Lease)
        stale = replace(kept, token="not-this-lease")
        answers = await one.release_many([*cast(list[Lease], leases), stale])
        assert answers == [None, None, None, None]
        newer = [await self.acquire(two, Slot(job, SLOT + 1000)) for job in ("r.a", "r.b")]
        assert all(isinstance(lease, Lease) for lease in newer)  # ended: granted at once
        assert await self.acquire(two, Slot("r.kept", SLOT + 1000), instance="i2") == "overlap"
        assert await two.release_many(cast(list[Lease], newer)) == [None, None]
        await self.expire(clock)
        (taken,) = await two.take_over([JobPolicy("r.kept"), JobPolicy("r.a")], instance_id="i3")
        assert taken.job == "r.kept"  # the released slots were not a dead runner's

    @pytest.mark.asyncio
    async def test_the_lease_state_shows_fences_and_the_slots_that_hold_a_lease(
        self, fleet: Factory, clock: Clock
    ) -> None:
        one, two = await self.started(fleet), await self.started(fleet)
        policy = JobPolicy("job", overlap="allow", max_attempts=1)
        assert await two.lease_state("job") == LeaseState()  # never claimed
        first = await self.acquire(one, Slot("job", SLOT), policy)
        second = await self.acquire(one, Slot("job", SLOT + 1000), policy)
        manual = await self.acquire(one, Slot("job", SLOT + 500), policy, reason="manual")
        assert isinstance(first, Lease) and isinstance(second, Lease)
        assert isinstance(manual, Lease)
        leased = frozenset({SLOT, SLOT + 500, SLOT + 1000})
        assert await two.lease_state("job") == LeaseState(SLOT + 1000, SLOT + 500, leased)
        await one.release(manual)
        await one.release(second, handover=True)  # handed over: still held until taken
        assert (await two.lease_state("job")).leased == {SLOT, SLOT + 1000}
        await self.expire(clock)  # expired, not yet taken over: still the slot's
        assert (await two.lease_state("job")).leased == {SLOT, SLOT + 1000}
        await two.take_over([policy], instance_id="i2")  # ends the first, restarts the second
        state = await two.lease_state("job")
        assert state == LeaseState(SLOT + 1000, SLOT + 500, frozenset({SLOT + 1000}))
        assert await two.lease_state("other") == LeaseState()

    @pytest.mark.asyncio
    async def test_the_lease_state_carries_the_stores_clock(
        self, fleet: Factory, clock: Clock
    ) -> None:
        """A backfill judges a slot's age on it: the clock claims are judged on, not the
        instance's (here they agree, within a few seconds)."""
        backend = await self.started(fleet)
        for job in ("never-claimed", "job"):
            if job == "job":
                assert isinstance(await self.acquire(backend, Slot(job, SLOT)), Lease)
            store_ms = (await backend.lease_state(job)).now_ms
            assert store_ms is not None and abs(store_ms - clock.now_ms()) < 5000, store_ms

    @pytest.mark.asyncio
    async def test_a_release_writes_its_runs_record_once_and_only_if_it_ends_the_lease(
        self, fleet: Factory, clock: Clock
    ) -> None:
        """A slot holds its lease or has its record, never neither: the record comes with
        the release, a release tried again writes it no second time, and a stale one (the
        slot taken over) writes none."""
        one, two = await self.started(fleet), await self.started(fleet)
        policies = [JobPolicy(job, max_attempts=2) for job in ("single", "batch", "stale")]
        single, batch, stale = [await self.acquire(one, Slot(p.name, SLOT)) for p in policies]
        assert isinstance(single, Lease) and isinstance(batch, Lease)
        assert isinstance(stale, Lease)

        def ended(lease: Lease) -> RunRecord:
            result = {"job": lease.job, "rows": [1, 2]}
            return replace(make_record(lease.job, SLOT), run_id=lease.run_id, result=result)

        def written(records: list[RunRecord]) -> list[tuple[str, Any]]:
            return [(r.run_id, r.result) for r in records]

        await one.release(single, record=(policies[0], ended(single)))
        await one.release(single, record=(policies[0], ended(single)))  # its answer was lost
        assert written(await two.history(policies[0], 10)) == [
            (single.run_id, {"job": "single", "rows": [1, 2]})
        ]
        assert (await two.lease_state("single")).leased == frozenset()
        answers = await one.release_many([batch], [(policies[1], ended(batch))])
        assert answers == [None]
        assert written(await two.history(policies[1], 10)) == [
            (batch.run_id, {"job": "batch", "rows": [1, 2]})
        ]
        await self.expire(clock)
        (retry,) = await two.take_over([policies[2]], instance_id="i2")
        await one.release(stale, record=(policies[2], ended(stale)))  # too late: taken over
        records = await two.history(policies[2], 10)
        assert [(r.run_id, r.outcome) for r in records] == [(stale.run_id, "interrupted")]
        assert (await two.lease_state("stale")).leased == frozenset({retry.slot_ms})

    @pytest.mark.asyncio
    async def test_released_slots_are_not_taken_over(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        lease = await self.acquire(backend, Slot("job", SLOT))
        assert isinstance(lease, Lease)
        await backend.release(lease)
        await self.expire(clock)
        assert await backend.take_over([JobPolicy("job")], instance_id="i2") == []

    @pytest.mark.asyncio
    async def test_a_lease_released_after_it_expired_ends_its_run_unless_taken_over(
        self, fleet: Factory, clock: Clock
    ) -> None:
        """A runner cut off from the store as its run ended releases late. While nobody has
        taken the slot over (its token still holds it) the release still ends the run, alone
        or in a batch, or hands it over: no sweep then restarts a run that has ended."""
        one, two = await self.started(fleet), await self.started(fleet)
        policies = [JobPolicy(job, max_attempts=3) for job in ("single", "batch", "handed")]
        single, batch, handed = [await self.acquire(one, Slot(p.name, SLOT)) for p in policies]
        assert isinstance(single, Lease) and isinstance(batch, Lease)
        assert isinstance(handed, Lease)
        await self.expire(clock)
        await one.release(single)
        assert await one.release_many([batch]) == [None]
        await one.release(handed, handover=True)
        (taken,) = await two.take_over(policies, instance_id="i2")
        assert (taken.job, taken.attempt) == ("handed", 1)  # a hand-over: no attempt counted
        for policy in policies:
            assert await two.history(policy, 10) == []  # no attempt was lost

    @pytest.mark.asyncio
    async def test_only_the_latest_slot_is_retried(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        allow = JobPolicy("job", overlap="allow")
        assert isinstance(await self.acquire(backend, Slot("job", SLOT), allow), Lease)
        newer = await self.acquire(backend, Slot("job", SLOT + 1000), allow)
        assert isinstance(newer, Lease)
        await backend.release(newer)
        await self.expire(clock)
        assert await backend.take_over([allow], instance_id="i2") == []
        assert [r.slot_ms for r in await backend.history(allow, 10)] == [SLOT]

    @pytest.mark.asyncio
    async def test_take_over_is_limited_to_the_given_jobs(
        self, fleet: Factory, clock: Clock
    ) -> None:
        backend = await self.started(fleet)
        assert isinstance(await self.acquire(backend, Slot("mine", SLOT)), Lease)
        assert isinstance(await self.acquire(backend, Slot("theirs", SLOT)), Lease)
        await self.expire(clock)
        taken = await backend.take_over([JobPolicy("mine")], instance_id="i2")
        assert [lease.job for lease in taken] == ["mine"]

    @pytest.mark.asyncio
    async def test_catch_up_only_for_jobs_claimed_before(self, fleet: Factory) -> None:
        backend = await self.started(fleet)
        policy = JobPolicy("job", overlap="allow")
        fresh = await self.acquire(backend, Slot("job", SLOT), policy, reason="catch-up")
        assert fresh == "not-acquired"
        assert isinstance(await self.acquire(backend, Slot("job", SLOT), policy), Lease)
        late = await self.acquire(backend, Slot("job", SLOT + 5000), policy, reason="catch-up")
        assert isinstance(late, Lease) and late.reason == "catch-up"
        again = await self.acquire(backend, Slot("job", SLOT + 5000), policy, reason="catch-up")
        assert again == "not-acquired"

    @pytest.mark.asyncio
    async def test_a_slot_far_ahead_of_the_backends_clock_is_refused(
        self, fleet: Factory, clock: Clock
    ) -> None:
        """An instance whose clock is 2 minutes fast must not fence the job for the fleet:
        the claim fails (closed) and the slot that falls due now is still granted."""
        backend = await self.started(fleet)
        now = clock.now_ms()
        for reason in ("schedule", "manual"):
            with pytest.raises(BackendError, match="max_clock_skew"):
                await self.acquire(backend, Slot("job", now + 120_000), reason=reason)
        assert isinstance(await self.acquire(backend, Slot("job", now)), Lease)

    @pytest.mark.asyncio
    async def test_manual_runs_do_not_fence_scheduled_slots(
        self, fleet: Factory, clock: Clock
    ) -> None:
        one, two = await self.started(fleet), await self.started(fleet)
        now = clock.now_ms()
        manual = await self.acquire(one, Slot("job", now), reason="manual")
        assert isinstance(manual, Lease) and manual.reason == "manual"
        await one.release(manual)
        assert await self.acquire(two, Slot("job", now), reason="manual") == "not-acquired"
        earlier = await self.acquire(two, Slot("job", now - 1000), instance="i2")
        assert isinstance(earlier, Lease)  # a scheduled slot still inside its jitter window
        assert await self.acquire(one, Slot("job", now - 1000)) == "not-acquired"

    @pytest.mark.asyncio
    async def test_history_ttl_drops_old_runs(self, fleet: Factory, clock: Clock) -> None:
        backend = await self.started(fleet)
        policy = JobPolicy("aged", history_ttl=timedelta(hours=1))
        old = make_record("aged", SLOT, 1, now=clock.now(), age=timedelta(hours=2))
        await backend.record(policy, old)
        await backend.record(policy, make_record("aged", SLOT + 1, 2, now=clock.now()))
        assert [r.run_id for r in await backend.history(policy, 10)] == ["run-2"]

    async def _states(self, backend: LeaseBackend, prefix: str, now: int) -> list[Claim]:
        """Jobs in each state a claim can meet (named ``prefix`` + state), and a claim of each."""
        skip, allow = JobPolicy(prefix + "busy"), JobPolicy(prefix + "allow", overlap="allow")
        fenced = await self.acquire(backend, Slot(prefix + "fenced", SLOT + 1000))
        assert isinstance(fenced, Lease)
        await backend.release(fenced)  # its run is over: only the fence refuses older slots
        assert isinstance(await self.acquire(backend, Slot(skip.name, SLOT), skip), Lease)
        assert isinstance(await self.acquire(backend, Slot(allow.name, SLOT), allow), Lease)
        assert isinstance(
            await self.acquire(backend, Slot(prefix + "manual", now), reason="manual"), Lease
        )
        wanted = [
            (Slot(prefix + "fresh", SLOT), JobPolicy(prefix + "fresh")),
            (Slot(prefix + "fenced", SLOT), JobPolicy(prefix + "fenced")),
            (Slot(skip.name, SLOT + 1000), skip),
            (Slot(allow.name, SLOT + 1000), allow),
            (Slot(prefix + "ahead", now + 120_000), JobPolicy(prefix + "ahead")),
            (Slot(prefix + "manual", now), JobPolicy(prefix + "manual")),
            (Slot(prefix + "later", SLOT + 5000), JobPolicy(prefix + "later")),
        ]
        return [Claim(slot, f"run-{n}", policy) for n, (slot, policy) in enumerate(wanted)]

    @pytest.mark.asyncio
    async def test_a_batch_has_the_outcomes_of_single_claims(
        self, fleet: Factory, clock: Clock
    ) -> None:
        """Fresh, fenced, overlapping, overlap-allowed, too far ahead, taken by a manual run:
        each claim of a batch is answered as a claim of its own is, and the one that fails
        (a slot too far ahead) fails alone."""
        backend = await self.started(fleet)
        now = clock.now_ms()
        singles = await self._states(backend, "s.", now)
        batched = await self._states(backend, "b.", now)
        alone: list[Any] = []
        for claim in singles:
            try:
                alone.append(await self.acquire(backend, claim.slot, claim.policy))
            except BackendError as exc:
                alone.append(exc)
        together = await backend.acquire_many(batched, instance_id="i1", timeout=5.0)

        def kind(outcome: object) -> str:
            if isinstance(outcome, Lease):
                return "lease"
            return type(outcome).__name__ if isinstance(outcome, Exception) else str(outcome)

        assert [kind(o) for o in together] == [kind(o) for o in alone]
        assert [kind(o) for o in alone][:4] == ["lease", "not-acquired", "overlap", "lease"]
        assert isinstance(together[4], BackendError) and "max_clock_skew" in str(together[4])
        for claim, outcome in zip(batched, together, strict=True):
            if isinstance(outcome, Lease):
                assert (outcome.job, outcome.slot_ms, outcome.run_id, outcome.attempt) == (
                    claim.slot.job,
                    claim.slot.slot_ms,
                    claim.run_id,
                    1,
                )
                assert await backend.renew(outcome)
        again = await backend.acquire_many(batched, instance_id="i2", timeout=5.0)
        assert not any(isinstance(o, Lease) for o in again), again

    @pytest.mark.asyncio
    async def test_batches_racing_single_claims_have_one_winner_per_slot(
        self, fleet: Factory
    ) -> None:
        backends = [await self.started(fleet) for _ in range(RACERS)]
        # More jobs than a backend may decide in one statement (see BATCH_CHUNK of SQL ones).
        policies = [JobPolicy(f"batch.{n}", overlap="allow") for n in range(20)]

        async def racer(index: int, barrier: asyncio.Barrier, slot_ms: int) -> list[bool]:
            backend = backends[index]
            claims = [Claim(Slot(p.name, slot_ms), f"r{index}", p) for p in policies]
            await barrier.wait()
            if index % 2:  # every other instance claims one slot at a time
                single = [await self.acquire(backend, c.slot, c.policy) for c in claims]
                return [isinstance(o, Lease) for o in single]
            outcomes = await backend.acquire_many(claims, instance_id=f"i{index}", timeout=5.0)
            assert not any(isinstance(o, Exception) for o in outcomes), outcomes
            return [isinstance(o, Lease) for o in outcomes]

        for round_ in range(3):  # the first race also creates the jobs' rows
            barrier = asyncio.Barrier(RACERS)
            slot_ms = SLOT + round_ * 1000
            results = await asyncio.gather(*(racer(i, barrier, slot_ms) for i in range(RACERS)))
            for column, policy in enumerate(policies):
                winners = [row[column] for row in results].count(True)
                assert winners == 1, f"{policy.name}:{slot_ms}: {winners} winners"

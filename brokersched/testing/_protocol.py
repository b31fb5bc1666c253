"""The lease protocol checked against a backend: random programs of claims, renewals, releases,
hand-overs, take-overs and store-clock moves (forward, and back), each run on the backend and
on the pure model (``brokersched.backends._lease.decide``), their answers compared step by step.

Hypothesis draws the programs and shrinks a failing one to the shortest that still fails; the
failure names the step and both answers. A backend's suite drives its store's clock through
``set_store_time`` (virtual time: no waiting); a suite that cannot is skipped, saying so.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, get_args

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .._exceptions import ClockSkewError
from ..abc import Claim, JobPolicy, Lease, LeaseBackend, Overlap, RunReason, RunRecord, Slot
from ..backends._lease import (
    Acquire,
    JobRow,
    Release,
    Renew,
    Store,
    TakenOver,
    TakeOver,
    TooFarAhead,
    decide,
)
from ._clock import TestClock

__all__ = ["LeaseProtocolCheck"]

JOBS = ("a", "b")
START = "2027-03-01T12:00:00+00:00"
TTL_MS = 1000
SKEW_MS = 500
STEP_MS = 250  # slots are on a grid of this step, drawn around the store's clock
REASONS: tuple[RunReason, ...] = ("schedule", "schedule", "manual", "catch-up")
WINDOWS = (None, timedelta(seconds=1), timedelta(seconds=3))

# One step of a program: a tuple whose first item names it (see ``_Run.step``).
_via = st.integers(0, 1)
_job = st.sampled_from((0, 0, 0, 1))
_slot = st.integers(-12, 3)  # grid steps from now: mostly due, some ahead of the clock
_lease = st.integers(0, 1000)  # an index into the leases granted so far (modulo their number)
_advance = st.sampled_from((50, 300, 700, 1100, 1600, 2600))
_overlap = st.sampled_from(get_args(Overlap))
_acquire = st.tuples(st.just("acquire"), _via, _job, _slot, st.sampled_from(REASONS), _overlap)
_take_over = st.tuples(
    st.just("take-over"), _via, st.integers(1, 3), _overlap, st.sampled_from(WINDOWS)
)
STEPS = st.one_of(
    st.tuples(st.just("advance"), _advance),
    st.tuples(st.just("step-back"), st.integers(1, 2 * SKEW_MS)),
    _acquire,
    _acquire,
    st.tuples(st.just("acquire-many"), _via, st.lists(_slot, min_size=2, max_size=2)),
    st.tuples(st.just("renew"), _lease),
    st.tuples(st.just("release"), _lease, st.booleans()),
    st.tuples(st.just("release-many"), st.lists(_lease, min_size=2, max_size=3)),
    _take_over,
    _take_over,
)
PROGRAMS = st.lists(STEPS, min_size=1, max_size=30)

#: Programs every backend is checked on before the random ones: the seams found so far.
SEAMS = (
    # A manual run granted while a dead runner's slot waits for its
    # take-over; the take-over must not restart the slot beside it (overlap="skip").
    [("acquire", 0, 0, 0, "schedule", "skip"), ("advance", 1600),
     ("acquire", 1, 0, 0, "manual", "skip"), ("take-over", 0, 3, "skip", None)],
    # A release that lands after the lease expired, before anyone took the slot over.
    [("acquire", 0, 0, 0, "schedule", "skip"), ("advance", 1600), ("release", 0, False),
     ("take-over", 1, 3, "skip", None)],
)  # fmt: skip


@dataclass
class _Model:
    """The pure protocol's view of the store: a row per job and the history it wrote."""

    now_ms: int
    rows: dict[str, JobRow] = field(default_factory=dict)
    history: dict[str, list[RunRecord]] = field(default_factory=dict)

    def store(self) -> Store:
        return Store(self.now_ms, TTL_MS, SKEW_MS)

    def apply(self, job: str, request: Any) -> Any:
        row, answer = decide(job, self.rows.get(job, JobRow()), request, self.store())
        self.rows[job] = row
        return answer


def _shape(answer: object) -> object:
    """What must agree between the backend and the model (tokens and run ids are the
    backend's own)."""
    if isinstance(answer, Lease):
        return ("lease", answer.job, answer.slot_ms, answer.attempt, answer.reason)
    if isinstance(answer, ClockSkewError | TooFarAhead):
        return "clock-skew"
    return answer


def _record(record: RunRecord) -> tuple[object, ...]:
    return (record.slot_ms, record.run_id, record.reason, record.attempt, record.outcome,
            record.error)  # fmt: skip


class _Run:
    """One program on a pair of backend objects (two instances of a fleet) and the model."""

    def __init__(self, check: LeaseProtocolCheck, backends: Sequence[LeaseBackend]) -> None:
        self.check = check
        self.backends = backends
        self.clock = TestClock(START)
        self.model = _Model(self.clock.now_ms())
        self.leases: list[Lease] = []
        self.log: list[str] = []

    def slot(self, k: int) -> int:
        return self.model.now_ms - self.model.now_ms % STEP_MS + k * STEP_MS

    def lease(self, index: int) -> Lease | None:
        return self.leases[index % len(self.leases)] if self.leases else None

    def agree(self, what: str, real: object, model: object) -> None:
        self.log.append(f"{what} -> {real!r}")
        if _shape(real) != _shape(model):
            steps = "\n  ".join(self.log)
            raise AssertionError(
                f"the backend and the protocol disagree at the last step:\n  {steps}\n"
                f"backend: {_shape(real)!r}\nprotocol: {_shape(model)!r}"
            )

    async def step(self, step: tuple[Any, ...]) -> None:
        kind = step[0]
        if kind == "advance":
            self.model.now_ms += step[1]
            self.log.append(f"store clock +{step[1]}ms")
            await self.check.set_store_time(self.backends, self.model.now_ms)
        elif kind == "step-back":
            self.model.now_ms -= step[1]
            self.log.append(f"store clock -{step[1]}ms")
            await self.check.set_store_time(self.backends, self.model.now_ms)
        elif kind == "acquire":
            _, via, job, k, reason, overlap = step
            policy = JobPolicy(JOBS[job], overlap=overlap)
            await self.acquire(via, [Claim(Slot(JOBS[job], self.slot(k)), "", policy, reason)])
        elif kind == "acquire-many":
            _, via, ks = step
            pairs = zip(JOBS, ks, strict=True)
            claims = [Claim(Slot(job, self.slot(k)), "", JobPolicy(job)) for job, k in pairs]
            await self.acquire(via, claims)
        elif kind == "renew":
            await self.renew(step[1])
        elif kind == "release":
            await self.release([step[1]], handover=step[2])
        elif kind == "release-many":
            await self.release(step[1], handover=False)
        else:
            _, via, attempts, overlap, window = step
            policies = [
                JobPolicy(job, overlap=overlap, max_attempts=attempts, retry_window=window)
                for job in JOBS
            ]  # fmt: skip
            await self.take_over(via, policies)

    async def acquire(self, via: int, claims: list[Claim]) -> None:
        backend = self.backends[via]
        claims = [Claim(c.slot, secrets.token_hex(8), c.policy, c.reason) for c in claims]
        answers: list[object]
        if len(claims) == 1:
            claim = claims[0]
            try:
                answers = [
                    await backend.acquire(
                        claim.slot,
                        policy=claim.policy,
                        instance_id=f"i{via}",
                        run_id=claim.run_id,
                        reason=claim.reason,
                        timeout=5.0,
                    )
                ]
            except ClockSkewError as exc:
                answers = [exc]
        else:
            answers = list(await backend.acquire_many(claims, instance_id=f"i{via}", timeout=5.0))
        for claim, real in zip(claims, answers, strict=True):
            token = real.token if isinstance(real, Lease) else "-"
            request = Acquire(
                claim.slot.slot_ms, claim.reason, claim.policy.overlap, token, claim.run_id,
                f"i{via}", self.clock.now_ms(),
            )  # fmt: skip
            model = self.model.apply(claim.slot.job, request)
            what = f"i{via} acquire {claim.slot.key} {claim.reason} {claim.policy.overlap}"
            self.agree(what, real, model)
            if isinstance(real, Lease):
                self.leases.append(real)

    async def renew(self, index: int) -> None:
        lease = self.lease(index)
        if lease is not None:
            real = await self.backends[0].renew(lease)
            model = self.model.apply(lease.job, Renew(lease.slot_ms, lease.token))
            self.agree(f"renew {lease.slot.key} attempt {lease.attempt}", real, model)

    async def release(self, indexes: list[int], *, handover: bool) -> None:
        chosen: dict[Slot, Lease] = {}
        for index in indexes:
            lease = self.lease(index)
            if lease is not None:
                chosen.setdefault(lease.slot, lease)
        leases = list(chosen.values())
        if not leases:
            return
        backend = self.backends[1]
        if len(leases) == 1:
            await backend.release(leases[0], handover=handover)
        else:
            errors = await backend.release_many(leases)
            assert errors == [None] * len(leases), errors
        for lease in leases:
            self.model.apply(lease.job, Release(lease.slot_ms, lease.token, handover))
            self.log.append(f"release {lease.slot.key} handover={handover}")

    async def take_over(self, via: int, policies: list[JobPolicy]) -> None:
        real = await self.backends[via].take_over(policies, instance_id=f"i{via}")
        by_slot = {lease.slot: lease for lease in real}
        answers: list[object] = []
        for policy in policies:

            def fresh(slot_ms: int, job: str = policy.name) -> tuple[str, str]:
                lease = by_slot.get(Slot(job, slot_ms))
                return (lease.token, lease.run_id) if lease else ("-", "-")

            request = TakeOver(policy, f"i{via}", self.clock.now_ms(), fresh)
            taken = self.model.apply(policy.name, request)
            assert isinstance(taken, TakenOver)
            answers.extend(taken.leases)
            self.model.history.setdefault(policy.name, []).extend(taken.records)
        what = f"i{via} take-over {[(p.overlap, p.max_attempts, p.retry_window) for p in policies]}"
        self.agree(what, sorted(map(_shape, real)), sorted(map(_shape, answers)))  # type: ignore[type-var]
        self.leases.extend(real)
        for policy in policies:
            records = await self.backends[via].history(policy, 1000)
            kept = self.model.history.get(policy.name, [])
            self.agree(
                f"history of {policy.name}",
                sorted(map(_record, records)),
                sorted(map(_record, kept)),
            )


F = TypeVar("F", bound=Callable[..., Any])


def _with_examples(programs: Sequence[list[tuple[Any, ...]]]) -> Callable[[F], F]:
    """Hypothesis's ``@example`` for each program, checked before the random ones."""

    def decorate(test: F) -> F:
        for program in reversed(programs):
            test = example(program=program)(test)
        return test

    return decorate


class LeaseProtocolCheck:
    """Mixed into ``LeaseBackendSuite``: the backend implements the pure lease protocol."""

    def make_backend(self, namespace: str, **options: Any) -> Any:
        raise NotImplementedError

    async def set_store_time(self, backends: Sequence[Any], now_ms: int) -> None:
        """Make the backends' store judge time as if its clock read ``now_ms`` (virtual), for
        the protocol check. A suite that cannot drive its store's clock leaves this out, and
        the check is skipped."""
        raise NotImplementedError

    @pytest.mark.asyncio
    @settings(
        max_examples=100,
        deadline=None,
        # One test, run by each backend's suite (differing executors): a program that failed
        # one backend is replayed on the others, which is as intended.
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.differing_executors,
        ],
    )
    @given(program=PROGRAMS)
    @_with_examples(SEAMS)
    async def test_the_lease_protocol_holds_for_random_programs(
        self, program: list[tuple[Any, ...]]
    ) -> None:
        namespace = "p" + secrets.token_hex(5)
        options = {"lease_ttl": timedelta(milliseconds=TTL_MS),
                   "max_clock_skew": timedelta(milliseconds=SKEW_MS)}  # fmt: skip
        backends = [self.make_backend(namespace, **options) for _ in range(2)]
        run = _Run(self, backends)
        for backend in backends:
            await backend.start(run.clock)
        try:
            try:
                await self.set_store_time(backends, run.model.now_ms)
            except NotImplementedError:
                pytest.skip(f"{type(self).__name__} does not drive its store's clock")
            for step in program:
                await run.step(step)
        finally:
            for backend in backends:
                await backend.stop()

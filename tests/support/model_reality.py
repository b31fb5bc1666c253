"""The fleet simulator's models of the stores against the real servers: one seeded scenario (a
fixed list of backend calls drawn from ``random.Random(seed)`` before either run), run once on
the real server and once on the model (``brokersched.testing._sim_lease`` and its neighbours),
and what each answered compared call by call, then what each kept at the end (the slots won,
the history, the fleet's records). A model that drifts from its server fails here, at the
first call where they disagree.

Time is virtual on both sides: the instances' clocks are a ``TestClock`` (real) or the
simulator's ``FleetClock`` (model), moved together; the store's clock is driven the way the
conformance suites drive it (``set_store_time``) where the backend judges on it. What the
server times by itself (a claim key's ``PX``, a duplicate window, a queue's ``x-expires``) is
left to real time, and the scenarios never come near it: their slot memories are minutes, and
a scenario spans less than a minute of virtual time and seconds of real time.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from brokersched._clock import Clock, ms_to_datetime
from brokersched._fleetrecords import ControlChange, Instance
from brokersched.abc import (
    Backend,
    Claim,
    ClaimBackend,
    JobPolicy,
    Lease,
    LeaseBackend,
    RunRecord,
    Slot,
)
from brokersched.testing import TestClock
from brokersched.testing._clock import FleetClock
from brokersched.testing._sim_store import Store

START = "2030-06-01T12:00:00+00:00"
SEEDS = (1, 2, 3)  # a few seeds in CI: each scenario takes about a second
JOBS = ("tick", "cron", "report.daily:$eu")
HISTORY_SIZES = {"tick": 3, "cron": 5, "report.daily:$eu": 2}
STEP_MS = 1000  # slots are on a grid of this step

Step = tuple[Any, ...]


class Clocks(Protocol):
    """The instances' clocks of one side, and the store's, moved together."""

    def instance(self) -> Clock: ...

    async def advance(self, ms: int) -> None: ...

    def now_ms(self) -> int: ...


class RealClocks:
    """The real side: every instance on one ``TestClock``; ``on_advance`` moves the store's
    clock after it (``set_store_time``)."""

    def __init__(self, on_advance: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.clock = TestClock(START)
        self.on_advance = on_advance

    def instance(self) -> Clock:
        return self.clock

    async def advance(self, ms: int) -> None:
        await self.clock.advance(timedelta(milliseconds=ms))
        if self.on_advance is not None:
            await self.on_advance(self.clock.now_ms())

    def now_ms(self) -> int:
        return self.clock.now_ms()


class ModelClocks:
    """The model's side: the simulator's ``FleetClock`` and a ``Store`` without faults on it."""

    def __init__(self) -> None:
        self.fleet = FleetClock(START)
        self.store = Store(self.fleet, self.fleet.instance(), random.Random(0))

    def instance(self) -> Clock:
        return self.fleet.instance()

    async def advance(self, ms: int) -> None:
        await self.fleet.advance(timedelta(milliseconds=ms))

    def now_ms(self) -> int:
        return self.fleet.now_ms()


# -- what each side answered ---------------------------------------------------------------------


def shape(answer: object) -> object:
    """What must agree between the server and the model: tokens, run ids and the words of
    errors are each side's own; the error's kind is not."""
    if isinstance(answer, Lease):
        return ("lease", answer.job, answer.slot_ms, answer.attempt, answer.reason)
    if isinstance(answer, BaseException):
        text = str(answer)
        if "too late" in text:
            return "error: too late to claim"
        return f"error: {type(answer).__name__}"
    if isinstance(answer, RunRecord):
        return (answer.job, answer.slot_ms, answer.run_id, answer.instance_id, answer.reason,
                answer.attempt, answer.outcome, answer.error)  # fmt: skip
    if isinstance(answer, Instance):
        return ("instance", answer.id, answer.jobs, answer.stopped)
    if isinstance(answer, list | tuple):
        return [shape(item) for item in answer]
    if isinstance(answer, dict):
        return {key: shape(value) for key, value in sorted(answer.items())}
    if hasattr(answer, "paused") and hasattr(answer, "disabled"):  # a JobControl
        return ("control", answer.paused, answer.disabled, len(answer.changes))  # type: ignore[attr-defined]
    return answer


@dataclass
class Transcript:
    """Each call and its answer's shape, in order."""

    steps: list[tuple[str, object]] = field(default_factory=list)

    def add(self, what: str, answer: object) -> None:
        self.steps.append((what, shape(answer)))


def assert_same(real: Transcript, model: Transcript, *, seed: int, server: str) -> None:
    """The first call where the model answered otherwise than the server fails the test,
    with the calls before it."""
    for n, (mine, theirs) in enumerate(zip(real.steps, model.steps, strict=False)):
        if mine != theirs:
            before = "\n  ".join(f"{what} -> {answer!r}" for what, answer in real.steps[:n][-12:])
            raise AssertionError(
                f"the model of {server} drifted from the server (seed {seed}, call {n}):\n"
                f"  ...\n  {before}\n"
                f"server: {mine[0]} -> {mine[1]!r}\n"
                f"model:  {theirs[0]} -> {theirs[1]!r}"
            )
    assert len(real.steps) == len(model.steps), (len(real.steps), len(model.steps))


async def answer(call: Awaitable[Any]) -> Any:
    """The call's answer, or the error it raised (an answer too)."""
    try:
        return await call
    except Exception as exc:
        return exc


# -- the scenarios ---------------------------------------------------------------------------------


def record_of(job: str, slot_ms: int, n: int, instance: str, now_ms: int) -> RunRecord:
    started = ms_to_datetime(now_ms)
    return RunRecord(
        job=job, slot_ms=slot_ms, run_id=f"run-{n}", instance_id=instance, reason="schedule",
        attempt=1, started_at=started, finished_at=started + timedelta(milliseconds=5),
        outcome="completed" if n % 3 else "failed", error=None if n % 3 else "boom",
    )  # fmt: skip


def instance_of(name: str, now_ms: int, jobs: int) -> Instance:
    now = ms_to_datetime(now_ms)
    return Instance(name, "host", 4242, "1.0", now, now, timedelta(seconds=5), jobs=jobs)


def policy(job: str, **options: Any) -> JobPolicy:
    return JobPolicy(job, history_size=HISTORY_SIZES[job], **options)


def _fleet_steps(rng: random.Random, via: int) -> Step:
    roll = rng.random()
    if roll < 0.3:
        return ("presence", via, rng.randint(0, 4))
    if roll < 0.5:
        return ("instances", via)
    if roll < 0.8:
        action = rng.choice(("pause", "resume", "disable", "enable"))
        return ("control", via, rng.choice(JOBS), action)
    return ("controls", via)


def claim_program(
    seed: int, instances: int, memories: Sequence[int], *, forget: bool = False
) -> list[Step]:
    """Claims (single, batched, boot windows, some too late to claim safely), records,
    history reads, the fleet's records, restarts with another ``slot_ttl`` (raising the fleet's
    memory), the fleet's slot memory record deleted by hand (``forget``: the way to lower
    it) and time passing: at most ``memories[0] / 4`` of it in all."""
    rng = random.Random(seed)
    steps: list[Step] = []
    passed, budget = 0, memories[0] // 4
    late = memories[0] // STEP_MS  # a slot this many steps old is near its claim deadline
    for _ in range(60):
        via = rng.randrange(instances)
        roll = rng.random()
        if roll < 0.3:
            k = rng.choice((0, 0, 1, 2, 3, -1, late - 3, late - 1, late, late + 2))
            steps.append(("claim", via, rng.choice(JOBS), k))
        elif roll < 0.42:
            # distinct slots, as a scheduler's batch of one instant has them
            ks = {(rng.choice(JOBS), rng.choice((0, 1, 2, late))) for _ in range(3)}
            steps.append(("claim-many", via, sorted(ks)))
        elif roll < 0.47:
            steps.append(("boot", via, rng.choice(JOBS), rng.choice((0, 1))))
        elif roll < 0.6 and passed < budget:
            ms = min(rng.choice((250, 700, 1500, 3000)), budget - passed)
            passed += ms
            steps.append(("advance", ms))
        elif roll < 0.72:
            steps.append(("record", via, rng.choice(JOBS), rng.choice((0, 1, 2))))
        elif roll < 0.8:
            steps.append(("history", via, rng.choice(JOBS), rng.choice((1, 2, 10))))
        elif roll < 0.92:
            steps.append(_fleet_steps(rng, via))
        elif roll < 0.96 and forget:
            steps.append(("forget", via))
        else:
            steps.append(("restart", via, rng.choice(memories)))
    return steps


@dataclass
class Side:
    """One side of a comparison: how its backends are made and its clocks."""

    clocks: Clocks
    make: Callable[[int], Backend]  # a backend of the fleet with this slot memory (ms)
    forget: Callable[[], Awaitable[None]] | None = None  # delete the fleet's memory record
    started: Callable[[], Awaitable[None]] | None = None  # after each start (the store's clock)
    backends: list[Backend] = field(default_factory=list)

    async def start(self, memory_ms: int) -> Backend:
        backend = self.make(memory_ms)
        await backend.start(self.clocks.instance())
        await backend.prepare([policy(job) for job in JOBS])  # as a scheduler's start does
        self.backends.append(backend)
        if self.started is not None:
            await self.started()
        return backend

    async def stop(self) -> None:
        for backend in self.backends:
            await backend.stop()


async def run_claims(side: Side, program: list[Step], memories: Sequence[int]) -> Transcript:
    """``program`` on the claim backends of ``side`` (one per instance, the first with the
    first memory)."""
    out = Transcript()
    live: list[ClaimBackend] = []
    for n in range(len(memories)):
        backend = await side.start(memories[n])
        assert isinstance(backend, ClaimBackend)
        live.append(backend)
        out.add(f"start i{n} memory {memories[n]}", fleet_memory(backend))
    records = 0
    for step in program:
        kind, now = step[0], side.clocks.now_ms()
        grid = now - now % STEP_MS

        def slot(job: str, k: int, grid: int = grid) -> Slot:
            return Slot(job, grid - k * STEP_MS)

        if kind == "advance":
            await side.clocks.advance(step[1])
            out.add(f"advance {step[1]}ms", None)
            continue
        via = step[1]
        backend = live[via]
        name = f"i{via}"
        if kind == "claim":
            chosen = slot(step[2], step[3])
            won = await answer(backend.claim(chosen, instance_id=name, run_id="r", timeout=5.0))
            out.add(f"{name} claim {chosen.key}", won)
        elif kind == "claim-many":
            claims = [Claim(slot(job, k), "r", policy(job)) for job, k in step[2]]
            won = await answer(backend.claim_many(claims, instance_id=name, timeout=5.0))
            out.add(f"{name} claim {[c.slot.key for c in claims]}", won)
        elif kind == "boot":
            chosen = slot(step[2], step[3])
            won = await answer(
                backend.claim_boot(chosen, instance_id=name, run_id="r", timeout=5.0)
            )
            out.add(f"{name} boot claim {chosen.key}", won)
        elif kind == "record":
            records += 1
            record = record_of(step[2], slot(step[2], step[3]).slot_ms, records, name, now)
            out.add(f"{name} record {record.run_id}", await answer(
                backend.record(policy(step[2]), record)
            ))  # fmt: skip
        elif kind == "history":
            found = await answer(backend.history(policy(step[2]), step[3]))
            out.add(f"{name} history {step[2]} {step[3]}", found)
        elif kind == "forget":
            assert side.forget is not None
            await side.forget()
            out.add("the fleet's slot memory record deleted", None)
        elif kind == "restart":
            await backend.stop()
            fresh = await side.start(step[2])
            assert isinstance(fresh, ClaimBackend)
            live[via] = fresh
            out.add(f"restart {name} memory {step[2]}", fleet_memory(fresh))
        else:
            await fleet_step(backend, step, now, out)
    for job in JOBS:
        out.add(f"history of {job}", await answer(live[0].history(policy(job), 100)))
    out.add("controls", await answer(live[0].controls()))
    return out


def lease_program(seed: int, instances: int, ttl_ms: int) -> list[Step]:
    """Claims (schedule, manual, catch-up; overlap skip or allow; single and batched),
    renewals, releases with their records (one, several, hand-overs), take-overs, lease
    states, history reads, the fleet's records, and the store's clock moving past leases."""
    rng = random.Random(seed)
    steps: list[Step] = []
    reasons = ("schedule", "schedule", "schedule", "manual", "catch-up")
    for _ in range(70):
        via = rng.randrange(instances)
        roll = rng.random()
        lease = rng.randrange(1000)  # an index into the leases granted so far
        if roll < 0.25:
            k = rng.choice((0, 0, 1, 2, 3, -1, 12))  # k < 0: ahead; 12: beyond the skew
            reason, skip = rng.choice(reasons), rng.random() < 0.5
            steps.append(("acquire", via, rng.choice(JOBS), -k if k == 12 else k, reason, skip))
        elif roll < 0.33:
            steps.append(("acquire-many", via, [(job, rng.choice((0, 1, 2))) for job in JOBS]))
        elif roll < 0.43:
            steps.append(("renew", lease))
        elif roll < 0.55:
            steps.append(("release", lease, rng.random() < 0.25, rng.random() < 0.8))
        elif roll < 0.6:
            steps.append(("release-many", [lease, rng.randrange(1000)]))
        elif roll < 0.68:
            steps.append(("take-over", via, rng.choice((1, 2, 3)), rng.random() < 0.5))
        elif roll < 0.8:
            ms = rng.choice((300, 1500, ttl_ms // 3, ttl_ms + 1000))
            steps.append(("advance", ms))
        elif roll < 0.85:
            steps.append(("state", via, rng.choice(JOBS)))
        elif roll < 0.9:
            steps.append(("history", via, rng.choice(JOBS), rng.choice((1, 10))))
        else:
            steps.append(_fleet_steps(rng, via))
    return steps


async def run_leases(side: Side, program: list[Step], instances: int, ttl_ms: int) -> Transcript:
    """``program`` on ``instances`` lease backends of ``side`` with ``lease_ttl`` ``ttl_ms``."""
    out = Transcript()
    live: list[LeaseBackend] = []
    for _ in range(instances):
        backend = await side.start(ttl_ms)
        assert isinstance(backend, LeaseBackend)
        live.append(backend)
    leases: list[Lease] = []
    records = 0

    def chosen(index: int) -> Lease | None:
        return leases[index % len(leases)] if leases else None

    def ended(lease: Lease) -> tuple[JobPolicy, RunRecord]:
        nonlocal records
        records += 1
        now = side.clocks.now_ms()
        return policy(lease.job), record_of(lease.job, lease.slot_ms, records, "end", now)

    for step in program:
        kind, now = step[0], side.clocks.now_ms()
        grid = now - now % STEP_MS
        if kind == "advance":
            await side.clocks.advance(step[1])
            out.add(f"advance {step[1]}ms", None)
        elif kind == "acquire":
            _, via, job, k, reason, skip = step
            rules = policy(job, overlap="skip" if skip else "allow")
            slot = Slot(job, grid - k * STEP_MS)
            got = await answer(live[via].acquire(
                slot, policy=rules, instance_id=f"i{via}", run_id=f"r{len(leases)}",
                reason=reason, timeout=5.0,
            ))  # fmt: skip
            out.add(f"i{via} acquire {slot.key} {reason} {rules.overlap}", got)
            leases += [got] if isinstance(got, Lease) else []
        elif kind == "acquire-many":
            claims = [Claim(Slot(j, grid - k * STEP_MS), "r", policy(j)) for j, k in step[2]]
            got = await answer(live[step[1]].acquire_many(claims, instance_id=f"i{step[1]}",
                                                          timeout=5.0))  # fmt: skip
            out.add(f"i{step[1]} acquire {[c.slot.key for c in claims]}", got)
            leases += [g for g in got if isinstance(g, Lease)] if isinstance(got, list) else []
        elif kind == "renew":
            if (lease := chosen(step[1])) is not None:
                out.add(f"renew {lease.slot.key} #{lease.attempt}", await answer(
                    live[0].renew(lease)
                ))  # fmt: skip
        elif kind == "release":
            if (lease := chosen(step[1])) is not None:
                record = ended(lease) if step[3] and not step[2] else None
                done = await answer(live[-1].release(lease, handover=step[2], record=record))
                out.add(f"release {lease.slot.key} handover={step[2]} record={bool(record)}", done)
        elif kind == "release-many":
            picked = {lease.slot: lease for i in step[1] if (lease := chosen(i)) is not None}
            if picked:
                ends = [ended(lease) for lease in picked.values()]
                done = await answer(live[0].release_many(list(picked.values()), ends))
                out.add(f"release {[slot.key for slot in picked]}", done)
        elif kind == "take-over":
            _, via, attempts, skip = step
            rules = [policy(job, overlap="skip" if skip else "allow", max_attempts=attempts)
                     for job in JOBS]  # fmt: skip
            got = await answer(live[via].take_over(rules, instance_id=f"i{via}"))
            out.add(f"i{via} take over {attempts} {skip}", sorted(map(str, shape(got))))  # type: ignore[arg-type]
            leases += got if isinstance(got, list) else []
        elif kind == "state":
            got = await answer(live[step[1]].lease_state(step[2]))
            out.add(f"i{step[1]} lease state of {step[2]}", got)
        elif kind == "history":
            found = await answer(live[step[1]].history(policy(step[2]), step[3]))
            out.add(f"i{step[1]} history {step[2]} {step[3]}", found)
        else:
            await fleet_step(live[step[1]], step, now, out)
    for job in JOBS:
        out.add(f"lease state of {job}", await answer(live[0].lease_state(job)))
        out.add(f"history of {job}", await answer(live[0].history(policy(job), 100)))
    out.add("controls", await answer(live[0].controls()))
    return out


async def fleet_step(backend: Backend, step: Step, now: int, out: Transcript) -> None:
    kind, name = step[0], f"i{step[1]}"
    if kind == "presence":
        record = instance_of(name, now, step[2])
        out.add(f"{name} publish presence", await answer(backend.publish_instance(record)))
    elif kind == "instances":
        out.add(f"{name} instances", await answer(backend.instances()))
    elif kind == "control":
        change = ControlChange(step[2], step[3], name, ms_to_datetime(now))
        out.add(f"{name} {step[3]} {step[2]}", await answer(backend.change_control(change)))
    else:
        out.add(f"{name} controls", await answer(backend.controls()))


def fleet_memory(backend: Backend) -> object:
    memory = getattr(backend, "fleet_slot_memory", None)
    return None if memory is None else round(memory / timedelta(milliseconds=1))


__all__ = [
    "JOBS",
    "SEEDS",
    "START",
    "ModelClocks",
    "RealClocks",
    "Side",
    "Transcript",
    "answer",
    "assert_same",
    "claim_program",
    "fleet_step",
    "instance_of",
    "lease_program",
    "policy",
    "record_of",
    "run_claims",
    "run_leases",
]

"""A release that fails as a run completes is retried until it lands, so the completed slot is
not taken over and run again. On virtual time: through an outage shorter than ``lease_ttl``
with a failing renewer beside it, past the lease's expiry until the fleet's next sweep, and
within a bound when the store never comes back. The real servers (a cut link, a held SQLite
lock) are in test_release_blip.py; the backends' side (a release of an expired lease not yet
taken over still ends the run) is in the conformance suite."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest

from brokersched import BackendUnavailableError, JobContext, MemoryBackend, Scheduler
from brokersched.abc import JobPolicy, Lease, Slot
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock

START = "2027-01-15T08:00:30+00:00"
WHEN = datetime.fromisoformat("2027-01-15T08:01:00+00:00")  # the slot; leased at once
WHEN_MS = int(WHEN.timestamp() * 1000)
TTL = "3s"


@dataclass
class Outage:
    """When the store cannot be reached (monotonic, virtual); one outage shared by the
    backends it applies to."""

    clock: TestClock
    until_ms: int = -1

    def begin(self, seconds: float) -> None:
        self.until_ms = self.clock.monotonic_ms() + round(seconds * 1000)

    def check(self, what: str) -> None:
        if self.clock.monotonic_ms() < self.until_ms:
            raise BackendUnavailableError(f"MemoryBackend could not {what}: the store is away")


@dataclass
class Reach:
    """What one instance's backend asked and when (monotonic ms)."""

    released: list[int] = field(default_factory=list)  # the releases that landed
    tries: list[int] = field(default_factory=list)  # every release sent
    renewals: list[int] = field(default_factory=list)


class Unreachable(MemoryBackend):
    """A memory backend whose every call fails while ``outage`` lasts."""

    def __init__(self, outage: Outage, **options: Any) -> None:
        super().__init__(**options)
        self.outage = outage
        self.reach = Reach()

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        self.outage.check("claim")
        return await super().acquire(*args, **kwargs)

    async def renew(self, lease: Lease) -> bool:
        self.reach.renewals.append(self.outage.clock.monotonic_ms())
        self.outage.check("renew")
        return await super().renew(lease)

    async def release(self, lease: Lease, **options: Any) -> None:
        self.reach.tries.append(self.outage.clock.monotonic_ms())
        self.outage.check("release")
        await super().release(lease, **options)
        self.reach.released.append(self.outage.clock.monotonic_ms())

    async def take_over(self, *args: Any, **kwargs: Any) -> list[Lease]:
        self.outage.check("take over")
        return await super().take_over(*args, **kwargs)


@dataclass
class Fleet:
    """A runner (its ``at()`` job is the slot) and another instance sweeping for dead runners'
    slots of the same job, on one store; the runner's handler starts ``outage`` as its last
    act. ``shared``: the other instance loses the store too (a database restart)."""

    outage_s: float
    shared: bool = False
    drain_timeout: str = "10s"
    clock: TestClock = field(default_factory=lambda: TestClock(START))
    store: MemoryStore = field(default_factory=MemoryStore)
    starts: list[tuple[str, int]] = field(default_factory=list)  # (instance, attempt)

    def __post_init__(self) -> None:
        self.outage = Outage(self.clock)
        self.backend = Unreachable(self.outage, store=self.store, lease_ttl=TTL)
        self.runner = Scheduler(
            self.backend,
            clock=self.clock,
            jitter=0,
            instance_id="runner",
            drain_timeout=self.drain_timeout,
        )
        self.job = self.runner.at("job", WHEN, self.handler)
        other_outage = self.outage if self.shared else Outage(self.clock)
        other = Unreachable(other_outage, store=self.store, lease_ttl=TTL)
        self.other = Scheduler(other, clock=self.clock, jitter=0, instance_id="other")
        self.other.at("job", WHEN + timedelta(days=1), self.handler)  # sweeps the job's slots

    async def handler(self, ctx: JobContext) -> None:
        self.starts.append((ctx.instance_id, ctx.attempt))
        await ctx.sleep(0.45)
        if (ctx.instance_id, ctx.attempt) == ("runner", 1):
            self.outage.begin(self.outage_s)  # 0.45 s into the run
        await ctx.sleep(0.05)

    async def run(self, seconds: str = "1m") -> list[tuple[int, str]]:
        """Both instances for ``seconds``; the job's history as (attempt, outcome)."""
        await self.runner.start()
        await self.other.start()
        await self.clock.advance(seconds)
        history = await self.job.history(10)
        await self.runner.stop()
        await self.other.stop()
        return [(record.attempt, record.outcome) for record in history]

    def since_slot(self, times: list[int]) -> list[int]:
        """Monotonic times as ms after the slot (and its lease) began."""
        slot_mono = WHEN_MS - datetime.fromisoformat(START).timestamp() * 1000
        return [round(t - slot_mono) for t in times]


async def test_an_outage_shorter_than_the_lease_as_a_run_completes_never_reruns_it() -> None:
    """The issue's timeline (lease_ttl 3 s, a 1.5 s outage from 0.45 s into a 0.5 s run):
    the lease is valid until 3 s, and the release lands as soon as the store is back (within
    the retry cap, a tenth of the lease). No renewal failing at 1 s ends the retries (before,
    the runner gave up at 1.2 s and the other instance reran the slot after 3 s)."""
    fleet = Fleet(outage_s=1.5)
    assert await fleet.run() == [(1, "completed")]
    assert fleet.starts == [("runner", 1)]
    (landed,) = fleet.since_slot(fleet.backend.reach.released)
    assert 1950 <= landed <= 1950 + 300
    # The renewer stopped when the handler returned: no renewal competes with the release.
    assert fleet.backend.reach.renewals == []


async def test_a_release_landing_after_the_lease_expired_still_ends_the_run() -> None:
    """The whole store away longer than the lease (a database restart): the runner keeps
    retrying past the expiry, and its release lands before the fleet's next sweep finds the
    slot. (The other instance's sweeps fall every 1.5 s from its start: at 3 s after the slot,
    the store is still away; at 4.5 s the release has landed, at 4.3 s.)"""
    fleet = Fleet(outage_s=3.75, shared=True)
    assert await fleet.run() == [(1, "completed")]
    assert fleet.starts == [("runner", 1)]
    (landed,) = fleet.since_slot(fleet.backend.reach.released)
    assert 3000 < landed < 4500


async def test_a_release_that_never_lands_gives_up_after_another_lease_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store never comes back for the runner: it retries, every 0.3 s at most, until one
    lease_ttl after the lease expired (3 s + 3 s after the slot), then logs one error naming
    the slot and what happens to it; the slot is then taken over as a dead runner's."""
    caplog.set_level(logging.WARNING, logger="brokersched")
    fleet = Fleet(outage_s=3600)
    history = await fleet.run()
    tries = fleet.since_slot(fleet.backend.reach.tries)
    assert tries[0] == 500 and 5700 <= tries[-1] <= 6000
    assert max(b - a for a, b in itertools.pairwise(tries)) <= 300
    assert fleet.backend.reach.released == []
    failures = [r.getMessage() for r in caplog.records if "release of job:" in r.getMessage()]
    assert len(failures) == 1 and "retrying for up to 5s500ms" in failures[0]
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert f"could not release the lease of job:{WHEN_MS}" in error.getMessage()
    assert "gave up" in error.getMessage() and "run it again (attempt 2)" in error.getMessage()
    # What the error said: the other instance took the slot over and ran it again.
    assert fleet.starts == [("runner", 1), ("other", 2)]
    assert (1, "interrupted") in history


async def test_a_stop_ends_the_retries_with_one_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="brokersched")
    fleet = Fleet(outage_s=3600, drain_timeout="1s")  # the stop comes before the bound
    await fleet.runner.start()
    await fleet.clock.advance("31s")  # the run has completed; its release keeps failing
    assert fleet.job.is_running
    await fleet.runner.stop()
    tries = len(fleet.backend.reach.tries)
    await fleet.clock.advance("1m")
    assert len(fleet.backend.reach.tries) == tries  # nothing retries after the stop
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "the scheduler stopped before it landed" in error.getMessage()


async def test_a_handed_over_lease_is_released_within_the_same_bound() -> None:
    """A release with no renewer (a claim answered after the stop began, a hand-over from a
    sweep) counts the lease from when the release began."""
    clock = TestClock(START)
    outage = Outage(clock)
    backend = Unreachable(outage, lease_ttl=TTL)
    sched = Scheduler(backend, clock=clock, jitter=0)
    await sched.start()
    lease = await backend.acquire(
        Slot("job", clock.now_ms()),
        policy=JobPolicy("job"),
        instance_id="i",
        run_id="r",
        reason="manual",
        timeout=1,
    )
    assert isinstance(lease, Lease)
    outage.begin(3600)
    began = clock.monotonic_ms()
    release = clock.spawn(sched._runner.release(lease, handover=True))
    await clock.advance("1m")
    assert release.done()
    assert began + 5700 <= backend.reach.tries[-1] <= began + 6000
    await sched.stop()


def alone(**options: Any) -> tuple[TestClock, Outage, Scheduler[Unreachable]]:
    """One instance alone on its store: only its own sweep can take its slots over."""
    clock = TestClock(START)
    outage = Outage(clock)
    backend = Unreachable(outage, lease_ttl=TTL)
    return clock, outage, Scheduler(backend, clock=clock, jitter=0, **options)


def ending_as_the_store_goes(
    outage: Outage, starts: list[int]
) -> Callable[[JobContext], Awaitable[None]]:
    """A 0.5 s handler (its attempts noted in ``starts``) whose first attempt takes the store
    away for 7 s as it ends, past the release's give-up."""

    async def handler(ctx: JobContext) -> None:
        starts.append(ctx.attempt)
        await ctx.sleep(0.45)
        if ctx.attempt == 1:
            outage.begin(7)
        await ctx.sleep(0.05)

    return handler


async def test_its_own_sweep_never_reruns_a_run_that_ended_here(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store away past the give-up (6 s after the slot) and back at 7.45 s: the runner's
    own sweep takes the expired lease over, as a dead runner's. The runner knows its run ended:
    it releases the slot as ended instead of running it again (another instance's sweep cannot
    know that: the README's Limits)."""
    caplog.set_level(logging.INFO, logger="brokersched")
    clock, outage, runner = alone()
    starts: list[int] = []
    handler = ending_as_the_store_goes(outage, starts)
    job = runner.at("job", WHEN, handler)
    await runner.start()
    await clock.advance("1m")
    history = [(record.attempt, record.outcome) for record in await job.history(10)]
    await runner.stop()
    assert starts == [1]  # before: [1, 2], its own sweep ran it again
    # The take-over recorded the expired attempt, as it does any: the history says both.
    assert sorted(history) == [(1, "completed"), (1, "interrupted")]
    (took,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("took over")]
    assert f"took over job:{WHEN_MS}, which ended here" in took


async def test_its_own_sweep_never_reruns_the_latest_slot_when_an_older_one_ends_after_it() -> None:
    """overlap="allow": slot A runs 5.6 s, slot B (5 s later) 0.5 s, and the store goes away
    as B ends, for 7 s; A ends after B, both releases come late. The store offers B (the
    job's latest claimed slot) to the sweep: B ended here too."""
    clock, outage, runner = alone()
    starts: list[tuple[int, int]] = []

    async def handler(ctx: JobContext) -> None:
        starts.append((ctx.slot_ms, ctx.attempt))
        if len(starts) == 1:
            await ctx.sleep(5.6)
        elif len(starts) == 2:
            await ctx.sleep(0.45)
            outage.begin(7)
            await ctx.sleep(0.05)

    runner.every("job", "5s", handler, overlap="allow")
    await runner.start()
    await clock.advance("20s")
    await runner.stop()
    (a, _), (b, _) = starts[:2]
    assert b - a == 5000
    assert [attempt for slot, attempt in starts if slot == b] == [1]  # before: [1, 2]


async def test_its_own_sweep_knows_after_a_stop_and_a_start_that_the_run_ended_here() -> None:
    """The run ends, its release keeps failing, the scheduler is stopped (the release given
    up) and started again while the store is still away: its sweep, once the store is back,
    finds the slot ended by the previous start."""
    clock, outage, runner = alone(drain_timeout="1s")
    starts: list[int] = []
    handler = ending_as_the_store_goes(outage, starts)
    runner.at("job", WHEN, handler)
    await runner.start()
    await clock.advance("31s")  # the slot is at 30 s: the run ended at 30.5 s
    await runner.stop()
    await runner.start()
    await clock.advance("30s")  # the store is back at 37.45 s
    await runner.stop()
    assert starts == [1]  # before: [1, 2]

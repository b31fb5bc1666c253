"""Regression tests for the races a review found: stop/drain, releases, cancellation, restarts."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import timedelta
from typing import Any

from brokersched import BackendError, Job, JobContext, MemoryBackend, Scheduler
from brokersched.abc import Lease
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend

START = "2027-01-15T08:00:30+00:00"


async def test_a_sync_run_that_finishes_during_stop_is_not_run_again() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    done: list[str] = []

    def work(ctx: JobContext) -> None:  # finishes in 50 ms and never looks at abort_reason
        time.sleep(0.05)
        done.append(ctx.instance_id)

    first = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="A")
    job = first.every("pay", "1h", work, catch_up=0)
    await first.start()
    trigger = asyncio.ensure_future(job.trigger())
    while not job.is_running:  # noqa: ASYNC110 - the run starts in a thread
        await asyncio.sleep(0.001)
    await first.stop()
    record = await trigger
    assert record is not None
    assert record.outcome == "completed"
    second = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="B")
    second.every("pay", "1h", work, catch_up=0)
    await second.start()
    await clock.advance("1m")  # its sweeps would take a hand-over and run it
    await second.stop()
    assert done == ["A"]


async def test_a_scheduler_restarted_after_stop_fires_again() -> None:
    clock = TestClock(START)
    ran: list[int] = []

    async def tick(ctx: JobContext) -> None:
        ran.append(ctx.slot_ms)

    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    sched.every("tick", "1m", tick, catch_up=0)
    await sched.start()
    await clock.advance("1m")
    await sched.stop()
    await clock.advance("5m")
    await sched.start()
    await clock.advance("3m")
    await sched.stop()
    assert len(ran) == 4


class FlakyRelease(MemoryBackend):
    failures = 1

    async def release(self, lease: Lease, **options: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise BackendError("connection reset")
        await super().release(lease, **options)


async def test_a_failed_release_is_retried_so_the_slot_is_not_rerun() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    runs: list[tuple[str, str, int]] = []

    async def daily(ctx: JobContext) -> None:
        runs.append((ctx.instance_id, ctx.reason, ctx.attempt))

    fleet = [
        Scheduler(FlakyRelease(store=store), clock=clock, jitter=0, instance_id="A"),
        Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="B"),
    ]
    for sched in fleet:
        sched.every("daily", "1h", daily, catch_up=0)
        await sched.start()
    await clock.advance_to("2027-01-15T09:00:00+00:00")
    await clock.advance("2m")  # far past the 30 s lease
    for sched in fleet:
        await sched.stop()
    assert len(runs) == 1


class SlowRelease(MemoryBackend):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.entered = asyncio.Event()

    async def release(self, lease: Lease, **options: Any) -> None:
        self.entered.set()
        await asyncio.sleep(0.05)  # a network round trip
        await super().release(lease, **options)


async def test_stop_waits_for_a_release_in_flight() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    runs: list[str] = []
    completed: list[str] = []

    async def daily(ctx: JobContext) -> None:
        runs.append(ctx.instance_id)

    backend = SlowRelease(store=store)
    first = Scheduler(backend, clock=clock, jitter=0, instance_id="A")
    job = first.every("daily", "1h", daily, catch_up=0)
    first.on("complete", lambda event: completed.append(event.job))
    await first.start()
    trigger = asyncio.ensure_future(job.trigger())
    await backend.entered.wait()  # the handler is done; its release is in flight
    await first.stop()
    assert completed == ["daily"]
    second = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="B")
    second.every("daily", "1h", daily, catch_up=0)
    await second.start()
    await clock.advance("1m")
    await second.stop()
    assert runs == ["A"]
    assert (await trigger) is not None


async def test_a_caller_giving_up_on_trigger_does_not_cut_the_run() -> None:
    clock = TestClock(START)
    outcomes: list[str] = []
    starts: list[tuple[str, int]] = []

    async def report(ctx: JobContext) -> None:
        starts.append((ctx.reason, ctx.attempt))
        await ctx.sleep(10)

    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    job = sched.every("report", "1h", report, catch_up=0)
    sched.on("complete", lambda event: outcomes.append(event.outcome))
    await sched.start()
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("1s")
    trigger.cancel()  # the HTTP request that asked for the run went away
    await clock.advance("2m")
    await sched.stop()
    assert outcomes == ["completed"]
    assert starts == [("manual", 1)]


async def test_a_job_removed_while_its_claim_is_in_flight_does_not_run() -> None:
    clock = TestClock(START)
    ran: list[str] = []

    async def gone(ctx: JobContext) -> None:
        ran.append("ran")

    sched = Scheduler(DictClaimBackend(claim_delay_s=2), clock=clock, jitter=0)
    sched.every("gone", "1m", gone)
    await sched.start()
    await clock.advance("31s")  # 08:01:01: the 08:01:00 claim takes 2 s
    sched.remove("gone", abort=True)
    await clock.advance("5s")
    await sched.stop()
    assert ran == []


async def test_trigger_is_refused_once_stop_began() -> None:
    import pytest

    sched = Scheduler(MemoryBackend(), jitter=0)
    job = sched.every("late", "1h", lambda ctx: None)
    await sched.start()
    await sched.stop()
    with pytest.raises(RuntimeError, match="the scheduler is not running"):
        await job.trigger()


async def test_a_handler_may_await_the_clock_in_its_cleanup() -> None:
    clock = TestClock(START, settle_timeout=5)
    cleaned: list[bool] = []

    async def careful(ctx: JobContext) -> None:
        try:
            await ctx.sleep(60)
        finally:
            await ctx.sleep(1)  # a graceful cleanup on the scheduler's clock
            cleaned.append(True)

    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    sched.every("t", "5m", careful, timeout="4s")
    await sched.start()
    began = time.monotonic()
    await clock.advance("5m")
    await sched.stop()
    assert cleaned == [True]
    assert time.monotonic() - began < 2  # virtual time: no waiting for settle_timeout


async def test_pause_and_resume_do_not_grow_the_timer_heap() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    job = sched.cron("nightly", "0 3 * * *", lambda ctx: None, catch_up=0)
    await sched.start()
    for _ in range(10_000):
        job.pause()
        job.resume()
    assert sched._timers.size <= 2 * len(sched.jobs()) + 65
    await sched.stop()


async def test_concurrent_stops_wait_for_one_drain() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock)
    await sched.start()
    await asyncio.gather(sched.stop(), sched.stop(), sched.start())
    assert not sched.running or sched.stopping is False
    await sched.stop()
    assert not sched.running


class SilentRenew(MemoryBackend):
    """A backend whose renewals never answer (a stalled link): they wait on the clock."""

    async def renew(self, lease: Lease) -> bool:
        assert self._clock is not None
        await self._clock.sleep(3600)
        return True


async def test_a_run_whose_renewals_never_answer_is_aborted_before_its_lease_expires() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    spans: list[tuple[int, int, str | None, str]] = []  # (start, end, abort reason, instance)

    async def long(ctx: JobContext) -> None:
        began = clock.now_ms()
        try:
            await ctx.sleep(600)
        finally:
            spans.append((began, clock.now_ms(), ctx.abort_reason, ctx.instance_id))

    silent = Scheduler(
        SilentRenew(store=store, lease_ttl="30s"), clock=clock, jitter=0, instance_id="silent"
    )
    job = silent.every("long", "1h", long, catch_up=0)
    healthy = Scheduler(
        MemoryBackend(store=store, lease_ttl="30s"), clock=clock, jitter=0, instance_id="ok"
    )
    healthy.every("long", "1h", long, catch_up=0)
    await silent.start()
    await healthy.start()
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("3m")
    await trigger
    await silent.stop()
    await healthy.stop()
    first = spans[0]
    assert first[2:] == ("lock-lost", "silent")
    assert first[1] - first[0] < 30_000  # aborted before the lease could expire
    assert len(spans) > 1  # ... after which the slot was retried as a dead runner's
    for before, after in itertools.pairwise(spans):
        assert after[0] >= before[1]  # never two runs of the slot at once
    # each lost attempt is recorded once, by the instance that took the slot over
    attempts = [record.attempt for record in await job.history(10)]
    assert attempts and sorted(attempts) == sorted(set(attempts))


class FailingReleases(MemoryBackend):
    failures = 3

    async def release(self, lease: Lease, **options: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise BackendError("database restarting")
        await super().release(lease, **options)


async def test_releases_are_retried_while_the_lease_is_held() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    runs: list[tuple[str, int]] = []

    async def daily(ctx: JobContext) -> None:
        runs.append((ctx.reason, ctx.attempt))

    fleet = [
        Scheduler(FailingReleases(store=store, lease_ttl="3s"), clock=clock, jitter=0),
        Scheduler(MemoryBackend(store=store, lease_ttl="3s"), clock=clock, jitter=0),
    ]
    job = fleet[0].every("daily", "1h", daily, catch_up=0)
    fleet[1].every("daily", "1h", daily, catch_up=0)
    for sched in fleet:
        await sched.start()
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("1m")
    record = await trigger
    for sched in fleet:
        await sched.stop()
    assert record is not None
    assert runs == [("manual", 1)]


async def test_claims_never_outlive_the_backend_slot_memory() -> None:
    clock = TestClock(START)
    backend = DictClaimBackend(slot_ttl=timedelta(seconds=10))
    sched = Scheduler(backend, clock=clock, jitter=0, max_late="9500ms")
    sched.every("tight", "1m", lambda ctx: None)
    await sched.start()
    await clock.advance("30s")
    await sched.stop()
    (timeout,) = backend.timeouts
    # 10 s of memory, less a margin (1 s of clock skew, 250 ms of flight), from the slot; not
    # the 9.5 s that max_late leaves
    assert timeout == 8.75


class LateAnswer(MemoryBackend):
    """The first renewal is applied at once but answered 15 s later (a slow link back); later
    renewals are never answered."""

    renewals = 0

    async def renew(self, lease: Lease) -> bool:
        assert self._clock is not None
        self.renewals += 1
        if self.renewals > 1:
            await self._clock.sleep(3600)
        renewed = await super().renew(lease)
        await self._clock.sleep(15)
        return renewed


async def test_the_lock_lost_deadline_counts_from_when_the_renewal_was_sent() -> None:
    """The store extended the lease when the renewal arrived, i.e. after it was sent: counted
    from the late answer instead, the run would go on after its lease expired in the store."""
    clock = TestClock(START)
    spans: list[tuple[int, int, str | None]] = []

    async def long(ctx: JobContext) -> None:
        began = clock.monotonic_ms()
        try:
            await ctx.sleep(600)
        finally:
            spans.append((began, clock.monotonic_ms(), ctx.abort_reason))

    sched = Scheduler(LateAnswer(lease_ttl="30s"), clock=clock, jitter=0)
    job = sched.every("long", "1h", long, catch_up=0)
    await sched.start()
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("2m")
    await trigger
    await sched.stop()
    began, ended, reason = spans[0]
    assert reason == "lock-lost"
    # renewal sent at 10 s, applied then (the store's lease now ends at 40 s), answered at
    # 25 s: the run must be aborted before 40 s, a margin (ttl/10) ahead
    assert ended - began == 37_000


# -- update() and resume() inside a slot's jitter window ------------------------------------


async def test_update_inside_the_jitter_window_keeps_the_slot() -> None:
    clock = TestClock("2027-01-15T08:00:30+00:00")
    sched = Scheduler(MemoryBackend(), clock=clock, jitter="20s")
    slots: list[str] = []
    job = sched.every("j", "1m", lambda ctx: slots.append(f"{ctx.scheduled_at:%H:%M:%S}"))
    await sched.start()
    await clock.advance("30s")  # 08:01:00: the slot's jitter window is open, its claim pending
    job.update(jitter="10s")
    await clock.advance("25s")
    await sched.stop()
    assert slots == ["08:01:00"]


async def test_resume_inside_the_jitter_window_joins_the_slot() -> None:
    clock = TestClock("2027-01-15T08:00:30+00:00")
    sched = Scheduler(MemoryBackend(), clock=clock, jitter="20s")
    slots: list[str] = []
    job = sched.every("j", "1m", lambda ctx: slots.append(f"{ctx.scheduled_at:%H:%M:%S}"))
    await sched.start()
    job.pause()
    await clock.advance("30s")  # 08:01:00 passes while paused
    job.resume()  # the fleet is still claiming 08:01:00: this instance joins
    await clock.advance("25s")
    await sched.stop()
    assert slots == ["08:01:00"]


async def test_update_from_the_handler_does_not_rerun_its_slot() -> None:
    clock = TestClock("2027-01-15T08:00:30+00:00")
    sched = Scheduler(MemoryBackend(), clock=clock, jitter="20s")
    slots: list[str] = []
    jobs: list[Job] = []

    async def retune(ctx: JobContext) -> None:
        slots.append(f"{ctx.scheduled_at:%H:%M:%S}")
        jobs[0].update(jitter="1s")

    jobs.append(sched.every("j", "1m", retune, claim=False))  # no claim to stop a second run
    await sched.start()
    await clock.advance("1m")
    await sched.stop()
    assert slots == ["08:01:00"]

"""Stopping drains: running handlers are told (``shutdown``), not cancelled, and a run that
finishes within ``drain_timeout`` is recorded as it returned. Virtual time: ``stop()`` lets the
TestClock run through the drain."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from brokersched import JobContext, MemoryBackend, RunEvent, Scheduler
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock

START = "2027-01-15T08:00:30+00:00"


def outcomes(sched: Scheduler[Any]) -> list[tuple[str, str, str | None]]:
    seen: list[tuple[str, str, str | None]] = []

    def note(event: RunEvent) -> None:
        seen.append((event.job, event.outcome, event.error))

    sched.on("complete", note)
    sched.on("fail", note)
    return seen


async def test_a_told_handler_checkpoints_and_completes() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, drain_timeout="10s")
    seen = outcomes(sched)
    checkpoints: list[tuple[int, str | None]] = []

    @sched.every("batches", "1m", catch_up=0)
    async def batches(ctx: JobContext) -> None:
        done = 0
        while not await ctx.wait_aborted(timeout=1):  # one batch a second until told
            done += 1
        checkpoints.append((done, ctx.abort_reason))

    await sched.start()
    await clock.advance("35s")  # 08:01:00 runs; 5 batches
    await sched.stop()
    assert checkpoints == [(5, "shutdown")]
    assert seen == [("batches", "completed", None)]
    # completed, not handed over: a successor does not run the slot again
    successor = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    again: list[int] = []
    successor.every("batches", "1m", lambda ctx: again.append(ctx.slot_ms), catch_up=0)
    await successor.start()
    await clock.advance("1s")
    await successor.stop()
    assert again == []


async def test_a_handler_that_finishes_within_drain_timeout_is_recorded_as_it_returned() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, drain_timeout="10s")
    seen = outcomes(sched)

    @sched.every("flush", "1m")
    async def flush(ctx: JobContext) -> None:
        await ctx.sleep(8)  # ignores the shutdown: finishes its flush
        if ctx.job == "flush":
            raise RuntimeError("the broker said no")

    await sched.start()
    await clock.advance("31s")  # runs from 08:01:00; 7 s left
    stopped_at = clock.monotonic_ms()
    await sched.stop()
    assert clock.monotonic_ms() - stopped_at == 7000  # the drain waited for it, in virtual time
    assert seen == [("flush", "failed", "RuntimeError: the broker said no")]


async def test_a_handler_still_running_after_drain_timeout_is_cancelled_and_handed_over() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, drain_timeout="10s")
    seen = outcomes(sched)
    cancelled_after: list[int] = []

    @sched.every("long", "1m", catch_up=0)
    async def long(ctx: JobContext) -> None:
        began = clock.monotonic_ms()
        try:
            await ctx.sleep(3600)
        except asyncio.CancelledError:
            cancelled_after.append(clock.monotonic_ms() - began)
            raise

    await sched.start()
    await clock.advance("35s")
    await sched.stop()
    assert cancelled_after == [15_000]  # 5 s of run, then the whole drain_timeout
    assert seen == [("long", "interrupted", "aborted: shutdown")]
    successor = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    retried: list[tuple[str, int]] = []
    successor.every("long", "1m", lambda ctx: retried.append((ctx.reason, ctx.attempt)))
    await successor.start()
    await clock.advance("1s")
    await successor.stop()
    assert retried == [("retry", 1)]  # handed over: no attempt counted


async def test_a_timeout_during_the_drain_still_cancels() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, drain_timeout="1m")
    seen = outcomes(sched)

    @sched.every("slow", "5m", timeout="20s")
    async def slow(ctx: JobContext) -> None:
        await ctx.sleep(3600)

    await sched.start()
    await clock.advance("4m35s")  # 08:05:00 runs
    stopped_at = clock.monotonic_ms()
    await sched.stop()
    assert clock.monotonic_ms() - stopped_at == 15_000  # the timeout, not drain_timeout
    assert seen == [("slow", "timed-out", "Timed out after 20s")]


async def test_the_lease_is_renewed_through_a_long_drain() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    sched = Scheduler(
        MemoryBackend(store=store, lease_ttl="3s"), clock=clock, jitter=0, drain_timeout="1m"
    )
    seen = outcomes(sched)
    other = Scheduler(MemoryBackend(store=store, lease_ttl="3s"), clock=clock, jitter=0)
    ran_elsewhere: list[int] = []
    other.every("long", "1h", lambda ctx: ran_elsewhere.append(ctx.slot_ms), catch_up=0)

    @sched.every("long", "1h", catch_up=0)
    async def long(ctx: JobContext) -> None:
        await ctx.sleep(40)  # ten lease lifetimes, most of them during the drain

    await sched.start()
    job = sched.get("long")
    assert job is not None
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("1s")
    await other.start()
    stop = asyncio.ensure_future(sched.stop())
    await clock.advance("45s")  # the other instance sweeps for dead runners all along
    await stop
    await trigger
    await other.stop()
    assert seen == [("long", "completed", None)]
    assert ran_elsewhere == []


async def test_sync_handlers_see_shutdown_and_return() -> None:
    sched = Scheduler(MemoryBackend(), jitter=0, drain_timeout="5s")
    seen = outcomes(sched)
    entered = asyncio.Event()
    loop = asyncio.get_running_loop()

    def polite(ctx: JobContext) -> None:
        loop.call_soon_threadsafe(entered.set)
        while ctx.abort_reason is None:
            time.sleep(0.001)
        assert ctx.abort_reason == "shutdown"

    job = sched.every("polite", "1h", polite)
    await sched.start()
    trigger = asyncio.ensure_future(job.trigger())
    await entered.wait()
    await sched.stop()
    await trigger
    assert seen == [("polite", "completed", None)]

"""The edges of a stop: runs caught releasing or recording when ``drain_timeout`` ends, sync
runs abandoned, a lease lost after a timeout, ``stop()`` called by a handler, and a scheduler
served in one event loop after another. Virtual time, except where a process-wide thing (a
signal handler, a new event loop) is the point."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from brokersched import BackendUnavailableError, JobContext, MemoryBackend, RunEvent, Scheduler
from brokersched.abc import ControlChange, Instance, JobControl, JobPolicy, Lease, RunRecord, Slot
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend

START = "2027-01-15T08:00:30+00:00"


class SlowBackend(MemoryBackend):
    """A memory backend whose records take ``record_s`` (virtual), whose releases can fail, and
    whose renewals can be refused."""

    def __init__(self, clock: TestClock, *, record_s: float = 0, **options: Any) -> None:
        super().__init__(**options)
        self.clock = clock
        self.record_s = record_s
        self.failing_releases = False
        self.releases = 0
        self.refusing_renewals = False

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self.clock.sleep(self.record_s)
        await super().record(job, record)

    async def release(self, lease: Lease, **options: Any) -> None:
        self.releases += 1
        if self.failing_releases:
            raise BackendUnavailableError("the store is away")
        await super().release(lease, **options)

    async def renew(self, lease: Lease) -> bool:
        return False if self.refusing_renewals else await super().renew(lease)


def until_told(ctx: JobContext, entered: threading.Event) -> None:
    """A sync handler's body: says it has begun, then polls until told (10 s at most)."""
    entered.set()
    deadline = time.monotonic() + 10
    while ctx.abort_reason is None and time.monotonic() < deadline:
        time.sleep(0.001)


async def began(entered: threading.Event) -> None:
    """Wait (real time) until a sync handler's thread has begun."""
    await asyncio.to_thread(entered.wait, 10)
    assert entered.is_set()


async def until(condition: Callable[[], bool]) -> None:
    """Let other tasks run until ``condition`` holds (a few loop turns on the memory backend)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("still not so after 1000 turns of the event loop")


async def running(sched: Scheduler[Any]) -> None:
    await until(lambda: sched.running)


def outcomes(sched: Scheduler[Any]) -> list[tuple[str, str | None]]:
    seen: list[tuple[str, str | None]] = []

    def note(event: RunEvent) -> None:
        seen.append((event.outcome, event.error))

    sched.on("complete", note)
    sched.on("fail", note)
    return seen


async def history(backend: MemoryBackend, sched: Scheduler[Any], name: str) -> list[str]:
    job = sched.get(name)
    assert job is not None
    return [record.outcome for record in await backend.history(job.settings.policy, 10)]


async def test_a_run_recording_when_drain_timeout_ends_is_not_cut() -> None:
    clock = TestClock(START)
    backend = SlowBackend(clock, record_s=2.5)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="10s")
    seen = outcomes(sched)

    @sched.every("flush", "1h", claim=False)  # no lease: its record goes by the recorder
    async def flush(ctx: JobContext) -> None:
        await ctx.sleep(9)  # finishes its flush although told to stop; its record takes 2.5 s

    await sched.start()
    trigger = asyncio.ensure_future(sched.get("flush").trigger())  # type: ignore[union-attr]
    await clock.advance("0s")
    await sched.stop()  # drain_timeout ends while the run records: it is not cut short
    await trigger
    assert seen == [("completed", None)]
    assert await history(backend, sched, "flush") == ["completed"]


async def test_a_sync_run_recording_when_drain_timeout_ends_is_recorded_once() -> None:
    clock = TestClock(START)
    backend = SlowBackend(clock, record_s=11)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="10s")
    seen = outcomes(sched)

    entered = threading.Event()
    sched.every("sync", "1h", lambda ctx: until_told(ctx, entered), claim=False)
    await sched.start()
    trigger = asyncio.ensure_future(sched.get("sync").trigger())  # type: ignore[union-attr]
    await began(entered)
    await sched.stop()  # the thread returns at once; its record ends 1 s after drain_timeout
    await trigger
    assert seen == [("completed", None)]  # not abandoned as well
    assert await history(backend, sched, "sync") == ["completed"]


async def test_a_run_releasing_when_drain_timeout_ends_is_not_cut_nor_run_again() -> None:
    """The run returns half a second before drain_timeout ends, as the store goes away for a
    second: its release is still being retried when drain_timeout ends. It is left to land
    (within the stop's grace), so the completed slot is not taken over: a successor, there
    once the lease would have expired, does not run it again."""
    clock = TestClock(START)
    store = MemoryStore()
    backend = SlowBackend(clock, store=store)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="10s")
    seen = outcomes(sched)
    ran: list[int] = []

    def store_back() -> None:
        backend.failing_releases = False

    @sched.every("flush", "1m", catch_up=0)
    async def flush(ctx: JobContext) -> None:
        ran.append(ctx.slot_ms)
        await ctx.sleep(9.5)  # finishes its flush although told to stop
        backend.failing_releases = True  # the store is away for a second as it returns
        clock.call_later(1000, store_back)

    await sched.start()
    await clock.advance("30s")  # 08:01:00 runs
    await sched.stop()
    assert seen == [("completed", None)]
    successor = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    again: list[tuple[str, int]] = []
    successor.every("flush", "1m", lambda ctx: again.append((ctx.reason, ctx.slot_ms)))
    await successor.start()
    await clock.advance("1m")  # the lease would have expired, and been swept, by then
    await successor.stop()
    assert [run for run in again if run[1] in ran] == [], "the completed slot ran again"


async def test_a_release_that_keeps_failing_ends_with_the_stop() -> None:
    clock = TestClock(START)
    backend = SlowBackend(clock)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="10s")

    entered = threading.Event()
    sched.every("job", "1h", lambda ctx: until_told(ctx, entered))
    await sched.start()
    trigger = asyncio.ensure_future(sched.get("job").trigger())  # type: ignore[union-attr]
    await began(entered)
    backend.failing_releases = True
    await sched.stop()
    await asyncio.gather(trigger, return_exceptions=True)
    tries = backend.releases
    await clock.advance("5m")
    assert backend.releases == tries  # nothing retries the release after the stop
    assert tries <= 20
    assert not clock.busy()


async def test_listeners_of_an_abandoned_run_are_not_cut() -> None:
    clock = TestClock(START, settle_timeout=0.1)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, drain_timeout="1s")
    heard: list[str] = []
    entered, done = threading.Event(), threading.Event()

    async def on_fail(event: RunEvent) -> None:
        await clock.sleep(0.5)
        heard.append(event.outcome)

    sched.on("fail", on_fail)

    @sched.every("stubborn", "1h")
    def stubborn(ctx: JobContext) -> None:
        entered.set()
        done.wait(10)  # ignores the shutdown

    await sched.start()
    trigger = asyncio.ensure_future(sched.get("stubborn").trigger())  # type: ignore[union-attr]
    try:
        await began(entered)
        await sched.stop()
    finally:
        done.set()
    await trigger
    assert heard == ["interrupted"]


async def test_an_unclaimed_run_due_as_the_stop_begins_does_not_start() -> None:
    sched = Scheduler(MemoryBackend(), jitter=0, drain_timeout="10s")
    started: list[int] = []
    job = sched.every("local", "1h", lambda ctx: started.append(ctx.slot_ms), claim=False)
    gate = asyncio.Event()

    @sched.every("long", "1h")
    async def long(ctx: JobContext) -> None:
        await gate.wait()  # keeps the drain going until the test is done

    await sched.start()
    trigger = asyncio.ensure_future(sched.get("long").trigger())  # type: ignore[union-attr]
    await until(lambda: sched.get("long").is_running)  # type: ignore[union-attr]
    stopping = asyncio.ensure_future(sched.stop())
    await until(lambda: sched.stopping)
    record = await sched._runner.run_slot(job._state, sched.clock.now_ms(), "schedule")
    gate.set()
    await stopping
    await trigger
    assert record is None
    assert started == []


async def test_a_lease_lost_after_a_timeout_is_not_recorded_by_its_loser() -> None:
    clock = TestClock(START)
    backend = SlowBackend(clock, lease_ttl="3s")
    sched = Scheduler(backend, clock=clock, jitter=0)
    seen = outcomes(sched)

    @sched.every("cleanup", "1h", timeout="2s")
    async def cleanup(ctx: JobContext) -> None:
        if ctx.reason == "retry":
            return
        try:
            await ctx.sleep(3600)
        except asyncio.CancelledError:
            backend.refusing_renewals = True  # the store loses the lease meanwhile
            await clock.sleep(5)  # a cleanup that outlives the lease
            backend.refusing_renewals = False

    await sched.start()
    trigger = asyncio.ensure_future(sched.get("cleanup").trigger())  # type: ignore[union-attr]
    await clock.advance("10s")
    await trigger
    await sched.stop()
    # the lease expired: the instance that took the slot over (here, once the cleanup was over)
    # recorded the attempt, once, and retried it
    assert seen == [("timed-out", "Timed out after 2s"), ("completed", None)]
    assert await history(backend, sched, "cleanup") == ["completed", "interrupted"]


async def test_a_handler_that_stops_its_scheduler_is_drained_not_cut() -> None:
    clock = TestClock(START)
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, drain_timeout="1m")
    seen = outcomes(sched)
    told: list[str | None] = []

    @sched.every("last", "1h")
    async def last(ctx: JobContext) -> None:
        await sched.stop()  # begins the stop and returns
        await ctx.wait_aborted(timeout=5)
        told.append(ctx.abort_reason)

    await sched.start()
    before = clock.monotonic_ms()
    trigger = asyncio.ensure_future(sched.get("last").trigger())  # type: ignore[union-attr]
    await clock.settle()
    await sched.wait_stopped()
    assert await trigger is not None
    assert clock.monotonic_ms() == before  # no drain_timeout spent waiting on itself
    assert told == ["shutdown"]
    assert seen == [("completed", None)]
    assert not sched.running


def test_a_scheduler_serves_in_one_event_loop_after_another() -> None:
    sched = Scheduler(MemoryBackend(), jitter=0)
    ran: list[int] = []
    sched.every("tick", "1h", lambda ctx: ran.append(ctx.slot_ms))

    async def serve_then_stop() -> None:
        serving = asyncio.ensure_future(sched.serve())
        await running(sched)
        for _ in range(10):  # serve() waits for the stop on this loop, not the first one
            await asyncio.sleep(0)
        assert sched.running and not serving.done()
        await sched.get("tick").trigger()  # type: ignore[union-attr]
        await sched.stop()
        await serving

    asyncio.run(serve_then_stop())
    asyncio.run(serve_then_stop())  # a new loop: nothing of the first one is awaited
    assert len(ran) == 2


def test_serve_gives_back_the_signal_handlers_it_found() -> None:
    def mine(signum: int, frame: FrameType | None) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        sched = Scheduler(MemoryBackend(), jitter=0)

        async def serve_then_stop() -> None:
            serving = asyncio.ensure_future(sched.serve())
            await running(sched)
            assert signal.getsignal(signal.SIGTERM) is not mine  # serve() has it meanwhile
            await sched.stop()
            await serving

        asyncio.run(serve_then_stop())
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


class GatedClaims(DictClaimBackend):
    """A claim-only backend whose claims wait, once in flight, until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = asyncio.Event()
        self.gate = asyncio.Event()

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        self.in_flight.set()
        await self.gate.wait()
        return await super().claim(slot, instance_id=instance_id, run_id=run_id, timeout=timeout)


async def test_a_claim_won_as_the_stop_begins_runs_in_the_drain_told_to_stop() -> None:
    """On a claim-only backend no other instance can win a slot once its claim is in: stopped
    while the claim was in flight, the instance runs it within drain_timeout, not nowhere,
    and tells it to stop at once, as every run of the drain is told."""
    backend, clock = GatedClaims(), TestClock(START)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="10s")
    told: list[str | None] = []

    @sched.every("flush", "1m")
    async def flush(ctx: JobContext) -> None:
        await ctx.wait_aborted(60)
        told.append(ctx.abort_reason)

    await sched.start()
    slot_ms = clock.now_ms() + 30_000  # 08:01:00, the next slot
    due = asyncio.ensure_future(clock.advance("30s"))
    await backend.in_flight.wait()
    stopping = asyncio.ensure_future(sched.stop())
    await until(lambda: sched.stopping)
    backend.gate.set()
    await stopping
    await due
    assert told == ["shutdown"]
    assert [(r.slot_ms, r.outcome) for r in backend.records["flush"]] == [(slot_ms, "completed")]


async def test_a_claim_won_in_the_drain_that_outlasts_it_is_cut_and_recorded() -> None:
    backend, clock = GatedClaims(), TestClock(START)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="1s")

    @sched.every("flush", "1m")
    async def flush(ctx: JobContext) -> None:
        await asyncio.Event().wait()  # deaf to the stop: cut when drain_timeout ends

    await sched.start()
    due = asyncio.ensure_future(clock.advance("30s"))
    await backend.in_flight.wait()
    stopping = asyncio.ensure_future(sched.stop())
    await until(lambda: sched.stopping)
    backend.gate.set()
    await until(lambda: bool(sched.get("flush").is_running))  # type: ignore[union-attr]
    await clock.advance("1s")
    await stopping
    await due
    assert [r.outcome for r in backend.records["flush"]] == ["interrupted"]


async def test_a_claim_won_after_its_job_was_removed_does_not_run() -> None:
    backend, clock = GatedClaims(), TestClock(START)
    sched = Scheduler(backend, clock=clock, jitter=0)
    ran: list[int] = []
    sched.every("flush", "1m", lambda ctx: ran.append(ctx.slot_ms))
    await sched.start()
    try:
        due = asyncio.ensure_future(clock.advance("30s"))
        await backend.in_flight.wait()
        sched.remove("flush")
        backend.gate.set()
        await due
        assert ran == []
        assert backend.claims  # the claim was won: the slot runs nowhere, at most once
    finally:
        await sched.stop()


class WatchedBackend(SlowBackend):
    """A slow backend (records and presence take a while) that notes how many of its calls
    were still going when it was stopped."""

    def __init__(self, clock: TestClock, **options: Any) -> None:
        super().__init__(clock, **options)
        self.going = 0
        self.going_at_stop: list[int] = []

    async def publish_instance(self, instance: Instance) -> None:
        self.going += 1
        try:
            if not instance.stopped:  # the last presence is quick
                await self.clock.sleep(5)
            await super().publish_instance(instance)
        finally:
            self.going -= 1

    async def _close(self) -> None:
        self.going_at_stop.append(self.going)
        await super()._close()


async def test_nothing_the_scheduler_began_calls_its_backend_once_it_stopped() -> None:
    """A run's end asks for a presence soon; the soon comes during the stop's last records: the
    presence it publishes ends (cut) before the backend stops, not on a backend stopped under
    it (where a client library opens a connection nobody closes). The run holds no lease, so
    it ends without waiting for its record, which the stop writes."""
    clock = TestClock(START)
    backend = WatchedBackend(clock, record_s=3)
    sched = Scheduler(backend, clock=clock, jitter=0)
    ran = asyncio.Event()
    sched.every("job", "1h", lambda ctx: ran.set(), claim=False)
    await sched.start()
    await sched.get("job").trigger()  # type: ignore[union-attr]
    assert ran.is_set()
    await sched.stop()
    assert backend.going_at_stop == [0]


class SlowControls(MemoryBackend):
    """A memory backend whose fleet-wide control changes take 5 s (virtual)."""

    def __init__(self, clock: TestClock) -> None:
        super().__init__()
        self.clock = clock
        self.writing = asyncio.Event()

    async def change_control(self, *changes: ControlChange) -> JobControl:
        self.writing.set()
        await self.clock.sleep(5)
        return await super().change_control(*changes)


async def test_a_control_change_still_being_written_when_the_scheduler_stops_is_answered() -> None:
    """The admin API's pause waits for the write; the stop cuts the write: the wait ends with
    an error naming what happened, not never."""
    clock = TestClock(START)
    backend = SlowControls(clock)
    sched = Scheduler(backend, clock=clock, jitter=0)
    sched.every("job", "1h", lambda ctx: None)
    await sched.start()
    asking = asyncio.ensure_future(sched.change_control("job", "pause", by="admin"))
    await until(backend.writing.is_set)
    await sched.stop()
    assert asking.done()
    with pytest.raises(BackendUnavailableError, match=r"stopped before .* pause of job job"):
        asking.result()

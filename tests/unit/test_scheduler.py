"""The scheduler on virtual time: the life of a slot, runs, events, drain, dynamic jobs."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from brokersched import (
    BackendError,
    JobContext,
    MemoryBackend,
    RunEvent,
    Scheduler,
    SkipEvent,
    StartEvent,
)
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START
from tests.support.helpers import DictClaimBackend
from tests.support.leases import acquire


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


class Recorder:
    """A handler that remembers every context it ran with."""

    def __init__(self, work_s: float = 0.0, fail: bool = False) -> None:
        self.contexts: list[JobContext] = []
        self.work_s = work_s
        self.fail = fail

    async def __call__(self, ctx: JobContext) -> None:
        self.contexts.append(ctx)
        if self.work_s:
            await ctx.sleep(self.work_s)
        if self.fail:
            raise RuntimeError(f"boom at {ctx.scheduled_at:%H:%M:%S}")

    @property
    def slots(self) -> list[str]:
        return [f"{ctx.scheduled_at:%H:%M:%S}" for ctx in self.contexts]


def events(sched: Scheduler[Any]) -> list[Any]:
    seen: list[Any] = []
    for name in ("skip", "start", "complete", "fail"):
        sched.on(name, seen.append)  # type: ignore[arg-type]
    return seen


async def test_every_fires_on_the_epoch_grid(scheduler: Scheduler[Any], clock: TestClock) -> None:
    handler = Recorder()
    scheduler.every("tick", "1m", handler)
    await scheduler.start()
    await clock.advance("3m")
    assert handler.slots == ["08:01:00", "08:02:00", "08:03:00"]
    assert all(ctx.reason == "schedule" and ctx.attempt == 1 for ctx in handler.contexts)


async def test_offset_shifts_the_grid(scheduler: Scheduler[Any], clock: TestClock) -> None:
    handler = Recorder()
    scheduler.every("tick", "1m", handler, offset="15s")
    await scheduler.start()
    await clock.advance("2m")
    assert handler.slots == ["08:01:15", "08:02:15"]


async def test_decorator_form_registers_and_returns_the_function(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    ran: list[int] = []

    @scheduler.every("deco", "10s")
    async def job(ctx: JobContext) -> None:
        ran.append(ctx.slot_ms)

    assert callable(job) and scheduler.get("deco") is not None
    await scheduler.start()
    await clock.advance("30s")
    assert len(ran) == 3


async def test_context_carries_the_slot(scheduler: Scheduler[Any], clock: TestClock) -> None:
    handler = Recorder()
    scheduler.every("ctx", "1m", handler, data={"batch": 50})
    await scheduler.start()
    await clock.advance("1m")
    (ctx,) = handler.contexts
    assert ctx.job == "ctx"
    assert ctx.scheduled_at == at("2027-01-15T08:01:00+00:00")
    assert ctx.slot_ms == int(ctx.scheduled_at.timestamp() * 1000)
    assert ctx.data == {"batch": 50}
    assert ctx.instance_id == "me"
    assert ctx.abort_reason is None
    assert len(ctx.run_id) == 16


async def test_sync_handlers_run_in_a_thread(scheduler: Scheduler[Any], clock: TestClock) -> None:
    threads: list[str] = []

    def sync_job(ctx: JobContext) -> None:
        threads.append(threading.current_thread().name)

    scheduler.every("sync", "1m", sync_job)
    await scheduler.start()
    await clock.advance("2m")
    assert len(threads) == 2
    assert threading.main_thread().name not in threads


async def test_a_failing_handler_is_recorded_and_the_schedule_goes_on(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    seen = events(scheduler)
    job = scheduler.every("flaky", "1m", Recorder(fail=True))
    await scheduler.start()
    await clock.advance("2m")
    fails = [e for e in seen if isinstance(e, RunEvent)]
    assert [(e.outcome, e.error) for e in fails] == [
        ("failed", "RuntimeError: boom at 08:01:00"),
        ("failed", "RuntimeError: boom at 08:02:00"),
    ]
    history = await job.history(10)
    assert [r.outcome for r in history] == ["failed", "failed"]
    assert history[0].slot_ms > history[1].slot_ms  # newest first


async def test_timeout_cancels_an_async_handler(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    seen = events(scheduler)
    cancelled: list[bool] = []

    async def slow(ctx: JobContext) -> None:
        try:
            await ctx.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(ctx.abort_reason == "timeout")
            raise

    job = scheduler.every("slow", "5m", slow, timeout="4s")
    await scheduler.start()
    await clock.advance("4m29s")
    assert not job.is_running
    await clock.advance("1s")  # the slot at 08:05:00
    assert job.is_running
    await clock.advance("3s")
    assert job.is_running
    await clock.advance("1s")
    assert not job.is_running
    assert cancelled == [True]
    (fail,) = [e for e in seen if isinstance(e, RunEvent)]
    assert (fail.outcome, fail.error, fail.duration_ms) == ("timed-out", "Timed out after 4s", 4000)


async def test_timeout_sets_abort_reason_for_sync_handlers() -> None:
    """A thread cannot be cancelled: the handler sees ``ctx.abort_reason`` (real time, 0.1 s)."""
    seen: list[str | None] = []

    def obedient(ctx: JobContext) -> None:
        deadline = time.monotonic() + 5
        while ctx.abort_reason is None and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(ctx.abort_reason)

    sched = Scheduler(MemoryBackend(), jitter=0)
    job = sched.every("obedient", "1h", obedient, timeout="100ms")
    async with sched:
        record = await job.trigger()
    assert seen == ["timeout"]
    assert record is not None
    assert (record.outcome, record.error) == ("timed-out", "Timed out after 100ms")


async def test_stop_aborts_running_handlers_and_hands_their_slot_over(clock: TestClock) -> None:
    store = MemoryStore()
    sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    reasons: list[str | None] = []

    async def long(ctx: JobContext) -> None:
        try:
            await ctx.sleep(3600)
        finally:
            reasons.append(ctx.abort_reason)

    job = sched.every("long", "1m", long)
    await sched.start()
    await clock.advance("30s")
    assert job.is_running
    await sched.stop()
    assert reasons == ["shutdown"]
    (record,) = await MemoryBackend(store=store).history(job.settings.policy, 5)
    assert (record.outcome, record.error) == ("interrupted", "aborted: shutdown")
    # the next instance takes the slot over at once, as attempt 1 again
    successor = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    handler = Recorder()
    successor.every("long", "1m", handler, catch_up=0)
    await successor.start()
    await clock.advance("1s")
    assert [(c.reason, c.attempt, c.slot_ms) for c in handler.contexts] == [
        ("retry", 1, record.slot_ms)
    ]
    await successor.stop()


async def test_drain_gives_up_after_drain_timeout() -> None:
    release = threading.Event()

    def stubborn(ctx: JobContext) -> None:
        release.wait(5)  # ignores ctx.abort_reason

    sched = Scheduler(DictClaimBackend(), jitter=0, drain_timeout="100ms")
    job = sched.every("stubborn", "1h", stubborn)
    await sched.start()
    trigger = asyncio.ensure_future(job.trigger())
    while not job.is_running:  # noqa: ASYNC110 - the run starts in a thread
        await asyncio.sleep(0.001)
    began = time.monotonic()
    await sched.stop()
    assert time.monotonic() - began < 1.0  # bounded by drain_timeout, not by the handler
    release.set()
    assert await trigger is None
    (record,) = await job.history(5)
    assert record.outcome == "interrupted"
    assert record.error == "abandoned: still running after drain_timeout (0.1s)"


async def test_an_abandoned_lease_run_is_recorded_once_by_its_taker() -> None:
    """With a lease, the abandoned run keeps its lease until it expires (it may still be
    writing); the instance that takes the slot over records it, once."""
    release = threading.Event()
    store = MemoryStore()

    def stubborn(ctx: JobContext) -> None:
        release.wait(5)

    sched = Scheduler(MemoryBackend(store=store, lease_ttl="300ms"), jitter=0, drain_timeout=0.1)
    job = sched.every("stubborn", "1h", stubborn, catch_up=0)
    await sched.start()
    trigger = asyncio.ensure_future(job.trigger())
    while not job.is_running:  # noqa: ASYNC110 - the run starts in a thread
        await asyncio.sleep(0.001)
    await sched.stop()
    release.set()
    assert await trigger is None
    assert await MemoryBackend(store=store).history(job.settings.policy, 5) == []
    taker = Scheduler(MemoryBackend(store=store, lease_ttl="300ms"), jitter=0)
    handler = Recorder()
    taker.every("stubborn", "1h", handler, catch_up=0)
    await taker.start()
    while not handler.contexts:  # noqa: ASYNC110 - real time: the lease expires on its own
        await asyncio.sleep(0.01)
    await taker.stop()
    records = await MemoryBackend(store=store).history(job.settings.policy, 5)
    assert [(r.outcome, r.attempt, r.error) for r in records] == [
        ("completed", 2, None),
        ("interrupted", 1, "runner lost its lease"),
    ]


async def test_events_and_listener_failures(scheduler: Scheduler[Any], clock: TestClock) -> None:
    seen = events(scheduler)
    async_seen: list[str] = []

    async def async_listener(event: Any) -> None:
        async_seen.append(type(event).__name__)

    def broken(event: Any) -> None:
        raise ValueError("listener bug")

    scheduler.on("complete", broken)
    scheduler.on("complete", async_listener)
    scheduler.every("ok", "1m", Recorder())
    await scheduler.start()
    await clock.advance("2m")
    kinds = [type(e).__name__ for e in seen]
    assert kinds == ["StartEvent", "RunEvent", "StartEvent", "RunEvent"]
    start, complete = seen[0], seen[1]
    assert isinstance(start, StartEvent) and isinstance(complete, RunEvent)
    assert start.scheduled_at == complete.scheduled_at == at("2027-01-15T08:01:00+00:00")
    assert complete.outcome == "completed" and complete.error is None
    assert async_seen == ["RunEvent", "RunEvent"]


async def test_pause_resume(scheduler: Scheduler[Any], clock: TestClock) -> None:
    handler = Recorder()
    job = scheduler.every("p", "1m", handler)
    await scheduler.start()
    await clock.advance("1m")
    job.pause()
    assert job.next_run is None
    await clock.advance("3m")
    job.resume()
    assert job.next_run == at("2027-01-15T08:05:00+00:00")
    await clock.advance("1m")
    assert handler.slots == ["08:01:00", "08:05:00"]


async def test_remove_disarms_and_can_abort(scheduler: Scheduler[Any], clock: TestClock) -> None:
    seen = events(scheduler)
    handler = Recorder(work_s=600)
    scheduler.every("gone", "1m", handler)
    await scheduler.start()
    await clock.advance("1m")
    job = scheduler.remove("gone", abort=True)
    await clock.advance("5m")
    assert handler.slots == ["08:01:00"]
    assert not job.is_running and scheduler.get("gone") is None
    (fail,) = [e for e in seen if isinstance(e, RunEvent)]
    assert (fail.outcome, fail.error) == ("interrupted", "aborted: removed")
    with pytest.raises(KeyError, match="no job named 'gone'"):
        scheduler.remove("gone")


async def test_jobs_added_while_running_are_armed(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    await scheduler.start()
    handler = Recorder()
    scheduler.every("late-comer", "1m", handler)
    await clock.advance("2m")
    assert handler.slots == ["08:01:00", "08:02:00"]


async def test_trigger_runs_now_through_the_claim(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    handler = Recorder()
    job = scheduler.every("manual", "1h", handler)
    await scheduler.start()
    record = await job.trigger()
    assert record is not None and record.outcome == "completed" and record.reason == "manual"
    assert handler.contexts[0].reason == "manual"
    assert handler.contexts[0].scheduled_at == at(START)
    assert await job.trigger() is None  # the same instant is claimed already


async def test_next_run_and_next_runs(scheduler: Scheduler[Any], clock: TestClock) -> None:
    job = scheduler.every("n", "15m", Recorder())
    assert job.next_runs(3, at("2027-01-15T08:00:00+00:00")) == [
        at("2027-01-15T08:15:00+00:00"),
        at("2027-01-15T08:30:00+00:00"),
        at("2027-01-15T08:45:00+00:00"),
    ]
    await scheduler.start()
    assert job.next_run == at("2027-01-15T08:15:00+00:00")
    once = scheduler.at("once", at("2027-01-15T09:00:00+00:00"), Recorder())
    await clock.advance("1h")
    assert once.next_run is None


async def test_at_runs_once(scheduler: Scheduler[Any], clock: TestClock) -> None:
    handler = Recorder()
    scheduler.at("once", at("2027-01-15T08:02:00+00:00"), handler)
    await scheduler.start()
    await clock.advance("1h")
    assert handler.slots == ["08:02:00"]


async def test_an_at_job_started_within_max_late_of_its_time_runs_late_once(
    clock: TestClock,
) -> None:
    store, handler = MemoryStore(), Recorder()
    when = datetime.fromtimestamp(clock.now_ms() / 1000, UTC) - timedelta(minutes=20)
    too_old = when - timedelta(minutes=50)
    fleet = [Scheduler(MemoryBackend(store=store), clock=clock, jitter=0) for _ in range(3)]
    for sched in fleet:  # a deploy 20 minutes after the migration's time
        sched.at("migrate", when, handler, max_late="1h")
        sched.at("too-old", too_old, handler, max_late="1h")
        await sched.start()
    await clock.advance("1m")
    assert [(ctx.job, ctx.reason) for ctx in handler.contexts] == [("migrate", "schedule")]
    restarted = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    restarted.at("migrate", when, handler, max_late="1h")
    await restarted.start()  # the slot is claimed already: no second run
    await clock.advance("1m")
    assert len(handler.contexts) == 1
    for sched in [*fleet, restarted]:
        await sched.stop()


async def test_a_stalled_process_skips_late_slots(clock: TestClock) -> None:
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, max_late="10s")
    seen = events(sched)
    handler = Recorder()
    sched.every("s", "1m", handler, catch_up=0)
    await sched.start()
    await clock.stall("5m")  # frozen from 08:00:30 to 08:05:30
    await clock.advance("1m")
    skips = [(e.reason, f"{e.scheduled_at:%H:%M}") for e in seen if isinstance(e, SkipEvent)]
    assert skips == [("late", "08:01")]  # one late skip, not one per missed slot
    assert handler.slots == ["08:06:00"]
    await sched.stop()


async def test_a_slow_claim_is_rechecked_for_lateness(clock: TestClock) -> None:
    # Answered after max_late, within the claim's bound (what is left of it, and a moment).
    backend = DictClaimBackend(claim_delay_s=10.1)
    sched = Scheduler(backend, clock=clock, jitter=0, max_late="10s")
    seen = events(sched)
    handler = Recorder()
    sched.every("slow-claim", "1m", handler)
    await sched.start()
    await clock.advance("1m")
    assert handler.contexts == []
    assert [(e.reason, e.detail) for e in seen if isinstance(e, SkipEvent)] == [
        ("late", "claim answered too late")
    ]
    await sched.stop()


async def test_backend_errors_fail_closed(clock: TestClock) -> None:
    backend = DictClaimBackend(fail=BackendError("broker down"))
    sched = Scheduler(backend, clock=clock, jitter=0)
    seen = events(sched)
    handler = Recorder()
    sched.every("closed", "1m", handler)
    await sched.start()
    await clock.advance("2m")
    assert handler.contexts == []
    assert [(e.reason, e.detail) for e in seen if isinstance(e, SkipEvent)] == [
        ("backend-error", "broker down"),
        ("backend-error", "broker down"),
    ]
    backend.fail = None  # the broker is back: claiming resumes by itself
    await clock.advance("1m")
    assert handler.slots == ["08:03:00"]
    await sched.stop()


async def test_a_fleet_runs_each_slot_exactly_once(clock: TestClock) -> None:
    store = MemoryStore()
    handler = Recorder()
    fleet = [
        Scheduler(MemoryBackend(store=store), clock=clock, jitter="5s", instance_id=f"i{n}")
        for n in range(3)
    ]
    for sched in fleet:
        sched.every("shared", "30s", handler)
        await sched.start()
    await clock.advance("10m5s")  # the last slot, 08:10:30, may be jittered up to 5 s
    slots = [ctx.slot_ms for ctx in handler.contexts]
    assert len(slots) == 20 and len(set(slots)) == 20
    assert len({ctx.instance_id for ctx in handler.contexts}) > 1  # jitter spreads the work
    for sched in fleet:
        await sched.stop()


async def test_claim_false_runs_on_every_instance(clock: TestClock) -> None:
    store = MemoryStore()
    handler = Recorder()
    fleet = [Scheduler(MemoryBackend(store=store), clock=clock, jitter=0) for _ in range(3)]
    for sched in fleet:
        sched.every("local", "1m", handler, claim=False)
        await sched.start()
    await clock.advance("2m")
    assert sorted(handler.slots) == ["08:01:00"] * 3 + ["08:02:00"] * 3
    for sched in fleet:
        await sched.stop()


async def test_claim_only_backends_run_each_slot_once(clock: TestClock) -> None:
    claims: dict[str, str] = {}
    handler = Recorder()
    fleet = [
        Scheduler(DictClaimBackend(claims), clock=clock, jitter="2s", instance_id=f"i{n}")
        for n in range(3)
    ]
    for sched in fleet:
        sched.every("outbox.flush", "5s", handler)
        await sched.start()
    await clock.advance("1m2s")
    slots = [ctx.slot_ms for ctx in handler.contexts]
    assert len(slots) == 12 and len(set(slots)) == 12
    for sched in fleet:
        await sched.stop()


async def test_overlap_skip_skips_without_queueing(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    """A 7 s job every 3 s: :03 and :06 are skipped, :09 runs (the seed's diagram)."""
    seen = events(scheduler)
    handler = Recorder(work_s=7)
    scheduler.every("long", "3s", handler, jitter=0)
    await scheduler.start()
    await clock.advance("14s")  # 08:00:30 -> 08:00:44
    assert handler.slots == ["08:00:33", "08:00:42"]
    skips = [f"{e.scheduled_at:%S}" for e in seen if isinstance(e, SkipEvent)]
    assert skips == ["36", "39"]
    assert {e.reason for e in seen if isinstance(e, SkipEvent)} == {"overlap"}


async def test_overlap_allow_runs_side_by_side(scheduler: Scheduler[Any], clock: TestClock) -> None:
    handler = Recorder(work_s=7)
    scheduler.every("wide", "3s", handler, overlap="allow")
    await scheduler.start()
    await clock.advance("9s")
    assert handler.slots == ["08:00:33", "08:00:36", "08:00:39"]


async def test_catch_up_runs_the_latest_missed_slot(clock: TestClock) -> None:
    store = MemoryStore()
    first = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    first.every("daily-ish", "1m", Recorder())
    await first.start()
    await clock.advance("1m")  # 08:01 ran
    await first.stop()
    await clock.advance("3m20s")  # everyone down: 08:02, 08:03, 08:04 missed; now 08:04:50
    handler = Recorder()
    second = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    second.every("daily-ish", "1m", handler, catch_up="2m")
    await second.start()
    await clock.advance("5s")
    assert [(c.reason, f"{c.scheduled_at:%H:%M}") for c in handler.contexts] == [
        ("catch-up", "08:04")
    ]
    await second.stop()


async def test_a_restarted_instance_runs_an_on_time_slot_as_scheduled(clock: TestClock) -> None:
    """An instance restarted half a second after a slot fell due, while the rest of the fleet
    waits out its jitter to claim it: the slot is on time, not missed. Whoever runs it runs
    it once, as ``schedule``; nothing is recorded ``catch-up``."""
    store = MemoryStore()
    handler = Recorder()
    survivor = Scheduler(MemoryBackend(store=store), clock=clock, instance_id="survivor")
    survivor.every("tick", "1m", handler, jitter="20s")
    await survivor.start()
    await clock.advance("1m")  # 08:01:00 ran (late in its jitter window); now 08:01:30
    await clock.advance_to(at("2027-01-15T08:02:00.500+00:00"))
    restarted = Scheduler(MemoryBackend(store=store), clock=clock, instance_id="restarted")
    restarted.every("tick", "1m", handler, jitter="20s")
    try:
        await restarted.start()
        await clock.advance("30s")
    finally:
        await restarted.stop()
        await survivor.stop()
    runs = [(c.reason, f"{c.scheduled_at:%H:%M}") for c in handler.contexts]
    assert runs == [("schedule", "08:01"), ("schedule", "08:02")]


async def test_a_slot_left_unclaimed_through_its_jitter_window_is_caught_up(
    clock: TestClock,
) -> None:
    """The same restart with no other instance up: nobody claims the slot in its jitter
    window, so it was missed, and runs as a catch-up once that window has passed."""
    store = MemoryStore()
    first = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    first.every("tick", "1m", Recorder())
    await first.start()
    await clock.advance("1m")  # 08:01 ran
    await first.stop()
    await clock.advance_to(at("2027-01-15T08:02:00.500+00:00"))
    handler = Recorder()
    restarted = Scheduler(MemoryBackend(store=store), clock=clock)
    restarted.every("tick", "1m", handler, jitter="20s")
    async with restarted:
        await clock.advance("19s")
        assert handler.contexts == [], "caught up while the fleet could still claim it"
        await clock.advance("2s")
    assert [(c.reason, f"{c.scheduled_at:%H:%M:%S}") for c in handler.contexts] == [
        ("catch-up", "08:02:00")
    ]


async def test_a_job_paused_for_the_fleet_is_not_caught_up_at_start(clock: TestClock) -> None:
    """Paused while the fleet was down: an instance starting within ``catch_up`` of the missed
    slot does not run it; resumed, the job runs its next slot."""
    store = MemoryStore()
    first = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    paused = first.every("daily-ish", "1m", Recorder())
    await first.start()
    await clock.advance("1m")  # 08:01 ran
    await paused.pause(by="ops")
    await first.stop()
    await clock.advance("3m20s")  # 08:02, 08:03, 08:04 missed; now 08:04:50
    handler = Recorder()
    second = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0)
    job = second.every("daily-ish", "1m", handler, catch_up="2m")
    await second.start()
    await clock.advance("5s")
    caught_up = [(c.reason, f"{c.scheduled_at:%H:%M}") for c in handler.contexts]
    assert caught_up == [], "a job paused for the fleet ran at start"
    await job.resume(by="ops")
    await clock.advance("1m")
    assert [(c.reason, f"{c.scheduled_at:%H:%M}") for c in handler.contexts] == [
        ("schedule", "08:05")
    ]
    await second.stop()


async def test_a_dead_runner_is_retried_by_another_instance(clock: TestClock) -> None:
    store = MemoryStore()
    corpse = MemoryBackend(store=store, lease_ttl="30s")
    await corpse.start(clock)
    from brokersched.abc import Slot

    slot_ms = int(at("2027-01-15T08:00:00+00:00").timestamp() * 1000)
    lease = await acquire(corpse, Slot("job", slot_ms), instance="dead", timeout=1)
    assert not isinstance(lease, str)  # acquired, then the process "dies": no renewals
    handler = Recorder()
    sched = Scheduler(MemoryBackend(store=store, lease_ttl="30s"), clock=clock, jitter=0)
    sched.every("job", "1h", handler, catch_up=0)
    await sched.start()
    await clock.advance("20s")
    assert handler.contexts == []  # the lease is still live
    await clock.advance("30s")
    assert [(c.reason, c.attempt, c.slot_ms) for c in handler.contexts] == [("retry", 2, slot_ms)]
    history = await sched.get("job").history(5)  # type: ignore[union-attr]
    assert [(r.outcome, r.attempt) for r in history] == [("completed", 2), ("interrupted", 1)]
    await sched.stop()


async def test_renewal_keeps_a_long_run_alive(clock: TestClock) -> None:
    store = MemoryStore()
    sched = Scheduler(MemoryBackend(store=store, lease_ttl="30s"), clock=clock, jitter=0)
    other = Scheduler(MemoryBackend(store=store, lease_ttl="30s"), clock=clock, jitter=0)
    mine, theirs = Recorder(work_s=300), Recorder()
    sched.every("long", "1h", mine)
    other.every("long", "1h", theirs)
    await sched.start()
    await other.start()
    record = asyncio.ensure_future(sched.get("long").trigger())  # type: ignore[union-attr]
    await clock.advance("6m")
    completed = await record
    assert completed is not None and completed.outcome == "completed"
    assert theirs.contexts == []  # never retried while the runner renewed
    await sched.stop()
    await other.stop()


async def test_lost_lease_aborts_the_run(clock: TestClock) -> None:
    store = MemoryStore()
    sched = Scheduler(MemoryBackend(store=store, lease_ttl="30s"), clock=clock, jitter=0)
    aborts: list[str | None] = []

    async def long(ctx: JobContext) -> None:
        try:
            await ctx.sleep(600)
        finally:
            aborts.append(ctx.abort_reason)

    job = sched.every("fragile", "1h", long)
    await sched.start()
    task = asyncio.ensure_future(job.trigger())
    await clock.advance("5s")
    row = store.jobs["fragile"]  # the database forgot the lease (e.g. restored backup)
    store.jobs["fragile"] = replace(row, leases={})
    await clock.advance("10s")
    record = await task
    assert aborts == ["lock-lost"]
    assert record is not None and record.outcome == "interrupted"
    await sched.stop()


async def test_async_context_manager_and_wait_stopped(clock: TestClock) -> None:
    sched = Scheduler(MemoryBackend(), clock=clock)
    async with sched:
        assert sched.running
        waiter = asyncio.ensure_future(sched.wait_stopped())
        await asyncio.sleep(0)
        assert not waiter.done()
    await asyncio.wait_for(waiter, 1)
    assert not sched.running


async def test_the_default_backend_is_memory() -> None:
    assert isinstance(Scheduler().backend, MemoryBackend)


def test_history_record_json_round_trip() -> None:
    from brokersched.abc import RunRecord

    record = RunRecord(
        job="j",
        slot_ms=1,
        run_id="r",
        instance_id="i",
        reason="retry",
        attempt=2,
        started_at=datetime(2027, 1, 1, tzinfo=UTC),
        finished_at=datetime(2027, 1, 1, 0, 0, 1, tzinfo=UTC),
        outcome="failed",
        error="E: x",
    )
    assert RunRecord.from_json(record.to_json()) == record
    assert timedelta(0) < record.finished_at - record.started_at  # type: ignore[operator]


async def test_overdue_lists_jobs_that_stopped_running(clock: TestClock) -> None:
    backend = DictClaimBackend()
    sched = Scheduler(backend, clock=clock, jitter=0, max_late="10s")
    sched.every("healthy", "1m", Recorder())
    await sched.start()
    await clock.advance("5m")
    assert sched.overdue() == []
    backend.fail = BackendError("down")
    await clock.advance("1m")
    assert sched.overdue() == []  # one missed slot is not yet overdue
    await clock.advance("1m")
    assert [job.name for job in sched.overdue()] == ["healthy"]
    backend.fail = None
    await clock.advance("1m")
    assert sched.overdue() == []
    await sched.stop()


async def test_slots_won_elsewhere_count_as_handled(clock: TestClock) -> None:
    claims: dict[str, str] = {}
    winner = Scheduler(DictClaimBackend(claims), clock=clock, jitter=0, instance_id="fast")
    loser = Scheduler(DictClaimBackend(claims), clock=clock, jitter=0, instance_id="slow")
    for sched in (winner, loser):
        sched.every("shared", "1m", Recorder())
    await winner.start()
    await loser.start()
    await clock.advance("10m")
    assert winner.overdue() == [] and loser.overdue() == []
    await winner.stop()
    await loser.stop()


async def test_update_changes_options_at_run_time(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    handler = Recorder()
    job = scheduler.every("u", "1m", handler, data={"v": 1})
    await scheduler.start()
    await clock.advance("1m")
    job.update(offset="15s", data={"v": 2})  # now 08:01:30
    assert job.next_run == at("2027-01-15T08:02:15+00:00")
    await clock.advance("1m")
    assert [(c.data["v"], f"{c.scheduled_at:%H:%M:%S}") for c in handler.contexts] == [
        (1, "08:01:00"),
        (2, "08:02:15"),
    ]


async def test_update_is_validated_like_registration() -> None:
    from brokersched import ConfigurationError

    job = Scheduler(DictClaimBackend()).every("sync", "10s", Recorder(), jitter="1s")
    with pytest.raises(ConfigurationError, match="needs a lease backend") as info:
        job.update(overlap="allow")
    assert info.value.backend == "DictClaimBackend"
    with pytest.raises(ConfigurationError, match="under half the time between runs"):
        job.update(jitter="5s")
    assert job.settings.jitter_ms == 1000  # nothing changed
    with pytest.raises(ConfigurationError, match="unknown option 'jiter'"):
        job.update(jiter="2s")


async def test_an_at_job_in_the_past_is_warned_of_at_registration(
    scheduler: Scheduler[Any], clock: TestClock, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="brokersched"):
        scheduler.at("soon", at("2027-01-15T08:00:00+00:00"), Recorder())  # 30 s ago: max_late
        scheduler.at("gone", at("2027-01-15T07:00:00+00:00"), Recorder())
        scheduler.at("later", at("2027-01-15T09:00:00+00:00"), Recorder())
    assert [r.getMessage() for r in caplog.records] == [
        "job 'gone': at 2027-01-15T07:00:00+00:00 passed 1h ago, more than its max_late (1m): "
        "it will never run (give a later time, or trigger it by hand)"
    ]

"""The fleet through the backend on the memory backend and virtual time: presence
and liveness, fleet-wide pause / resume / disable / enable with their audit trail, abort of a
run on another instance, trigger with data."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from brokersched import JobContext, Scheduler
from brokersched.abc import ControlChange, Instance, JobControl, RunInProgress
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START


def _every_minute(schedulers: list[Scheduler[MemoryBackend]], runs: list[str]) -> None:
    async def tick(ctx: JobContext) -> None:
        runs.append(f"{ctx.instance_id}@{ctx.scheduled_at:%H:%M}")

    for sched in schedulers:
        sched.every("tick", "1m", tick, catch_up=0)


async def test_a_pause_on_one_instance_stops_the_job_on_every_instance(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    a, b = memory_fleet
    for sched in memory_fleet:
        await sched.start()
    await clock.advance("1m")  # 08:01 runs once
    assert len(runs) == 1
    job = a.get("tick")
    assert job is not None
    control = await job.pause(by="alice")
    assert control is not None and control.paused
    await clock.advance("3m")  # 08:02-08:04: nobody runs them
    assert len(runs) == 1
    other = b.get("tick")
    assert other is not None and other.paused and other.next_run is None
    await other.resume(by="bob")
    await clock.advance("1m")  # 08:05 runs again, on one instance
    assert runs[1:] == [runs[-1]] and runs[-1].endswith("@08:05")
    assert job.control is not None and not job.paused
    changes = [(c.action, c.actor) for c in job.control.changes]
    assert changes == [("pause", "alice"), ("resume", "bob")]


async def test_a_pause_written_by_another_process_is_honoured_at_the_next_slot(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    """Written straight to the backend a moment before the slot (no heartbeat in between):
    the read before the claim sees it."""
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    for sched in memory_fleet:
        await sched.start()
    await clock.advance("29s")  # 08:00:59: the last heartbeat was at 08:00:55
    pause = ControlChange("tick", "pause", "ops", clock.now())
    await memory_fleet[0].backend.change_control(pause)
    await clock.advance("1s")  # 08:01 falls due
    assert runs == []
    assert all(s.get("tick").paused for s in memory_fleet)  # type: ignore[union-attr]


async def test_disable_refuses_manual_runs_too_and_enable_restores_them(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    runs: list[str] = []
    _every_minute(memory_fleet, runs)
    for sched in memory_fleet:
        await sched.start()
    job = memory_fleet[0].get("tick")
    assert job is not None
    await job.disable()
    await clock.advance("2m")
    other = memory_fleet[1].get("tick")
    assert other is not None and other.disabled and not other.enabled
    assert await other.trigger() is None and runs == []
    await other.enable()
    assert (await other.trigger()) is not None and len(runs) == 1


async def test_a_change_made_before_start_is_written_at_start(clock: TestClock) -> None:
    store = MemoryStore()
    first = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="A")
    first.every("tick", "1m", lambda ctx: None)
    job = first.get("tick")
    assert job is not None
    assert await job.pause(by="deploy") is None  # not running: written at start
    await first.start()
    try:
        controls = await first.backend.controls()
        assert controls["tick"].paused and controls["tick"].changes[0].actor == "deploy"
    finally:
        await first.stop()


async def test_instances_publish_presence_and_a_silent_one_turns_late_then_dead(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    a, _ = memory_fleet
    for sched in memory_fleet:
        await sched.start()
    # A third instance, killed with -9 while it ran a leased run: it published once.
    ghost = Instance(
        id="C",
        host="h",
        pid=7,
        version="0",
        started_at=clock.now(),
        last_seen=clock.now(),
        heartbeat=timedelta(seconds=5),
        running=(RunInProgress("tick", "r1", 0, clock.now(), "schedule", leased=True),),
    )
    await a.backend.publish_instance(ghost)
    await clock.advance("5s")
    seen = {i.id: i.liveness(clock.now()) for i in await a.instances()}
    assert seen == {"A": "alive", "B": "alive", "C": "alive"}
    await clock.advance("5s")
    assert {i.id: i.liveness(clock.now()) for i in await a.instances()}["C"] == "late"
    await clock.advance("6s")
    instances = {i.id: i for i in await a.instances()}
    assert instances["C"].liveness(clock.now()) == "dead"
    assert instances["A"].liveness(clock.now()) == "alive"
    running = await a.runs_in_progress()
    assert [(i.id, r.run_id, r.leased) for i, r in running] == [("C", "r1", True)]
    await memory_fleet[1].stop()
    assert {i.id: i.liveness(clock.now()) for i in await a.instances()}["B"] == "stopped"
    await clock.advance("11m")  # forgotten after FORGET
    assert {i.id for i in await a.instances()} == {"A"}


async def test_an_abort_reaches_the_run_on_another_instance_within_a_heartbeat(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    a, b = memory_fleet
    started = asyncio.Event()
    seen: list[object] = []

    async def long(ctx: JobContext) -> None:
        started.set()
        try:
            await clock.sleep(3600)
        finally:
            seen.append(ctx.abort_reason)

    a.every("long", "1h", long, catch_up=0)
    b.every("long", "1h", long, catch_up=0)
    await b.start()
    job = b.get("long")
    assert job is not None
    running = asyncio.ensure_future(job.trigger())
    await started.wait()
    await a.start()
    await clock.advance("2s")  # B publishes its run soon after it started
    [(instance, run)] = await a.runs_in_progress()
    assert instance.id == "B"
    assert await a.abort(run.run_id, by="carol") == run
    await clock.advance("5s")  # B reads the controls at its next heartbeat
    record = await running
    assert seen == ["aborted"]
    assert record is not None and record.outcome == "interrupted"
    assert record.error == "aborted on request"
    control = (await a.backend.controls())["long"]
    assert [(c.action, c.actor, c.run_id) for c in control.changes] == [
        ("abort", "carol", run.run_id)
    ]
    assert await a.abort("nope") is None


async def test_trigger_with_data_gives_the_run_that_data(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    seen: list[object] = []
    job = scheduler.every("t", "1h", lambda ctx: seen.append(ctx.data), data={"a": 1})
    await scheduler.start()
    await job.trigger({"user": 7})
    await clock.advance("1s")
    await job.trigger()
    assert seen == [{"user": 7}, {"a": 1}]


async def test_a_backend_without_fleet_records_pauses_this_instance_only(
    clock: TestClock, caplog: pytest.LogCaptureFixture
) -> None:
    sched = Scheduler(_Local(), clock=clock, jitter=0)
    job = sched.every("t", "1m", lambda ctx: None)
    await sched.start()
    try:
        assert await job.pause() is None and job.paused
        assert "applies to this instance only" in caplog.text
        assert await sched.instances() == []
    finally:
        await sched.stop()


class _Local(MemoryBackend):
    @property
    def fleet(self) -> bool:
        return False


def test_the_control_record_keeps_its_latest_changes_and_reads_back() -> None:
    control = JobControl("j")
    clock = TestClock(START)
    for n in range(60):
        action = "pause" if n % 2 else "resume"
        control = control.apply(ControlChange("j", action, f"u{n}", clock.now()))
    assert control.paused and len(control.changes) == 50
    assert JobControl.from_json(control.to_json()) == control
    assert control.changes[-1].actor == "u59"


async def test_a_run_here_is_aborted_at_once_even_without_fleet_records(clock: TestClock) -> None:
    sched = Scheduler(_Local(), clock=clock, jitter=0)
    started = asyncio.Event()

    async def long(ctx: JobContext) -> None:
        started.set()
        await clock.sleep(3600)

    job = sched.every("long", "1h", long)
    await sched.start()
    try:
        running = asyncio.ensure_future(job.trigger())
        await started.wait()
        [run_id] = [run.ctx.run_id for run in job._state.runs.values()]
        aborted = await sched.abort(run_id, by="me")
        assert aborted is not None and aborted.job == "long"
        record = await running
        assert record is not None and record.outcome == "interrupted"
    finally:
        await sched.stop()


async def test_an_instance_starting_on_a_fleet_paused_whole_says_so(
    clock: TestClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()

    def member(name: str) -> Scheduler[MemoryBackend]:
        sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id=name)
        sched.every("tick", "1m", lambda ctx: None)
        sched.every("sync", "1m", lambda ctx: None)
        return sched

    first = member("A")
    async with first:
        tick, sync = first.get("tick"), first.get("sync")
        assert tick is not None and sync is not None
        await tick.pause(by="alice")
        await sync.disable(by="alice")
        async with member("B"):
            pass
        warned = [r.message for r in caplog.records if "every job is paused" in r.message]
        assert warned == [
            "every job is paused or disabled for the fleet (tick, sync): this instance runs "
            "nothing until one is resumed or enabled (Job.resume(), Job.enable(), the admin "
            "API or the dashboard)"
        ]
        await tick.resume(by="alice")
        caplog.clear()
        async with member("C"):
            pass
        assert not [r for r in caplog.records if "every job is paused" in r.message]

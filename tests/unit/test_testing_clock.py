"""TestClock settles like trio's ``wait_all_tasks_blocked``: a test can hold a run open."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from brokersched import JobContext, MemoryBackend, RunEvent, Scheduler
from brokersched.testing import TestClock
from tests.support.clocks import START


@pytest.fixture
def clock() -> TestClock:
    return TestClock(START, settle_timeout=5)


class Gate:
    """A handler that waits on an ``asyncio.Event`` the test sets: a run held open."""

    def __init__(self) -> None:
        self.entered = 0
        self.release = asyncio.Event()
        self.finished = 0
        self.cancelled = 0

    async def __call__(self, ctx: JobContext) -> None:
        self.entered += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1


async def test_advance_returns_while_a_handler_waits_on_an_event(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    gate = Gate()
    job = scheduler.every("held", "1m", gate)
    await scheduler.start()
    await clock.advance("30s")  # 08:01:00 falls due; the handler blocks on the event
    assert (gate.entered, gate.finished) == (1, 0)
    assert job.is_running
    gate.release.set()
    await clock.advance("1s")
    assert (gate.entered, gate.finished) == (1, 1)
    assert not job.is_running
    [record] = await job.history(5)
    assert record.outcome == "completed"


async def test_overlap_can_be_tested_with_a_held_run(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    gate = Gate()
    skipped: list[str] = []
    scheduler.on("skip", lambda event: skipped.append(event.reason))
    scheduler.every("held", "1m", gate)
    await scheduler.start()
    await clock.advance("1m30s")  # 08:01 runs and holds; 08:02 finds it running
    assert gate.entered == 1
    assert skipped == ["overlap"]
    gate.release.set()
    await clock.advance("1m")  # 08:03 runs (and holds again: the event stays set, so it ends)
    assert (gate.entered, gate.finished) == (2, 2)


async def test_a_virtual_timeout_cancels_a_handler_blocked_on_anything(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    gate = Gate()
    outcomes: list[str] = []
    scheduler.on("fail", lambda event: outcomes.append(event.outcome))
    scheduler.every("held", "1m", gate, timeout="10s")
    await scheduler.start()
    await clock.advance("35s")  # runs at 08:01:00, still blocked 5 s later
    assert (gate.entered, gate.cancelled) == (1, 0)
    await clock.advance("5s")  # 08:01:10: the timeout cancels it
    assert (gate.entered, gate.cancelled, gate.finished) == (1, 1, 0)
    assert outcomes == ["timed-out"]


async def test_stop_tells_a_held_handler_and_drains(clock: TestClock) -> None:
    gate = Gate()
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0, drain_timeout="5s")
    sched.every("held", "1m", gate)
    await sched.start()
    await clock.advance("30s")
    assert gate.entered == 1
    await sched.stop()
    assert gate.cancelled == 1


async def test_scheduler_work_is_still_waited_for(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    """A sync handler's thread is work, not a block: advance() waits until it returns."""
    done = threading.Event()

    def work(ctx: JobContext) -> None:
        done.wait(0.2)  # real time, in the worker thread
        done.set()

    scheduler.every("sync", "1m", work)
    await scheduler.start()
    await clock.advance("30s")
    assert done.is_set()


async def test_a_busy_listener_is_reported_after_settle_timeout(clock: TestClock) -> None:
    clock.settle_timeout = 0.2
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    never = asyncio.Event()

    async def listener(event: Any) -> None:
        await never.wait()  # not a handler: the scheduler's own work, waited for

    sched.on("start", listener)
    sched.every("j", "1m", lambda ctx: None)
    await sched.start()
    with pytest.raises(TimeoutError, match=r"brokersched:on:start"):
        await clock.advance("30s")
    never.set()
    await clock.settle()
    await sched.stop()


async def test_a_failing_handler_logs_its_traceback_once(
    scheduler: Scheduler[MemoryBackend], clock: TestClock, caplog: pytest.LogCaptureFixture
) -> None:
    def deep() -> None:
        raise RuntimeError("kaboom")

    async def handler(ctx: JobContext) -> None:
        deep()

    failures: list[RunEvent] = []
    scheduler.on("fail", failures.append)
    job = scheduler.every("fails", "1m", handler)
    await scheduler.start()
    with caplog.at_level(logging.INFO, logger="brokersched"):
        await clock.advance("30s")
    with_trace = [r for r in caplog.records if r.exc_info]
    assert len(with_trace) == 1
    [line] = with_trace
    assert line.getMessage().startswith("run job=fails ")
    assert getattr(line, "outcome", None) == "failed"
    assert "in deep" in caplog.text  # the stack, not just the message
    [event] = failures
    assert isinstance(event.exception, RuntimeError)
    assert event.error == "RuntimeError: kaboom"
    [record] = await job.history(1)
    assert record.error == "RuntimeError: kaboom"  # the record keeps the message only

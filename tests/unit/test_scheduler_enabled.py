"""Scheduling switched off, registry kept: ``Scheduler(enabled=False)``,
``BROKERSCHED_ENABLED=false``, ``brokersched run --no-schedule``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from brokersched import (
    ConfigurationError,
    JobContext,
    MemoryBackend,
    Scheduler,
)
from brokersched._clock import Timer
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from brokersched.web._views import job_state

START = "2027-01-15T08:00:30+00:00"


class CountingClock(TestClock):
    """A virtual clock that counts the timers that fired on it (a bound on a call that
    answered in time never fires)."""

    def __init__(self, start: str) -> None:
        super().__init__(start)
        self.fired = 0

    def _counted(self, callback: Callable[[], object]) -> Callable[[], object]:
        def fired() -> object:
            self.fired += 1
            return callback()

        return fired

    def call_at(self, when_ms: int, callback: Callable[[], object]) -> Timer:
        return super().call_at(when_ms, self._counted(callback))

    def call_later(self, delay_ms: int, callback: Callable[[], object]) -> Timer:
        return super().call_later(delay_ms, self._counted(callback))


class Runs:
    def __init__(self, work_s: float = 0) -> None:
        self.seen: list[tuple[str, str]] = []  # (instance, reason)
        self.work_s = work_s

    async def __call__(self, ctx: JobContext) -> None:
        self.seen.append((ctx.instance_id, ctx.reason))
        if self.work_s:
            await ctx.sleep(self.work_s)


async def test_a_disabled_scheduler_lists_jobs_arms_nothing_and_runs_on_trigger() -> None:
    clock, runs = CountingClock(START), Runs()
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, enabled=False)
    job = scheduler.every("tick", "1m", runs)
    scheduler.cron("report", "0 * * * *", runs)
    assert not scheduler.enabled
    async with scheduler:
        scheduler.every("added", "1m", runs)  # a job added while running is not armed either
        await clock.advance("2h")
        assert runs.seen == []
        assert clock.fired == 0  # not a slot, not a catch-up, not a take-over sweep
        assert [j.name for j in scheduler.jobs()] == ["tick", "report", "added"]
        assert job.next_run is None
        assert job.next_runs(1)  # the schedule is still there to show
        assert scheduler.overdue() == []
        assert job_state(scheduler, job) == "disabled"
        record = await job.trigger()
        assert record is not None and record.outcome == "completed"
        assert runs.seen == [(scheduler.instance_id, "manual")]
        job.resume()  # nothing to resume: still not armed
        await clock.advance("5m")
        assert len(runs.seen) == 1


async def test_a_trigger_on_a_disabled_instance_goes_through_the_claim() -> None:
    """A web replica (disabled) triggers a job that a scheduling replica is running: the
    lease refuses the overlap, as it would anywhere."""
    clock, store, runs = TestClock(START), MemoryStore(), Runs(work_s=30)
    worker = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="worker")
    web = Scheduler(
        MemoryBackend(store=store), clock=clock, jitter=0, instance_id="web", enabled=False
    )
    worker.every("sync", "1m", runs, catch_up=0)
    on_web = web.every("sync", "1m", runs, catch_up=0)
    async with worker, web:
        await clock.advance("30s")  # the worker's run of 08:01 is going on
        assert runs.seen == [("worker", "schedule")]
        assert await on_web.trigger() is None  # overlap: refused by the lease
        await clock.advance("45s")  # the worker's run is over
        trigger = asyncio.ensure_future(on_web.trigger())
        await clock.advance("30s")
        record = await trigger
        assert record is not None and record.instance_id == "web"
    assert runs.seen[:2] == [("worker", "schedule"), ("web", "manual")]


@pytest.mark.parametrize(
    ("value", "enabled"),
    [
        *[("false", False), ("OFF", False), (" 0 ", False), ("no", False)],
        *[("true", True), ("Yes", True), ("1", True), ("on", True)],
    ],
)
def test_brokersched_enabled_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool
) -> None:
    monkeypatch.setenv("BROKERSCHED_ENABLED", value)
    assert Scheduler().enabled is enabled
    assert Scheduler(enabled=True).enabled  # the argument wins over the environment
    assert not Scheduler(enabled=False).enabled


def test_brokersched_enabled_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROKERSCHED_ENABLED", "maybe")
    with pytest.raises(ConfigurationError) as caught:
        Scheduler()
    assert str(caught.value) == (
        "BROKERSCHED_ENABLED='maybe' is not a boolean: use true or false (also 1/yes/on or "
        "0/no/off), or leave it unset"
    )
    assert caught.value.option == "enabled"


def test_enabled_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match=r"enabled='no' must be True or False"):
        Scheduler(enabled="no")  # type: ignore[call-overload]


async def test_enabled_is_set_before_start_only() -> None:
    clock, seen = TestClock(START), list[str]()
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    scheduler.every("tick", "1s", lambda ctx: seen.append(ctx.reason))
    scheduler.enabled = False  # what `brokersched run --no-schedule` does
    async with scheduler:
        await clock.advance("5s")
        assert seen == [] and not scheduler.enabled
        with pytest.raises(RuntimeError, match=r"enabled can only be set before start\(\)"):
            scheduler.enabled = True

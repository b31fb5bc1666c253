"""Boot runs: ``scheduler.after(name, delay)`` and ``run_on_start=True``, per process
(``claim=False``) or once per fleet (``claim=True``, the default)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from brokersched import (
    ConfigurationError,
    JobContext,
    MemoryBackend,
    RabbitMQBackend,
    Scheduler,
)
from brokersched.abc import Backend
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend, Runs

START = "2027-01-15T08:00:30+00:00"


def fleet(clock: TestClock, size: int, kind: str = "lease", **options: Any) -> list[Scheduler[Any]]:
    """``size`` schedulers sharing a MemoryBackend's store (lease) or a dict (claim-only)."""
    store, claims = MemoryStore(), dict[str, str]()

    def backend() -> Backend:
        return MemoryBackend(store=store) if kind == "lease" else DictClaimBackend(claims)

    return [
        Scheduler(backend(), clock=clock, jitter=0, instance_id=f"i{n}", **options)
        for n in range(size)
    ]


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


async def test_after_runs_once_delay_after_start_per_process_or_per_fleet() -> None:
    clock, runs = TestClock(START), Runs()
    schedulers = fleet(clock, 3)
    for scheduler in schedulers:
        scheduler.after("cache.warm", "2s", runs, claim=False)  # per process
        scheduler.after("recovery.sweep", "2s", runs)  # per fleet
    await asyncio.gather(*(s.start() for s in schedulers))
    first = schedulers[0].get("cache.warm")
    assert first is not None and first.next_run == at("2027-01-15T08:00:32+00:00")
    await clock.advance("1999ms")
    assert runs.seen == []
    await clock.advance("1ms")
    assert first.next_run is None
    await clock.advance("10m")
    due = at("2027-01-15T08:00:32+00:00")
    assert sorted(runs.of("cache.warm")) == [(f"i{n}", "start", due) for n in range(3)]
    ((_, reason, when),) = runs.of("recovery.sweep")
    assert (reason, when) == ("start", due)
    history = await schedulers[0].get("recovery.sweep").history()  # type: ignore[union-attr]
    assert [(r.reason, r.job) for r in history] == [("start", "recovery.sweep")]
    await asyncio.gather(*(s.stop() for s in schedulers))


async def test_run_on_start_adds_one_run_at_start_to_the_schedule() -> None:
    clock, runs = TestClock(START), Runs()
    schedulers = fleet(clock, 3)
    for scheduler in schedulers:
        scheduler.every("refresh", "1m", runs, run_on_start=True, claim=False)
        scheduler.cron("recover", "0 * * * *", runs, run_on_start=True, catch_up=0)
    async with schedulers[0], schedulers[1], schedulers[2]:
        await clock.advance("1m")
    start, minute = at(START), at("2027-01-15T08:01:00+00:00")
    assert sorted(runs.of("refresh")) == sorted(
        [(f"i{n}", "start", start) for n in range(3)]
        + [(f"i{n}", "schedule", minute) for n in range(3)]
    )
    assert [(r, w) for _, r, w in runs.of("recover")] == [("start", start)]


@pytest.mark.parametrize("kind", ["lease", "claim-only"])
async def test_instances_starting_within_a_window_share_one_boot_run(kind: str) -> None:
    """Boot runs fall on either side of a window's edge: still one run; an instance starting
    two windows after the last boot run runs it again (the next deploy)."""
    clock, runs = TestClock("2027-01-15T08:00:59.900+00:00"), Runs()
    a, b, c, d = fleet(clock, 4, kind)
    for scheduler in (a, b, c, d):
        scheduler.after("sweep", 0, runs)
    await a.start()
    await clock.advance("200ms")  # now 08:01:00.100: another window
    await b.start()
    await clock.advance("50s")
    await c.start()  # 08:01:50.100, less than a window after b
    await clock.advance("1s")
    assert [i for i, _, _ in runs.of("sweep")] == ["i0"]
    await clock.advance("3m")
    await d.start()
    await clock.advance("1s")
    assert [i for i, _, _ in runs.of("sweep")] == ["i0", "i3"]
    for scheduler in (a, b, c, d):
        await scheduler.stop()


async def test_boot_runs_respect_pause_disable_and_stop() -> None:
    clock, runs = TestClock(START), Runs()
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    paused = scheduler.after("paused", "1s", runs)
    scheduler.after("stopped", "1m", runs)
    async with scheduler:
        paused.pause()
        await clock.advance("10s")
    await clock.advance("2m")
    assert runs.seen == []
    off = Scheduler(MemoryBackend(), clock=clock, jitter=0, enabled=False)
    job = off.after("warm", "1s", runs)
    async with off:
        await clock.advance("10s")
        assert runs.seen == []
        assert job.next_run is None
        record = await job.trigger()  # still runs on demand
        assert record is not None and record.reason == "manual"


async def test_an_after_job_added_to_a_running_scheduler_waits_its_delay() -> None:
    clock, runs = TestClock(START), Runs()
    async with Scheduler(MemoryBackend(), clock=clock, jitter=0) as scheduler:
        await clock.advance("1m")
        scheduler.after("late", "5s", runs)
        await clock.advance("4s")
        assert runs.seen == []
        await clock.advance("1s")
        assert [w for _, _, w in runs.of("late")] == [at("2027-01-15T08:01:35+00:00")]


def test_after_is_described_and_listed() -> None:
    scheduler = Scheduler()
    job = scheduler.after("warm", "2s", Runs(), claim=False, timeout="1m")
    assert (job.kind, job.describe(), job.next_run, job.next_runs(3)) == (
        "after",
        "once, 2s after start",
        None,
        [],
    )


@pytest.mark.parametrize(
    ("register", "message"),
    [
        (
            lambda s: s.after("a", "2s", Runs(), jitter="1s"),
            "job 'a': option 'jitter' does not apply to after(): it runs once, when its delay "
            "has passed",
        ),
        (
            lambda s: s.after("a", "2s", Runs(), catch_up="1m"),
            "job 'a': option 'catch_up' does not apply to after()",
        ),
        (
            lambda s: s.after("a", "2s", Runs(), run_on_start=True),
            "job 'a': option 'run_on_start' applies to every() and cron() only, not to after()",
        ),
        (
            lambda s: s.at("a", datetime(2030, 1, 1, tzinfo=UTC), Runs(), run_on_start=True),
            "job 'a': option 'run_on_start' applies to every() and cron() only, not to at()",
        ),
        (lambda s: s.after("a", "-1s", Runs()), "job 'a': delay '-1s' is negative"),
        (
            lambda s: s.every("a", "1m", Runs(), run_on_start="yes"),
            "job 'a': option 'run_on_start' = 'yes' is invalid",
        ),
    ],
)
def test_boot_options_are_validated(register: Any, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        register(Scheduler())
    assert str(caught.value).startswith(message)


def test_a_fleet_boot_run_needs_room_for_its_boot_key() -> None:
    """``<key>:start`` is a name too (at most 128 characters): NATS refused a longer one at
    every boot claim (``backend-error``), so such a boot run never ran."""
    scheduler = Scheduler()
    with pytest.raises(ConfigurationError) as caught:
        scheduler.after("x" * 123, "1s", Runs())
    assert str(caught.value).endswith(
        "is too long for a boot run claimed once per fleet: it is claimed under '<key>:start', "
        "at most 128 characters; give it a key of at most 122"
    )
    with pytest.raises(ConfigurationError, match="too long for a boot run"):
        scheduler.every("job", "1m", Runs(), key="k" * 123, run_on_start=True)
    scheduler.after("x" * 122, "1s", Runs())
    scheduler.after("x" * 123, "1s", Runs(), claim=False)  # per process: no boot key
    scheduler.every("y" * 128, "1m", Runs(), run_on_start=True, key="short")
    scheduler.every("z" * 128, "1m", Runs())


def test_after_on_a_claim_only_backend() -> None:
    scheduler = Scheduler(RabbitMQBackend("amqp://127.0.0.1/"))
    job = scheduler.after("sweep", timedelta(seconds=1), Runs())
    assert job.kind == "after"


# -- the fleet on real servers: three instances start together, the boot run happens once ---


class Long:
    """A handler that takes 30 s, and remembers which reasons ran at once."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.overlaps: list[list[str]] = []
        self.reasons: list[str] = []

    async def __call__(self, ctx: JobContext) -> None:
        self.running.append(ctx.reason)
        self.reasons.append(ctx.reason)
        if len(self.running) > 1:
            self.overlaps.append(list(self.running))
        await ctx.sleep(30)
        self.running.remove(ctx.reason)


@pytest.mark.parametrize("instances", [1, 2])
async def test_a_boot_run_and_the_jobs_slots_never_overlap_with_overlap_skip(
    instances: int,
) -> None:
    clock, handler = TestClock("2027-01-15T08:00:59+00:00"), Long()
    schedulers = fleet(clock, instances)
    skips: list[str] = []
    for scheduler in schedulers:
        scheduler.every("sync", "1m", handler, run_on_start=True, catch_up=0)
        scheduler.on("skip", lambda event: skips.append(event.reason))
    await asyncio.gather(*(s.start() for s in schedulers))
    await clock.advance("3m")
    for scheduler in schedulers:
        await scheduler.stop()
    assert handler.overlaps == []
    assert handler.reasons[0] == "start"  # the boot run, then the slots it did not overlap
    assert "overlap" in skips  # 08:01:00 fell due while the boot run held the job's lease
    assert handler.reasons.count("start") == 1

"""``overlap="replace"`` on the memory backend and virtual time: a slot that comes due while the
previous slot's run still goes cuts that run (``ctx.abort_reason == "replaced"``, outcome
``replaced``, recorded once) and then runs, here or on another instance of the fleet; never two
runs of the job at once; a run that does not end within ``max_late`` makes the new slot a skip;
the option is refused on a claim-only backend."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import ConfigurationError, JobContext, Scheduler, SkipEvent
from brokersched.backends.memory import MemoryBackend
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend
from tests.support.wait import until


class Overlaps:
    """A handler that holds its run until told to stop (or ``work_s`` on the clock), and
    counts how many of its runs go at once."""

    def __init__(self, work_s: float = 3600) -> None:
        self.work_s = work_s
        self.going = 0
        self.most = 0
        self.told: list[tuple[int, str | None]] = []  # (slot, abort_reason) of each cut run

    async def __call__(self, ctx: JobContext) -> None:
        self.going += 1
        self.most = max(self.most, self.going)
        try:
            await ctx.sleep(self.work_s)
        except asyncio.CancelledError:
            self.told.append((ctx.slot_ms, ctx.abort_reason))
            raise
        finally:
            self.going -= 1


async def outcomes(sched: Scheduler[Any], name: str) -> list[tuple[int, str]]:
    job = sched.get(name)
    assert job is not None
    return sorted((r.slot_ms, r.outcome) for r in await job.history(50))


async def test_the_next_slot_cuts_the_run_in_the_way(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    handler = Overlaps()
    scheduler.every("feed", "10s", handler, overlap="replace")
    await scheduler.start()
    await clock.advance("35s")  # 08:00:40 cut by :50, cut by 08:01:00, which still runs
    history = await outcomes(scheduler, "feed")
    first = history[0][0]
    assert history == [(first, "replaced"), (first + 10_000, "replaced")]
    assert handler.told == [(slot, "replaced") for slot, _ in history]
    assert handler.most == 1 and handler.going == 1
    job = scheduler.get("feed")
    assert job is not None
    record = (await job.history(1))[0]
    assert record.error == "replaced by a later slot"


async def test_a_run_on_another_instance_is_cut_through_the_fleet(
    memory_fleet: list[Scheduler[MemoryBackend]], clock: TestClock
) -> None:
    """A ran the slot; B's claim of the next one is blocked by A's run: B asks the fleet, A
    reads it at its next heartbeat and cuts its run; B's claim then goes through."""
    a, b = memory_fleet
    handler = Overlaps()
    a.every("feed", "10s", handler, overlap="replace", max_late="30s")
    b.every("feed", "10s", handler, overlap="replace", max_late="30s")
    ran: list[tuple[str, int]] = []
    for name, sched in (("A", a), ("B", b)):
        sched.on("start", lambda e, name=name: ran.append((name, e.slot_ms)))
    await a.start()
    await clock.advance("5s")  # 08:00:35: A alone runs 08:00:40 when it comes
    await b.start()
    await clock.advance("15s")  # 08:00:50: A's run cut, 08:00:50 runs
    history = await outcomes(a, "feed")
    assert history[0][1] == "replaced"
    assert handler.most == 1
    assert [slot for _, slot in ran] == sorted({slot for _, slot in ran})  # each slot once


async def test_a_run_that_does_not_end_makes_the_new_slot_a_skip(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    """A handler that goes on after its cancellation keeps its lease: the next slot waits for
    it until its ``max_late`` is over, then is skipped, saying why."""
    told: list[str | None] = []

    async def stubborn(ctx: JobContext) -> None:
        try:
            await ctx.sleep(3600)
        except asyncio.CancelledError:
            told.append(ctx.abort_reason)
            await ctx.sleep(8)  # finishes what it was doing first

    skips: list[SkipEvent] = []
    scheduler.on("skip", skips.append)
    scheduler.every("feed", "10s", stubborn, overlap="replace", max_late="3s")
    await scheduler.start()
    await clock.advance("24s")  # 08:00:40 runs, 08:00:50 waits until :53, then is skipped
    assert [e.reason for e in skips] == ["overlap"]
    assert skips[0].detail is not None and "did not end within max_late (3s)" in skips[0].detail
    assert told == ["replaced"]
    await clock.advance("5s")  # the cut run ends at 08:00:58
    assert [o for _, o in await outcomes(scheduler, "feed")] == ["replaced"]


def test_replace_needs_a_lease_backend() -> None:
    sched = Scheduler(DictClaimBackend())
    with pytest.raises(ConfigurationError, match="needs a lease backend") as info:
        sched.every("feed", "10s", Overlaps(), overlap="replace")  # type: ignore[call-overload]
    assert info.value.option == "overlap"
    assert info.value.backend == "DictClaimBackend"
    assert "'replace'" in str(info.value)


def test_replace_does_not_apply_to_at() -> None:
    sched = Scheduler(MemoryBackend())
    with pytest.raises(ConfigurationError, match="does not apply to at"):
        sched.at("once", datetime(2030, 1, 1, tzinfo=UTC), Overlaps(), overlap="replace")  # type: ignore[call-overload]


async def test_a_sync_handler_is_told_through_abort_reason() -> None:
    """A sync handler runs in a thread, which cannot be cancelled: it sees
    ``ctx.abort_reason == "replaced"`` and returns; its run is recorded ``replaced`` all the
    same. Real time: the thread is the point."""
    told: list[str | None] = []

    def polite(ctx: JobContext) -> None:
        while ctx.abort_reason is None and len(told) < 3:
            time.sleep(0.01)
        told.append(ctx.abort_reason)

    sched = Scheduler(MemoryBackend(), jitter=0)
    job = sched.every("feed", "1s", polite, overlap="replace")
    async with sched:
        await until(lambda: told, what="the first run told to stop")
        await until(lambda: _replaced(job), what="its record")
    assert told[0] == "replaced"


async def _replaced(job: Any) -> bool:
    return any(record.outcome == "replaced" for record in await job.history(10))


async def test_a_job_run_on_every_instance_replaces_its_own_run(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    """``claim=False``: no lease, the runs are this instance's; the next slot cuts the one in
    its way and waits for it to end."""
    handler = Overlaps()
    scheduler.every("warm", "10s", handler, overlap="replace", claim=False)
    await scheduler.start()
    await clock.advance("25s")
    assert [o for _, o in await outcomes(scheduler, "warm")] == ["replaced"]
    assert handler.most == 1 and handler.going == 1

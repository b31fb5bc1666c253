"""A stored schedule's new version applied while the loop is late (the poll's answer, or the
switch at a version's effective time, handled before the timer of a slot already due) must not
drop that slot: it is still a slot of the version in force at its instant, and every instance
of the fleet, equally loaded, drops it alike, with no skip and no missed report."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from brokersched import BackendError, JobContext, Scheduler
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START


@pytest.mark.asyncio
async def test_a_version_applied_after_a_due_slot_before_its_timer_keeps_the_slot() -> None:
    seen: list[int] = []
    sched = Scheduler(MemoryBackend(), jitter=0, instance_id="i0")

    @sched.task("tick")
    async def tick(ctx: JobContext) -> None:
        seen.append(ctx.slot_ms)

    await sched.start()
    try:
        await sched.schedules.put("acme", task="tick", every="1s")
        await asyncio.sleep(3.5)
        # a second version, in force later: the record the next poll applies
        await sched.schedules.put("acme", task="tick", every="1s", data="v2")
        runner: Any = sched._life.runner
        stored = runner.stored
        await asyncio.sleep(0.6)  # read by the poll
        loop = asyncio.get_running_loop()
        now = time.time()
        slot_s = int(now) + 1  # the next slot

        def late_loop() -> None:
            # The poll's answer is in the ready queue when the loop stalls past the slot: it
            # is handled before the slot's timer, which only comes due now.
            loop.call_soon(stored.apply, "acme")
            time.sleep(0.1)

        loop.call_at(loop.time() + (slot_s - time.time()) - 0.05, late_loop)
        await asyncio.sleep(slot_s - time.time() + 1.5)
    finally:
        await sched.stop()
    assert slot_s * 1000 in seen, (slot_s * 1000, seen[-4:])


@pytest.mark.asyncio
async def test_a_slot_of_a_version_read_after_it_is_reported_missed_not_dropped_unseen() -> None:
    """An instance that reads a new version only after one of its slots (its reads failing
    meanwhile, as a loaded or cut-off instance's do) never armed that slot: no instance ran
    it, and it must be reported missed, as the slots it skipped fail-closed are."""
    clock, store = TestClock(START), MemoryStore()
    member = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id="i0")
    writer = Scheduler(MemoryBackend(store=store), clock=clock, instance_id="writer")
    member.task("tick")(lambda ctx: None)
    missed: list[int] = []
    member.on("missed", lambda e: missed.append(e.slot_ms))
    writer.on("missed", lambda e: missed.append(e.slot_ms))
    await member.start()
    await writer.start()
    try:
        await writer.schedules.put("acme", task="tick", every="1h")  # no slot in this test
        await clock.advance("5s")
        real_read = member.backend.fleet_records

        async def failing(kind: Any) -> dict[str, str]:
            raise BackendError("store away")

        member.backend.fleet_records = failing  # type: ignore[method-assign]
        second = await writer.schedules.put("acme", task="tick", every="7s")
        change_ms = round(second.effective_at.timestamp() * 1000)
        first_slot = change_ms - change_ms % 7000 + 7000
        await clock.advance("12s")  # past the new version's first slot
        member.backend.fleet_records = real_read  # type: ignore[method-assign]
        await clock.advance("3m")
    finally:
        await member.stop()
        await writer.stop()
    assert first_slot in missed, (first_slot, missed)

"""A slot of a stored schedule runs with the version in force at the slot's instant, even when
its run begins after the next version's effective time (a slow claim, a late timer): its
``ctx.data`` and task are that version's, and a delete taking effect just after the slot does
not leave the slot claimed and never run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from brokersched import JobContext, Scheduler
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START


class SlowClaims(MemoryBackend):
    """A memory backend whose claims take 300 ms (on the scheduler's clock)."""

    async def acquire_many(self, claims: Sequence[Any], *, instance_id: str, timeout: float) -> Any:
        assert self._clock is not None
        await self._clock.sleep(0.3)
        return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)

    async def _acquire(self, claim: Any, instance_id: str, timeout: float) -> Any:
        assert self._clock is not None
        await self._clock.sleep(0.3)
        return await super()._acquire(claim, instance_id, timeout)


def _member(
    clock: TestClock, store: MemoryStore, seen: list[tuple[str, int, Any]]
) -> Scheduler[Any]:
    sched = Scheduler(SlowClaims(store=store), clock=clock, jitter=0, instance_id="i0")

    def task(name: str) -> Any:
        async def run(ctx: JobContext) -> None:
            seen.append((name, ctx.slot_ms, ctx.data))

        return run

    sched.task("one")(task("one"))
    sched.task("two")(task("two"))
    return sched


async def _to_ms_of_second(clock: TestClock, ms: int) -> None:
    """Advance to the next instant ``ms`` past a whole second."""
    await clock.advance(((ms - clock.now_ms()) % 1000 or 1000) / 1000)


@pytest.mark.asyncio
async def test_a_slot_claimed_slowly_runs_with_its_own_versions_task_and_data() -> None:
    clock, store = TestClock(START), MemoryStore()
    seen: list[tuple[str, int, Any]] = []
    member = _member(clock, store, seen)
    await member.start()
    try:
        await member.schedules.put("acme", task="one", every="1s", data="v1")
        await clock.advance("5s")
        await _to_ms_of_second(clock, 100)
        second = await member.schedules.put("acme", task="two", every="1s", data="v2")
        change_ms = round(second.effective_at.timestamp() * 1000)
        assert change_ms % 1000 == 100  # the slot at change_ms - 100 is the first version's
        await clock.advance("5s")
    finally:
        await member.stop()
    before = [(task, data) for task, slot, data in seen if slot < change_ms]
    after = [(task, data) for task, slot, data in seen if slot >= change_ms]
    assert before and after
    assert set(after) == {("two", "v2")}
    assert set(before) == {("one", "v1")}, [s for s in seen if s[1] >= change_ms - 1000]


@pytest.mark.asyncio
async def test_a_delete_taking_effect_during_a_slow_claim_still_runs_the_slot_before_it() -> None:
    clock, store = TestClock(START), MemoryStore()
    seen: list[tuple[str, int, Any]] = []
    member = _member(clock, store, seen)
    await member.start()
    try:
        await member.schedules.put("acme", task="one", every="1s", data="v1")
        await clock.advance("5s")
        await _to_ms_of_second(clock, 100)
        assert await member.schedules.delete("acme")
        gone_ms = clock.now_ms() + 3000
        await clock.advance("5s")
    finally:
        await member.stop()
    slots = sorted(slot for _, slot, _ in seen)
    # the last slot before the delete took effect (gone_ms - 100) is a slot of version 1
    assert slots[-1] == gone_ms - 100, (slots[-3:], gone_ms)


@pytest.mark.asyncio
async def test_a_schedule_the_store_no_longer_has_stops_on_the_running_instances() -> None:
    clock, store = TestClock(START), MemoryStore()
    seen: list[tuple[str, int, Any]] = []
    member = _member(clock, store, seen)
    await member.start()
    try:
        await member.schedules.put("acme", task="one", every="1s", data="v1")
        await clock.advance("10s")
        assert seen
        store.fleet.clear()  # the store forgot every schedule (and the log of changes)
        assert [s async for s in member.schedules.list()] == []
        assert await member.schedules.delete("acme") is False  # nothing an operator can stop
        await clock.advance("2m")  # past the periodic re-read of every record
        ran = len(seen)
        await clock.advance("10s")
    finally:
        await member.stop()
    assert len(seen) == ran, "a schedule the store no longer has still runs"

"""Schedules as data on the real servers: a schedule written through one scheduler's backend
(the writer runs no task) runs once per slot on a fleet of three others; a change of interval
and data applies from its effective time on every instance alike, and a delete stops it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest

from brokersched import JobContext, Scheduler
from tests.support.namespaces import fresh_namespace

KINDS = ["postgres", "sqlite", "rabbitmq", "nats", "nats-lease", "redis", "redis-lease"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stored_schedule_runs_once_per_slot_of_the_version_in_force(
    request: pytest.FixtureRequest, kind: str
) -> None:
    async with fresh_namespace(request, kind, "stored") as make:
        ran: list[tuple[str, int, Any]] = []

        def task(name: str) -> Any:
            async def tick(ctx: JobContext) -> None:
                ran.append((name, ctx.slot_ms, ctx.data))

            return tick

        fleet = [Scheduler(make(), instance_id=f"i{n}") for n in range(3)]
        for sched in fleet:
            sched.task("tick")(task(sched.instance_id))
        writer = Scheduler(make(), instance_id="writer")
        await asyncio.gather(*(sched.start() for sched in [writer, *fleet]))
        try:
            first = await writer.schedules.put(
                "tenant-1", task="tick", every="1s", jitter=0, max_late="2s"
            )
            await _until(lambda: all(s.get("tenant-1") is not None for s in fleet), 5)
            await asyncio.sleep(3.5)
            second = await writer.schedules.put(
                "tenant-1",
                task="tick",
                every="2s",
                jitter=0,
                max_late="2s",
                data="v2",
                if_version=1,
                by="ops",
            )
            await asyncio.sleep(7)
            assert await writer.schedules.delete("tenant-1", if_version=2)
            gone_ms = round(time.time() * 1000) + 3000
            # the job goes once its last slots could no longer be claimed (max_late after it)
            await _until(lambda: all(s.get("tenant-1") is None for s in fleet), 20)
            await asyncio.sleep(1.5)
            listed = [s async for s in writer.schedules.list()]
        finally:
            await asyncio.gather(*(sched.stop() for sched in [writer, *fleet]))
    assert listed == []
    counts = Counter(slot for _, slot, _ in ran)
    assert set(counts.values()) == {1}, counts  # no slot ran twice
    first_ms = _ms(first.effective_at)
    change_ms = _ms(second.effective_at)
    slots = sorted(counts)
    assert slots[0] >= first_ms
    ones = [s for s in slots if s < change_ms]
    twos = [s for s in slots if s >= change_ms]
    assert len(ones) >= 3 and len(twos) >= 3, slots
    missing = "a slot of the first version is missing"
    assert ones == list(range(ones[0], ones[-1] + 1, 1000)), missing
    assert all(s % 2000 == 0 for s in twos) and twos == list(range(twos[0], twos[-1] + 1, 2000))
    assert twos[0] - change_ms < 2000, "the second version's first slot is missing"
    assert twos[-1] < gone_ms, "a slot ran after the delete took effect"
    assert {d for _, s, d in ran if s < change_ms} == {None}
    assert {d for _, s, d in ran if s >= change_ms} == {"v2"}


def _ms(value: Any) -> int:
    return round(value.timestamp() * 1000)


async def _until(condition: object, timeout_s: float) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)

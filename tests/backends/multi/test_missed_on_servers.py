"""Missed slots on the real servers: a fleet of three instances whose process freezes (a
blocked event loop: every instance at once) leaves slots that nobody ran; once the checks are
over, every slot of the job since its first run either ran once or was reported missed once,
by one instance, with its record in the backend's history."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest

from brokersched import JobContext, MissedEvent, Scheduler
from tests.support.namespaces import fresh_namespace

KINDS = ["postgres", "sqlite", "rabbitmq", "nats", "nats-lease", "redis", "redis-lease"]
FROZEN_S = 2.6  # about two slots of the job pass while the process is frozen
SETTLED_S = 20.0  # what the checks (max_late, then a margin for clocks and flights) may take


@pytest.mark.parametrize("kind", KINDS)
async def test_every_slot_ran_once_or_was_reported_missed_once(
    request: pytest.FixtureRequest, kind: str
) -> None:
    async with fresh_namespace(request, kind, "missed") as make:
        schedulers = [
            Scheduler(make(), jitter=0, max_late="300ms", instance_id=f"i{n}") for n in range(3)
        ]
        ran: list[int] = []
        reported: list[tuple[str, int]] = []

        async def tick(ctx: JobContext) -> None:
            ran.append(ctx.slot_ms)

        for sched in schedulers:
            lease = sched.backend.capabilities.leases
            sched.every("tick", "1s", tick, **({"catch_up": 0} if lease else {}))  # type: ignore[call-overload]

            def on_missed(event: MissedEvent, name: str = sched.instance_id) -> None:
                reported.append((name, event.slot_ms))

            sched.on("missed", on_missed)
        await asyncio.gather(*(sched.start() for sched in schedulers))
        try:
            await _until(lambda: len(ran) >= 2, 10)
            time.sleep(FROZEN_S)  # noqa: ASYNC251 - the process freezes: every instance at once
            woke_ms = round(time.time() * 1000)
            await _until(lambda: _settled(ran, reported, woke_ms, schedulers), SETTLED_S)
            job = schedulers[0].get("tick")
            records = await job.history(100)
        finally:
            await asyncio.gather(*(sched.stop() for sched in schedulers))
    slots = [s for s in range(ran[0], woke_ms, 1000)]
    outcomes = Counter(ran) + Counter(slot for _, slot in reported)
    assert {slot: outcomes[slot] for slot in slots} == dict.fromkeys(slots, 1), (ran, reported)
    assert len(reported) >= 2, "a frozen process that missed nothing proves nothing"
    missed = sorted(r.slot_ms for r in records if r.outcome == "missed")
    assert missed == sorted(slot for _, slot in reported)
    assert {r.reason for r in records if r.outcome == "missed"} == {"missed"}


def _settled(
    ran: list[int], reported: list[tuple[str, int]], woke_ms: int, fleet: list[Scheduler[Any]]
) -> bool:
    """Every slot from the first run to the wake is accounted for (it ran or was reported),
    and no instance watches a slot or checks one any more."""
    done = set(ran) | {slot for _, slot in reported}
    if not all(slot in done for slot in range(ran[0], woke_ms, 1000)):
        return False
    return all(sched._life.runner is None or sched._life.runner.missed.idle for sched in fleet)


async def _until(condition: object, timeout_s: float) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)

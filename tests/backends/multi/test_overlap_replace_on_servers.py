"""``overlap="replace"`` on every lease backend against the real thing (MemoryBackend, a SQLite
file, the PostgreSQL server, Redis in lease mode, a NATS KV bucket): two instances whose slots
interleave cut each other's runs through the fleet's controls, each cut run is recorded
``replaced`` once and never two runs of the job go at once (virtual time); a runner that died
holding its lease makes the next slot wait for the lease to expire on the store's clock (real
time: the store is the point)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import JobContext, Scheduler, StartEvent
from brokersched._clock import ms_to_datetime
from brokersched.abc import Backend, JobPolicy, Lease, LeaseBackend, Slot
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.leases import acquire
from tests.support.namespaces import fresh_namespace
from tests.support.wait import until

KINDS = ["memory", "sqlite", "postgres", "redis-lease", "nats-lease"]


@pytest.fixture(params=KINDS)
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Backend]]:
    """A factory of lease backends of one fresh namespace (one per instance)."""
    if request.param == "memory":
        store = MemoryStore()
        yield lambda **options: MemoryBackend(store=store, **options)
        return
    async with fresh_namespace(request, request.param, "replace") as make:
        yield make


class Holder:
    """A handler that holds its run until cut, and checks that no two runs ever go at once."""

    def __init__(self) -> None:
        self.going: set[str] = set()
        self.most = 0
        self.cut: list[tuple[str, int, str | None]] = []  # instance, slot, abort_reason

    async def __call__(self, ctx: JobContext) -> None:
        self.going.add(ctx.run_id)
        self.most = max(self.most, len(self.going))
        try:
            await ctx.sleep(3600)
        except asyncio.CancelledError:
            self.cut.append((ctx.instance_id, ctx.slot_ms, ctx.abort_reason))
            raise
        finally:
            self.going.discard(ctx.run_id)


async def test_instances_cut_each_others_runs(make: Callable[..., Backend]) -> None:
    """A's slots fall at :05, :15...; B's at :00, :10... (a deploy that moved the job's
    offset): each slot finds the other instance's run in the way, has it cut through the
    fleet's controls, and runs once that run's lease is released."""
    clock = TestClock(datetime.now(UTC).replace(microsecond=0))
    holder = Holder()
    starts: list[StartEvent] = []

    def instance(name: str, offset: str) -> Scheduler[Any]:
        # virtual slots run ahead of the store's clock
        backend = make(max_clock_skew="1h")
        sched = Scheduler(backend, clock=clock, jitter=0, instance_id=name, heartbeat="1s")
        sched.every("feed", "10s", holder, offset=offset, overlap="replace", max_late="8s")
        sched.on("start", starts.append)
        return sched

    a, b = instance("A", "5s"), instance("B", "0s")
    start_ms = clock.now_ms()
    async with a, b:
        # 3 s after a slot: the run it cut has ended (a heartbeat, a release) and it runs
        await clock.advance_to(ms_to_datetime(start_ms - start_ms % 5000 + 43_000))
        job = a.get("feed")
        assert job is not None
        history = await job.history(50)
        slots = [e.slot_ms for e in starts]
        cut = [slot for _, slot, reason in holder.cut if reason == "replaced"]
    assert holder.most == 1
    assert len(slots) >= 7 and len(slots) == len(set(slots))  # every slot ran, once
    assert {s % 10_000 for s in slots} == {0, 5_000}  # on both instances' grids
    replaced = sorted(r.slot_ms for r in history if r.outcome == "replaced")
    assert replaced == sorted(cut)  # each once
    assert replaced == slots[:-1]  # every run but the last was cut by the next slot
    by_slot = {r.slot_ms: r.instance_id for r in history}
    assert set(by_slot.values()) == {"A", "B"}


async def test_a_dead_runners_lease_is_waited_for(make: Callable[..., Backend]) -> None:
    """A runner died holding the lease of the job's last slot (3 s): the next slots, 2 s
    apart, wait for that lease to expire on the store's clock (the latest of them then runs);
    the dead attempt is recorded ``interrupted`` once (``max_attempts=1``: not restarted),
    never ``replaced``."""
    dead = make(lease_ttl="3s")
    assert isinstance(dead, LeaseBackend)
    ran: list[tuple[int, float]] = []

    async def work(ctx: JobContext) -> None:
        ran.append((ctx.slot_ms, asyncio.get_running_loop().time()))

    sched = Scheduler(make(lease_ttl="3s"), jitter=0, instance_id="B")
    options: dict[str, Any] = {"overlap": "replace", "max_attempts": 1, "catch_up": 0}
    job = sched.every("feed", "2s", work, max_late="5s", **options)
    await dead.start(sched.clock)
    try:
        now = sched.clock.now_ms()
        last = now - now % 2000
        policy = JobPolicy("feed", overlap="replace", max_attempts=1)
        lease = await acquire(dead, Slot("feed", last), policy, instance="died")
        held_since = asyncio.get_running_loop().time()
        assert isinstance(lease, Lease)
        async with sched:
            await until(lambda: ran, what="the next slot's run")
            await until(lambda: _outcomes_of(job, last), what="the dead attempt's record")
            records = await _outcomes_of(job, last)
    finally:
        await dead.stop()
    slot, started = ran[0]
    assert slot > last
    assert started - held_since >= 2.9  # not before the dead runner's lease expired
    assert records == ["interrupted"]


async def _outcomes_of(job: Any, slot_ms: int) -> list[str]:
    return [r.outcome for r in await job.history(20) if r.slot_ms == slot_ms]

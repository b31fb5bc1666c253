"""``start(wait=False)``: the application starts while its backend is away; the scheduler
connects in the background, reports not-ready meanwhile and never runs a slot unclaimed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from brokersched import BackendUnavailableError, JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock
from tests.support.names import unique
from tests.support.rabbitmq_helpers import TrackedBackend, delete_queues, via
from tests.support.tcp_proxy import TcpProxy

START = "2027-01-15T08:00:00+00:00"


class DownBackend(MemoryBackend):
    """Refuses to start while ``down`` (as a broker that is not there yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.attempts = 0

    async def start(self, clock: Any) -> None:
        self.attempts += 1
        if self.down:
            raise BackendUnavailableError("connection refused")
        await super().start(clock)


async def test_start_without_waiting_retries_until_the_backend_answers() -> None:
    clock = TestClock(START)
    backend = DownBackend()
    notes: list[str] = []

    @asynccontextmanager
    async def lifespan(scheduler: Scheduler[Any]) -> AsyncIterator[None]:
        notes.append("enter")
        yield
        notes.append("exit")

    sched = Scheduler(backend, clock=clock, jitter=0, max_late="10s", lifespan=lifespan)
    runs: list[int] = []

    @sched.every("tick", "5s")
    async def tick(ctx: JobContext) -> None:
        runs.append(ctx.slot_ms)

    await sched.start(wait=False)
    assert notes == ["enter"] and not sched.ready
    await clock.advance("3s")  # attempts at 0, 0.5 s, 1.5 s
    assert backend.attempts == 3 and not sched.ready
    with pytest.raises(RuntimeError, match="the backend is not reachable yet"):
        await sched.get("tick").trigger()  # type: ignore[union-attr]
    assert sched.overdue() == []  # not yet: 2 slots + max_late
    await clock.advance("20s")
    assert runs == []  # nothing ran unclaimed
    assert [job.name for job in sched.overdue()] == ["tick"]  # 08:00:10 + 10 s has passed

    backend.down = False
    await clock.advance("30s")  # the next attempt (at most 30 s later) connects
    assert sched.ready
    assert runs and all(slot >= clock.now_ms() - 30_000 for slot in runs)
    assert sched.overdue() == []
    await sched.stop()
    assert notes == ["enter", "exit"]


async def test_stop_ends_the_attempts_and_the_lifespan() -> None:
    clock = TestClock(START)
    backend = DownBackend()
    exits: list[str] = []

    @asynccontextmanager
    async def lifespan(scheduler: Scheduler[Any]) -> AsyncIterator[None]:
        yield
        exits.append("exit")

    sched = Scheduler(backend, clock=clock, lifespan=lifespan)
    await sched.start(wait=False)
    await clock.advance("2s")
    waiter = asyncio.ensure_future(sched.wait_stopped())
    await sched.stop()
    await asyncio.wait_for(waiter, 1)
    attempts = backend.attempts
    await clock.advance("1m")
    assert backend.attempts == attempts  # no attempt after stop()
    assert exits == ["exit"] and not sched.ready
    backend.down = False
    async with sched:  # and it can start again
        assert sched.ready


async def test_a_rabbitmq_that_is_down_at_start_is_waited_for(
    amqp_url: str, amqp_proxy: TcpProxy
) -> None:
    """RabbitMQ unreachable at start (the proxy refuses connections), then reachable: the
    scheduler connects by itself and its slots run, claimed. About 3 s."""
    await amqp_proxy.cut()
    touched: set[str] = set()
    backend = TrackedBackend(via(amqp_url, amqp_proxy.port), touched=touched, prefix=unique("t"))
    sched = Scheduler(backend, jitter=0)
    runs: list[str] = []
    sched.every("tick", "500ms", lambda ctx: runs.append(ctx.run_id))
    try:
        await sched.start(wait=False)
        await asyncio.sleep(1.0)
        assert not sched.ready and runs == []
        amqp_proxy.restore()
        deadline = time.monotonic() + 15
        while not (sched.ready and runs):
            assert time.monotonic() < deadline, "not connected and running within 15 s"
            await asyncio.sleep(0.05)
        await sched.stop()
    finally:
        await sched.stop()
        await delete_queues(amqp_url, touched)
    assert amqp_proxy.accepted >= 1

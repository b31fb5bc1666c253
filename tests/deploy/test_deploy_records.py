"""Recording a run never holds up the next one: records are written in the background, in
order; while the backend is away, those beyond ``record_buffer`` are dropped (counted, logged, a
metric); ``stop()`` writes what it can within ``drain_timeout``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from brokersched import (
    BackendUnavailableError,
    JobContext,
    MemoryBackend,
    PrometheusMetrics,
    RecordDroppedEvent,
    Scheduler,
)
from brokersched.abc import JobPolicy, RunRecord
from brokersched.testing import TestClock
from tests.support.names import unique
from tests.support.rabbitmq_helpers import TrackedBackend, delete_queues, via
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import until

START = "2027-01-15T08:00:00+00:00"


class AwayBackend(MemoryBackend):
    """Writes records as the memory backend does, except while ``away``: then a write fails
    after 10 s (virtual), as one to an unreachable broker does."""

    def __init__(self, clock: TestClock) -> None:
        super().__init__()
        self.clock = clock
        self.away = False

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self.record_many([(job, record)])

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        if self.away:
            await self.clock.sleep(10)
            raise BackendUnavailableError("the broker is away")
        await super().record_many(records)


def tick(ctx: JobContext) -> None: ...


async def test_a_claim_false_job_keeps_its_rhythm_while_records_cannot_be_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = TestClock(START)
    backend = AwayBackend(clock)
    sched = Scheduler(backend, clock=clock, jitter=0, record_buffer=5)
    metrics = PrometheusMetrics(CollectorRegistry()).attach(sched)
    job = sched.every("refresh", "1s", tick, claim=False)
    skips: list[str] = []
    sched.on("skip", lambda event: skips.append(event.reason))
    told: list[RecordDroppedEvent] = []
    sched.on("record-dropped", told.append)
    async with sched:
        backend.away = True
        await clock.advance("30s")
        assert skips == []  # not one slot skipped as overlap: runs do not wait for records
        assert [event.dropped for event in told] == list(range(1, 26))
        assert {(event.job, event.outcome) for event in told} == {("refresh", "completed")}
        assert sched._recorder.pending == 5
        dropped = [r for r in caplog.records if getattr(r, "event", None) == "record-dropped"]
        assert len(dropped) == 25
        assert dropped[-1].getMessage().endswith("25 dropped so far")
        sample = metrics.registry.get_sample_value(
            "brokersched_records_dropped_total", {"job": "refresh"}
        )
        assert sample == 25

        backend.away = False  # the broker is back: the 5 kept, then the new ones, in order
        await clock.advance("20s")
        records = await job.history(100)
    slots = [record.slot_ms for record in reversed(records)]
    assert slots == sorted(slots)
    first_ms = 1_800_000_000_000 + 1000  # 08:00:01, the first slot
    assert slots[:5] == [first_ms + n * 1000 for n in range(5)]  # the oldest were kept
    assert slots[-1] == first_ms + 49_000  # 08:00:50: written at once, the broker being back
    assert len(records) + sched._recorder.dropped == 50  # each run written or counted


async def test_stop_writes_what_it_can_within_drain_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = TestClock(START)
    backend = AwayBackend(clock)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="5s")
    sched.every("refresh", "1s", tick, claim=False)
    await sched.start()
    backend.away = True
    await clock.advance("3s")
    began = clock.monotonic_ms()
    await sched.stop()
    assert clock.monotonic_ms() - began <= 5000 + 2000  # drain_timeout, plus a write's grace
    assert sched._recorder.dropped == 3
    assert "stop() could not write it within" in caplog.text


async def test_stop_flushes_records_waiting_for_a_slow_backend() -> None:
    clock = TestClock(START)
    backend = AwayBackend(clock)
    sched = Scheduler(backend, clock=clock, jitter=0, drain_timeout="10s")
    job = sched.every("refresh", "1s", tick, claim=False)
    await sched.start()
    backend.away = True
    await clock.advance("3s")
    backend.away = False  # the next retry (within 5 s) writes all three
    await sched.stop()
    assert sched._recorder.dropped == 0
    assert len(await sched.backend.history(job.settings.policy, 10)) == 3


async def test_a_claim_false_job_keeps_its_rhythm_through_a_rabbitmq_outage(
    amqp_url: str, amqp_proxy: TcpProxy
) -> None:
    """The broker is cut off for 6 s (real time): the per-instance job runs every second all
    the same, and its records reach the broker once it is back. About 10 s."""
    touched: set[str] = set()
    backend = TrackedBackend(via(amqp_url, amqp_proxy.port), touched=touched, prefix=unique("t"))
    sched = Scheduler(backend, jitter=0)
    job = sched.every("refresh", "1s", tick, claim=False)
    started: list[float] = []
    skips: list[str] = []
    sched.on("start", lambda event: started.append(time.monotonic()))
    sched.on("skip", lambda event: skips.append(event.reason))
    try:
        async with sched:
            await until(lambda: len(started) >= 2, timeout=10, what="two runs before the outage")
            await amqp_proxy.cut()
            cut_at = time.monotonic()
            await asyncio.sleep(6)
            during = [at for at in started if at > cut_at]
            amqp_proxy.restore()
            assert len(during) >= 5, during  # not 1 or 2 held up by 10 s writes
            assert skips == []
            await until(
                lambda: sched._recorder.pending == 0, timeout=20, what="the records to be written"
            )
            records = await job.history(100)
    finally:
        await delete_queues(amqp_url, touched)
    assert sched._recorder.dropped == 0
    assert len(records) >= len(started) - 1  # the last run may have finished after the stop
    slots = [record.slot_ms for record in reversed(records)]
    assert slots == sorted(slots)

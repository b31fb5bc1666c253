"""Run records that queue while a write is going are written together (``record_many``), on
a backend that writes a batch in one round trip; each record is written once, in order, and a
record that can never be written costs only itself. The backends' side is in the conformance
suites."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from brokersched import BackendError, MemoryBackend
from brokersched._clock import Clock
from brokersched._events import Events
from brokersched._recorder import Recorder
from brokersched._tasks import TaskSet
from brokersched.abc import Backend, JobPolicy, RunRecord
from brokersched.testing import TestClock

POLICY = JobPolicy("job", history_size=100)


def run(n: int, error: str | None = None) -> RunRecord:
    started = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)
    return RunRecord(
        "job", n, f"run-{n}", "i1", "schedule", 1, started, started, "completed", error
    )


class BatchingMemory(MemoryBackend):
    """Writes a batch all or none; remembers each write. ``gate`` holds the writes back,
    ``down`` fails them as an outage, a record whose error is ``"bad"`` fails as a bug."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.down = False

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self.record_many([(job, record)])

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        self.writes.append([record.slot_ms for _, record in records])
        await self.gate.wait()
        if self.down:
            raise BackendError("database away")
        if any(record.error == "bad" for _, record in records):
            raise ValueError("cannot encode this record")
        for job, record in records:
            self._append(job, record)


async def written(backend: BatchingMemory) -> list[int]:
    return [record.slot_ms for record in reversed(await backend.history(POLICY, 100))]


@pytest.fixture
async def backend() -> BatchingMemory:
    backend = BatchingMemory()
    await backend.start(TestClock())
    return backend


def recorder_on(clock: Clock, backend: Backend) -> Recorder:
    return Recorder(clock, backend, 100, Events(TaskSet(clock)))


async def test_records_queued_during_a_write_go_in_one_write(backend: BatchingMemory) -> None:
    recorder = recorder_on(TestClock(), backend)
    backend.gate.clear()
    recorder.put(POLICY, run(0))
    await asyncio.sleep(0)  # the first write is going
    for n in range(1, 6):
        recorder.put(POLICY, run(n))
    backend.gate.set()
    await recorder.wait_written(5)
    assert backend.writes == [[0], [1, 2, 3, 4, 5]]
    assert await written(backend) == [0, 1, 2, 3, 4, 5]


async def test_an_outage_retries_the_batch_without_duplicates(backend: BatchingMemory) -> None:
    clock = TestClock()
    recorder = recorder_on(clock, backend)
    backend.down = True
    for n in range(4):
        recorder.put(POLICY, run(n))
    await clock.settle()
    backend.down = False
    await clock.advance("1s")
    await recorder.wait_written(5)
    assert backend.writes[0] == [0, 1, 2, 3] and backend.writes[-1] == [0, 1, 2, 3]
    assert await written(backend) == [0, 1, 2, 3]


async def test_a_record_that_cannot_be_written_costs_only_itself(
    backend: BatchingMemory, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = recorder_on(TestClock(), backend)
    for n in range(4):
        recorder.put(POLICY, run(n, error="bad" if n == 2 else None))
    await recorder.wait_written(5)
    assert await written(backend) == [0, 1, 3]
    assert "could not record run run-2 of job" in caplog.text


async def test_a_backend_without_batches_gets_one_record_at_a_time() -> None:
    backend = MemoryBackend()
    await backend.start(TestClock())
    recorder = recorder_on(TestClock(), backend)
    for n in range(3):
        recorder.put(POLICY, run(n))
    await recorder.wait_written(5)
    assert len(await backend.history(POLICY, 10)) == 3

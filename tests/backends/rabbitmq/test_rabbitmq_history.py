"""RabbitMQ history: one stream per prefix (no quorum queue per job, which hung a broker with a
soft open-files limit of 1024 at ~310 jobs), with the per-job bounds kept by the backend,
against the real broker on 127.0.0.1:5672. The node loss is in
tests/cluster/test_rabbitmq_cluster.py."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest

from brokersched import BackendError
from brokersched.abc import JobPolicy
from brokersched.backends.rabbitmq import (
    RabbitMQBackend,
    _history,
    history_queue_name,
    history_stream_name,
)
from tests.support.names import unique
from tests.support.rabbitmq_helpers import (
    CLOCK,
    SLOT,
    delete_queues,
    fleet_queues,
    queue_exists,
    run_record,
)
from tests.support.wait import until

JOBS = ("job", "big", "busy", "rare", "a", "b", "old", "w0", "w1", "w2", "n0", "n1", "n2", "n3")


@pytest.fixture
def prefix() -> str:
    return unique("h")


@pytest.fixture
async def backend(amqp_url: str, prefix: str) -> AsyncIterator[RabbitMQBackend]:
    started = RabbitMQBackend(amqp_url, prefix=prefix, slot_ttl="1m")
    await started.start(CLOCK)
    yield started
    await started.stop()
    histories = [history_queue_name(prefix, job) for job in JOBS]
    await delete_queues(amqp_url, [*histories, *fleet_queues(prefix)])


async def is_stream(raw: aio_pika.abc.AbstractConnection, queue: str) -> bool:
    """A declare naming another type than the queue's is refused naming ``x-queue-type``; one
    naming its type but not its retention is refused naming the retention."""
    channel = await raw.channel()
    try:
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "stream"})
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        return "'x-max-length-bytes'" in repr(exc.args)
    await channel.close()
    return True


def ids(records: list[object]) -> list[str]:
    return [record.run_id for record in records]  # type: ignore[attr-defined]


async def test_every_job_records_into_one_stream_read_newest_first_within_each_bound(
    backend: RabbitMQBackend, raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """One broker object for the prefix, however many jobs; each job keeps its own
    history_size (count trimming by the reader), newest first, and a limit below it."""
    small, large = JobPolicy("a", history_size=3), JobPolicy("b", history_size=7)
    for n in range(10):
        await backend.record(small, run_record("a", SLOT + n, n))
        await backend.record(large, run_record("b", SLOT + n, 100 + n))
    assert await is_stream(raw, history_stream_name(prefix))
    for job in ("a", "b"):
        assert not await queue_exists(raw, history_queue_name(prefix, job))
    assert ids(await backend.history(small, 10)) == ["run-9", "run-8", "run-7"]
    assert ids(await backend.history(large, 10)) == [f"run-{n}" for n in range(109, 102, -1)]
    assert ids(await backend.history(large, 2)) == ["run-109", "run-108"]
    assert await backend.history(small, 0) == []
    assert await backend.history(JobPolicy("job", history_size=5), 5) == []  # none recorded
    for _ in range(3):  # reads leave everything in place
        assert ids(await backend.history(small, 10)) == ["run-9", "run-8", "run-7"]


async def test_a_busy_job_does_not_hide_a_rare_jobs_records(backend: RabbitMQBackend) -> None:
    """The rare job's records lie far behind the busy job's: the reader steps back until it
    has them (the stream's byte retention is far above what the busy job wrote)."""
    rare, busy = JobPolicy("rare", history_size=10), JobPolicy("busy", history_size=20)
    for n in range(2):
        await backend.record(rare, run_record("rare", SLOT + n, n))
    semaphore = asyncio.Semaphore(32)

    async def write(n: int) -> None:
        async with semaphore:
            await backend.record(busy, run_record("busy", SLOT + n, n))

    await asyncio.gather(*(write(n) for n in range(2000)))
    assert ids(await backend.history(rare, 10)) == ["run-1", "run-0"]
    assert len(await backend.history(busy, 100)) == 20


async def stream_headers(
    raw: aio_pika.abc.AbstractConnection, stream: str
) -> list[dict[str, object]]:
    """The headers of every message of ``stream``, oldest first (read up to a message of our
    own, appended now)."""
    end = uuid.uuid4().hex
    seen: list[dict[str, object]] = []
    done = asyncio.Event()
    channel = await raw.channel()
    await channel.set_qos(prefetch_count=1000)
    queue = await channel.declare_queue(stream, passive=True)

    async def collect(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = dict(message.headers or {})
        if headers.get("test-end") == end:
            done.set()
        elif not done.is_set():
            seen.append(headers)
        await message.ack()

    await queue.consume(collect, arguments={"x-stream-offset": "first"})
    await channel.default_exchange.publish(aio_pika.Message(b"", headers={"test-end": end}), stream)
    async with asyncio.timeout(30):
        await done.wait()
    await channel.close()
    return seen


async def test_reads_asked_together_share_one_scan(
    backend: RabbitMQBackend,
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page listing every job's last run asks for all of them at once; jobs that never ran
    make a read step back over the whole stream. The reads asked together are one scan (one
    read of the stream's end), each answered with its own job's records, and they write
    nothing to the stream."""
    ends = 0
    read_end = _history.History._read_end

    async def counted(self: _history.History, jobs: Iterable[str]) -> Any:
        nonlocal ends
        ends += 1
        return await read_end(self, jobs)

    monkeypatch.setattr(_history.History, "_read_end", counted)
    a, busy = JobPolicy("a", history_size=10), JobPolicy("busy", history_size=10)
    never = [JobPolicy(f"n{k}", history_size=10) for k in range(4)]
    await backend.record(a, run_record("a", SLOT, 0))
    await asyncio.gather(  # written together, so in no particular order (channels race) ...
        *(backend.record(busy, run_record("busy", SLOT + n, n)) for n in range(298))
    )
    for n in (298, 299):  # ... and the two the read must answer with, last and in order
        await backend.record(busy, run_record("busy", SLOT + n, n))
    stream = history_stream_name(prefix)

    def marks(headers: list[dict[str, object]]) -> int:
        return sum("bs-mark" in each for each in headers)

    before = marks(await stream_headers(raw, stream))
    answers = await asyncio.gather(
        backend.history(a, 1), backend.history(busy, 2), *(backend.history(p, 1) for p in never)
    )
    assert [ids(answer) for answer in answers] == [["run-0"], ["run-299", "run-298"]] + [[]] * 4
    assert ends == 1
    assert marks(await stream_headers(raw, stream)) == before == 0


async def test_concurrent_writers_and_readers_of_several_jobs(
    backend: RabbitMQBackend, amqp_url: str, prefix: str
) -> None:
    """Three writers (one backend each) of three jobs and readers at once: nothing is lost, no
    reader sees another job's record, each read is newest first."""
    writers = [RabbitMQBackend(amqp_url, prefix=prefix, slot_ttl="1m") for _ in range(3)]
    for writer in writers:
        await writer.start(CLOCK)
    policies = [JobPolicy(f"w{k}", history_size=50) for k in range(3)]
    # The stream in place and started first: RabbitMQ 3.10 may fail a publish or a consume
    # (an internal error that closes the connection) while a stream it just made starts
    # (README, Limits); this test is about readers and writers of a working stream.
    warm = JobPolicy("a", history_size=1)
    await backend.record(warm, run_record("a", SLOT, 0))
    await until(
        lambda: backend.history(warm, 1),
        timeout=20,
        what="the stream to answer",
        ignore=BackendError,
    )
    try:

        async def write(k: int) -> None:
            for n in range(30):
                await writers[k].record(policies[k], run_record(f"w{k}", SLOT + n, n))

        async def read(k: int) -> None:
            for _ in range(5):
                records = await backend.history(policies[k], 50)
                assert {record.job for record in records} <= {f"w{k}"}
                slots = [record.slot_ms for record in records]
                assert slots == sorted(slots, reverse=True)

        await asyncio.gather(*(write(k) for k in range(3)), *(read(k) for k in range(3)))
        for k in range(3):
            assert ids(await backend.history(policies[k], 50)) == [
                f"run-{n}" for n in range(29, -1, -1)
            ]
    finally:
        for writer in writers:
            await writer.stop()


@pytest.mark.parametrize("kind", ["quorum", "classic"])
async def test_an_old_per_job_history_queue_is_read_with_the_stream_and_reported_once(
    backend: RabbitMQBackend,
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    """A fleet upgraded from per-job history queues: the old queue's records are read along with
    the new ones, the queue is left as it is (no new record goes to it), and a warning says
    once how to remove it."""
    queue = history_queue_name(prefix, "old")
    channel = await raw.channel()
    arguments: dict[str, object] = {"x-queue-type": kind, "x-max-length": 5}
    arguments["x-overflow"] = "drop-head"
    if kind == "quorum":
        arguments["x-single-active-consumer"] = True
    await channel.declare_queue(queue, durable=True, arguments=arguments)
    for n in range(3):
        body = run_record("old", SLOT + n, n).to_json().encode()
        await channel.default_exchange.publish(aio_pika.Message(body, delivery_mode=2), queue)
    policy = JobPolicy("old", history_size=5)
    with caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"):
        for n in range(3, 5):
            await backend.record(policy, run_record("old", SLOT + n, n))
        for _ in range(2):
            assert ids(await backend.history(policy, 10)) == [f"run-{n}" for n in range(4, -1, -1)]
        assert ids(await backend.history(policy, 2)) == ["run-4", "run-3"]
    warnings = [r.getMessage() for r in caplog.records if queue in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"rabbitmqctl delete_queue {queue}" in warnings[0]
    # Left whole, nothing new in it: the read's records go back as its channel closes.
    deadline = asyncio.get_running_loop().time() + 10
    while (await channel.declare_queue(queue, passive=True)).declaration_result.message_count != 3:
        assert asyncio.get_running_loop().time() < deadline, "the old queue did not hold 3 again"
        await asyncio.sleep(0.05)


async def test_reads_alone_never_push_a_rare_jobs_run_out_of_the_scan(
    backend: RabbitMQBackend,
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read steps back over a bounded number of records (32,000; 300 here): a rare job's
    only run, followed by 250 of a busy job's, is in view, and stays in view however often
    the history is read (a dashboard every 10 s) while nothing is recorded. Fails when each
    read appends an end marker: 100 reads push the rare run past the bound. The 100 markers
    that reads of an earlier release appended are read over, not counted."""
    monkeypatch.setattr(_history, "_HISTORY_SCAN_MAX", 300)
    rare, busy = JobPolicy("rare", history_size=5), JobPolicy("busy", history_size=5)
    await backend.record(rare, run_record("rare", SLOT, 0))
    semaphore = asyncio.Semaphore(32)

    async def write(n: int) -> None:
        async with semaphore:
            await backend.record(busy, run_record("busy", SLOT + n, 100 + n))

    await asyncio.gather(*(write(n) for n in range(1, 251)))
    assert ids(await backend.history(rare, 5)) == ["run-0"]
    for _ in range(100):
        assert len(await backend.history(busy, 1)) == 1
    assert ids(await backend.history(rare, 5)) == ["run-0"]
    stream = history_stream_name(prefix)
    headers = await stream_headers(raw, stream)
    assert sum("bs-job" in each for each in headers) == 251

    channel = await raw.channel(publisher_confirms=True)
    for n in range(100):  # as each read of an earlier release did
        await channel.default_exchange.publish(
            aio_pika.Message(b"", headers={"bs-mark": f"{n}"}), stream
        )
    await channel.close()
    assert ids(await backend.history(rare, 5)) == ["run-0"]


async def test_a_read_of_an_empty_stream_ends(
    backend: RabbitMQBackend, raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """A stream made at start before any record sends a reader nothing to find its end by:
    the read appends one end marker and answers; later reads find the end without one."""
    await backend.prepare([JobPolicy("job")])  # declares the history stream
    stream = history_stream_name(prefix)
    assert await queue_exists(raw, stream)
    for _ in range(3):
        assert await backend.history(JobPolicy("job", history_size=5), 5) == []
    headers = await stream_headers(raw, stream)
    assert [sorted(each) for each in headers] == [["bs-mark", "x-stream-offset"]]


async def test_a_history_longer_than_a_window_is_read_whole(backend: RabbitMQBackend) -> None:
    """2100 records of one job: the reader steps back over several windows."""
    policy = JobPolicy("big", history_size=2100)
    semaphore = asyncio.Semaphore(32)

    async def write(n: int) -> None:
        async with semaphore:
            await backend.record(policy, run_record("big", SLOT + n, n))

    await asyncio.gather(*(write(n) for n in range(2100)))
    records = await backend.history(policy, 2100)
    assert {record.run_id for record in records} == {f"run-{n}" for n in range(2100)}


async def test_a_read_before_any_record_makes_nothing(
    backend: RabbitMQBackend, raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """A script that only reads history leaves no object on the broker."""
    assert await backend.history(JobPolicy("job", history_size=5), 5) == []
    assert not await queue_exists(raw, history_stream_name(prefix))
    assert not await queue_exists(raw, history_queue_name(prefix, "job"))

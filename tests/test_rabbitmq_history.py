"""RabbitMQ history queues are quorum queues (issue 16: history that survives a node loss),
against the real broker on 127.0.0.1:5672. The node loss itself is in
tests/test_rabbitmq_cluster_history.py."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import aio_pika
import aiormq.exceptions
import pytest

from brokersched.abc import JobPolicy
from brokersched.backends.rabbitmq import RabbitMQBackend, history_queue_name
from tests.test_rabbitmq_backend import CLOCK, SLOT, run_record


@pytest.fixture
def prefix() -> str:
    return f"h{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def backend(
    amqp_url: str, prefix: str, raw: aio_pika.abc.AbstractConnection
) -> AsyncIterator[RabbitMQBackend]:
    started = RabbitMQBackend(amqp_url, prefix=prefix, slot_ttl="1m")
    await started.start(CLOCK)
    yield started
    await started.stop()
    channel = await raw.channel()
    for job in ("job", "big"):
        await channel.queue_delete(history_queue_name(prefix, job))
    for name in (f"{prefix}.slot-memory", f"{prefix}.slot-memory.lock"):
        await channel.queue_delete(name)


async def queue_type(raw: aio_pika.abc.AbstractConnection, queue: str, length: int) -> str:
    """``quorum`` or ``classic``, for a history queue of ``length``: a declare naming the other
    type is refused (406)."""
    for kind in ("quorum", "classic"):
        channel = await raw.channel()
        arguments = {"x-queue-type": kind, "x-max-length": length, "x-overflow": "drop-head"}
        if kind == "quorum":
            arguments["x-single-active-consumer"] = True
        try:
            await channel.declare_queue(queue, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed:
            continue
        await channel.close()
        return kind
    raise AssertionError(f"{queue}: neither type")


async def test_history_goes_to_a_quorum_queue_and_reads_leave_it_whole(
    backend: RabbitMQBackend, raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """Replicated on a cluster; each read puts every record back (a quorum queue counts that as
    a redelivery, and RabbitMQ 4 drops a message redelivered 20 times unless told not to)."""
    policy = JobPolicy("job", history_size=5)
    for n in range(7):
        await backend.record(policy, run_record("job", SLOT + n, n))
    assert await queue_type(raw, history_queue_name(prefix, "job"), 5) == "quorum"
    newest = ["run-6", "run-5", "run-4", "run-3", "run-2"]
    for _ in range(25):
        assert [record.run_id for record in await backend.history(policy, 10)] == newest


async def test_a_classic_history_queue_of_an_earlier_version_keeps_recording(
    backend: RabbitMQBackend,
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = history_queue_name(prefix, "job")
    channel = await raw.channel()
    arguments = {"x-queue-type": "classic", "x-max-length": 5, "x-overflow": "drop-head"}
    await channel.declare_queue(queue, durable=True, arguments=arguments)
    policy = JobPolicy("job", history_size=5)
    with caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"):
        for n in range(3):
            await backend.record(policy, run_record("job", SLOT + n, n))
    assert "a classic queue made by an earlier brokersched" in caplog.text
    assert f"rabbitmqctl delete_queue {queue}" in caplog.text
    assert [r.run_id for r in await backend.history(policy, 10)] == ["run-2", "run-1", "run-0"]
    assert await queue_type(raw, queue, 5) == "classic"


@pytest.mark.slow
async def test_a_history_longer_than_a_quorum_queues_default_credit_is_read_whole(
    backend: RabbitMQBackend,
) -> None:
    """A quorum queue lends an unlimited consumer 2000 messages at most: the reader asks for
    exactly what the queue holds."""
    policy = JobPolicy("big", history_size=2100)
    semaphore = asyncio.Semaphore(32)

    async def write(n: int) -> None:
        async with semaphore:
            await backend.record(policy, run_record("big", SLOT + n, n))

    await backend.record(policy, run_record("big", SLOT, 0))  # declares the queue once
    await asyncio.gather(*(write(n) for n in range(1, 2100)))
    records = await backend.history(policy, 2100)
    assert {record.run_id for record in records} == {f"run-{n}" for n in range(2100)}

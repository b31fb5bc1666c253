"""What the RabbitMQ tests share: slots far in the future, a prefix's fleet queues, a backend that
notes every queue it touches (so the test deletes them), queue deletion and lookup, a declare
that skips where the broker denies a deprecated feature, a broker URL pointed at a proxy."""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq.exceptions
import pytest
from pamqp import commands, frame
from pamqp.common import FieldTable
from pamqp.exceptions import UnmarshalingException

from brokersched._clock import SystemClock
from brokersched._exceptions import BackendError
from brokersched.abc import JobPolicy, RunRecord, Slot
from brokersched.backends.rabbitmq import (
    RabbitMQBackend,
    claim_queue_name,
    fleet_lock_name,
    fleet_queue_name,
    history_queue_name,
    history_stream_name,
    lock_queue_name,
    record_queue_name,
)

CLOCK = SystemClock()


# Slots due long after the test (claimed early): RabbitMQBackend refuses a claim of a slot older
# than its slot memory, and a fixed date in the past, or soon to be, would be one.
SLOT = 4_102_444_800_000  # 2100-01-01T00:00:00Z


CLAIM_ARGUMENTS: FieldTable = {
    "x-queue-type": "classic",
    "x-max-length": 1,
    "x-overflow": "reject-publish",
}


def fleet_queues(prefix: str) -> list[str]:
    """The queues the RabbitMQBackends (and schedulers) of ``prefix`` share: the slot memory's
    record queue and its lock, the history stream, the fleet's presence queue and its lock (a
    scheduler's). The per-job history queues and the per-slot claim queues are not among them;
    deleting the record queue deletes its fence exchanges too, and deleting one a fleet never
    made is not an error."""
    return [
        record_queue_name(prefix),
        lock_queue_name(prefix),
        history_stream_name(prefix),
        fleet_queue_name(prefix),
        fleet_lock_name(prefix),
    ]


class TrackedBackend(RabbitMQBackend):
    """The real backend, noting every queue it touches so that the test can delete them."""

    def __init__(self, *args: Any, touched: set[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.touched = touched
        touched.update(fleet_queues(self.prefix))

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        self.touched.add(claim_queue_name(self.prefix, slot))
        return await super().claim(slot, instance_id=instance_id, run_id=run_id, timeout=timeout)

    async def prepare(self, jobs: Any) -> None:
        self.touched.update(history_queue_name(self.prefix, job.name) for job in jobs)
        await super().prepare(jobs)

    async def prepare_claims(self, slots: Any) -> None:  # a scheduler's next slot, declared ahead
        self.touched.update(claim_queue_name(self.prefix, slot) for slot in slots)
        await super().prepare_claims(slots)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        self.touched.add(history_queue_name(self.prefix, job.name))
        await super().record(job, record)


async def delete_queues(url: str, names: Iterable[str], exchanges: Iterable[str] = ()) -> None:
    """Delete the queues ``names``, then the exchanges ``exchanges`` (deleting a missing queue
    or exchange is not an error on RabbitMQ)."""
    names, exchanges = list(names), list(exchanges)
    if not names and not exchanges:
        return
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)
        for name in exchanges:
            await channel.exchange_delete(name)


# How RabbitMQ refuses a deprecated feature it does not permit: 4.3 on, by default, for transient
# non-exclusive queues (RabbitMQ 4.0 when configured so); it closes the whole connection with
# INTERNAL_ERROR - Feature `transient_nonexcl_queues` is deprecated.
_DENIED_FEATURE = re.compile(r"Feature `(\w+)` is deprecated")


async def declare_or_skip(
    channel: aio_pika.abc.AbstractChannel, queue: str, *, durable: bool, arguments: FieldTable
) -> aio_pika.abc.AbstractQueue:
    """Declare ``queue`` as a test needs it, or skip the test, naming the deprecated feature
    the broker denies (a transient non-exclusive queue): the broker decides, not its version."""
    try:
        return await channel.declare_queue(queue, durable=durable, arguments=arguments)
    except aiormq.exceptions.AMQPError as exc:
        denied = _DENIED_FEATURE.search(str(exc))
        if denied is None:
            raise
        pytest.skip(
            f"the broker denies the deprecated feature {denied[1]} that this test needs: "
            f"{str(exc).splitlines()[0]}"
        )


async def queue_exists(raw: aio_pika.abc.AbstractConnection, queue: str) -> bool:
    """Whether ``queue`` is on the broker (a passive declare: one on a classic queue with
    ``x-expires`` renews its lease)."""
    channel = await raw.channel()
    try:
        await channel.declare_queue(queue, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    await channel.close()
    return True


async def claim(backend: RabbitMQBackend, slot: Slot, *, timeout: float = 5.0) -> bool:
    return await backend.claim(slot, instance_id="i", run_id=uuid.uuid4().hex, timeout=timeout)


def resumed(backend: RabbitMQBackend) -> Callable[[], Awaitable[bool]]:
    """A poll that is true once ``backend`` wins claims again.

    Every attempt claims a fresh slot: an attempt that fails ambiguously may still have won its
    slot on the broker, and would make every later attempt on that slot lose.
    """
    attempts = itertools.count(1)

    async def poll() -> bool:
        try:
            return await claim(backend, Slot("resume", SLOT + next(attempts)), timeout=1.0)
        except BackendError:
            return False

    return poll


def run_record(job: str, slot_ms: int, n: int) -> RunRecord:
    at = datetime.now(UTC)
    return RunRecord(job, slot_ms, f"run-{n}", "i1", "schedule", 1, at, at, "completed")


def via(url: str, port: int, scheme: str | None = None) -> str:
    """``url`` pointed at 127.0.0.1:``port`` (a proxy), keeping credentials and vhost."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(scheme=scheme or parts.scheme, netloc=netloc))


class AckSpotter:
    """Parses the server's AMQP frames; true at the chunk holding the ``nth`` publisher-confirm
    ack from now."""

    def __init__(self, nth: int = 1) -> None:
        self.buffer = b""
        self.left = nth

    def __call__(self, data: bytes) -> bool:
        self.buffer += data
        while self.buffer:
            try:
                consumed, _channel, parsed = frame.unmarshal(self.buffer)
            except UnmarshalingException:  # a frame split across chunks: wait for the rest
                return False
            self.buffer = self.buffer[consumed:]
            if isinstance(parsed, commands.Basic.Ack):
                self.left -= 1
                if not self.left:
                    return True
        return False

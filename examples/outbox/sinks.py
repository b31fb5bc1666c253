"""Where ``outbox.flush`` publishes: the log (no server needed) or a RabbitMQ queue."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from store import OutboxRow

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractRobustConnection

logger = logging.getLogger("outbox.sink")


class Sink(Protocol):
    async def start(self) -> None: ...
    async def publish(self, row: OutboxRow) -> None: ...
    async def stop(self) -> None: ...


class LogSink:
    """Publishes to the log: the example runs with no server at all."""

    async def start(self) -> None:
        pass

    async def publish(self, row: OutboxRow) -> None:
        logger.info("published %s %s %s", row.id, row.topic, row.payload)

    async def stop(self) -> None:
        pass


class RabbitMQSink:
    """Publishes each row to a durable queue with publisher confirms.

    The AMQP ``message_id`` is the outbox row id: a consumer deduplicates on it, which covers the
    one case the outbox cannot avoid (a flush dies after the broker confirmed a message and
    before the row was marked sent, and the row is published again).
    """

    def __init__(self, url: str, queue: str) -> None:
        self.url = url
        self.queue = queue
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None

    async def start(self) -> None:
        import aio_pika

        self._connection = await aio_pika.connect_robust(self.url)
        self._channel = await self._connection.channel(publisher_confirms=True)
        await self._channel.declare_queue(self.queue, durable=True)

    async def publish(self, row: OutboxRow) -> None:
        import aio_pika

        assert self._channel is not None, "start() the sink first"
        message = aio_pika.Message(
            row.payload.encode(),
            message_id=row.id,
            type=row.topic,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        # Returns once the broker confirmed the message: only then may the row be marked sent.
        await self._channel.default_exchange.publish(message, self.queue, mandatory=True)

    async def stop(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = self._channel = None

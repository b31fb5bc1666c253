"""Registration refuses a job at import: ``overlap`` needs a lease backend, RabbitMQ has none."""

from __future__ import annotations

from brokersched import JobContext, RabbitMQBackend, Scheduler

scheduler = Scheduler(RabbitMQBackend("amqp://app:s3cret@127.0.0.1:1/"))


@scheduler.every("fine", "1m")
async def fine(ctx: JobContext) -> None:
    pass


@scheduler.every("exclusive", "1m", overlap="skip")  # type: ignore[call-overload, untyped-decorator]
async def exclusive(ctx: JobContext) -> None:
    pass


@scheduler.every("also-bad", "10s", jitter="6s")
async def also_bad(ctx: JobContext) -> None:
    pass

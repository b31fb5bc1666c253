"""A scheduler on RabbitMQ (``BROKERSCHED_AMQP_URL``, queues under ``BROKERSCHED_TEST_PREFIX``).

``max_late`` and ``slot_ttl`` are short so that the claim queues of a test expire soon after it.
"""

from __future__ import annotations

import os

from brokersched import JobContext, RabbitMQBackend, Scheduler

backend = RabbitMQBackend(
    os.environ["BROKERSCHED_AMQP_URL"],
    slot_ttl="20s",
    prefix=os.environ.get("BROKERSCHED_TEST_PREFIX", "brokersched-cli-test"),
)
scheduler = Scheduler(backend, jitter=0, max_late="5s")


@scheduler.every("greet", "1h")
async def greet(ctx: JobContext) -> None:
    ctx.logger.info("hello from %s", ctx.instance_id)


@scheduler.cron("nightly", "30 2 * * *", timezone="Europe/Paris")
async def nightly(ctx: JobContext) -> None:
    pass

"""A scheduler on NATS JetStream (``BROKERSCHED_NATS_URL``, streams under
``BROKERSCHED_TEST_PREFIX``): purge and doctor."""

from __future__ import annotations

import os

from brokersched import JobContext, NATSBackend, Scheduler

backend = NATSBackend(
    os.environ.get("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222"),
    slot_ttl="20s",
    prefix=os.environ.get("BROKERSCHED_TEST_PREFIX", "brokersched-cli-test"),
)
scheduler = Scheduler(backend, jitter=0, max_late="5s")


@scheduler.every("beat", "1h")
async def beat(ctx: JobContext) -> None:
    ctx.logger.info("beat on %s", ctx.instance_id)

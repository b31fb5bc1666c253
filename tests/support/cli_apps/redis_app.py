"""A scheduler on Redis (``BROKERSCHED_REDIS_URL``, keys under ``BROKERSCHED_TEST_PREFIX``):
``RedisLeaseBackend``, or ``RedisBackend`` when ``BROKERSCHED_TEST_REDIS_KIND=claim``."""

from __future__ import annotations

import os

from brokersched import JobContext, RedisBackend, RedisLeaseBackend, Scheduler

url = os.environ["BROKERSCHED_REDIS_URL"]
prefix = os.environ.get("BROKERSCHED_TEST_PREFIX", "brokersched-cli-test")
backend = (
    RedisBackend(url, slot_ttl="20s", prefix=prefix)
    if os.environ.get("BROKERSCHED_TEST_REDIS_KIND") == "claim"
    else RedisLeaseBackend(url, lease_ttl="5s", prefix=prefix)
)
scheduler = Scheduler(backend, jitter=0, max_late="5s")


@scheduler.every("sweep", "1d")
async def sweep(ctx: JobContext) -> None:
    ctx.logger.info("sweeping on %s", ctx.instance_id)

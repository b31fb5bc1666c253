"""A scheduler on PostgreSQL (``BROKERSCHED_POSTGRES_DSN``, schema ``BROKERSCHED_TEST_SCHEMA``)."""

from __future__ import annotations

import os

from brokersched import JobContext, PostgresBackend, Scheduler

scheduler = Scheduler(
    PostgresBackend(
        os.environ["BROKERSCHED_POSTGRES_DSN"],
        schema=os.environ.get("BROKERSCHED_TEST_SCHEMA", "brokersched_cli_test"),
        lease_ttl="5s",
    ),
    jitter=0,
)


@scheduler.every("vacuum", "1d", overlap="skip", max_attempts=2)
async def vacuum(ctx: JobContext) -> None:
    ctx.logger.info("vacuuming")

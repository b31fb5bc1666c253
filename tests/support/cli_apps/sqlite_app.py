"""A scheduler on SQLite (the file in ``BROKERSCHED_TEST_DB``): run, trigger, history, jobs."""

from __future__ import annotations

import logging
import os

from brokersched import JobContext, Scheduler, SQLiteBackend

scheduler = Scheduler(
    SQLiteBackend(os.environ["BROKERSCHED_TEST_DB"], lease_ttl="5s"),
    jitter=0,
    drain_timeout="2s",
    instance_id=os.environ.get("BROKERSCHED_TEST_INSTANCE"),
)


@scheduler.every("tick", "200ms", catch_up=0)
async def tick(ctx: JobContext) -> None:
    ctx.logger.debug("tick %s", ctx.slot_ms)


@scheduler.every("flaky", "200ms", catch_up=0)
async def flaky(ctx: JobContext) -> None:
    raise RuntimeError("flaky by design")


@scheduler.cron(
    "report", "0 8 * * MON-FRI", timezone="Europe/Paris", timeout="10m", data={"to": "ops"}
)
def report(ctx: JobContext) -> None:
    logging.getLogger("app").info("report for %s", ctx.data)


@scheduler.every("boom", "1h", catch_up=0)
def boom(ctx: JobContext) -> None:
    raise ValueError("boom: the handler failed")

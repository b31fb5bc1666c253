"""A job that is still running when ``brokersched run`` is told to stop (SQLite backend)."""

from __future__ import annotations

import os

from brokersched import JobContext, Scheduler, SQLiteBackend

scheduler = Scheduler(
    SQLiteBackend(os.environ["BROKERSCHED_TEST_DB"], lease_ttl="5s"), jitter=0, drain_timeout="5s"
)


@scheduler.every("long", "500ms", catch_up=0, max_late="1s")
async def long(ctx: JobContext) -> None:
    ctx.logger.info("long run started")
    await ctx.sleep(60)  # cancelled by the drain, with ctx.abort_reason == "shutdown"

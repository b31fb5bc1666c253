"""A fleet member on SQLite (the file in ``BROKERSCHED_TEST_DB``) that beats every 200 ms and
holds a long run: what a kill -9 leaves behind."""

from __future__ import annotations

import os

from brokersched import JobContext, Scheduler, SQLiteBackend

scheduler = Scheduler(
    SQLiteBackend(os.environ["BROKERSCHED_TEST_DB"], lease_ttl="30s"),
    jitter=0,
    drain_timeout="1s",
    heartbeat="200ms",
    instance_id=os.environ.get("BROKERSCHED_TEST_INSTANCE"),
)


@scheduler.every("hold", "1h", run_on_start=True, catch_up=0)
async def hold(ctx: JobContext) -> None:
    await ctx.wait_aborted()  # until told

"""A scheduler on SQLite (the file in ``BROKERSCHED_TEST_DB``) with a task, for ``brokersched
schedules``: its stored schedules are read and written through the file, no scheduler
started. ``BROKERSCHED_TEST_BACKEND=redis`` puts it on a claim-only backend instead (a
lease-only option is refused)."""

from __future__ import annotations

import os

from brokersched import JobContext, RedisBackend, Scheduler, SQLiteBackend
from brokersched.abc import Backend


def _backend() -> Backend:
    if os.environ.get("BROKERSCHED_TEST_BACKEND") == "redis":
        return RedisBackend("redis://:hunter2-pw@127.0.0.1:1/0", slot_ttl="1m")
    return SQLiteBackend(os.environ["BROKERSCHED_TEST_DB"], lease_ttl="5s")


scheduler = Scheduler(_backend(), jitter=0)


@scheduler.task("reports.send")
async def send(ctx: JobContext) -> None:
    ctx.logger.info("report for %s", ctx.data)

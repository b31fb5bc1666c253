"""A scheduler with a task, for ``brokersched schedules`` (``create``: a new one per command):
on SQLite, the file in ``BROKERSCHED_TEST_DB``, its stored schedules read and written through
the file with no scheduler started; ``BROKERSCHED_TEST_BACKEND=redis`` puts it on a claim-only
backend that is never reached (a dry run checks a schedule without connecting)."""

from __future__ import annotations

import os

from brokersched import JobContext, RedisBackend, Scheduler, SQLiteBackend
from brokersched.abc import Backend


async def send(ctx: JobContext) -> None:
    ctx.logger.info("report for %s", ctx.data)


def create() -> Scheduler[Backend]:
    backend: Backend
    if os.environ.get("BROKERSCHED_TEST_BACKEND") == "redis":
        backend = RedisBackend("redis://127.0.0.1:1/0", slot_ttl="1m")
    else:
        backend = SQLiteBackend(os.environ["BROKERSCHED_TEST_DB"], lease_ttl="5s")
    scheduler: Scheduler[Backend] = Scheduler(backend, jitter=0)
    scheduler.task("reports.send")(send)
    return scheduler

"""A decorated job refused, then a job refused in the direct form, which raises at import."""

from __future__ import annotations

from brokersched import JobContext, Scheduler

scheduler = Scheduler()


@scheduler.every("also-bad", "10s", jitter="6s")
async def also_bad(ctx: JobContext) -> None:
    pass


async def purge(ctx: JobContext) -> None:
    pass


scheduler.every("purge", "10s", purge, jitter="7s")
scheduler.every("never-reached", "10s", purge, jitter="8s")

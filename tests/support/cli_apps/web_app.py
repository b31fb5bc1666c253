"""An application for ``brokersched run ... --http``: the embedded backend, a few jobs."""

from __future__ import annotations

import asyncio

from brokersched import JobContext, Scheduler

scheduler = Scheduler(instance_id="web-1", jitter="100ms")


@scheduler.every("outbox.flush", "2s", data={"api_key": "sk-live-do-not-show"})
async def flush(ctx: JobContext) -> None:
    await asyncio.sleep(0.05)


@scheduler.cron("report:daily$eu", "0 8 * * *", timezone="Europe/Paris")
async def report(ctx: JobContext) -> None:
    pass

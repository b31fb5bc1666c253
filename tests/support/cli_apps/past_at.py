"""An at() job whose instant passed long ago: it will never run."""

from __future__ import annotations

from datetime import UTC, datetime

from brokersched import JobContext, Scheduler

scheduler = Scheduler()


@scheduler.at("migrate", datetime(2020, 1, 1, tzinfo=UTC))
async def migrate(ctx: JobContext) -> None:
    pass

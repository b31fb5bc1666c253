"""A fleet member for ``brokersched backfill`` beside it (tests/deploy/test_cli_backfill_fleet.py):
the backend of ``ops_app`` (the same variables) and one job, ``long``, every 3 s, whose
scheduled runs last, by slot, 0.2 s, until the scheduler stops, 8 s, 0.2 s... (several go at
once), and whose backfilled runs 0.1 s. No ``timeout``: only the store can tell a backfill that
a run goes on."""

from __future__ import annotations

import asyncio
import os

from brokersched import JobContext, Scheduler
from brokersched.abc import Backend
from tests.support.cli_apps.ops_app import make_backend


def create() -> Scheduler[Backend]:
    backend = make_backend(
        os.environ["BROKERSCHED_TEST_BACKEND"],
        os.environ["BROKERSCHED_TEST_URL"],
        os.environ["BROKERSCHED_TEST_PREFIX"],
    )
    scheduler = Scheduler(backend, jitter=0, max_late="1s", drain_timeout="10s")

    @scheduler.every("long", "3s", overlap="allow", catch_up=0)
    async def long(ctx: JobContext) -> None:
        if ctx.reason != "schedule":
            await asyncio.sleep(0.1)
        elif ctx.slot_ms // 3000 % 3 == 1:
            await ctx.wait_aborted()  # until the scheduler stops
        else:
            await asyncio.sleep(8 if ctx.slot_ms // 3000 % 3 else 0.2)

    return scheduler

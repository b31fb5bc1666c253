"""The admin dashboard on the embedded backend, with one command (no server):

    brokersched run examples/dashboard/app.py:scheduler --http 127.0.0.1:8080

then open http://127.0.0.1:8080/. Two instances of one application share the embedded store
(the second one runs in the first one's lifespan), so the timelines show two lanes; a few jobs:
one fails now and then (with a cause, so its run page has a traceback worth reading), one is
cut by its timeout now and then, one is slower than its interval (its next slots are skipped,
by design), one is paused. The trigger, pause and resume buttons need an admin token: start it
with ``BROKERSCHED_ADMIN_TOKEN=<16+ characters>`` and sign in on the page with the same.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.backends.memory import MemoryStore


async def flush_outbox(ctx: JobContext) -> None:
    await asyncio.sleep(0.05)


async def call_provider(batch: int) -> None:
    await asyncio.sleep(0.1)
    if random.random() < 0.3:
        raise ConnectionError(f"payment provider reset the connection (batch {batch})")


async def sync_payments(ctx: JobContext) -> None:
    batch = ctx.slot_ms // 3000 % 100
    try:
        await call_provider(batch)
    except ConnectionError as exc:  # a failure with a cause: the run page shows both
        raise RuntimeError(f"payments batch {batch} failed") from exc


async def render_invoices(ctx: JobContext) -> None:
    await asyncio.sleep(random.choice((0.2, 0.3, 1.5)))  # now and then past its 1 s timeout


async def export(ctx: JobContext) -> None:
    # longer than its 5 s: the next slot is skipped (overlap); a stop ends it at once
    await ctx.wait_aborted(timeout=7)


def build(instance_id: str, store: MemoryStore, **options: Any) -> Scheduler[MemoryBackend]:
    scheduler = Scheduler(MemoryBackend(store=store), instance_id=instance_id, **options)
    scheduler.every("outbox.flush", "2s", flush_outbox, timeout="1s")
    scheduler.every("payments.sync", "3s", sync_payments, max_attempts=1)
    scheduler.every("invoices.render", "4s", render_invoices, timeout="1s")
    scheduler.every("export.slow", "5s", export, timeout="30s")
    scheduler.every("cache.warm", "10s", flush_outbox).pause()  # paused from the start
    # data is never shown by the API or the page: only "***"
    scheduler.cron(
        "report.daily",
        "0 8 * * *",
        flush_outbox,
        timezone="Europe/Paris",
        data={"smtp_password": "s3cret"},
    )
    return scheduler


store = MemoryStore()  # what a shared database would be to several processes


@asynccontextmanager
async def second_instance(first: Scheduler[Any]) -> AsyncIterator[None]:
    """Another instance of the application, sharing the store: its runs get a lane."""
    async with build("instance-2", store):
        yield


scheduler = build("instance-1", store, lifespan=second_instance)  # the dashboard's instance

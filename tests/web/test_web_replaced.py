"""Runs cut by a later slot (``overlap="replace"``) through the admin API: the outcome is in the
vocabulary the dashboard draws from, and the history filters on it."""

from __future__ import annotations

import asyncio

import httpx

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock
from brokersched.web import create_app

TOKEN = "a-t0ken-for-the-tests"


async def held(ctx: JobContext) -> None:
    await asyncio.Event().wait()


async def test_replaced_runs_are_listed_and_filtered() -> None:
    clock = TestClock("2027-01-15T08:00:30+00:00")
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    scheduler.every("feed", "10s", held, overlap="replace")
    async with scheduler:
        await clock.advance("25s")  # 08:00:40 cut by 08:00:50, which still runs
        app = create_app(scheduler, token=TOKEN)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            vocabulary = (await http.get("/vocabulary")).json()
            history = (await http.get("/jobs/feed/history?outcome=replaced")).json()
    assert "replaced" in vocabulary["outcomes"]
    assert "replaced" not in vocabulary["failures"]
    runs = [(run["outcome"], run["error"]) for run in history["records"]]
    assert runs == [("replaced", "replaced by a later slot")]

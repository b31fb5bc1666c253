"""Regressions found by breaking the richer pause (branch breakpause): what the admin API
shows of a change's note and of a pause until the far future."""

from __future__ import annotations

from typing import Any

import httpx

from brokersched import JobContext, Scheduler
from brokersched.backends.memory import MemoryBackend
from brokersched.testing import TestClock
from brokersched.web import create_app

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def noop(ctx: JobContext) -> None:
    pass


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


async def test_a_url_password_in_a_note_is_not_shown_to_readers() -> None:
    """BUG: a note is shown as written by every read of the control record: GET /jobs (open to
    whoever reaches the app, no token), POST answers, ``brokersched jobs --json`` and
    ``brokersched pause --json``. An operator's ``--note "failover to
    amqp://app:pw@new-host"`` puts the password on the dashboard, while every other text there
    (the backend's URL, an instance's host, a job's options) goes through ``redact_text``."""
    scheduler = Scheduler(MemoryBackend(), clock=TestClock("2026-03-02T12:00:00+00:00"), jitter=0)
    scheduler.every("tick", "1m", noop)
    async with scheduler, client(create_app(scheduler, token=TOKEN)) as api:
        note = "failover to amqp://app:s3cret-pw@new-host:5672/"
        answer = await api.post("/jobs/tick/pause", json={"note": note}, headers=AUTH)
        assert answer.status_code == 200
        shown = await api.get("/jobs")  # no token: any reader
        assert shown.status_code == 200
        assert "new-host" in shown.text  # the note is there...
        assert "s3cret-pw" not in shown.text  # ...but not the password (it is)
        assert "s3cret-pw" not in answer.text


async def test_the_job_list_answers_after_a_pause_until_the_end_of_year_9999() -> None:
    """BUG: POST /jobs/tick/pause {"until": "9999-12-31T23:59:59.9Z"} answers 200 (the pause is
    written), then every GET /jobs is a 500 (``job.next_run`` -> ``ms_to_datetime``: year
    10000 is out of range), so the dashboard shows no job until someone resumes it by hand."""
    scheduler = Scheduler(MemoryBackend(), clock=TestClock("2026-03-02T12:00:00+00:00"), jitter=0)
    scheduler.every("tick", "1s", noop)
    async with scheduler, client(create_app(scheduler, token=TOKEN)) as api:
        until = "9999-12-31T23:59:59.9Z"
        answer = await api.post("/jobs/tick/pause", json={"until": until}, headers=AUTH)
        if answer.status_code != 200:
            assert answer.status_code in (400, 409), answer.text  # refused: fine
            return
        listed = await api.get("/jobs")
        assert listed.status_code == 200, listed.text  # 500 internal error

"""Roles on the admin API, route by route (every operation of its OpenAPI document, so that a
new route is checked too): without a read token reading is open; with one, reading needs it or
the admin token, and the read token changes nothing; a host application's check that takes the
action decides each one, reads included. The page's session says what its viewer may do."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock
from brokersched.web import create_app
from brokersched.web._openapi import OPEN_READS, OPERATIONS

ADMIN = "admin-token-0123456789abcdef"
READER = "reader-token-0123456789abcdef"
RUN_ID = "0123456789abcdef"


async def noop(ctx: JobContext) -> None:
    pass


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler[Any]]:
    clock = TestClock("2026-03-02T12:00:00+00:00")
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="instance-a")
    scheduler.every("outbox.flush", "1m", noop)
    scheduler.task("reports.send")(noop)
    async with scheduler:
        await clock.advance("1m")
        yield scheduler


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def call(http: httpx.AsyncClient, method: str, path: str, token: str | None) -> int:
    """The status of one operation, its path filled in; the event stream asked for its headers
    only (its body never ends)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if path == "/events":
        method = "head"
    response = await http.request(
        method.upper(), url_of(path), headers=headers, **body_of(method, path)
    )
    return response.status_code


def url_of(path: str) -> str:
    return (
        path.replace("{name}", "outbox.flush").replace("{run_id}", RUN_ID).replace("{id}", "acme")
    )


def body_of(method: str, path: str) -> dict[str, Any]:
    """The body an operation needs to be well formed (a skip's count, a schedule)."""
    if path.endswith("/skip"):
        return {"json": {"count": 1}}
    if method == "put" and path == "/schedules/{id}":
        return {"json": {"task": "reports.send", "every": "1m"}}
    return {}


def action_of(method: str, path: str) -> str:
    """The action a per-action authorize() is asked with."""
    if method == "get":
        return "read"
    return "schedule" if path.startswith("/schedules") else path.rsplit("/", 1)[1]


READS = [op for op in OPERATIONS if op.method == "get"]
CHANGES = [op for op in OPERATIONS if op.method != "get"]


@pytest.mark.parametrize("op", READS, ids=[op.path for op in READS])
async def test_reading_is_open_without_a_read_token(scheduler: Scheduler[Any], op: Any) -> None:
    async with client(create_app(scheduler, token=ADMIN)) as http:
        assert await call(http, op.method, op.path, None) not in (401, 403)


@pytest.mark.parametrize("op", READS, ids=[op.path for op in READS])
async def test_with_a_read_token_reading_needs_it_or_the_admin_token(
    scheduler: Scheduler[Any], op: Any
) -> None:
    async with client(create_app(scheduler, token=ADMIN, read_token=READER)) as http:
        anonymous = await call(http, op.method, op.path, None)
        assert anonymous not in (401, 403) if op.path in OPEN_READS else anonymous == 401
        assert await call(http, op.method, op.path, "not-a-token-0123456789") in (
            (200, 503) if op.path in OPEN_READS else (401,)
        )
        for token in (READER, ADMIN):
            assert await call(http, op.method, op.path, token) not in (401, 403), token


@pytest.mark.parametrize("op", CHANGES, ids=[f"{op.method} {op.path}" for op in CHANGES])
async def test_the_read_token_changes_nothing_and_the_admin_token_may(
    scheduler: Scheduler[Any], op: Any
) -> None:
    async with client(create_app(scheduler, token=ADMIN, read_token=READER)) as http:
        assert await call(http, op.method, op.path, None) == 401
        assert await call(http, op.method, op.path, READER) == 403
        assert await call(http, op.method, op.path, ADMIN) not in (401, 403)


def support_may_read_and_pause(request: Request, action: str) -> bool:
    """The host application's own roles: support reads and pauses; ops does anything."""
    user = request.headers.get("x-user")
    return user == "ops" or (user == "support" and action in ("read", "pause"))


@pytest.mark.parametrize(
    "op", [*READS, *CHANGES], ids=[f"{o.method} {o.path}" for o in [*READS, *CHANGES]]
)
async def test_the_host_application_decides_each_action_reads_included(
    scheduler: Scheduler[Any], op: Any
) -> None:
    app = create_app(scheduler, authorize=support_may_read_and_pause)

    async def as_user(user: str | None) -> int:
        headers = {"x-user": user} if user else {}
        method = "HEAD" if op.path == "/events" else op.method.upper()
        body = body_of(op.method, op.path)
        async with client(app) as http:
            return (
                await http.request(method, url_of(op.path), headers=headers, **body)
            ).status_code

    action = action_of(op.method, op.path)
    if op.path in OPEN_READS:
        assert await as_user(None) not in (401, 403)
    elif op.method == "get":
        assert await as_user(None) == 401
        assert await as_user("support") not in (401, 403)
    elif action == "pause":
        assert await as_user("support") not in (401, 403)
    else:
        assert await as_user("support") == 403  # may read, not this
        assert await as_user(None) == 401
    assert await as_user("ops") not in (401, 403)


async def test_the_session_says_what_its_viewer_may_do(scheduler: Scheduler[Any]) -> None:
    async with client(create_app(scheduler, token=ADMIN, read_token=READER)) as http:
        anonymous = (await http.get("/session")).json()
        assert (anonymous["can_read"], anonymous["authorized"], anonymous["actions"]) == (
            False,
            False,
            [],
        )
        assert "backend" not in anonymous and "instance_id" not in anonymous
        reader = (await http.get("/session", headers={"Authorization": f"Bearer {READER}"})).json()
        assert (reader["can_read"], reader["authorized"], reader["via"]) == (
            True,
            False,
            "read-token",
        )
        admin = (await http.get("/session", headers={"Authorization": f"Bearer {ADMIN}"})).json()
        assert admin["can_read"] and admin["via"] == "token"
        assert admin["actions"] == [
            "trigger", "pause", "resume", "disable", "enable", "skip", "abort", "schedule"
        ]  # fmt: skip
        health = (await http.get("/health")).json()
        assert health == {"status": "ok", "overdue": [], "now_ms": health["now_ms"]}
        refused = await http.post(
            "/jobs/outbox.flush/pause", headers={"Authorization": f"Bearer {READER}"}
        )
        assert refused.json()["error"] == "the read-only token may not pause: use the admin token"


def test_a_read_token_of_its_own_and_long_enough(scheduler: Scheduler[Any]) -> None:
    from brokersched import ConfigurationError

    with pytest.raises(ConfigurationError, match="the read token is too short"):
        create_app(scheduler, token=ADMIN, read_token="short")
    with pytest.raises(ConfigurationError, match="give the read-only role a token of its own"):
        create_app(scheduler, token=ADMIN, read_token=ADMIN)

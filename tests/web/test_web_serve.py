"""The admin app served for real: uvicorn on a free port of 127.0.0.1, in-process and through
``brokersched run --http``; the live event stream over TCP."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from brokersched import JobContext, Scheduler
from brokersched.cli import cli
from brokersched.testing import TestClock
from brokersched.web import TOKEN_ENV, _stream
from brokersched.web._serve import HTTPServer
from tests.support.cli_apps.process import RunningCLI

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APP = "tests.support.cli_apps.web_app:scheduler"


async def ok(ctx: JobContext) -> None:
    pass


async def leaky(ctx: JobContext) -> None:
    raise RuntimeError("cannot reach amqp://app:hunter2-pw@mq.internal/")


@pytest.fixture
async def served(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[Scheduler[Any], HTTPServer, str]]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    scheduler = Scheduler(instance_id="instance-a")
    scheduler.every("ok", "1h", ok)
    scheduler.every("leaky", "1h", leaky)
    server = HTTPServer(scheduler, "127.0.0.1", 0)
    url = await server.start()
    try:
        async with scheduler:
            yield scheduler, server, url
    finally:
        await server.stop()


async def next_event(lines: AsyncIterator[str]) -> tuple[str, dict[str, Any]]:
    """The next ``event:``/``data:`` pair of a Server-Sent Events stream."""
    kind = None
    async for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: ") and kind is not None:
            return kind, json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended")


async def test_the_event_stream_shows_runs_live_and_forgets_clients_that_leave(
    served: tuple[Scheduler[Any], HTTPServer, str],
) -> None:
    _, server, url = served
    server_hub: _stream.EventHub = server.app.state.events
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        async with http.stream("GET", "events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.aiter_lines()
            async for line in lines:  # subscribed once the greeting arrives
                if line == ": connected":
                    break
            assert server_hub.clients == 1
            for name in ("ok", "leaky"):
                response = await http.post(f"jobs/{name}/trigger", headers=AUTH)
                assert response.status_code == 202
            async with asyncio.timeout(10):
                events = [await next_event(lines) for _ in range(4)]
        by_kind = {(kind, data["job"]): data for kind, data in events}
        assert set(by_kind) == {
            ("start", "ok"),
            ("complete", "ok"),
            ("start", "leaky"),
            ("fail", "leaky"),
        }
        done = by_kind["complete", "ok"]
        assert (done["outcome"], done["reason"], done["instance_id"]) == (
            "completed",
            "manual",
            "instance-a",
        )
        failed = by_kind["fail", "leaky"]
        assert failed["error"] == "RuntimeError: cannot reach amqp://app:***@mq.internal/"
        # the server notices the closed connection (a count to watch, not an event to await)
        async with asyncio.timeout(10):
            while server_hub.clients:  # noqa: ASYNC110
                await asyncio.sleep(0.02)


async def test_a_client_too_slow_for_the_stream_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_stream, "QUEUE_SIZE", 3)
    clock = TestClock()
    scheduler = Scheduler(clock=clock)
    job = scheduler.every("ok", "1h", ok)
    hub = _stream.EventHub(scheduler)
    stream = hub.stream()
    async with scheduler:
        assert (await anext(stream)).startswith("retry: ")
        await job.trigger()  # start, complete: the queue holds them
        await clock.advance("1s")  # a new slot for the next manual run
        await job.trigger()  # a third event fills the queue; the fourth cuts the client off
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
    assert hub.clients == 0


# -- brokersched run --http ----------------------------------------------------------------


def test_run_serves_the_api_and_the_dashboard() -> None:
    cli = RunningCLI("run", APP, "--http", "127.0.0.1:0", env={TOKEN_ENV: TOKEN})
    try:
        line = cli.wait_for_line(lambda line: "serving the admin API and dashboard" in line)
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert match is not None, line
        url = match.group(0)
        hint = cli.wait_for_line(lambda line: "dashboard buttons" in line)
        assert hint.endswith(
            "dashboard buttons: sign in on the page with the admin token (the value of "
            "BROKERSCHED_ADMIN_TOKEN)"
        )
        with httpx.Client(base_url=url, timeout=10) as http:
            page = http.get("")
            assert page.status_code == 200 and '<main id="view"' in page.text
            assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
            script = http.get("static/app.js")
            assert script.headers["content-type"].startswith("text/javascript")
            assert "new EventSource(" in script.text
            assert http.get("static/nothing.js").status_code == 404
            assert http.get("static/..%2F_app.py").status_code == 404
            jobs = http.get("jobs").json()
            assert [job["name"] for job in jobs["jobs"]] == ["outbox.flush", "report:daily$eu"]
            assert "sk-live-do-not-show" not in json.dumps(jobs)
            assert http.post("jobs/report%3Adaily%24eu/trigger").status_code == 401
            assert http.post("jobs/report%3Adaily%24eu/trigger", headers=AUTH).status_code == 202
            deadline = time.monotonic() + 10
            while not (records := http.get("jobs/report%3Adaily%24eu/history").json()["records"]):
                assert time.monotonic() < deadline, "the manual run was never recorded"
                time.sleep(0.05)
            assert records[0]["reason"] == "manual" and records[0]["instance_id"] == "web-1"
            assert http.get("health").json()["status"] == "ok"
        assert cli.stop(signal.SIGTERM) == 0, cli.output()
    finally:
        cli.kill()
    assert TOKEN not in cli.output()
    assert cli.lines[-1].endswith("stopped")


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "[::]"])
def test_run_refuses_a_non_loopback_address_without_a_token(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    result = CliRunner().invoke(cli, ["run", APP, "--http", f"{host}:8080"])
    assert result.exit_code == 2
    bare = host.strip("[]")
    shown = f"[{bare}]" if ":" in bare else bare
    assert result.stderr.strip() == (
        f"Error: --http {shown}:8080 is not a loopback address and no admin token is set: set "
        f"{TOKEN_ENV} (at least 16 characters) or serve on 127.0.0.1"
    )


@pytest.mark.parametrize("address", ["8080", "127.0.0.1", "127.0.0.1:http", ":8080", "h:70000"])
def test_run_refuses_an_address_that_is_not_host_port(address: str) -> None:
    result = CliRunner().invoke(cli, ["run", APP, "--http", address])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: --http '{address}' is not HOST:PORT; write e.g. 127.0.0.1:8080 "
        "(port 0: any free port)"
    )


def test_run_refuses_a_taken_port_and_a_short_token() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["run", APP, "--http", f"127.0.0.1:{port}"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: cannot serve --http 127.0.0.1:{port}: Address already in use"
    )
    short = CliRunner().invoke(cli, ["run", APP, "--http", "0:0"], env={TOKEN_ENV: "tiny-pw"})
    assert short.exit_code == 2
    assert short.stderr.startswith("Error: the admin token is too short (7 characters)")
    assert "tiny-pw" not in short.stderr

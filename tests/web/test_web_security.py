"""The admin app as an attacker (or a careless operator) tries it: another site's page reaching
a loopback server through DNS rebinding, odd input where a route expects a number or a name,
job data quoted by a handler's error, a token pasted with a newline, a flood of event streams.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect

from brokersched import ConfigurationError, JobContext, Scheduler
from brokersched.testing import TestClock
from brokersched.web import TOKEN_ENV, _stream, create_app
from brokersched.web._serve import HTTPServer

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "sk-live-do-not-show"


async def ok(ctx: JobContext) -> None:
    pass


async def quotes_its_data(ctx: JobContext) -> None:
    assert ctx.data is not None
    raise KeyError(f"no account for the key {ctx.data['auth']['api_key']}")


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.fixture
async def served(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    scheduler = Scheduler(instance_id="instance-a")
    scheduler.every("ok", "1h", ok)
    server = HTTPServer(scheduler, "127.0.0.1", 0)
    url = await server.start()
    try:
        async with scheduler:
            yield url
    finally:
        await server.stop()


# -- DNS rebinding: a loopback server answers to loopback names only -------------------------


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:{port}", "10.0.0.7:{port}", "[::1", "admin.example.com"]
)
async def test_a_loopback_server_refuses_another_host_name(served: str, host: str) -> None:
    """A page of evil.example whose name now resolves to 127.0.0.1 is same-origin with
    itself: its Host is evil.example, and without this check it could read every route."""
    port = httpx.URL(served).port
    async with httpx.AsyncClient(base_url=served, timeout=10) as http:
        headers = {"Host": host.format(port=port)}
        read = await http.get("jobs", headers=headers)
        changed = await http.post(
            "jobs/ok/pause", headers={**headers, **AUTH, "Origin": f"http://{headers['Host']}"}
        )
    for response in (read, changed):
        assert response.status_code == 421
        assert response.json()["error"] == (
            f"Host {headers['Host']!r} refused: this admin server listens on a loopback address "
            "and answers to loopback names only (127.0.0.1, [::1], localhost); a proxy in "
            "front of it must pass one of those as Host, or its name must be listed in "
            "BROKERSCHED_ADMIN_HOSTS"
        )


@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}", "app.localhost"]
)
async def test_a_loopback_server_answers_to_loopback_names(served: str, host: str) -> None:
    port = httpx.URL(served).port
    async with httpx.AsyncClient(base_url=served, timeout=10) as http:
        response = await http.get("jobs", headers={"Host": host.format(port=port)})
    assert response.status_code == 200
    assert response.json()["jobs"][0]["name"] == "ok"


async def test_a_proxy_name_may_be_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """nginx on this machine passing ``Host: admin.example.com`` to 127.0.0.1:8080."""
    monkeypatch.setenv("BROKERSCHED_ADMIN_HOSTS", "admin.example.com, Other.Example.")
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    server = HTTPServer(scheduler, "127.0.0.1", 0)
    url = await server.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            allowed = [
                await http.get("jobs", headers={"Host": host})
                for host in ("admin.example.com", "ADMIN.example.com:443", "other.example")
            ]
            refused = await http.get("jobs", headers={"Host": "evil.example"})
    finally:
        await server.stop()
    assert [response.status_code for response in allowed] == [200, 200, 200]
    assert refused.status_code == 421


# -- odd input -----------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["²", "٣", "1_0", " 5", "5\n", "+5", "0x10", "9" * 5000])
async def test_a_limit_that_is_not_ascii_digits_is_a_400(limit: str) -> None:
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    async with client(create_app(scheduler)) as api:
        response = await api.get("/jobs/ok/history", params={"limit": limit})
    assert response.status_code == 400
    shown = repr(limit) if len(limit) < 10 else f"{limit[:10]!r}..."
    assert response.json()["error"] == (
        f"limit {shown} is invalid: use a whole number from 1 to 1000"
    )


@pytest.mark.parametrize("action", ["", "/history", "/pause"])
async def test_a_very_long_name_is_not_echoed_whole(action: str) -> None:
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    name = "y" * 20_000
    async with client(create_app(scheduler, token=TOKEN)) as api:
        if action == "/pause":
            response = await api.post(f"/jobs/{name}{action}", headers=AUTH)
        else:
            response = await api.get(f"/jobs/{name}{action}")
    assert response.status_code == 404
    assert response.json()["error"] == (
        f"no job named '{'y' * 128}'... (20000 characters; job names have at most 128) (jobs: ok)"
    )


@pytest.mark.parametrize("path", ["/jobs/%C3%BCml%C3%A4ut", "/jobs/a%00b", "/jobs/%FF"])
async def test_names_no_job_can_have_are_a_404(path: str) -> None:
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    async with client(create_app(scheduler)) as api:
        response = await api.get(path)
    assert response.status_code == 404
    assert response.json()["error"].startswith("no job named ")


# -- job data quoted in an error ------------------------------------------------------------


async def test_job_data_quoted_by_a_handler_error_is_masked_everywhere() -> None:
    clock = TestClock("2026-03-02T12:00:00+00:00")
    scheduler = Scheduler(clock=clock, jitter=0, instance_id="instance-a")
    data = {"auth": {"api_key": SECRET, "region": "eu"}, "retries": 3}
    scheduler.every("sync", "1m", quotes_its_data, data=data)
    app = create_app(scheduler)
    hub: _stream.EventHub = app.state.events
    stream = hub.stream()
    async with scheduler, client(app) as api:
        assert (await anext(stream)).startswith("retry: ")
        await clock.advance("1m")
        events = [await anext(stream), await anext(stream)]  # start, fail
        texts = [
            (await api.get(path)).text for path in ("/jobs", "/jobs/sync", "/jobs/sync/history")
        ]
    await stream.aclose()
    for text in [*texts, *events]:
        assert SECRET not in text
    record = json.loads(texts[2])["records"][0]
    assert record["error"] == "KeyError: 'no account for the key ***'"
    assert json.loads(texts[1])["last"]["error"] == record["error"]
    assert events[1].startswith("event: fail\n")
    assert '"error":"KeyError: \'no account for the key ***\'"' in events[1]


# -- the token as configured ------------------------------------------------------------------


async def test_a_token_pasted_with_a_newline_still_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token read from a file or a Kubernetes secret often ends with a newline, which no
    Authorization header can carry: without trimming, every change would be refused."""
    monkeypatch.setenv(TOKEN_ENV, f"{TOKEN}\n")
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    async with client(create_app(scheduler)) as api:
        response = await api.post("/jobs/ok/pause", headers=AUTH)
    assert response.status_code == 200


def test_a_token_of_white_space_is_too_short() -> None:
    with pytest.raises(ValueError, match=r"^the admin token is too short \(0 characters\)"):
        create_app(Scheduler(), token=" " * 20)


# -- the event stream -------------------------------------------------------------------------


async def test_event_stream_clients_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "MAX_CLIENTS", 2)
    scheduler = Scheduler()
    app = create_app(scheduler)
    hub: _stream.EventHub = app.state.events
    streams = [hub.stream(), hub.stream()]
    for stream in streams:
        assert (await anext(stream)).startswith("retry: ")
    assert hub.clients == 2
    async with client(app) as api:
        refused = await api.get("/events")
    assert refused.status_code == 503
    assert refused.json()["error"] == (
        "too many event-stream clients (2); close another dashboard tab or try again later"
    )
    assert refused.headers["retry-after"] == "10"
    for stream in streams:
        await stream.aclose()
    assert hub.clients == 0


async def test_head_on_the_event_stream_ends_at_once(served: str) -> None:
    """A HEAD is answered with the headers only; a stream behind it would hold the connection
    (and a client's place in the hub) forever, and the next request on it would hang."""
    async with httpx.AsyncClient(base_url=served, timeout=5) as http:
        head = await http.head("events")
        after = await http.get("health")  # the same keep-alive connection
    assert head.status_code == 200
    assert head.headers["content-type"].startswith("text/event-stream")
    assert after.json()["status"] == "ok"


# -- errors ------------------------------------------------------------------------------------


async def test_an_internal_error_is_json_without_a_traceback() -> None:
    def broken(request: Any) -> bool:
        raise RuntimeError("session store down: postgresql://app:hunter2-pw@db/sessions")

    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    app = create_app(scheduler, authorize=broken)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as api:
        response = await api.post("/jobs/ok/pause")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error (the server's log has the details)"}


# -- the event-stream cap under a burst ------------------------------------------------------------


async def test_the_event_stream_cap_holds_under_a_burst(served: str) -> None:
    """Twice the cap, all at the same moment: each request takes its place when it is answered,
    not when its stream first runs, so exactly MAX_CLIENTS streams are served."""
    burst = 2 * _stream.MAX_CLIENTS
    barrier = asyncio.Barrier(burst)
    answered: list[int] = []
    all_answered = asyncio.Event()
    limits = httpx.Limits(max_connections=burst + 10, max_keepalive_connections=0)

    async def one(http: httpx.AsyncClient) -> None:
        await barrier.wait()
        async with http.stream("GET", "events") as response:
            answered.append(response.status_code)
            if len(answered) == burst:
                all_answered.set()
            await all_answered.wait()  # every stream stays open until all are answered

    async with httpx.AsyncClient(base_url=served, timeout=30, limits=limits) as http:
        await asyncio.wait_for(asyncio.gather(*(one(http) for _ in range(burst))), 60)
        after = await http.get("health")
    assert sorted(answered).count(200) == _stream.MAX_CLIENTS
    assert sorted(answered).count(503) == burst - _stream.MAX_CLIENTS
    assert after.status_code == 200


async def test_a_client_gone_before_its_stream_ran_gives_its_place_back() -> None:
    scheduler = Scheduler()
    hub = create_app(scheduler).state.events
    assert isinstance(hub, _stream.EventHub)
    client = hub.open()
    assert client is not None and hub.clients == 1
    response = _stream.EventStreamResponse(hub, client, {})

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client went away")  # before the first byte

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        await response(scope, receive, send)
    assert hub.clients == 0


# -- behind a reverse proxy ------------------------------------------------------------------------

PUBLIC = "https://admin.example.com"


def proxied(app: Any, peer: str = "127.0.0.1") -> httpx.AsyncClient:
    """What an app behind nginx sees: the proxy's address, and the Host it passes on."""
    transport = httpx.ASGITransport(app=app, client=(peer, 41234))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080")


async def test_behind_a_proxy_a_current_browser_is_judged_by_sec_fetch_site() -> None:
    """nginx passing Host 127.0.0.1:8080: the Origin (the public name) never matches it, but
    every current browser says the request is same-origin, and that decides."""
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    browser = {**AUTH, "Origin": PUBLIC, "Sec-Fetch-Site": "same-origin"}
    async with proxied(create_app(scheduler, token=TOKEN)) as api:
        paused = await api.post("/jobs/ok/pause", headers=browser)
        foreign = await api.post(
            "/jobs/ok/resume", headers={**browser, "Sec-Fetch-Site": "cross-site"}
        )
    assert paused.status_code == 200
    assert foreign.status_code == 403


async def test_behind_a_proxy_an_older_browser_needs_the_trusted_proxy_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without Sec-Fetch-Site (Safari before 16.4) only Origin is left: it must match the
    X-Forwarded-Host of a proxy listed in BROKERSCHED_TRUSTED_PROXIES."""
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    old_browser = {**AUTH, "Origin": PUBLIC, "X-Forwarded-Host": "admin.example.com"}
    async with proxied(create_app(scheduler, token=TOKEN)) as api:
        untrusted = await api.post("/jobs/ok/pause", headers=old_browser)
    monkeypatch.setenv("BROKERSCHED_TRUSTED_PROXIES", "10.0.0.0/8, 127.0.0.1")
    app = create_app(scheduler, token=TOKEN)
    async with proxied(app) as api:
        trusted = await api.post("/jobs/ok/pause", headers=old_browser)
        forwarded = await api.post(
            "/jobs/ok/resume",
            headers={**AUTH, "Origin": PUBLIC, "Forwarded": 'for=1.2.3.4;host="admin.example.com"'},
        )
        lying = await api.post(
            "/jobs/ok/pause", headers={**old_browser, "X-Forwarded-Host": "other.example"}
        )
    async with proxied(app, peer="192.0.2.7") as api:  # not the proxy: its header is ignored
        stranger = await api.post("/jobs/ok/pause", headers=old_browser)
    assert untrusted.status_code == 403
    assert untrusted.json()["error"] == (
        "cross-site request refused: Origin 'https://admin.example.com' does not match Host "
        "'127.0.0.1:8080' (behind a reverse proxy: list it in BROKERSCHED_TRUSTED_PROXIES)"
    )
    assert (trusted.status_code, forwarded.status_code) == (200, 200)
    assert lying.status_code == 403
    assert "nor X-Forwarded-Host 'other.example'" in lying.json()["error"]
    assert stranger.status_code == 403


async def test_behind_a_proxy_on_a_real_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """``brokersched run --http``'s server judges the peer itself (uvicorn would otherwise put
    the X-Forwarded-For address in its place)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv("BROKERSCHED_TRUSTED_PROXIES", "127.0.0.1")
    scheduler = Scheduler()
    scheduler.every("ok", "1h", ok)
    server = HTTPServer(scheduler, "127.0.0.1", 0)
    url = await server.start()
    headers = {
        **AUTH,
        "Origin": PUBLIC,
        "X-Forwarded-Host": "admin.example.com",
        "X-Forwarded-For": "198.51.100.9",
    }
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            response = await http.post("jobs/ok/pause", headers=headers)
    finally:
        await server.stop()
    assert response.status_code == 200


@pytest.mark.parametrize("value", ["localhost", "10.0.0.0/33", "127.0.0.1;", "nginx"])
def test_a_trusted_proxy_that_is_no_address_is_refused(value: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_app(Scheduler(), trusted_proxies=f"127.0.0.1, {value}")
    assert str(caught.value).startswith(
        f"trusted proxy {value!r} is not an IP address or network; use e.g. 127.0.0.1, ::1, "
        "10.0.0.0/8 or *"
    )
    assert caught.value.option == "trusted_proxies"

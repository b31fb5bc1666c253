"""The admin API (``brokersched.web``) through httpx's ASGI transport, against real schedulers
on the embedded backend in virtual time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.requests import Request
from starlette.routing import Route

from brokersched import (
    BackendUnavailableError,
    ConfigurationError,
    JobContext,
    MemoryBackend,
    RabbitMQBackend,
    Scheduler,
)
from brokersched.abc import JobPolicy
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from brokersched.web import TOKEN_ENV, create_app
from brokersched.web._openapi import OPERATIONS, UndocumentedAnswerError, openapi_document
from brokersched.web._reply import Reply

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START = "2026-03-02T12:00:00+00:00"
ODD = "report:daily$eu"  # a valid job name that is not URL-safe: ':' and '$'
SECRET = "sk-live-do-not-show"


@pytest.fixture
def clock() -> TestClock:
    return TestClock(START)


async def noop(ctx: JobContext) -> None:
    pass


def build(clock: TestClock, store: MemoryStore | None = None, name: str = "a") -> Scheduler[Any]:
    scheduler = Scheduler(
        MemoryBackend(store=store), clock=clock, jitter=0, instance_id=f"instance-{name}"
    )
    scheduler.every("outbox.flush", "1m", noop, timeout="30s", data={"api_key": SECRET})
    scheduler.cron(ODD, "0 8 * * *", noop, timezone="Europe/Paris")
    return scheduler


@pytest.fixture
async def scheduler(clock: TestClock) -> AsyncIterator[Scheduler[Any]]:
    async with build(clock) as scheduler:
        yield scheduler


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.fixture
async def api(scheduler: Scheduler[Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with client(create_app(scheduler, token=TOKEN)) as http:
        yield http


# -- reading -------------------------------------------------------------------------------


async def test_jobs_lists_schedule_options_state_next_runs_and_last_outcome(
    clock: TestClock, api: httpx.AsyncClient
) -> None:
    await clock.advance("1m")  # the 12:01 slot runs
    body = (await api.get("/jobs")).json()
    assert body["instance_id"] == "instance-a"
    assert body["running"] is True and body["changes_enabled"] is True
    flush, report = body["jobs"]
    assert (flush["name"], flush["kind"], flush["schedule"], flush["zone"]) == (
        "outbox.flush",
        "every",
        "every 1m",
        "UTC",
    )
    assert flush["state"] == "armed"
    assert flush["next_runs"][:2] == ["2026-03-02T12:02:00.000Z", "2026-03-02T12:03:00.000Z"]
    assert flush["options"]["timeout"] == "30s" and flush["options"]["overlap"] == "skip"
    assert flush["options"]["data"] == "***"
    last = flush["last"]
    assert (last["outcome"], last["slot"], last["instance_id"]) == (
        "completed",
        "2026-03-02T12:01:00.000Z",
        "instance-a",
    )
    assert (report["name"], report["zone"], report["last"]) == (ODD, "Europe/Paris", None)
    assert report["next_runs"][0] == "2026-03-03T07:00:00.000Z"  # 08:00 in Paris (CET)


async def test_a_job_by_its_percent_encoded_name(api: httpx.AsyncClient) -> None:
    response = await api.get("/jobs/report%3Adaily%24eu")
    assert response.status_code == 200
    assert response.json()["name"] == ODD
    assert len(response.json()["next_runs"]) == 10
    history = await api.get("/jobs/report%3Adaily%24eu/history")
    assert history.status_code == 200 and history.json()["records"] == []


@pytest.mark.parametrize("path", ["/jobs/nope", "/jobs/nope/history", "/jobs/a%2Fb"])
async def test_an_unknown_job_is_a_404_that_says_so(api: httpx.AsyncClient, path: str) -> None:
    response = await api.get(path)
    assert response.status_code == 404
    error = response.json()["error"]
    if "%2F" in path:  # a '/' is never in a job name: no route has that shape
        assert error == "no such route: GET /jobs/a/b"
    else:
        assert error == f"no job named 'nope' (jobs: outbox.flush, {ODD})"


async def test_an_unknown_job_is_a_404_for_changes_too(api: httpx.AsyncClient) -> None:
    response = await api.post("/jobs/nope/pause", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"].startswith("no job named 'nope'")


async def test_history_shows_every_instance_lateness_and_missed_slots(clock: TestClock) -> None:
    store = MemoryStore()
    async with build(clock, store, "a") as one, build(clock, store, "b") as two:
        await clock.advance("3m")  # 12:01, 12:02, 12:03: each on one of the two
        for scheduler in (one, two):
            job = scheduler.get("outbox.flush")
            assert job is not None
            job.pause()
        await clock.advance("1m30s")  # 12:04: nobody runs it
        for scheduler in (one, two):
            job = scheduler.get("outbox.flush")
            assert job is not None
            job.resume()
        await clock.advance("2m")  # 12:05, 12:06; now 12:06:30
        async with client(create_app(one)) as api:
            body = (await api.get("/jobs/outbox.flush/history", params={"limit": 10})).json()
    records = body["records"]
    ran = sorted(r["slot_ms"] for r in records)
    assert len(ran) == 5 and len(set(ran)) == 5  # each slot once
    assert {r["instance_id"] for r in records} <= {"instance-a", "instance-b"}
    assert all(r["late_ms"] >= 0 and r["outcome"] == "completed" for r in records)
    # 12:06 is still within max_late (60s): not yet "should have run"
    minute = 60_000
    first = ran[0]
    assert body["slots"] == [first + n * minute for n in range(5)]
    missed = set(body["slots"]) - set(ran)
    assert missed == {first + 3 * minute}  # 12:04


async def test_a_slot_reported_missed_is_in_the_history_and_a_mark_of_the_timeline(
    clock: TestClock,
) -> None:
    store = MemoryStore()
    async with build(clock, store, "a"), build(clock, store, "b") as two:
        await clock.advance("1m")  # 12:01 runs; now 12:01:30
        await clock.stall("4m")  # both frozen: at 12:05:30, 12:02-12:04 are past max_late (60s)
        await clock.advance("2m")  # the checks are over
        async with client(create_app(two)) as api:
            history = (await api.get("/jobs/outbox.flush/history", params={"limit": 20})).json()
            missed = (await api.get("/jobs/outbox.flush/history?outcome=missed")).json()
            timeline = (await api.get("/jobs/outbox.flush/timeline?window=1h")).json()
    reported = sorted(r["slot_ms"] for r in missed["records"])
    assert [slot - reported[0] for slot in reported] == [0, 60_000, 120_000]
    assert {r["reason"] for r in missed["records"]} == {"missed"}
    assert {r["instance_id"] for r in missed["records"]} <= {"instance-a", "instance-b"}
    assert all(r["outcome"] != "missed" for r in history["records"] if r["slot_ms"] < reported[0])
    marks = {m["slot_ms"]: m for m in timeline["slots"]}
    for slot in reported:
        assert marks[slot]["state"] == "missed"
        assert marks[slot]["detail"].startswith("reported by instance-")
    assert not {r["slot_ms"] for r in timeline["runs"]} & set(reported)  # a report, not a run


async def test_history_refuses_a_bad_limit(api: httpx.AsyncClient) -> None:
    for limit in ("0", "abc", "1001", "-1"):
        response = await api.get("/jobs/outbox.flush/history", params={"limit": limit})
        assert response.status_code == 400
        assert response.json()["error"] == (
            f"limit '{limit}' is invalid: use a whole number from 1 to 1000"
        )


async def test_errors_and_the_backend_are_redacted(clock: TestClock) -> None:
    async def leaky(ctx: JobContext) -> None:
        raise RuntimeError("cannot reach postgresql://app:hunter2-pw@db.internal/orders")

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    scheduler.every("leaky", "1m", leaky, data={"token": SECRET})
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("1m")
        texts = [
            (await api.get(path)).text for path in ("/jobs", "/jobs/leaky", "/jobs/leaky/history")
        ]
    for text in texts:
        assert "hunter2-pw" not in text and SECRET not in text
    record = json.loads(texts[2])["records"][0]
    assert record["outcome"] == "failed"
    assert record["error"] == "RuntimeError: cannot reach postgresql://app:***@db.internal/orders"


async def test_a_failed_runs_traceback_is_in_the_history_redacted(clock: TestClock) -> None:
    def connect(ctx: JobContext) -> None:
        raise ConnectionError(f"no route for {ctx.data['token']}")

    async def leaky(ctx: JobContext) -> None:
        try:
            connect(ctx)
        except ConnectionError as exc:
            raise RuntimeError("postgresql://app:hunter2-pw@db.internal/orders failed") from exc

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    job = scheduler.every("leaky", "1m", leaky, data={"token": SECRET})
    scheduler.every("fine", "1m", noop)
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("1m")
        text = (await api.get("/jobs/leaky/history")).text
        fine = (await api.get("/jobs/fine/history")).json()["records"][0]
        # A record written unredacted (a third-party backend, an earlier bug) is masked too.
        (written,) = await job.history(1)
        raw = replace(written, traceback=f"Traceback ...\nKeyError: {SECRET} amqp://u:pw9@h/")
        await scheduler.backend.record(JobPolicy("leaky"), raw)
        again = (await api.get("/jobs/leaky/history")).json()["records"][0]
    assert "hunter2-pw" not in text and SECRET not in text
    traceback = json.loads(text)["records"][0]["traceback"]
    assert "in connect" in traceback and "in leaky" in traceback
    assert "The above exception was the direct cause" in traceback
    assert traceback.rstrip().endswith(
        "RuntimeError: postgresql://app:***@db.internal/orders failed"
    )
    assert fine["outcome"] == "completed" and fine["traceback"] is None
    assert again["traceback"] == "Traceback ...\nKeyError: *** amqp://u:***@h/"


async def test_a_runs_result_is_in_its_record_redacted(clock: TestClock) -> None:
    async def sent(ctx: JobContext) -> dict[str, Any]:
        return {"sent": 3, "via": "amqp://u:pw9@h/", "for": ctx.data["token"]}

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    job = scheduler.every("sent", "1m", sent, data={"token": SECRET})
    scheduler.every("fine", "1m", noop)
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("1m")
        history = (await api.get("/jobs/sent/history")).json()["records"]
        fine = (await api.get("/jobs/fine/history")).json()["records"][0]
        run_id = history[0]["run_id"]
        run = (await api.get(f"/jobs/sent/runs/{run_id}")).json()["run"]
        # A record written unredacted (a third-party backend, an earlier bug) is masked too.
        (written,) = await job.history(1)
        raw = replace(written, run_id="raw", result=[f"KeyError: {SECRET}"])
        await scheduler.backend.record(JobPolicy("sent"), raw)
        again = (await api.get("/jobs/sent/history")).json()["records"][0]
    shown = {"sent": 3, "via": "amqp://u:***@h/", "for": "***"}
    assert history[0]["result"] == run["result"] == shown
    assert fine["result"] is None
    assert (again["run_id"], again["result"]) == ("raw", ["KeyError: ***"])


async def test_a_broker_url_is_shown_without_its_password() -> None:
    backend = RabbitMQBackend("amqp://app:hunter2-pw@127.0.0.1:5672/")  # never connected
    scheduler = Scheduler(backend)
    scheduler.every("tick", "1m", noop)
    async with client(create_app(scheduler)) as api:
        body = (await api.get("/jobs")).json()
    assert "hunter2-pw" not in json.dumps(body)
    assert "amqp://app:***@127.0.0.1:5672/" in body["backend"]
    assert body["running"] is False and body["jobs"][0]["state"] == "idle"
    assert "overlap" not in body["jobs"][0]["options"]  # a claim-only backend: no lease options


async def test_health_is_degraded_with_the_overdue_jobs(clock: TestClock) -> None:
    release = asyncio.Event()

    async def stuck(ctx: JobContext) -> None:
        await release.wait()  # holds its lease: the next slots are skipped (overlap)

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    scheduler.every("stuck", "1m", stuck)
    scheduler.every("fine", "1m", noop)
    async with scheduler, client(create_app(scheduler)) as api:
        assert (await api.get("/health")).json()["status"] == "ok"
        await clock.advance("4m")
        response = await api.get("/health")
        release.set()
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "degraded"
    assert [job["job"] for job in body["overdue"]] == ["stuck"]
    assert body["overdue"][0]["state"] == "running"
    async with client(create_app(scheduler)) as api:
        stopped = await api.get("/health")
    assert (stopped.status_code, stopped.json()["status"]) == (503, "stopped")


async def test_openapi_describes_every_route(api: httpx.AsyncClient) -> None:
    schema = (await api.get("/openapi.json")).json()
    assert schema["openapi"].startswith("3.")
    app = create_app(Scheduler())
    api_routes = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        and route.path not in ("/", "/openapi.json")
        and not route.path.startswith("/static/")
        for method in (route.methods or set()) - {"HEAD"}
    }
    described = {(path, method) for path, item in schema["paths"].items() for method in item}
    assert described == api_routes
    assert (
        schema == openapi_document()
    )  # made from the routes' own models (Schemathesis: test_web_schemathesis.py)
    for path in ("/jobs/{name}/trigger", "/jobs/{name}/pause", "/jobs/{name}/resume"):
        assert schema["paths"][path]["post"]["security"] == [{"bearer": []}]
    trigger = schema["paths"]["/jobs/{name}/trigger"]["post"]["responses"]
    assert sorted(trigger) == ["202", "400", "401", "403", "404", "409", "413"]


async def test_unknown_routes_and_methods_answer_in_json(api: httpx.AsyncClient) -> None:
    missing = await api.get("/nothing")
    assert (missing.status_code, missing.json()) == (404, {"error": "no such route: GET /nothing"})
    wrong = await api.get("/jobs/outbox.flush/trigger")
    assert wrong.status_code == 405
    assert wrong.json() == {"error": "GET is not allowed on /jobs/outbox.flush/trigger"}


# -- changing: the token, the origin -------------------------------------------------------


@pytest.mark.parametrize("action", ["trigger", "pause", "resume"])
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}],
    ids=["no token", "wrong token", "no Bearer scheme"],
)
async def test_changes_need_the_token(
    scheduler: Scheduler[Any], api: httpx.AsyncClient, action: str, headers: dict[str, str]
) -> None:
    response = await api.post(f"/jobs/outbox.flush/{action}", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="brokersched"'
    assert response.json()["error"] == (
        "missing or wrong admin token (send Authorization: Bearer <token>)"
    )
    job = scheduler.get("outbox.flush")
    assert job is not None and not job.paused
    assert await job.history() == []  # nothing ran


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({"Origin": "http://evil.example"}, "Origin 'http://evil.example' does not match Host"),
        ({"Origin": "null"}, "Origin 'null' does not match Host"),
        ({"Origin": "http://testserver:8080"}, "Origin 'http://testserver:8080' does not match"),
        ({"Sec-Fetch-Site": "cross-site"}, "Sec-Fetch-Site is 'cross-site'"),
        ({"Sec-Fetch-Site": "same-site"}, "Sec-Fetch-Site is 'same-site'"),
    ],
)
async def test_cross_site_changes_are_refused_even_with_the_token(
    scheduler: Scheduler[Any], api: httpx.AsyncClient, headers: dict[str, str], why: str
) -> None:
    response = await api.post("/jobs/outbox.flush/pause", headers={**AUTH, **headers})
    assert response.status_code == 403
    assert response.json()["error"].startswith(f"cross-site request refused: {why}")
    job = scheduler.get("outbox.flush")
    assert job is not None and not job.paused


async def test_pause_and_resume_are_for_the_fleet_and_audited(
    clock: TestClock, scheduler: Scheduler[Any], api: httpx.AsyncClient
) -> None:
    same_origin = {**AUTH, "Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}
    paused = await api.post("/jobs/outbox.flush/pause", headers=same_origin)
    assert paused.status_code == 200
    body = paused.json()
    assert (body["job"], body["state"], body["scope"]) == ("outbox.flush", "paused", "the fleet")
    assert body["control"]["paused"] and body["control"]["changes"][0]["action"] == "pause"
    assert body["control"]["changes"][0]["actor"] == "api:token@127.0.0.1"
    job = scheduler.get("outbox.flush")
    assert job is not None and job.paused
    await clock.advance("2m")
    assert await job.history() == []
    assert (await api.get("/jobs/outbox.flush")).json()["state"] == "paused"
    resumed = await api.post("/jobs/outbox.flush/resume", headers=AUTH)
    assert resumed.json()["state"] == "armed"
    await clock.advance("1m")
    # 12:02 (resumed at 12:02:00, its window still open) and 12:03
    assert [f"{r.started_at:%H:%M}" for r in await job.history()] == ["12:03", "12:02"]


async def test_a_pause_until_with_a_note_and_a_skip_go_through_the_api(
    clock: TestClock, scheduler: Scheduler[Any], api: httpx.AsyncClient
) -> None:
    paused = await api.post(
        "/jobs/outbox.flush/pause",
        headers=AUTH,
        json={"until": "2026-03-02T12:03:00+00:00", "note": "db failover"},
    )
    assert paused.status_code == 200
    control = paused.json()["control"]
    assert control["paused"] and control["until"] == "2026-03-02T12:03:00+00:00"
    assert control["changes"][0]["note"] == "db failover"
    await clock.advance("2m30s")
    job = scheduler.get("outbox.flush")
    assert job is not None and await job.history() == []  # 12:01, 12:02 paused
    await clock.advance("1m")
    assert [f"{r.started_at:%H:%M}" for r in await job.history()] == ["12:03"]
    assert (await api.get("/jobs/outbox.flush")).json()["control"]["paused"] is False
    skipped = await api.post("/jobs/outbox.flush/skip", headers=AUTH, json={"count": 2})
    assert skipped.status_code == 200
    assert (
        skipped.json()["control"]["skip"]["count"],
        skipped.json()["control"]["skip"]["left"],
    ) == (2, 2)
    await clock.advance("1m")  # 12:04 skipped
    (listed,) = [j for j in (await api.get("/jobs")).json()["jobs"] if j["name"] == "outbox.flush"]
    assert listed["control"]["skip"]["left"] == 1
    await clock.advance("2m")  # 12:05 skipped; 12:06 runs
    assert [f"{r.started_at:%H:%M}" for r in await job.history()] == ["12:06", "12:03"]


@pytest.mark.parametrize(
    ("action", "body", "status", "says"),
    [
        ("pause", {"until": "2026-03-02T13:00:00"}, 400, "until is invalid"),
        ("pause", {"until": "2026-03-02T11:00:00+00:00"}, 409, "is not in the future"),
        ("pause", {"note": "x" * 501}, 400, "note is invalid"),
        ("resume", {"until": "2026-03-02T13:00:00+00:00"}, 400, "until is invalid"),
        ("skip", {"count": -1}, 400, "count is invalid"),
        ("skip", {"count": "2"}, 400, "count is invalid"),
        ("skip", {"count": 2, "extra": 1}, 400, "extra is invalid"),
    ],
)
async def test_a_bad_change_is_refused_naming_the_field_and_changes_nothing(
    scheduler: Scheduler[Any],
    api: httpx.AsyncClient,
    action: str,
    body: dict[str, Any],
    status: int,
    says: str,
) -> None:
    response = await api.post(f"/jobs/outbox.flush/{action}", headers=AUTH, json=body)
    assert response.status_code == status and says in response.json()["error"]
    job = scheduler.get("outbox.flush")
    assert job is not None and (job.control is None or not job.control.changes)


async def test_trigger_runs_through_the_claim_in_the_background(
    clock: TestClock, scheduler: Scheduler[Any], api: httpx.AsyncClient
) -> None:
    response = await api.post(
        f"/jobs/{ODD.replace(':', '%3A').replace('$', '%24')}/trigger", headers=AUTH
    )
    assert response.status_code == 202
    assert response.json()["accepted"] is True
    await clock.settle()
    job = scheduler.get(ODD)
    assert job is not None
    (record,) = await job.history()
    assert (record.reason, record.outcome, record.instance_id) == (
        "manual",
        "completed",
        "instance-a",
    )


async def test_trigger_on_a_stopped_scheduler_is_a_409(clock: TestClock) -> None:
    async with client(create_app(build(clock), token=TOKEN)) as api:
        response = await api.post("/jobs/outbox.flush/trigger", headers=AUTH)
    assert response.status_code == 409
    assert response.json()["error"] == (
        "cannot trigger job 'outbox.flush': the scheduler is not running"
    )


async def test_without_a_token_changes_are_disabled(
    scheduler: Scheduler[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    async with client(create_app(scheduler)) as api:
        response = await api.post("/jobs/outbox.flush/pause", headers=AUTH)
        listed = (await api.get("/jobs")).json()
    assert response.status_code == 403
    assert "no admin token is configured (set BROKERSCHED_ADMIN_TOKEN" in response.json()["error"]
    assert listed["changes_enabled"] is False


async def test_the_token_comes_from_the_environment(
    scheduler: Scheduler[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with client(create_app(scheduler)) as api:
        assert (await api.post("/jobs/outbox.flush/pause", headers=AUTH)).status_code == 200
        wrong = {"Authorization": f"Bearer {TOKEN}x"}
        assert (await api.post("/jobs/outbox.flush/pause", headers=wrong)).status_code == 401


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_app(Scheduler(), token="short")
    assert str(caught.value).startswith(
        "the admin token is too short (5 characters); use at least 16"
    )
    assert caught.value.option == "token"


async def test_the_host_application_may_authorise_instead(scheduler: Scheduler[Any]) -> None:
    async def is_admin(request: Request) -> bool:
        return request.headers.get("x-user") == "alice"

    async with client(create_app(scheduler, authorize=is_admin)) as api:
        alice = await api.post("/jobs/outbox.flush/pause", headers={"X-User": "alice"})
        mallory = await api.post("/jobs/outbox.flush/resume", headers={"X-User": "mallory"})
        forged = await api.post(
            "/jobs/outbox.flush/resume",
            headers={"X-User": "alice", "Origin": "http://evil.example"},
        )
    assert (alice.status_code, mallory.status_code, forged.status_code) == (200, 401, 403)
    job = scheduler.get("outbox.flush")
    assert job is not None and job.paused


async def test_mounted_in_a_host_application(
    scheduler: Scheduler[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.applications import Starlette

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    host = Starlette()
    host.mount("/scheduler", create_app(scheduler, authorize=lambda r: "x-admin" in r.headers))
    async with client(host) as api:
        page = await api.get("/scheduler/")
        listed = await api.get("/scheduler/jobs")
        origin = {"X-Admin": "1", "Origin": "http://testserver"}
        paused = await api.post("/scheduler/jobs/outbox.flush/pause", headers=origin)
        refused = await api.post("/scheduler/jobs/outbox.flush/resume")
        script = await api.get("/scheduler/static/app.js")
        bare = await api.get("/scheduler", follow_redirects=False)
    # relative: mountable
    assert script.headers["content-type"].startswith("text/javascript")
    assert (bare.status_code, bare.headers["location"]) == (307, "http://testserver/scheduler/")
    assert page.status_code == 200 and 'src="static/app.js"' in page.text
    assert [job["name"] for job in listed.json()["jobs"]] == ["outbox.flush", ODD]
    assert (paused.status_code, refused.status_code) == (200, 401)


def test_an_answer_goes_through_the_body_its_document_declares_for_its_status() -> None:
    trigger = next(op for op in OPERATIONS if op.key == ("post", "/jobs/{name}/trigger"))
    accepted = {"job": "a", "accepted": True, "detail": "the run goes through the claim"}
    assert json.loads(trigger.render(Reply(accepted, 202)).body) == accepted
    with pytest.raises(UndocumentedAnswerError, match="answered 200; its OpenAPI document"):
        trigger.render(Reply(accepted, 200))  # a status the document does not declare
    with pytest.raises(ValidationError):
        trigger.render(Reply({**accepted, "extra": 1}, 202))  # a key it does not declare
    with pytest.raises(ValidationError):
        trigger.render(Reply({"job": "a"}, 202))  # keys it forgot


async def test_an_overview_read_during_an_outage_says_what_is_not_known(
    clock: TestClock, scheduler: Scheduler[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable(*args: Any) -> Any:
        raise BackendUnavailableError("connection refused")

    monkeypatch.setattr(scheduler.backend, "history", unreachable)
    monkeypatch.setattr(scheduler.backend, "instances", unreachable)
    async with client(create_app(scheduler)) as api:
        body = (await api.get("/overview")).json()
    failures = body["failures"]
    assert failures["unread"] == sorted(["outbox.flush", ODD])
    assert failures["complete"] is False and failures["count"] == 0
    assert failures["error"].startswith("no job's history could be read: ")
    assert "connection refused" in failures["error"]
    assert "connection refused" in body["fleet"]["error"]
    assert body["fleet"]["instances"] == []

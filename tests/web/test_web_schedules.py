"""The admin API's stored schedules (``GET /schedules``, ``GET``, ``PUT`` and ``DELETE
/schedules/{id}``) through httpx's ASGI transport, on schedulers of one memory store in virtual
time: a write's version and who made it, a conflict answering 409 with the schedule's version,
a refused schedule answering 400 naming it and writing nothing, a delete, and a schedule
written through the API run once per slot by the fleet."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from brokersched.web import create_app

TOKEN = "test-admin-token-0123456789"
READER = "test-reader-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START = "2026-03-02T12:00:00+00:00"
SECRET = "pw-do-not-show-42"


class Fleet:
    """Two schedulers on one store, each with the task; the API served by the first."""

    def __init__(self) -> None:
        self.clock = TestClock(START)
        self.store = MemoryStore()
        self.runs: list[tuple[str, str, Any]] = []
        self.members = [self.member(name) for name in ("a", "b")]

    def member(self, name: str) -> Scheduler[Any]:
        backend = MemoryBackend(store=self.store)
        scheduler = Scheduler(backend, clock=self.clock, jitter=0, instance_id=f"instance-{name}")

        @scheduler.task("reports.send")
        async def send(ctx: JobContext) -> None:
            self.runs.append((name, f"{ctx.scheduled_at:%H:%M:%S}", ctx.data))

        return scheduler


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet()
    for member in fleet.members:
        await member.start()
    try:
        yield fleet
    finally:
        for member in fleet.members:
            await member.stop()


@pytest.fixture
async def api(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(fleet.members[0], token=TOKEN, read_token=READER)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


async def put(api: httpx.AsyncClient, schedule_id: str, **body: Any) -> httpx.Response:
    return await api.put(f"/schedules/{schedule_id}", json=body, headers=AUTH)


async def test_put_writes_a_version_each_time_and_get_shows_the_latest(
    api: httpx.AsyncClient, fleet: Fleet
) -> None:
    first = await put(
        api, "acme", task="reports.send", cron="0 8 * * MON-FRI", timezone="Europe/Paris",
        data={"tenant": "acme"}, options={"timeout": "30s"}, by="alice",
    )  # fmt: skip
    assert first.status_code == 200, first.text
    body = first.json()
    assert (body["version"], body["updated_by"], body["task"]) == (1, "alice", "reports.send")
    assert body["trigger"] == {
        "kind": "cron", "expression": "0 8 * * MON-FRI", "timezone": "Europe/Paris", "dst": None
    }  # fmt: skip
    assert body["options"] == {"timeout": "30s", "timezone": "Europe/Paris"}
    second = await put(api, "acme", task="reports.send", every="10s", if_version=1)
    assert second.status_code == 200, second.text
    assert (second.json()["version"], second.json()["describe"]) == (2, "every 10s")
    assert second.json()["updated_by"] == "api:token@127.0.0.1"  # the caller, as for a pause
    got = await api.get("/schedules/acme", headers=AUTH)
    assert (got.status_code, got.json()["version"], got.json()["data"]) == (200, 2, None)
    # the other instance reads the same store
    seen = await fleet.members[1].schedules.get("acme")
    assert seen is not None and seen.version == 2
    assert (await put(api, "beta", task="reports.send", at="2027-01-01T00:00:00Z")).is_success
    listed = await api.get("/schedules", headers={"Authorization": f"Bearer {READER}"})
    assert [s["id"] for s in listed.json()["schedules"]] == ["acme", "beta"]
    only = await api.get("/schedules", params={"prefix": "be"}, headers=AUTH)
    assert [s["id"] for s in only.json()["schedules"]] == ["beta"]


async def test_if_version_conflicts_answer_409_with_the_version_and_change_nothing(
    api: httpx.AsyncClient,
) -> None:
    assert (await put(api, "acme", task="reports.send", every="10s", if_version=0)).is_success
    again = await put(api, "acme", task="reports.send", every="20s", if_version=0)
    assert again.status_code == 409
    assert again.json()["version"] == 1 and "is at version 1, not 0" in again.json()["error"]
    refused = await api.delete("/schedules/acme", params={"if_version": 7}, headers=AUTH)
    assert (refused.status_code, refused.json()["version"]) == (409, 1)
    got = (await api.get("/schedules/acme", headers=AUTH)).json()
    assert (got["version"], got["trigger"]["interval_ms"]) == (1, 10_000)
    absent = await api.delete("/schedules/nobody", params={"if_version": 3}, headers=AUTH)
    assert (absent.status_code, absent.json()["version"]) == (409, 0)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"task": "reports.send", "every": "10x"}, "interval '10x' is not a duration"),
        ({"task": "reports.send", "cron": "0 8 * *"}, "has 4 fields; 5 or 6 are accepted"),
        ({"task": "reports.send", "cron": "0 8 * * *", "timezone": "Mars/Olympus"}, "Mars/Olympus"),
        (
            {"task": "reports.send", "every": "1m", "options": {"bogus": 1}},
            "unknown option 'bogus' (valid options:",
        ),
        (
            {"task": "reports.send", "every": "1m", "options": {"task": "x"}},
            "options.task is not a job option",
        ),
        ({"task": "reports.send", "every": "1m", "cron": "* * * * *"}, "exactly one of every"),
        ({"task": "reports.send"}, "exactly one of every, cron or at (given: none)"),
        ({"task": "reports.send", "every": "1m", "color": "red"}, "color is invalid"),
        ({"task": 3, "every": "1m"}, "task is invalid"),
        ({"task": "reports.send", "at": "0001-01-01T00:00:00+05:00"}, "is out of range"),
        ({"task": "reports.send", "at": "2027-01-15T08:00:00"}, "at is invalid"),
        (None, "the body is required"),
    ],
)
async def test_a_refused_schedule_answers_400_naming_it_and_writes_nothing(
    api: httpx.AsyncClient, body: Any, said: str
) -> None:
    if body is None:
        answer = await api.put("/schedules/acme", headers=AUTH)
    else:
        answer = await put(api, "acme", **body)
    assert answer.status_code == 400, answer.text
    assert said in answer.json()["error"]
    assert (await api.get("/schedules/acme", headers=AUTH)).status_code == 404


async def test_a_body_larger_than_64_kib_is_refused(api: httpx.AsyncClient) -> None:
    answer = await put(api, "acme", task="reports.send", every="1m", data="x" * 70_000)
    assert answer.status_code == 413 and "at most 65536 are taken" in answer.json()["error"]
    assert (await api.get("/schedules/acme", headers=AUTH)).status_code == 404


async def test_an_invalid_id_is_refused_on_write_and_found_nowhere(api: httpx.AsyncClient) -> None:
    bad = await put(api, "-starts-with-a-dash", task="reports.send", every="1m")
    assert bad.status_code == 400 and "is not valid" in bad.json()["error"]
    assert (await api.get("/schedules/-starts-with-a-dash", headers=AUTH)).status_code == 404
    assert (await api.delete("/schedules/-starts-with-a-dash", headers=AUTH)).status_code == 404


async def test_delete_stops_it_and_a_second_delete_answers_404(
    api: httpx.AsyncClient, fleet: Fleet
) -> None:
    await put(api, "acme", task="reports.send", every="10s")
    done = await api.delete("/schedules/acme", params={"if_version": 1}, headers=AUTH)
    assert (done.status_code, done.json()["deleted"]) == (200, True)
    assert (await api.get("/schedules/acme", headers=AUTH)).status_code == 404
    again = await api.delete("/schedules/acme", headers=AUTH)
    assert (again.status_code, again.json()["error"]) == (404, "no stored schedule 'acme'")
    assert (await api.get("/schedules", headers=AUTH)).json() == {"schedules": []}


async def test_only_the_admin_token_writes(api: httpx.AsyncClient) -> None:
    reader = {"Authorization": f"Bearer {READER}"}
    refused = await api.put("/schedules/acme", json={"task": "t", "every": "1m"}, headers=reader)
    assert refused.status_code == 403
    assert refused.json()["error"] == "the read-only token may not schedule: use the admin token"
    assert (await api.put("/schedules/acme", json={"task": "t", "every": "1m"})).status_code == 401
    assert (await api.delete("/schedules/acme", headers=reader)).status_code == 403
    assert (await api.get("/schedules")).status_code == 401
    assert (await api.get("/schedules/acme", headers=AUTH)).status_code == 404


async def test_a_schedule_written_through_the_api_runs_once_per_slot_on_the_fleet(
    api: httpx.AsyncClient, fleet: Fleet
) -> None:
    written = await put(api, "acme", task="reports.send", every="10s", data={"n": 1})
    assert written.status_code == 200
    await fleet.clock.advance("1m")
    slots = [slot for _, slot, _ in fleet.runs]
    # 12:00:00 + 3 s effective: the slots from 12:00:10 to 12:01:00, each run once
    assert slots and sorted(slots) == sorted(set(slots)), fleet.runs
    assert slots[0] == "12:00:10" and slots[-1] == "12:01:00", slots
    assert {data["n"] for _, _, data in fleet.runs} == {1}
    await api.delete("/schedules/acme", headers=AUTH)
    count = len(fleet.runs)
    await fleet.clock.advance("1m")
    assert len(fleet.runs) == count


async def test_a_password_in_a_schedules_data_is_masked(api: httpx.AsyncClient) -> None:
    data = {"broker": f"amqp://app:{SECRET}@mq.internal/"}
    written = await put(api, "acme", task="reports.send", every="1m", data=data)
    assert SECRET not in written.text
    for path in ("/schedules/acme", "/schedules"):
        answer = await api.get(path, headers=AUTH)
        assert SECRET not in answer.text and "amqp://app:***@mq.internal/" in answer.text

"""The dashboard's pages as the admin API serves them: the fleet overview, a job's history
(filtered, paged), its timeline (what became of every slot), one run, the session. Real
schedulers on the embedded backend, in virtual time, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import httpx
import pytest

from brokersched import JobContext, MemoryBackend, Retry, Scheduler
from brokersched._clock import datetime_to_ms, ms_to_datetime
from brokersched._events import SkipEvent
from brokersched.abc import JobPolicy, RunRecord
from brokersched.backends.memory import MemoryStore
from brokersched.testing import TestClock
from brokersched.web import TOKEN_ENV, create_app
from brokersched.web._attempts import next_attempt
from brokersched.web._failures import error_pattern
from brokersched.web._query import WINDOW_PATTERN, QueryError, parse_window, window_ms
from brokersched.web._timeline import Pauses, Window, timeline

TOKEN = "test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START = "2026-03-02T12:00:00+00:00"
MINUTE = 60_000
START_MS = datetime_to_ms(TestClock(START).now())


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def noop(ctx: JobContext) -> None:
    pass


def connect(slot_ms: int) -> None:
    raise ConnectionError(f"provider reset the connection at {slot_ms}")


async def fails_on_odd_minutes(ctx: JobContext) -> None:
    if ctx.slot_ms // MINUTE % 2:
        try:
            connect(ctx.slot_ms)
        except ConnectionError as exc:
            raise RuntimeError("payments batch failed") from exc


def fleet_member(clock: TestClock, store: MemoryStore, name: str) -> Scheduler[Any]:
    scheduler = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id=name)
    scheduler.every("payments", "1m", fails_on_odd_minutes)
    scheduler.every("flush", "1m", noop)
    scheduler.cron("report", "0 8 * * *", noop, timezone="Europe/Paris")
    return scheduler


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[TestClock, Scheduler[Any], Scheduler[Any]]]:
    clock = TestClock(START)
    store = MemoryStore()
    async with fleet_member(clock, store, "web-a") as a, fleet_member(clock, store, "web-b") as b:
        await clock.advance("5m")  # 12:01 ... 12:05 on web-a (the first to claim)
        await a.stop()  # (a pause would pause the whole fleet)
        await clock.advance("5m")  # 12:06 ... 12:10 on web-b
        await a.start()
        yield clock, a, b


# -- a job's history: filters and pages --------------------------------------------------------


async def test_history_filters_by_outcome_instance_and_reason(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    clock, a, _ = fleet
    async with client(create_app(a, token=TOKEN)) as api:
        assert (await api.post("/jobs/payments/trigger", headers=AUTH)).status_code == 202
        await clock.settle()
        everything = (await api.get("/jobs/payments/history", params={"limit": 100})).json()
        failed = (await api.get("/jobs/payments/history?outcome=failed")).json()
        on_b = (await api.get("/jobs/payments/history?instance=web-b")).json()
        manual = (await api.get("/jobs/payments/history?reason=manual")).json()
        both = await api.get("/jobs/payments/history?outcome=completed,failed&reason=schedule")
    records = everything["records"]
    assert len(records) == 11  # ten slots and the manual run
    assert set(everything["choices"]["reason"]) >= {"schedule", "retry", "manual"}
    assert everything["choices"]["outcome"] == [
        "completed",
        "failed",
        "timed-out",
        "interrupted",
        "missed",
        "replaced",
    ]
    odd = [r for r in records if r["slot_ms"] // MINUTE % 2 and r["reason"] == "schedule"]
    assert [r["run_id"] for r in failed["records"]] == [r["run_id"] for r in odd]
    assert (failed["matched"], failed["scanned"], failed["next"]) == (5, 11, None)
    assert [r["instance_id"] for r in on_b["records"]] == ["web-b"] * 5
    assert on_b["matched"] == 5
    assert [r["reason"] for r in manual["records"]] == ["manual"]
    assert both.json()["matched"] == 10


async def test_history_pages_follow_each_other_without_gap_or_repeat(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    clock, a, _ = fleet
    async with client(create_app(a)) as api:
        newest = (await api.get("/jobs/flush/history", params={"limit": 10})).json()["records"]
        pages: list[list[str]] = []
        params: dict[str, str] = {"limit": "3"}
        while True:
            page = (await api.get("/jobs/flush/history", params=params)).json()
            pages.append([r["run_id"] for r in page["records"]])
            if page["next"] is None:
                break
            if len(pages) == 2:  # a new run arrives between two pages: nothing shifts
                await clock.advance("1m")
            params["before"] = page["next"]
    assert [len(page) for page in pages] == [3, 3, 3, 1]
    assert [run for page in pages for run in page] == [r["run_id"] for r in newest]


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("outcome=lost", "outcome 'lost' is invalid: use one or more of completed, failed, "),
        ("reason=cron", "reason 'cron' is invalid: use one or more of schedule, catch-up, "),
        ("before=yesterday", "before 'yesterday' is invalid: pass the `next` value of the "),
        ("limit=5000", "limit '5000' is invalid: use a whole number from 1 to 1000"),
    ],
)
async def test_a_bad_filter_is_a_400_that_says_what_would_do(query: str, error: str) -> None:
    scheduler = Scheduler()
    scheduler.every("flush", "1m", noop)
    async with client(create_app(scheduler)) as api:
        response = await api.get(f"/jobs/flush/history?{query}")
    assert response.status_code == 400
    assert response.json()["error"].startswith(error)


async def test_the_first_page_says_whether_there_is_an_older_one(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    _, a, _ = fleet
    async with client(create_app(a)) as api:
        some = (await api.get("/jobs/flush/history", params={"limit": 4})).json()
        every = (await api.get("/jobs/flush/history", params={"limit": 10})).json()
    assert some["next"] == f"{_started_ms(some['records'][-1])}-{some['records'][-1]['run_id']}"
    assert every["next"] is None
    assert "matched" not in some  # the first page read only what it shows (and one more)


def _started_ms(record: dict[str, Any]) -> int:
    return datetime_to_ms(ms_to_datetime(0).fromisoformat(record["started_at"]))


# -- a run -------------------------------------------------------------------------------------


async def test_a_failed_run_has_its_traceback_attempts_and_neighbours(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    _, a, _ = fleet
    async with client(create_app(a)) as api:
        records = (await api.get("/jobs/payments/history?limit=10")).json()["records"]
        failed = next(i for i, r in enumerate(records) if r["outcome"] == "failed" and i > 0)
        run_id = records[failed]["run_id"]
        body = (await api.get(f"/jobs/payments/runs/{run_id}")).json()
    run = body["run"]
    assert (run["run_id"], run["outcome"], run["error"]) == (
        run_id,
        "failed",
        "RuntimeError: payments batch failed",
    )
    assert "ConnectionError: provider reset the connection" in run["traceback"]
    assert "The above exception was the direct cause" in run["traceback"]
    assert run["instance_id"] in {"web-a", "web-b"} and run["late_ms"] == 0
    assert run["duration_ms"] == 0  # virtual time: the handler takes none
    assert [attempt["run_id"] for attempt in body["attempts"]] == [run_id]
    assert body["newer"] == records[failed - 1]["run_id"]
    assert body["older"] == records[failed + 1]["run_id"]
    assert body["max_attempts"] == 3
    assert body["job"]["name"] == "payments" and body["job"]["zone"] == "UTC"


async def test_the_attempts_at_a_slot_are_the_retries_of_a_dead_runner() -> None:
    scheduler = Scheduler(instance_id="web-a")
    scheduler.every("sync", "1m", noop)
    slot = START_MS
    records = [
        _record("sync", slot, "r1", "web-b", attempt=1, outcome="interrupted", reason="schedule"),
        _record("sync", slot, "r2", "web-a", attempt=2, outcome="completed", reason="retry"),
    ]
    async with scheduler, client(create_app(scheduler)) as api:
        for record in records:
            await scheduler.backend.record(JobPolicy("sync"), record)
        body = (await api.get("/jobs/sync/runs/r2")).json()
        missing = await api.get("/jobs/sync/runs/nope")
    assert [(a["run_id"], a["attempt"]) for a in body["attempts"]] == [("r1", 1), ("r2", 2)]
    assert missing.status_code == 404
    assert missing.json()["error"] == (
        "no run 'nope' in the history of job 'sync' (its newest 2 records were searched; older "
        "ones are trimmed)"
    )


def _record(
    job: str,
    slot_ms: int,
    run_id: str,
    instance: str,
    *,
    attempt: int = 1,
    outcome: Any = "completed",
    reason: Any = "schedule",
    took_ms: int = 100,
) -> RunRecord:
    started = ms_to_datetime(slot_ms + 10)
    return RunRecord(
        job=job,
        slot_ms=slot_ms,
        run_id=run_id,
        instance_id=instance,
        reason=reason,
        attempt=attempt,
        started_at=started,
        finished_at=started + timedelta(milliseconds=took_ms),
        outcome=outcome,
    )


# -- the timeline: what became of each slot ------------------------------------------------------


async def test_a_slot_skipped_because_a_run_was_still_going_is_not_missed() -> None:
    release = asyncio.Event()

    async def slow(ctx: JobContext) -> None:
        await release.wait()  # holds its lease: the next slots are skipped (overlap='skip')

    clock = TestClock(START)
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="web-a")
    scheduler.every("slow", "1m", slow)
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("3m30s")  # 12:01 runs on; 12:02 and 12:03 fall during it
        release.set()
        await clock.advance("3m")  # 12:04 ... 12:06 run; now 12:06:30
        body = (await api.get("/jobs/slow/timeline", params={"window": "15m"})).json()
    states = {(mark["slot_ms"] - START_MS) // MINUTE: mark["state"] for mark in body["slots"]}
    assert states == {2: "overlap", 3: "overlap"}
    assert body["lanes"] == ["web-a"]
    assert sorted((run["slot_ms"] - START_MS) // MINUTE for run in body["runs"]) == [1, 4, 5, 6]


async def test_slots_paused_through_the_api_or_by_code_are_paused_not_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    clock = TestClock(START)
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="web-a")
    job = scheduler.every("flush", "1m", noop)
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("1m")  # 12:01 runs
        await api.post("/jobs/flush/pause", headers=AUTH)
        await clock.advance("2m30s")  # 12:02, 12:03: paused here
        await api.post("/jobs/flush/resume", headers=AUTH)
        await clock.advance("1m")  # 12:04 runs
        job.pause()  # by code: known from the job's fleet-wide control record
        await clock.advance("1m")  # 12:05: nobody runs it
        job.resume()
        await clock.advance("2m30s")  # 12:06 ... 12:08 run; now 12:08
        body = (await api.get("/jobs/flush/timeline", params={"window": "1h"})).json()
    states = {(mark["slot_ms"] - START_MS) // MINUTE: mark["state"] for mark in body["slots"]}
    assert states == {2: "paused", 3: "paused", 5: "paused"}
    assert body["known_from_ms"] is None  # the records go back to the first run
    assert body["first_ms"] == START_MS + MINUTE


async def test_a_slot_another_instance_won_is_on_its_lane_not_a_fault(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    _, a, _ = fleet
    async with client(create_app(a)) as api:
        body = (await api.get("/jobs/flush/timeline", params={"window": "1h"})).json()
    assert body["lanes"] == ["web-a", "web-b"] and body["here"] == "web-a"
    assert body["slots"] == []  # every slot ran, on one lane or the other
    ran = sorted((run["slot_ms"] - START_MS) // MINUTE for run in body["runs"])
    assert ran == list(range(1, 11))
    assert {run["instance_id"] for run in body["runs"]} == {"web-a", "web-b"}


def test_a_double_run_is_flagged_and_a_retry_is_not() -> None:
    scheduler = Scheduler(instance_id="web-a")
    job = scheduler.every("sync", "1m", noop)
    one, two = START_MS + MINUTE, START_MS + 2 * MINUTE
    records = [  # newest first
        _record("sync", two, "d2", "web-b"),
        _record("sync", two, "d1", "web-a"),  # the same slot, attempt 1 twice: a double
        _record("sync", one, "r2", "web-a", attempt=2, reason="retry"),
        _record("sync", one, "r1", "web-b", outcome="interrupted"),
    ]
    now = START_MS + 10 * MINUTE
    body = timeline(
        job,
        records,
        window=Window(now - 3_600_000, now),
        now_ms=now,
        here="web-a",
        skips=[],
        pauses=Pauses(),
        overlap_skips=False,
        read_limit=1000,
    )
    doubles = [mark["slot_ms"] for mark in body["slots"] if mark["state"] == "double"]
    assert doubles == [two]
    missed = sorted((m["slot_ms"] - START_MS) // MINUTE for m in body["slots"][:-1])
    assert missed == [3, 4, 5, 6, 7, 8, 9]  # 12:10 is within max_late: not judged yet


def test_why_this_instance_skipped_a_slot_is_shown_and_a_lost_claim_is_no_fault() -> None:
    scheduler = Scheduler(instance_id="web-a")
    job = scheduler.every("sync", "1m", noop)
    records = [_record("sync", START_MS + MINUTE, "r1", "web-b")]
    skips = [
        SkipEvent("sync", START_MS + 2 * MINUTE, "late", "the claim answered 70s late"),
        SkipEvent("sync", START_MS + 3 * MINUTE, "backend-error", "ConnectionError: reset"),
        SkipEvent("sync", START_MS + 4 * MINUTE, "not-acquired"),
    ]
    now = START_MS + 6 * MINUTE
    body = timeline(
        job,
        records,
        window=Window(now - 900_000, now),
        now_ms=now,
        here="web-a",
        skips=skips,
        pauses=Pauses(),
        overlap_skips=True,
        read_limit=1000,
    )
    marks = [((m["slot_ms"] - START_MS) // MINUTE, m["state"], m["detail"]) for m in body["slots"]]
    assert marks == [
        (2, "late", "the claim answered 70s late"),
        (3, "backend-error", "ConnectionError: reset"),
        (4, "not-acquired", "claimed by another instance; no record"),
        (5, "missed", "no instance ran it"),
    ]


def test_a_backfilled_older_range_marks_no_slot_missed_before_the_fleet_began() -> None:
    """The fleet ran from 12:10; an operator backfilled 11:00-11:04: the slots between are no
    fault of the fleet's (it did not exist), and the backfilled ones ran."""
    scheduler = Scheduler(instance_id="web-a")
    job = scheduler.every("sync", "1m", noop)
    backfilled = [
        _record("sync", START_MS - n * MINUTE, f"b{n}", "ops", reason="backfill")
        for n in (56, 57, 58, 59, 60)
    ]
    records = [_record("sync", START_MS + n * MINUTE, f"r{n}", "web-a") for n in (12, 11, 10)]
    now = START_MS + 13 * MINUTE
    body = timeline(
        job,
        [*records, *backfilled],
        window=Window(now - 3 * 3_600_000, now),
        now_ms=now,
        here="web-a",
        skips=[],
        pauses=Pauses(),
        overlap_skips=False,
        read_limit=1000,
    )
    assert [mark["state"] for mark in body["slots"]] == []  # 12:13: within max_late
    assert len(body["runs"]) == 8


def test_records_cut_by_the_read_limit_say_from_when_the_timeline_is_known() -> None:
    scheduler = Scheduler(instance_id="web-a")
    job = scheduler.every("sync", "1m", noop)
    records = [_record("sync", START_MS + n * MINUTE, f"r{n}", "web-a") for n in (3, 2)]
    now = START_MS + 4 * MINUTE
    common: dict[str, Any] = {
        "window": Window(now - 3_600_000, now),
        "now_ms": now,
        "here": "web-a",
        "skips": [],
        "pauses": Pauses(),
        "overlap_skips": False,
    }
    cut = timeline(job, records, read_limit=2, **common)
    whole = timeline(job, records, read_limit=3, **common)
    assert cut["known_from_ms"] == START_MS + 2 * MINUTE
    assert whole["known_from_ms"] is None


# -- the overview --------------------------------------------------------------------------------


async def test_the_overview_shows_failures_of_the_hour_next_runs_and_the_instances(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    clock, a, _ = fleet
    report = a.get("report")
    assert report is not None
    report.pause()
    async with client(create_app(a)) as api:
        body = (await api.get("/overview", params={"window": "15m"})).json()
        await clock.advance("1h")
        later = (await api.get("/overview")).json()
    assert body["instance_id"] == "web-a" and body["backend_status"]["reachable"] is True
    failures = body["failures"]
    assert (failures["count"], failures["complete"]) == (5, True)
    assert [(r["job"], r["outcome"]) for r in failures["runs"]] == [("payments", "failed")] * 5
    slots = [r["slot_ms"] for r in failures["runs"]]
    assert slots == sorted(slots, reverse=True)
    assert failures["runs"][0]["error"] == "RuntimeError: payments batch failed"
    (group,) = failures["groups"]  # failures alike: one row, the latest run first
    assert {k: group[k] for k in ("job", "outcome", "error", "count", "instances")} == {
        "job": "payments",
        "outcome": "failed",
        "error": "RuntimeError: payments batch failed",
        "count": 5,
        "instances": ["web-a", "web-b"],
    }
    assert group["latest"]["run_id"] == failures["runs"][0]["run_id"]
    # the next run of every armed job, soonest first; the paused one has none
    nexts = [(n["job"], (n["at_ms"] - START_MS) // MINUTE) for n in body["next_runs"]]
    assert nexts == [("flush", 11), ("payments", 11)]
    # instances: this one first, then those seen in the runs
    instances = body["instances"]
    assert [(i["instance_id"], i["here"]) for i in instances] == [("web-a", True), ("web-b", False)]
    assert sum(i["runs"] for i in instances) == 20 and sum(i["failures"] for i in instances) == 5
    jobs = {job["name"]: job for job in body["jobs"]}
    assert jobs["payments"]["counts"] == {"completed": 5, "failed": 5}
    assert jobs["report"]["state"] == "paused" and jobs["report"]["timeline"]["runs"] == []
    assert len(jobs["flush"]["timeline"]["runs"]) == 10
    # an hour later: the failures of 12:11 ... 13:10 (odd minutes) only, the earlier aged out
    assert (later["failures"]["count"], later["failures"]["complete"]) == (30, True)
    oldest = min(r["slot_ms"] for r in later["failures"]["runs"])
    assert (oldest - START_MS) // MINUTE == 11


async def test_a_job_run_more_often_than_the_overview_reads_says_its_count_is_partial() -> None:
    clock = TestClock(START)

    async def fails(ctx: JobContext) -> None:
        raise RuntimeError("always")

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="web-a")
    scheduler.every("busy", "2s", fails)
    scheduler.every("daily", "1d", fails)
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("40m")  # 1200 runs: more than the 1000 the overview reads at most
        body = (await api.get("/overview", params={"window": "15m"})).json()
    assert (body["failures"]["count"], body["failures"]["complete"]) == (1000, False)
    assert len(body["failures"]["runs"]) == 50
    busy, daily = body["jobs"]
    assert busy["counts"] == {"failed": 451}  # 12:25:00 ... 12:40:00, both ends
    assert busy["timeline"]["known_from_ms"] is not None  # older records were not read
    assert daily["counts"] == {} and daily["timeline"]["known_from_ms"] is None


@pytest.mark.parametrize("window", ["0s", "30s", "8d", "soon", "1" * 40])
async def test_a_bad_window_is_a_400(window: str) -> None:
    scheduler = Scheduler()
    scheduler.every("flush", "1m", noop)
    async with client(create_app(scheduler)) as api:
        for path in ("/overview", "/jobs/flush/timeline"):
            response = await api.get(path, params={"window": window})
            assert response.status_code == 400
            assert (
                "is invalid: use a duration from 1m to 7d, e.g. 15m, 1h, 24h"
                in (response.json()["error"])
            )


# -- the session: what the page may change -------------------------------------------------------


async def test_the_session_says_whether_the_token_is_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    scheduler = Scheduler(instance_id="web-a")
    async with client(create_app(scheduler)) as api:
        anonymous = (await api.get("/session")).json()
        right = (await api.get("/session", headers=AUTH)).json()
        wrong = (await api.get("/session", headers={"Authorization": "Bearer x" * 3})).json()
    assert anonymous["changes_enabled"] and anonymous["token_accepted"]
    assert (anonymous["authorized"], right["authorized"], wrong["authorized"]) == (
        False,
        True,
        False,
    )
    assert right["via"] == "token" and right["instance_id"] == "web-a"


async def test_a_host_session_needs_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mounted with authorize= reading the host's cookie session: the page must not ask for a
    token that does not exist."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    scheduler = Scheduler()
    app = create_app(scheduler, authorize=lambda request: request.cookies.get("user") == "alice")
    async with client(app) as api:
        stranger = (await api.get("/session")).json()
        api.cookies.set("user", "alice")
        alice = (await api.get("/session")).json()
    assert alice == {
        "changes_enabled": True,
        "token_accepted": False,
        "authorized": True,
        "via": "host",
        "can_read": True,
        "reads_protected": False,
        "actions": ["trigger", "pause", "resume", "disable", "enable", "skip", "abort", "schedule"],
        "instance_id": scheduler.instance_id,
        "backend": "MemoryBackend()",
    }
    assert (stranger["authorized"], stranger["token_accepted"]) == (False, False)
    assert (stranger["can_read"], stranger["actions"]) == (True, [])


async def test_a_failing_host_check_is_no_session(caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: Any) -> bool:
        raise RuntimeError("session store down")

    async with client(create_app(Scheduler(), authorize=broken)) as api:
        body = (await api.get("/session")).json()
    assert (body["authorized"], body["via"]) == (False, None)
    assert "the host application's authorize() failed" in caplog.text


def test_a_window_is_a_whole_number_of_minutes_hours_days_or_weeks_from_1m_to_7d() -> None:
    week_ms = 7 * 86_400_000
    for unit, unit_ms in (("m", 60_000), ("h", 3_600_000), ("d", 86_400_000), ("w", week_ms)):
        for count in range(week_ms // unit_ms + 50):
            window = f"{count}{unit}"
            taken = 60_000 <= count * unit_ms <= week_ms
            assert bool(re.fullmatch(WINDOW_PATTERN, window)) == taken, window
            if taken:
                assert parse_window(window) == window
                assert window_ms(window) == count * unit_ms
    for refused in ("01h", "1h30m", "1.5h", "90M", " 1h", "1h ", "60s", "1h\n"):
        with pytest.raises(QueryError):
            parse_window(refused)


# -- failures alike, whatever ids their messages carry -------------------------------------------


async def test_failures_whose_messages_differ_by_ids_are_one_row_with_the_latest_example() -> None:
    clock = TestClock(START)

    async def batch(ctx: JobContext) -> None:
        raise RuntimeError(f"batch {ctx.slot_ms // MINUTE % 100} failed (run {ctx.run_id})")

    async def other(ctx: JobContext) -> None:
        raise KeyError("no such account")

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="web-a")
    scheduler.every("payments", "1m", batch)
    scheduler.every("ledger", "1m", other)
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("12m")
        body = (await api.get("/overview", params={"window": "15m"})).json()
    failures = body["failures"]
    assert failures["count"] == 24
    groups = {group["job"]: group for group in failures["groups"]}
    assert len(failures["groups"]) == 2 and set(groups) == {"payments", "ledger"}
    payments = groups["payments"]
    assert payments["count"] == 12
    assert payments["pattern"] == "RuntimeError: batch <n> failed (run <id>)"
    assert re.fullmatch(r"RuntimeError: batch \d+ failed \(run [0-9a-f]{16}\)", payments["error"])
    assert payments["latest"]["slot_ms"] == START_MS + 12 * MINUTE  # the latest is the example
    assert payments["error"] == payments["latest"]["error"]
    assert groups["ledger"]["count"] == 12


@pytest.mark.parametrize(
    ("error", "pattern"),
    [
        ("RuntimeError: batch 33 failed", "RuntimeError: batch <n> failed"),
        ("E: order 5f0c2a9b1e not found", "E: order <id> not found"),
        ("E: 0xdeadbeef at 3", "E: <id> at <n>"),
        ("E: 123e4567-e89b-12d3-a456-426614174000 gone", "E: <id> gone"),
        ("E: facade decade", "E: facade decade"),  # hex letters, no digit: words
        (None, None),
    ],
)
def test_an_errors_kind_has_its_ids_and_numbers_replaced(
    error: str | None, pattern: str | None
) -> None:
    assert error_pattern(error) == pattern


# -- a failed run: is it run again? ----------------------------------------------------------------


async def test_a_failed_run_without_retry_says_it_is_not_retried(
    fleet: tuple[TestClock, Scheduler[Any], Scheduler[Any]],
) -> None:
    _, a, _ = fleet
    async with client(create_app(a)) as api:
        failed = (await api.get("/jobs/payments/history?outcome=failed&limit=1")).json()
        (record,) = failed["records"]
        body = (await api.get(f"/jobs/payments/runs/{record['run_id']}")).json()
        done = (await api.get("/jobs/flush/history?limit=1")).json()["records"][0]
        completed = (await api.get(f"/jobs/flush/runs/{done['run_id']}")).json()
    assert body["next_attempt"]["retried"] is False
    assert body["next_attempt"]["summary"] == "not retried"
    assert "no retry= option" in body["next_attempt"]["detail"]
    assert completed["next_attempt"] is None  # it did not fail


async def test_a_failed_run_with_retry_says_whether_it_was_retried() -> None:
    clock = TestClock(START)

    async def fails(ctx: JobContext) -> None:
        raise RuntimeError("down")

    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="web-a")
    scheduler.every("sync", "10m", fails, retry=Retry(attempts=2, backoff="1s"), timeout="5s")
    async with scheduler, client(create_app(scheduler)) as api:
        await clock.advance("10m")
        await clock.advance("5s")  # the retry ran and failed too
        records = (await api.get("/jobs/sync/history?limit=5")).json()["records"]
        by_attempt = {r["attempt"]: r["run_id"] for r in records}
        first = (await api.get(f"/jobs/sync/runs/{by_attempt[1]}")).json()
        last = (await api.get(f"/jobs/sync/runs/{by_attempt[2]}")).json()
    assert first["next_attempt"]["retried"] is True
    assert first["next_attempt"]["summary"] == "retried (attempt 2)"
    assert last["next_attempt"] == {
        "retried": False,
        "summary": "not retried",
        "detail": "the last of retry's 2 attempts",
    }


def test_an_interrupted_run_is_taken_over_only_on_a_lease_backend_within_max_attempts() -> None:
    scheduler = Scheduler(instance_id="web-a")
    job = scheduler.every("sync", "1m", noop, max_attempts=2)
    cut = _record("sync", START_MS, "r1", "web-b", outcome="interrupted")
    claim_only = next_attempt(cut, [cut], job, leases=False, now_ms=START_MS)
    assert claim_only is not None and claim_only["retried"] is False
    assert "claim-only backend" in claim_only["detail"]
    leased = next_attempt(cut, [cut], job, leases=True, now_ms=START_MS)
    assert leased is not None and leased["retried"] is None
    assert leased["summary"] == "may be taken over (at most 2 attempts, max_attempts)"
    second = replace(cut, attempt=2, run_id="r2")
    assert next_attempt(second, [cut, second], job, leases=True, now_ms=START_MS) == {
        "retried": False,
        "summary": "not retried",
        "detail": "max_attempts (2) reached",
    }

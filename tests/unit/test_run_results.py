"""RunRecord.result: a handler's JSON return value kept with its run, redacted and capped;
``Scheduler(record_results=False)`` keeps none; ``ctx.previous`` reads the job's last finished
run (record and result) when a handler asks, in async and sync handlers alike."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import JobContext, MemoryBackend, Retry, Scheduler
from brokersched._results import CUT_KEY, RESULT_LIMIT, dumps_result, run_result
from brokersched.abc import JobPolicy, RunRecord
from brokersched.testing import TestClock, make_context

TOKEN = "sk-live-4f9a2c"


async def test_a_handlers_json_value_is_kept_with_its_run(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    async def count(ctx: JobContext) -> dict[str, Any]:
        return {"sent": 3, "ids": (1, 2), "note": "ü ✓"}

    def sync_count(ctx: JobContext) -> list[int]:
        return [1, 2, 3]

    async def nothing(ctx: JobContext) -> None:
        return None

    jobs = [
        scheduler.every(name, "1m", handler)
        for name, handler in (("a", count), ("s", sync_count), ("n", nothing))
    ]
    await scheduler.start()
    await clock.advance("1m")
    results = [(await job.history(1))[0].result for job in jobs]
    assert results == [{"sent": 3, "ids": [1, 2], "note": "ü ✓"}, [1, 2, 3], None]
    manual = await jobs[0].trigger()
    assert manual is not None and manual.result == results[0]  # as the history reads it


async def test_a_value_that_is_not_json_is_no_result_said_once_per_job(
    scheduler: Scheduler[Any], clock: TestClock, caplog: pytest.LogCaptureFixture
) -> None:
    values: list[Any] = [{1, 2}, datetime.now(UTC), float("nan")]

    async def odd(ctx: JobContext) -> Any:
        return values.pop(0)

    job = scheduler.every("odd", "1m", odd)
    await scheduler.start()
    with caplog.at_level(logging.WARNING, "brokersched"):
        await clock.advance("3m")
    records = await job.history(5)
    assert [(r.outcome, r.result) for r in records] == [("completed", None)] * 3
    said = [r for r in caplog.records if getattr(r, "event", None) == "result-not-json"]
    assert len(said) == 1 and "job odd returned a set" in said[0].getMessage()


async def test_results_are_redacted_like_tracebacks(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    async def report(ctx: JobContext) -> dict[str, Any]:
        return {
            "dsn": "postgresql://app:hunter2@db/pay",
            "for": [f"account {ctx.data['token']}"],
            "password": "hunter2",
            "db_passwd": 1234,
            f"key {TOKEN}": "libpq password=hunter2 host=db",
        }

    job = scheduler.every("report", "1m", report, data={"token": TOKEN})
    await scheduler.start()
    await clock.advance("1m")
    (record,) = await job.history(1)
    assert record.result == {
        "dsn": "postgresql://app:***@db/pay",
        "for": ["account ***"],
        "password": "***",
        "db_passwd": "***",
        "key ***": "libpq password=*** host=db",
    }
    assert "hunter2" not in record.to_json() and TOKEN not in record.to_json()


def test_a_result_over_the_cap_is_an_honest_marker() -> None:
    value = {"rows": ["é" * 100] * 100}
    result, is_json = run_result(value)
    text = dumps_result(value)
    assert is_json and len(text) > RESULT_LIMIT
    assert result == {CUT_KEY: {"bytes": len(text), "limit": RESULT_LIMIT}, "head": result["head"]}
    assert text.startswith(result["head"]) and len(result["head"]) == RESULT_LIMIT // 4
    assert len(dumps_result(result)) <= RESULT_LIMIT  # JSON, and small, even when escaped
    huge, _ = run_result(["postgresql://app:hunter2@db/x"] * 10_000)
    assert huge[CUT_KEY]["bytes"] > 64 * RESULT_LIMIT and huge["head"] == ""  # not masked
    cut, _ = run_result(["postgresql://app:hunter2@db/x"] * 200)
    assert "hunter2" not in cut["head"] and cut["head"].startswith('["postgresql://app:***@')
    fits = ["x" * (RESULT_LIMIT - 4)]
    assert len(dumps_result(fits)) == RESULT_LIMIT and run_result(fits) == (fits, True)


def test_records_without_a_result_read_and_write_as_before() -> None:
    record = RunRecord("j", 1, "r", "i", "schedule", 1, datetime.now(UTC), None, "completed")
    text = record.to_json()
    assert "result" not in json.loads(text)  # what an earlier release writes and reads
    assert RunRecord.from_json(text) == record
    kept = RunRecord.from_json(json.dumps({**json.loads(text), "result": {"n": [1]}}))
    assert kept.result == {"n": [1]}
    assert RunRecord.from_json(kept.to_json()) == kept


async def test_record_results_false_keeps_none(clock: TestClock) -> None:
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, record_results=False)

    async def count(ctx: JobContext) -> int:
        return 3

    job = scheduler.every("count", "1m", count)
    async with scheduler:
        await clock.advance("1m")
        (record,) = await job.history(1)
    assert (record.outcome, record.result) == ("completed", None)


async def test_ctx_previous_is_the_last_finished_run_in_async_and_sync_handlers(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    """Each run sees the one before it (its record and result), the first sees none; a
    failed run counts as finished; asking twice reads once."""
    seen: dict[str, list[Any]] = {"async": [], "sync": []}

    async def totals(ctx: JobContext) -> int:
        previous = await ctx.previous
        assert (await ctx.previous) is previous
        seen["async"].append(previous and (previous.outcome, previous.result))
        if len(seen["async"]) == 2:
            raise RuntimeError("a bad run")
        return (previous.result or 0) + 1 if previous else 1

    def sync_totals(ctx: JobContext) -> int:
        assert threading.current_thread() is not threading.main_thread()
        previous = ctx.previous.get(timeout=10)
        seen["sync"].append(previous and (previous.run_id, previous.result))
        return (previous.result if previous else 0) + 10

    scheduler.every("totals", "1m", totals)
    sync_job = scheduler.every("sync-totals", "1m", sync_totals)
    await scheduler.start()
    await clock.advance("3m")
    assert seen["async"] == [None, ("completed", 1), ("failed", None)]
    records = await sync_job.history(3)
    assert [r.result for r in records] == [30, 20, 10]
    assert seen["sync"] == [None, (records[2].run_id, 10), (records[1].run_id, 20)]


async def test_a_handler_that_does_not_ask_reads_nothing(
    scheduler: Scheduler[Any], clock: TestClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    original = MemoryBackend.history

    async def counted(self: MemoryBackend, job: JobPolicy, limit: int) -> list[RunRecord]:
        reads.append(job.name)
        return await original(self, job, limit)

    monkeypatch.setattr(MemoryBackend, "history", counted)

    async def quiet(ctx: JobContext) -> int:
        return 1

    async def asks(ctx: JobContext) -> None:
        await ctx.previous

    scheduler.every("quiet", "1m", quiet)
    scheduler.every("asks", "1m", asks)
    await scheduler.start()
    await clock.advance("2m")
    assert reads == ["asks", "asks"]


async def test_make_context_answers_the_previous_run_given() -> None:
    record = RunRecord(
        "j", 1, "r", "i", "schedule", 1, datetime.now(UTC), None, "completed", result=[7]
    )
    ctx = make_context("j", previous=record)
    assert await ctx.previous is record
    assert ctx.previous.get() is record  # already known: no loop needed
    assert await make_context("j").previous is None


async def test_get_on_the_event_loop_is_refused(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    errors: list[str] = []

    async def wrong(ctx: JobContext) -> None:
        try:
            ctx.previous.get()
        except RuntimeError as exc:
            errors.append(str(exc))

    scheduler.every("wrong", "1m", wrong)
    await scheduler.start()
    await clock.advance("1m")
    assert errors and "use `await ctx.previous`" in errors[0]


async def test_a_retry_sees_the_attempt_it_follows(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    seen: list[tuple[int, Any]] = []

    async def flaky(ctx: JobContext) -> str:
        previous = await ctx.previous
        seen.append((ctx.attempt, previous and (previous.attempt, previous.outcome)))
        if ctx.attempt == 1:
            raise ConnectionError("reset")
        return "ok"

    scheduler.every("flaky", "1h", flaky, retry=Retry(attempts=2, backoff="10s"))
    await scheduler.start()
    await clock.advance("1h")
    await clock.advance("10s")
    assert seen == [(1, None), (2, (1, "failed"))]


async def test_a_missed_slots_report_is_no_previous_run(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    seen: list[Any] = []

    async def export(ctx: JobContext) -> int:
        previous = await ctx.previous
        seen.append(previous and previous.result)
        return len(seen)

    job = scheduler.every("export", "1m", export)
    await scheduler.start()
    await clock.advance("1m")
    (ran,) = await job.history(1)
    report = replace(ran, run_id="m", reason="missed", outcome="missed", result=None)
    await scheduler.backend.record(JobPolicy("export"), report)
    await clock.advance("1m")
    assert seen == [None, 1]

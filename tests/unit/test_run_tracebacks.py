"""RunRecord.traceback: a failed or timed-out run's exception with its cause chain, redacted
(URLs' passwords, the job's data) and capped; None for a run that did not fail."""

from __future__ import annotations

import json
import logging
import traceback
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched._tracebacks import TRACEBACK_LIMIT, cap_traceback, run_traceback
from brokersched.abc import RunRecord
from brokersched.testing import TestClock

TOKEN = "sk-live-4f9a2c"


def load_payments(token: str) -> None:
    raise ConnectionError(f"cannot reach postgresql://app:hunter2@db/pay for {token}")


async def test_a_failed_runs_record_keeps_its_redacted_traceback_and_cause(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    async def payments(ctx: JobContext) -> None:
        try:
            load_payments(ctx.data["token"])
        except ConnectionError as exc:
            raise RuntimeError("payments batch 4 failed") from exc

    job = scheduler.every("payments", "1m", payments, data={"token": TOKEN})
    ok = scheduler.every("fine", "1m", lambda ctx: None)
    await scheduler.start()
    await clock.advance("1m")
    (record,) = await job.history(1)
    assert record.error == "RuntimeError: payments batch 4 failed"
    text = record.traceback
    assert text is not None
    assert text.startswith("Traceback (most recent call last):")
    assert "in load_payments" in text and "in payments" in text  # both frames
    assert "The above exception was the direct cause of the following exception" in text
    assert text.rstrip().endswith("RuntimeError: payments batch 4 failed")
    assert "hunter2" not in text and TOKEN not in text  # password and job data masked
    assert "postgresql://app:***@db/pay" in text
    (fine,) = await ok.history(1)
    assert (fine.outcome, fine.traceback) == ("completed", None)


async def test_a_timed_out_async_run_shows_where_it_was_waiting(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    async def stuck_in_the_bank_call(ctx: JobContext) -> None:
        await ctx.sleep(3600)

    job = scheduler.every("slow", "1m", stuck_in_the_bank_call, timeout="5s")
    await scheduler.start()
    await clock.advance("1m5s")
    (record,) = await job.history(1)
    assert record.outcome == "timed-out"
    assert record.traceback is not None
    assert "in stuck_in_the_bank_call" in record.traceback
    assert "CancelledError" in record.traceback


def test_a_long_traceback_keeps_its_end_and_says_it_was_cut() -> None:
    def step(n: int) -> None:
        try:
            if n == 0:
                raise OSError("the first cause")
            step(n - 1)
        except Exception as exc:
            message = "the innermost ✓ error" if n == 100 else f"step {n}"
            raise ValueError(message) from exc

    try:
        step(100)
    except ValueError as exc:
        text = run_traceback(exc)
        whole = "".join(traceback.format_exception(exc)).splitlines()
    assert len(text.encode()) <= TRACEBACK_LIMIT
    first, _, rest = text.partition("\n")
    assert first.startswith("[traceback cut: ") and first.endswith(" bytes left out]")
    assert rest.split("\n")[0] in whole  # from a line's start
    assert rest.rstrip().endswith("ValueError: the innermost ✓ error")
    assert "in step" in rest and "the first cause" not in rest  # the outermost went


def test_a_huge_exception_message_is_cut_in_its_middle() -> None:
    text = "Traceback (most recent call last):\n  File x\nValueError: " + "é" * 10_000 + "END"
    capped = cap_traceback(text)
    assert len(capped.encode()) <= TRACEBACK_LIMIT
    assert capped.endswith("END") and " [...] " in capped and "File x" in capped
    assert cap_traceback("short\n") == "short\n"


def test_records_without_a_traceback_read_as_before() -> None:
    record = RunRecord("j", 1, "r", "i", "schedule", 1, datetime.now(UTC), None, "completed", None)
    text = record.to_json()
    assert "traceback" not in json.loads(text)  # what an earlier release writes and reads
    assert RunRecord.from_json(text) == record
    failed = RunRecord.from_json(
        json.dumps({**json.loads(text), "traceback": "T", "added_later": 1})
    )
    assert failed.traceback == "T"  # and a key a later release adds is ignored


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


async def test_an_exception_whose_str_raises_is_a_failed_run_that_runs_once(
    clock: TestClock,
) -> None:
    """Its ``str()`` raised while the runner wrote the error, so the run looked lost: its slot
    was handed over and another instance ran it again (attempt 2, a retry nobody asked for)."""
    backend = MemoryBackend()
    runs: list[tuple[str, str, int]] = []
    schedulers = [
        Scheduler(backend, clock=clock, jitter=0, instance_id=name) for name in ("a", "b")
    ]

    async def files(ctx: JobContext) -> None:
        runs.append((ctx.instance_id, ctx.reason, ctx.attempt))
        raise BadStr()

    jobs = [sched.every("files", "10m", files) for sched in schedulers]
    for sched in schedulers:
        await sched.start()
    try:
        await clock.advance("10m")
        await clock.advance("2m")  # time for a take-over, had the run looked lost
        assert len(runs) == 1, runs
        (record,) = await jobs[0].history(5)
        assert (record.outcome, record.error) == ("failed", "BadStr: <exception str() failed>")
    finally:
        for sched in schedulers:
            await sched.stop()


async def test_an_undecodable_file_name_in_an_error_is_recorded(
    scheduler: Scheduler[Any], clock: TestClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A file name of bytes that are not UTF-8 decodes to lone surrogates (``os.listdir``),
    which no backend can store: the record was lost. They are escaped."""

    async def scan(ctx: JobContext) -> None:
        raise ValueError("cannot read bad\udcffname")

    job = scheduler.every("scan", "1m", scan)
    await scheduler.start()
    # The failure's log line is not captured: pytest-xdist cannot send a lone surrogate to
    # the controller (the record, which is the point here, is read below).
    with caplog.at_level(logging.CRITICAL, logger="brokersched"):
        await clock.advance("1m")
    (record,) = await job.history(1)
    assert record.error == "ValueError: cannot read bad\\udcffname"
    assert record.traceback is not None and "bad\\udcffname" in record.traceback


async def test_an_error_is_redacted_like_its_traceback(
    scheduler: Scheduler[Any], clock: TestClock
) -> None:
    """The error beside the traceback showed a URL's password and the job's data (a repr of
    a data string with a backslash escapes it: masked as shown too)."""
    secret = "ab\\cd-" + TOKEN

    async def sync(ctx: JobContext) -> None:
        raise KeyError(f"connect postgresql://app:S3cretPW@db/x for {ctx.data['tok']}")

    job = scheduler.every("sync", "1m", sync, data={"tok": secret})
    await scheduler.start()
    await clock.advance("1m")
    (record,) = await job.history(1)
    assert record.error is not None and record.traceback is not None
    for text in (record.error, record.traceback):
        assert "S3cretPW" not in text and TOKEN not in text, text

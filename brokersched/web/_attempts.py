"""What follows a run that failed: another attempt at its slot, or none. Two options make one,
each for its own kind of failure: ``retry=`` runs a handler that failed (or timed out, when it
catches ``TimeoutError``) again under the same claim; ``max_attempts`` (lease backends only)
lets another instance take over a slot whose runner died. Nothing else runs a slot again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .._clock import datetime_to_ms
from .._durations import format_duration
from .._scheduler import Job
from ..abc import FAILURES, RunRecord

__all__ = ["next_attempt"]

GRACE_MS = 10_000  # a retry's record is written when it ends: allow for the writing


def _outlook(retried: bool | None, summary: str, detail: str) -> dict[str, Any]:
    return {"retried": retried, "summary": summary, "detail": detail}


def next_attempt(
    record: RunRecord, attempts: list[RunRecord], job: Job, *, leases: bool, now_ms: int
) -> dict[str, Any] | None:
    """Whether ``record`` (one of ``attempts``, the runs of its slot) was or will be run
    again, and why: ``retried`` true, false, or null (not known yet). ``None`` for a run that
    did not fail."""
    later = sorted(r.attempt for r in attempts if r.attempt > record.attempt)
    if later:
        return _outlook(True, f"retried (attempt {later[0]})", "a later attempt at this slot")
    if record.outcome not in FAILURES:
        return None
    if record.outcome == "missed":
        return _outlook(False, "not run", "no instance ran this slot in time; nothing runs it now")
    if record.outcome == "interrupted":
        return _taken_over(record, job, leases=leases)
    retry = job.settings.retry
    if retry is None:
        return _outlook(
            False,
            "not retried",
            "the job has no retry= option (max_attempts only lets another instance take over "
            "a slot whose runner died)",
        )
    if record.attempt >= retry.attempts:
        return _outlook(False, "not retried", f"the last of retry's {retry.attempts} attempts")
    if record.outcome == "timed-out" and not retry.catches(TimeoutError()):
        return _outlook(False, "not retried", "retry= does not catch a timeout (TimeoutError)")
    timeout = job.settings.timeout
    if timeout is not None and record.finished_at is not None:
        wait = retry.delay(record.attempt, jittered=False) + timeout
        if (
            now_ms
            > datetime_to_ms(record.finished_at) + wait // timedelta(milliseconds=1) + GRACE_MS
        ):
            return _outlook(
                False,
                "not retried",
                f"no attempt {record.attempt + 1} was recorded within {format_duration(wait)}: "
                "its error is not one retry= catches, or retry's deadline came first",
            )
    return _outlook(
        None,
        f"may be retried (at most {retry.attempts} attempts, retry=)",
        "retried if retry= catches its error and its deadline allows; no later attempt is "
        "recorded yet",
    )


def _taken_over(record: RunRecord, job: Job, *, leases: bool) -> dict[str, Any]:
    """An interrupted run (its runner stopped or died): another instance takes its slot over
    on a lease backend, within ``max_attempts``."""
    if not leases:
        return _outlook(
            False,
            "not retried",
            "a claim-only backend keeps no lease: a slot whose runner stopped is not run again",
        )
    most = job.settings.policy.max_attempts
    if record.attempt >= most:
        return _outlook(False, "not retried", f"max_attempts ({most}) reached")
    return _outlook(
        None,
        f"may be taken over (at most {most} attempts, max_attempts)",
        "another instance takes the slot over once its lease expires (within catch_up); no "
        "later attempt is recorded yet",
    )

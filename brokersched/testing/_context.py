"""``make_context()``: a ``JobContext`` for unit-testing a handler without a scheduler."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .._clock import Clock, datetime_to_ms
from .._context import AbortReason, JobContext, PreviousRun, abort
from ..abc import RunReason, RunRecord

__all__ = ["abort", "make_context"]


def make_context(
    job: str = "test-job",
    *,
    scheduled_at: datetime | None = None,
    run_id: str = "test-run",
    reason: RunReason = "schedule",
    attempt: int = 1,
    data: Any = None,
    instance_id: str = "test-instance",
    abort_reason: AbortReason | None = None,
    clock: Clock | None = None,
    previous: RunRecord | None = None,
) -> JobContext:
    """A context as the scheduler would build it; ``scheduled_at`` defaults to now (UTC);
    ``previous``: what ``ctx.previous`` answers (``await ctx.previous``, or
    ``ctx.previous.get()`` in a sync handler)."""
    when = scheduled_at or (clock.now() if clock else datetime.now(UTC))
    ctx = JobContext(
        job=job,
        run_id=run_id,
        slot_ms=datetime_to_ms(when),
        reason=reason,
        attempt=attempt,
        data=data,
        instance_id=instance_id,
        clock=clock,
        previous=PreviousRun.known(previous),
    )
    if abort_reason is not None:
        abort(ctx, abort_reason)
    return ctx

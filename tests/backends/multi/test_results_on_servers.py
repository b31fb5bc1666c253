"""A run's result and ``ctx.previous`` of tests/unit/test_run_results.py on the real servers:
a handler's return value is recorded (redacted) by one instance and read back by the next run
on another, through the backend, from an async handler and a sync one."""

from __future__ import annotations

from typing import Any

import pytest

from brokersched import JobContext, Scheduler
from brokersched.abc import Backend, RunRecord
from tests.support.namespaces import fresh_namespace

KINDS = ["postgres", "sqlite", "rabbitmq", "nats", "redis", "redis-lease"]
DSN = "postgresql://app:hunter2@db/orders"


def exported(previous: RunRecord | None, ctx: JobContext) -> dict[str, Any]:
    """The next export: one more than the previous run's, and who saw what before it."""
    count = previous.result["count"] if previous and previous.result else 0
    seen = previous.instance_id if previous else None
    return {"count": count + 1, "by": ctx.instance_id, "after": seen, "from": DSN}


async def export_async(ctx: JobContext) -> dict[str, Any]:
    return exported(await ctx.previous, ctx)


def export_sync(ctx: JobContext) -> dict[str, Any]:
    return exported(ctx.previous.get(timeout=30), ctx)


async def next_instant(scheduler: Scheduler[Any], after_ms: int) -> None:
    """Until the scheduler's clock is past ``after_ms``: a manual run claims its instant, and
    two manual runs of one instant run once."""
    await scheduler.clock.sleep_until(after_ms + 1)


@pytest.mark.parametrize("kind", KINDS)
async def test_the_next_run_on_another_instance_reads_the_result(
    request: pytest.FixtureRequest, kind: str
) -> None:
    async with fresh_namespace(request, kind, "results") as make:
        backends: list[Backend] = [make(), make()]
        a, b = (
            Scheduler(backend, jitter=0, enabled=False, instance_id=name)
            for backend, name in zip(backends, ("a", "b"), strict=True)
        )
        job_a = a.every("export", "1h", export_async)
        job_b = b.every("export", "1h", export_sync)
        async with a, b:
            first = await job_a.trigger()
            assert first is not None
            await job_a.history(1)  # a's record written: the next run, on b, reads it
            await next_instant(b, first.slot_ms)
            second = await job_b.trigger()
            assert second is not None
            await job_b.history(1)
            await next_instant(a, second.slot_ms)
            third = await job_a.trigger()
            assert third is not None
            records = await job_a.history(5)  # once a's last record is written
    shown = "postgresql://app:***@db/orders"
    assert [(r.run_id, r.outcome, r.result) for r in records] == [
        (third.run_id, "completed", {"count": 3, "by": "a", "after": "b", "from": shown}),
        (second.run_id, "completed", {"count": 2, "by": "b", "after": "a", "from": shown}),
        (first.run_id, "completed", {"count": 1, "by": "a", "after": None, "from": shown}),
    ]

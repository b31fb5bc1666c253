"""A run's lease deadline is armed only when it could come before the next renewal (no
timer per run that never fires), and still aborts the run before its lease can expire."""

from __future__ import annotations

import asyncio
from typing import Any

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.abc import Lease, Slot
from brokersched.testing import TestClock

START = "2027-01-15T08:00:30+00:00"


class LateAnswer(MemoryBackend):
    """Grants a lease, then answers 25 s later (a claim stuck on a slow link); its renewals,
    sent at once, are answered an hour later."""

    async def acquire(self, slot: Slot, **kwargs: Any) -> Any:
        lease = await super().acquire(slot, **kwargs)
        assert self._clock is not None
        await self._clock.sleep(25)
        return lease

    async def renew(self, lease: Lease) -> bool:
        assert self._clock is not None
        await self._clock.sleep(3600)  # the link still stalls
        return await super().renew(lease)


async def test_a_lease_answered_late_is_given_up_before_it_can_expire() -> None:
    clock = TestClock(START)
    spans: list[tuple[int, int, str | None]] = []
    sent: list[int] = []

    async def long(ctx: JobContext) -> None:
        began = clock.now_ms()
        try:
            await ctx.sleep(600)
        finally:
            spans.append((began, clock.now_ms(), ctx.abort_reason))

    sched = Scheduler(LateAnswer(lease_ttl="30s"), clock=clock, jitter=0)
    job = sched.every("long", "1h", long, catch_up=0)
    await sched.start()
    sent.append(clock.now_ms())
    trigger = asyncio.ensure_future(job.trigger())
    await clock.advance("2m")
    await trigger
    await sched.stop()
    (began, ended, reason) = spans[0]
    assert reason == "lock-lost"
    assert began - sent[0] >= 25_000  # the run began once the late answer came
    assert ended - sent[0] < 30_000  # and was aborted before the lease could expire

"""Missed slots, in virtual time: a scheduled slot no instance ran within max_late is reported
by exactly one instance of the fleet (event, history record, metric); a slot that ran, or was
skipped on purpose, is not."""

from __future__ import annotations

from typing import Any

import pytest

from brokersched import BackendError, JobContext, MissedEvent, Scheduler, SkipEvent
from brokersched._clock import ms_to_datetime
from brokersched.abc import JobPolicy, Lease, Slot
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from tests.support.clocks import START
from tests.support.helpers import DictClaimBackend

pytestmark = pytest.mark.asyncio


class Recorder:
    """A handler that remembers the slots it ran."""

    def __init__(self) -> None:
        self.slots: list[str] = []

    async def __call__(self, ctx: JobContext) -> None:
        self.slots.append(f"{ctx.scheduled_at:%H:%M:%S}")


class FailingClaims(MemoryBackend):
    """A memory backend whose claims of scheduled slots fail while ``failing`` is set."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store=store)
        self.failing = False

    async def acquire(self, slot: Slot, *, policy: JobPolicy, **kwargs: Any) -> Any:
        if self.failing:
            raise BackendError("the store is away")
        return await super().acquire(slot, policy=policy, **kwargs)


def missed_of(*schedulers: Scheduler[Any]) -> list[tuple[str, str]]:
    """Every ``missed`` event of ``schedulers``, as (instance, slot time)."""
    seen: list[tuple[str, str]] = []
    for sched in schedulers:
        name = sched.instance_id

        def on_missed(event: MissedEvent, name: str = name) -> None:
            seen.append((name, f"{event.scheduled_at:%H:%M}"))

        sched.on("missed", on_missed)
    return seen


def fleet(clock: TestClock, backends: list[Any]) -> list[Scheduler[Any]]:
    return [
        Scheduler(backend, clock=clock, jitter=0, max_late="10s", instance_id=f"i{n}")
        for n, backend in enumerate(backends)
    ]


async def start(schedulers: list[Scheduler[Any]], handler: Recorder) -> None:
    for sched in schedulers:
        if sched.backend.capabilities.leases:
            sched.every("job", "1m", handler, catch_up=0)
        else:
            sched.every("job", "1m", handler)
        await sched.start()


async def stop(schedulers: list[Scheduler[Any]]) -> None:
    for sched in schedulers:
        await sched.stop()


async def test_a_frozen_fleet_reports_each_missed_slot_once() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    schedulers = fleet(clock, [MemoryBackend(store=store) for _ in range(3)])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await clock.stall("5m")  # every instance frozen from 08:00:30 to 08:05:30
    await clock.advance("2m")
    assert sorted(slot for _, slot in seen) == ["08:01", "08:02", "08:03", "08:04", "08:05"]
    assert handler.slots == ["08:06:00", "08:07:00"]
    records = await schedulers[0].get("job").history(20)
    missed = [r for r in records if r.outcome == "missed"]
    assert sorted(f"{ms_to_datetime(r.slot_ms):%H:%M}" for r in missed) == sorted(
        s for _, s in seen
    )
    assert all(r.started_at == r.finished_at > ms_to_datetime(r.slot_ms) for r in missed)
    assert {(r.reason, r.attempt) for r in missed} == {("missed", 0)}
    assert all("no instance ran it within max_late (10s)" in (r.error or "") for r in missed)
    await stop(schedulers)


async def test_a_slot_another_instance_ran_is_not_reported() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    failing = FailingClaims(store)
    schedulers = fleet(clock, [failing, MemoryBackend(store=store)])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    failing.failing = True
    skips: list[SkipEvent] = []
    schedulers[0].on("skip", skips.append)
    await clock.advance("3m")
    assert {e.reason for e in skips} == {"backend-error"}
    assert handler.slots == ["08:01:00", "08:02:00", "08:03:00"]
    assert seen == []
    await stop(schedulers)


async def test_a_slot_every_instance_failed_to_claim_is_reported_once() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    backends = [FailingClaims(store) for _ in range(3)]
    schedulers = fleet(clock, backends)
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    for backend in backends:
        backend.failing = True
    await clock.advance("1m")  # 08:01 is skipped everywhere
    for backend in backends:
        backend.failing = False
    await clock.advance("1m")
    assert [slot for _, slot in seen] == ["08:01"]
    assert handler.slots == ["08:02:00"]
    await stop(schedulers)


async def test_the_slots_of_a_paused_job_are_not_missed() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    schedulers = fleet(clock, [MemoryBackend(store=store) for _ in range(2)])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await schedulers[0].get("job").pause(by="ops")
    await clock.stall("150s")  # 08:01 and 08:02 pass, paused, while the fleet is frozen
    await schedulers[1].get("job").resume(by="ops")
    await clock.advance("2m")
    assert seen == []
    assert handler.slots == ["08:03:00", "08:04:00", "08:05:00"]
    await stop(schedulers)


async def test_a_pause_made_after_a_slot_was_missed_does_not_hide_it() -> None:
    clock = TestClock(START)
    store = MemoryStore()
    backends = [FailingClaims(store) for _ in range(2)]
    schedulers = fleet(clock, backends)
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    for backend in backends:
        backend.failing = True
    await clock.advance("30s")  # 08:01:00 is skipped everywhere (the store away)
    for backend in backends:
        backend.failing = False
    await clock.advance("12s")  # 08:01:12: past its max_late (10 s), before its check
    await schedulers[0].get("job").pause(by="ops", note="after the outage")
    await clock.advance("2m")
    assert [slot for _, slot in seen] == ["08:01"]
    assert handler.slots == []
    await stop(schedulers)


async def test_claim_only_a_slot_nobody_claimed_is_reported_by_the_one_whose_check_won() -> None:
    clock = TestClock(START)
    claims: dict[str, str] = {}
    backends = [DictClaimBackend(claims) for _ in range(3)]
    schedulers = fleet(clock, backends)
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await clock.stall("150s")  # 08:01 and 08:02 pass while frozen
    await clock.advance("1m")
    assert sorted(slot for _, slot in seen) == ["08:01", "08:02"]
    assert handler.slots == ["08:03:00", "08:04:00"]
    await stop(schedulers)


async def test_claim_only_a_slot_that_ran_is_not_reported() -> None:
    clock = TestClock(START)
    claims: dict[str, str] = {}
    failing = DictClaimBackend(claims, fail=BackendError("the broker is away"))
    schedulers = fleet(clock, [failing, DictClaimBackend(claims)])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await clock.advance("1m")
    failing.fail = None  # back for the check: its claim loses to the one that ran
    await clock.advance("1m")
    assert handler.slots == ["08:01:00", "08:02:00"]
    assert seen == []
    await stop(schedulers)


async def test_a_claim_won_too_late_to_run_is_reported_by_its_winner() -> None:
    clock = TestClock(START)
    claims: dict[str, str] = {}
    slow = DictClaimBackend(claims, claim_delay_s=10.1)
    schedulers = fleet(clock, [slow])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await clock.advance("1m")
    assert seen == [("i0", "08:01")]
    await clock.advance("1m")
    assert seen == [("i0", "08:01"), ("i0", "08:02")]  # never twice, the check loses to it
    assert handler.slots == []
    await stop(schedulers)


async def test_a_lease_won_too_late_to_run_is_reported_once() -> None:
    clock = TestClock(START)
    store = MemoryStore()

    class Slow(MemoryBackend):
        async def acquire(self, slot: Slot, *, policy: JobPolicy, **kwargs: Any) -> Any:
            answer = await super().acquire(slot, policy=policy, **kwargs)
            if isinstance(answer, Lease):
                await clock.sleep(10.1)
            return answer

    schedulers = fleet(clock, [Slow(store=store), Slow(store=store)])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await clock.advance("90s")
    assert [slot for _, slot in seen] == ["08:01"]
    assert handler.slots == []
    await stop(schedulers)


async def test_claim_only_a_check_that_fails_half_way_keeps_what_it_found() -> None:
    clock = TestClock(START)

    class FailsOnce(DictClaimBackend):
        """Its second claim after the freeze fails (the broker blinks): the first one won."""

        def __init__(self) -> None:
            super().__init__({})
            # the claims up to the failing one: the slot after the wake, then the checks of
            # 08:01 (won) and 08:02 (fails, and is tried again)
            self.claims_left = 3

        async def claim(self, slot: Slot, **kwargs: Any) -> bool:
            self.claims_left -= 1
            if self.claims_left == 0:
                raise BackendError("the broker blinked")
            return await super().claim(slot, **kwargs)

    backend = FailsOnce()
    schedulers = fleet(clock, [backend])
    seen, handler = missed_of(*schedulers), Recorder()
    await start(schedulers, handler)
    await clock.stall("150s")  # 08:01 and 08:02 pass while frozen, checked together
    await clock.advance("1m")
    assert sorted(seen) == [("i0", "08:01"), ("i0", "08:02")]
    await stop(schedulers)

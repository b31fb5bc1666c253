"""``retry=Retry(...)``: a failed run is run again on the scheduler's clock, under the slot's
claim or lease; every attempt is recorded; bad values and schedules that would skip the next
slot are refused at registration."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from brokersched import (
    ConfigurationError,
    JobContext,
    MemoryBackend,
    Retry,
    RunEvent,
    Scheduler,
    StartEvent,
)
from brokersched._metrics import PrometheusMetrics
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend


class Flaky:
    """Fails its first ``failures`` calls with ``error``, then succeeds; notes each call."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or ConnectionError("partner API down")
        self.calls: list[tuple[str, int, str, int]] = []  # (reason, attempt, instance, now_ms)

    async def __call__(self, ctx: JobContext) -> None:
        self.calls.append((ctx.reason, ctx.attempt, ctx.instance_id, ctx._clock.now_ms()))
        if len(self.calls) <= self.failures:
            raise self.error


def outcomes(records: list[Any]) -> list[tuple[str, int, str]]:
    return [(r.reason, r.attempt, r.outcome) for r in reversed(records)]


async def test_a_failed_run_is_retried_with_backoff_and_every_attempt_is_recorded(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    handler = Flaky(2)
    job = scheduler.every("bill", "1h", handler, retry=Retry(attempts=3, backoff="10s"))
    events: list[Any] = []
    scheduler.on("start", events.append)
    scheduler.on("fail", events.append)
    await scheduler.start()
    await clock.advance_to("2027-01-15T09:00:40+00:00")
    slot_ms = clock.now_ms() - 40_000
    # The waits: 10s, then 20s (doubling), on the virtual clock.
    assert [(r, a, at - slot_ms) for r, a, _, at in handler.calls] == [
        ("schedule", 1, 0),
        ("retry", 2, 10_000),
        ("retry", 3, 30_000),
    ]
    records = await job.history(10)
    assert outcomes(records) == [
        ("schedule", 1, "failed"),
        ("retry", 2, "failed"),
        ("retry", 3, "completed"),
    ]
    assert len({r.run_id for r in records}) == 3  # each attempt is its own record
    assert {r.slot_ms for r in records} == {slot_ms}
    assert records[-1].error == "ConnectionError: partner API down"
    assert records[-1].traceback is not None and "partner API down" in records[-1].traceback
    starts = [(e.reason, e.attempt) for e in events if isinstance(e, StartEvent)]
    assert starts == [("schedule", 1), ("retry", 2), ("retry", 3)]
    assert [e.attempt for e in events if isinstance(e, RunEvent)] == [1, 2]


async def test_retries_stop_at_attempts_and_skip_exceptions_not_in_on(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    always = Flaky(99)
    other = Flaky(99, KeyError("bug"))
    a = scheduler.every("a", "1h", always, retry=Retry(attempts=2, backoff="1s"))
    b = scheduler.every("b", "1h", other, retry=Retry(on=ConnectionError, backoff="1s"))
    await scheduler.start()
    await clock.advance("1h")
    assert outcomes(await a.history(10)) == [("schedule", 1, "failed"), ("retry", 2, "failed")]
    assert outcomes(await b.history(10)) == [("schedule", 1, "failed")]  # a KeyError: no retry


async def test_a_timeout_is_retried_as_a_timeout_error(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    calls: list[int] = []

    async def slow_then_fast(ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            await ctx.sleep(60)

    job = scheduler.every(
        "t", "1h", slow_then_fast, timeout="5s", retry=Retry(attempts=2, backoff="1s")
    )
    never = scheduler.every(
        "n", "1h", slow_then_fast, timeout="5s", retry=Retry(on=ValueError, backoff="1s")
    )
    await scheduler.start()
    await clock.advance("1h")
    assert outcomes(await job.history(10)) == [
        ("schedule", 1, "timed-out"),
        ("retry", 2, "completed"),
    ]
    assert outcomes(await never.history(10)) == [("schedule", 1, "timed-out")]


async def test_no_retry_starts_past_the_deadline(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    handler = Flaky(99)
    retry = Retry(attempts=10, backoff="10s", deadline="45s")
    job = scheduler.every("d", "1h", handler, retry=retry)
    await scheduler.start()
    await clock.advance("1h")
    # Retries at 10s and 30s; the next would start at 70s, past 45s after the slot.
    assert outcomes(await job.history(10)) == [
        ("schedule", 1, "failed"),
        ("retry", 2, "failed"),
        ("retry", 3, "failed"),
    ]


async def test_a_stop_cuts_the_wait_short_and_the_run_ends_failed_recorded(
    clock: TestClock,
) -> None:
    backend = MemoryBackend()
    scheduler = Scheduler(backend, clock=clock, jitter=0, instance_id="me")
    handler = Flaky(99)
    job = scheduler.every("s", "1h", handler, retry=Retry(attempts=3, backoff="10m"))
    await scheduler.start()
    await clock.advance_to("2027-01-15T09:00:05+00:00")
    assert job.is_running  # waiting 10 minutes for its retry, under its lease
    began = clock.monotonic_ms()
    await scheduler.stop()
    assert clock.monotonic_ms() - began < 1000  # the wait did not hold the stop
    assert len(handler.calls) == 1
    assert outcomes(await backend.history(job.settings.policy, 10)) == [("schedule", 1, "failed")]


async def test_retries_run_under_the_lease_and_apart_from_max_attempts(
    clock: TestClock,
) -> None:
    """A second instance sweeping for dead runners finds the lease renewed all along: nobody
    takes the slot over while its retries wait (max_attempts=1 allows no take-over anyway)."""
    backend = MemoryBackend(lease_ttl="30s")
    handler = Flaky(3)
    schedulers = [
        Scheduler(backend, clock=clock, jitter=0, instance_id=name) for name in ("a", "b")
    ]
    for each in schedulers:
        each.every("l", "1h", handler, max_attempts=1, retry=Retry(attempts=4, backoff="1m"))
    for each in schedulers:
        await each.start()
    try:
        await clock.advance("1h15m")  # the retries wait 1m, 2m, 4m: 7 minutes of leases
        assert [(r, a) for r, a, _, _ in handler.calls] == [
            ("schedule", 1),
            ("retry", 2),
            ("retry", 3),
            ("retry", 4),
        ]
        assert len({i for _, _, i, _ in handler.calls}) == 1  # all on the winner
        job = schedulers[0].get("l")
        assert outcomes(await job.history(10))[-1] == ("retry", 4, "completed")
    finally:
        for each in schedulers:
            await each.stop()


async def test_on_a_claim_only_backend_the_winner_retries(clock: TestClock) -> None:
    claims: dict[str, str] = {}
    handler = Flaky(1)
    schedulers = [
        Scheduler(DictClaimBackend(claims), clock=clock, jitter=0, instance_id=name)
        for name in ("a", "b", "c")
    ]
    for each in schedulers:
        each.every("c", "1h", handler, retry=Retry(attempts=2, backoff="5s"))
        await each.start()
    try:
        await clock.advance("1h")
        assert [(r, a) for r, a, _, _ in handler.calls] == [("schedule", 1), ("retry", 2)]
        assert len({i for _, _, i, _ in handler.calls}) == 1
    finally:
        for each in schedulers:
            await each.stop()


async def test_retries_are_counted_in_the_metrics(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    scheduler.every("m", "1h", Flaky(2), retry=Retry(attempts=3, backoff="1s"))
    registry = CollectorRegistry()
    PrometheusMetrics(registry).attach(scheduler)
    assert registry.get_sample_value("brokersched_retries_total", {"job": "m"}) == 0
    await scheduler.start()
    await clock.advance("1h")
    assert registry.get_sample_value("brokersched_retries_total", {"job": "m"}) == 2
    runs = {"job": "m", "outcome": "failed"}
    assert registry.get_sample_value("brokersched_runs_total", runs) == 2


async def test_a_retry_can_come_from_an_override_mapping(clock: TestClock) -> None:
    scheduler = Scheduler(
        MemoryBackend(), clock=clock, jitter=0, overrides={"o": {"retry": {"attempts": 2}}}
    )
    job = scheduler.every("o", "1h", Flaky(1))
    assert job.settings.retry == Retry(attempts=2)
    await scheduler.stop()


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"attempts": 0}, "attempts (0) must be 1 to 1000"),
        ({"attempts": True}, "attempts (True) must be a whole number"),
        ({"backoff": "soon"}, "backoff 'soon' is not a duration"),
        ({"backoff": "1m", "max_backoff": "10s"}, "max_backoff (10s) must be at least backoff"),
        ({"jitter": -1}, "jitter -1 is negative"),
        ({"deadline": 0}, "deadline (0s) must be greater than 0"),
        ({"on": ()}, "on (()) must be an exception class or a non-empty tuple"),
        ({"on": (BaseException,)}, "is not an Exception subclass"),
        ({"on": asyncio.CancelledError}, "is not an Exception subclass"),
    ],
)
def test_bad_values_are_named(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^Retry: ") as info:
        Retry(**kwargs)
    assert said in str(info.value)
    assert info.value.option == "retry"


def test_a_mapping_with_an_unknown_keyword_is_refused(scheduler: Scheduler[Any]) -> None:
    with pytest.raises(ConfigurationError, match="unexpected keyword argument 'tries'"):
        scheduler.every("x", "1h", Flaky(0), retry={"tries": 3})
    with pytest.raises(ConfigurationError, match="is not a Retry"):
        scheduler.every("x", "1h", Flaky(0), retry=3)


def test_retries_that_would_reach_the_next_slot_are_refused_with_overlap_skip(
    scheduler: Scheduler[Any],
) -> None:
    retry = Retry(attempts=4, backoff="10s")  # waits 10s + 20s + 40s = 70s
    with pytest.raises(ConfigurationError) as info:
        scheduler.every("tight", "1m", Flaky(0), retry=retry)
    message = str(info.value)
    assert "3 waits of up to 1m10s in all = 1m10s" in message
    assert "next slot (1m apart)" in message and "overlap='skip'" in message
    with pytest.raises(ConfigurationError, match=r"\+ 4 runs of up to 10s \(timeout\) = 1m50s"):
        scheduler.every("t2", "90s", Flaky(0), retry=retry, timeout="10s")
    # Accepted: overlap allowed, a deadline that bounds it, a longer gap, a claim-only backend.
    scheduler.every("allow", "1m", Flaky(0), retry=retry, overlap="allow")
    scheduler.every("dl", "1m", Flaky(0), retry=Retry(attempts=4, deadline="40s"), timeout="10s")
    scheduler.every("long", "2m", Flaky(0), retry=retry)
    claims = Scheduler(DictClaimBackend())
    claims.every("tight", "1m", Flaky(0), retry=retry)


async def test_retries_ending_exactly_at_the_next_slot_are_refused_and_a_moment_less_is_not(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    """With ``overlap='skip'`` a slot's retries hold it until the last one ends: a worst case
    ending exactly at the next slot would skip that slot, and is refused. A millisecond less is
    accepted, and the next slot runs on time after retries that took every bit of it."""
    with pytest.raises(ConfigurationError, match=r"= 1m\) does not end before the next slot"):
        scheduler.every(
            "exact", "1m", Flaky(0), retry=Retry(attempts=2, backoff="50s"), timeout="5s"
        )
    runs: list[tuple[str, int, str]] = []

    async def hangs(ctx: JobContext) -> None:
        runs.append(
            (ctx.reason, ctx.attempt, f"{ctx.scheduled_at:%H:%M} at {clock.now():%M:%S.%f}")
        )
        if ctx.scheduled_at.minute == 1:
            await ctx.sleep(3600)  # each attempt of 08:01 times out

    retry = Retry(attempts=2, backoff="49999ms")  # 49.999s + 2 runs of up to 5s
    scheduler.every("under", "1m", hangs, retry=retry, timeout="5s")
    await scheduler.start()
    await clock.advance("1m31s")
    assert runs == [
        ("schedule", 1, "08:01 at 01:00.000000"),
        ("retry", 2, "08:01 at 01:54.999000"),
        ("schedule", 1, "08:02 at 02:00.000000"),  # the last attempt ended 1 ms before
    ]


def test_the_worst_case_counts_max_backoff_and_jitter() -> None:
    retry = Retry(attempts=5, backoff="10s", max_backoff="25s", jitter="1s")
    # 10+1, 20+1, 25+1, 25+1
    assert retry.worst_case(None)[0] == timedelta(seconds=84)
    assert [retry.delay(n, jittered=False) for n in (1, 5, 40)] == [
        timedelta(seconds=11),
        timedelta(seconds=26),
        timedelta(seconds=26),
    ]


def test_an_update_keeps_the_retry_and_can_change_it(scheduler: Scheduler[Any]) -> None:
    job = scheduler.every("u", "1h", Flaky(0), retry=Retry(attempts=4, on=KeyError))
    job.update(jitter="1s")
    assert job.settings.retry == Retry(attempts=4, on=KeyError)
    job.update(retry={"attempts": 2})
    assert job.settings.retry == Retry(attempts=2)
    assert repr(job.settings.retry) == "Retry(attempts=2, backoff='10s')"

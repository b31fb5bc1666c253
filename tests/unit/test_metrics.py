"""Prometheus metrics: a scheduler on virtual time, scraped; and the real HTTP endpoint."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from brokersched import (
    ConfigurationError,
    JobContext,
    MemoryBackend,
    NATSBackend,
    NATSLeaseBackend,
    PostgresBackend,
    RabbitMQBackend,
    RedisBackend,
    RedisLeaseBackend,
    Scheduler,
    SQLiteBackend,
)
from brokersched._metrics import OTHER_JOB, PrometheusMetrics, backend_label
from brokersched.abc import Backend, BrokerBudget
from brokersched.testing import TestClock
from tests.support.helpers import DictClaimBackend


async def ok(ctx: JobContext) -> None:
    await ctx.sleep(2)


async def bad(ctx: JobContext) -> None:
    raise RuntimeError("bad")


async def slow(ctx: JobContext) -> None:
    await ctx.sleep(90)  # every 1m: the next slot finds it running (overlap skip)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_runs_skips_durations_and_gauges(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    scheduler.every("ok", "1m", ok)
    scheduler.every("bad", "1m", bad)
    scheduler.every("slow", "1m", slow)
    metrics = PrometheusMetrics().attach(scheduler)
    registry = metrics.registry
    await scheduler.start()
    await clock.advance("1m")  # 08:01:30: every job ran once at 08:01:00; slow still running
    assert value(registry, "brokersched_active_runs", job="slow") == 1
    assert value(registry, "brokersched_active_runs", job="ok") == 0
    await clock.advance("2m")  # 08:03:30

    assert value(registry, "brokersched_runs_total", job="ok", outcome="completed") == 3
    assert value(registry, "brokersched_runs_total", job="ok", outcome="failed") == 0
    assert value(registry, "brokersched_runs_total", job="bad", outcome="failed") == 3
    # slow: 08:01 ran 90 s (to 08:02:30), 08:02 was skipped, 08:03 is running
    assert value(registry, "brokersched_runs_total", job="slow", outcome="completed") == 1
    assert value(registry, "brokersched_skips_total", job="slow", reason="overlap") == 1
    assert value(registry, "brokersched_active_runs", job="slow") == 1
    assert value(registry, "brokersched_run_duration_seconds_sum", job="ok") == 6.0
    assert value(registry, "brokersched_run_duration_seconds_sum", job="slow") == 90.0
    assert value(registry, "brokersched_run_duration_seconds_bucket", job="ok", le="2.5") == 3
    assert value(registry, "brokersched_run_duration_seconds_bucket", job="ok", le="1.0") == 0
    # the last completion of ok: the 08:03:00 slot, 2 s of work
    assert value(registry, "brokersched_last_success_timestamp_seconds", job="ok") == (
        clock.now().replace(minute=3, second=2).timestamp()
    )
    assert value(registry, "brokersched_last_success_timestamp_seconds", job="bad") is None
    # jitter 0 on virtual time: every scheduled run started on its slot
    assert value(registry, "brokersched_run_lateness_seconds_count", job="ok") == 3
    assert value(registry, "brokersched_run_lateness_seconds_sum", job="ok") == 0
    claims = value(registry, "brokersched_claim_duration_seconds_count", backend="memory")
    # 9 scheduled slots (the skipped one too) + 3 catch-up claims at start, refused: a job
    # never claimed before has missed nothing
    assert claims == 9 + 3

    text = generate_latest(registry).decode()
    assert 'brokersched_runs_total{job="bad",outcome="failed"} 3.0' in text
    assert 'brokersched_skips_total{job="slow",reason="overlap"} 1.0' in text
    assert "# TYPE brokersched_run_lateness_seconds histogram" in text
    assert "# TYPE brokersched_claim_duration_seconds histogram" in text


async def test_lateness_is_start_minus_slot_on_the_scheduler_clock(clock: TestClock) -> None:
    backend = DictClaimBackend(claim_delay_s=3)  # every claim takes 3 s of virtual time
    sched = Scheduler(backend, clock=clock, jitter=0, max_late="10s")
    sched.every("claimed-late", "1m", ok)
    metrics = PrometheusMetrics().attach(sched)
    await sched.start()
    await clock.advance("2m")
    await sched.stop()
    registry = metrics.registry
    assert value(registry, "brokersched_run_lateness_seconds_count", job="claimed-late") == 2
    assert value(registry, "brokersched_run_lateness_seconds_sum", job="claimed-late") == 6.0
    assert (
        value(registry, "brokersched_run_lateness_seconds_bucket", job="claimed-late", le="2.0")
        == 0
    )


async def test_manual_runs_count_but_are_not_late(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    job = scheduler.every("manual", "1h", ok)
    metrics = PrometheusMetrics().attach(scheduler)
    await scheduler.start()
    run = asyncio.ensure_future(job.trigger())
    await clock.advance("5s")
    assert (await run) is not None
    registry = metrics.registry
    assert value(registry, "brokersched_runs_total", job="manual", outcome="completed") == 1
    assert value(registry, "brokersched_run_lateness_seconds_count", job="manual") is None


async def test_the_job_label_is_capped(
    scheduler: Scheduler[MemoryBackend], clock: TestClock
) -> None:
    scheduler.every("first", "1m", ok)
    scheduler.every("second", "1m", ok)
    metrics = PrometheusMetrics(max_jobs=2).attach(scheduler)  # both known jobs get a label
    await scheduler.start()
    for n in range(5):  # dynamic jobs with generated names
        scheduler.every(f"tenant-{n}.sync", "1m", ok)
    await clock.advance("1m")
    registry = metrics.registry
    assert value(registry, "brokersched_runs_total", job="first", outcome="completed") == 1
    assert value(registry, "brokersched_runs_total", job=OTHER_JOB, outcome="completed") == 5
    text = generate_latest(registry).decode()
    assert "tenant-" not in text


async def test_known_jobs_start_at_zero(scheduler: Scheduler[MemoryBackend]) -> None:
    scheduler.every("idle", "1h", ok)
    registry = PrometheusMetrics().attach(scheduler).registry
    for outcome in ("completed", "failed", "timed-out", "interrupted"):
        assert value(registry, "brokersched_runs_total", job="idle", outcome=outcome) == 0
    assert value(registry, "brokersched_active_runs", job="idle") == 0


def test_each_instance_has_its_own_registry_by_default() -> None:
    first, second = PrometheusMetrics(), PrometheusMetrics()  # no "Duplicated timeseries"
    assert first.registry is not second.registry
    assert first.registry is not REGISTRY


def test_max_jobs_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match=r"max_jobs \(0\) must be at least 1"):
        PrometheusMetrics(max_jobs=0)


def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'brokersched\[prometheus\]'"):
        PrometheusMetrics()


# -- the real endpoint: brokersched run --metrics-port -------------------------------------


# Constructing a backend never connects.
BACKENDS: list[tuple[Callable[[], Backend], str]] = [
    (lambda: RabbitMQBackend("amqp://127.0.0.1/"), "rabbitmq"),
    (lambda: NATSBackend("nats://127.0.0.1:4222"), "nats"),
    (lambda: NATSLeaseBackend("nats://127.0.0.1:4222"), "nats"),
    (lambda: RedisBackend("redis://127.0.0.1:6379/0"), "redis"),
    (lambda: RedisLeaseBackend("redis://127.0.0.1:6379/0"), "redis"),
    (lambda: PostgresBackend("postgresql://127.0.0.1/test"), "postgres"),
    (lambda: SQLiteBackend(":memory:"), "sqlite"),
    (MemoryBackend, "memory"),
    (DictClaimBackend, "dictclaim"),  # a backend of your own: its name, lower case
]


@pytest.mark.parametrize(("make", "label"), BACKENDS, ids=[label for _, label in BACKENDS])
def test_the_backend_label_is_one_users_read(make: Callable[[], Backend], label: str) -> None:
    assert backend_label(make().name) == label


class BudgetedBackend(MemoryBackend):
    """A backend whose server's budget was read (as ``RabbitMQBackend`` with a management URL)."""

    reading: BrokerBudget | None = None

    @property
    def budget(self) -> BrokerBudget | None:
        return self.reading


def test_the_server_budget_is_read_at_each_scrape(clock: TestClock) -> None:
    backend = BudgetedBackend()
    metrics = PrometheusMetrics().attach(Scheduler(backend, clock=clock))
    metrics.attach(Scheduler(backend, clock=clock))  # a backend shared by two: one series

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"backend": "budgeted"})

    assert sample("brokersched_broker_budget_used") is None  # not read: no series
    backend.reading = BrokerBudget(0.65, "warn", "node a: ...")
    assert (sample("brokersched_broker_budget_used"), sample("brokersched_broker_shedding")) == (
        0.65,
        0.0,
    )
    backend.reading = BrokerBudget(0.82, "shed", "node a: ...")
    assert sample("brokersched_broker_shedding") == 1.0
    assert generate_latest(metrics.registry).count(b"brokersched_broker_shedding{") == 1

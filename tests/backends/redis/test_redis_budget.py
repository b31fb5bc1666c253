"""The Redis server's budget on a server of the test's own (``redis-server
--maxmemory 4mb``, a free port, stopped at the end), read at start and every
``budget_interval`` of the backend's virtual clock: filled under an evicting policy, the
backend sheds (no new claim nor lease: the slot is skipped, never run twice) and the metric
says so; emptied, it sheds no more (though every claim, reading the policy itself, is refused
until it is ``noeviction`` again); under ``noeviction`` a full server only warns."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis

from brokersched import BackendError, Scheduler
from brokersched._metrics import PrometheusMetrics
from brokersched.abc import JobPolicy, Slot
from brokersched.backends._budget import SHED
from brokersched.backends.redis import RedisBackend, RedisLeaseBackend
from brokersched.testing import TestClock
from tests.support.budget import read_again
from tests.support.leases import acquire
from tests.support.redis_helpers import RedisServer

MAXMEMORY = 4 * 1024 * 1024
LOGGER = "brokersched.backends.redis"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """Started with noeviction: both backends refuse to start on an evicting policy."""
    started = RedisServer(tmp_path / "redis").start(
        "--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction", "--appendonly", "yes"
    )
    yield started
    started.stop()


def fill(admin: redis.Redis, share: float) -> int:
    """Write filler keys (``fill:<n>``, 8 KB each) until ``used_memory`` is ``share`` of
    ``maxmemory``; how many were written."""
    count = 0
    while int(admin.info("memory")["used_memory"]) < share * MAXMEMORY:
        admin.set(f"fill:{count}", b"x" * 8192)
        count += 1
    return count


async def test_an_evicting_server_near_maxmemory_sheds_claims_and_the_metric_shows_it(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = TestClock(datetime.now(UTC))
    backend = RedisBackend(server.url, prefix="budget", budget_interval="1s")
    metrics = PrometheusMetrics().attach(Scheduler(backend, clock=clock))
    admin = redis.Redis(port=server.port)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"backend": "redis"})

    await backend.start(clock)
    try:
        assert backend.budget is not None and backend.budget.state == "ok"
        assert backend.budget.detail.startswith("used_memory ")
        assert "of maxmemory 4.0 MB (writes are refused when it is full)" in backend.budget.detail
        assert " of maxclients 10000 clients" in backend.budget.detail
        assert sample("brokersched_broker_shedding") == 0.0
        first = Slot("tick", clock.now_ms() + 60_000)  # made after the fleet's record
        assert await backend.claim(first, instance_id="a", run_id="r1", timeout=2)

        admin.config_set("maxmemory-policy", "allkeys-lru")  # changed while running
        fill(admin, (SHED + 1) / 2)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await read_again(backend, clock)
        reading = backend.budget
        assert reading is not None and reading.state == "shed", reading
        assert "allkeys-lru: keys are evicted when it is full" in reading.detail
        assert sample("brokersched_broker_shedding") == 1.0
        assert sample("brokersched_broker_budget_used") == pytest.approx(reading.used)
        [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert error.startswith("RedisBackend: shedding: the server is at ")
        assert "no new claim or lease is made" in error

        second = Slot("tick", first.slot_ms + 1000)
        with pytest.raises(BackendError, match=r"shedding: the claim of tick:\d+ is not made"):
            await backend.claim(second, instance_id="a", run_id="r2", timeout=2)
        assert admin.exists(f"budget:{{tick}}:claim:{second.slot_ms}") == 0  # nothing written

        admin.flushdb()  # the filler and the claims gone: under WARN again
        await read_again(backend, clock)
        assert backend.budget is not None and backend.budget.state == "ok"
        assert sample("brokersched_broker_shedding") == 0.0
        third = Slot("tick", first.slot_ms + 2000)
        # No longer shedding, but each claim reads the policy itself: still refused ...
        with pytest.raises(BackendError, match=r"\(maxmemory-policy allkeys-lru, read with"):
            await backend.claim(third, instance_id="a", run_id="r3", timeout=2)
        admin.config_set("maxmemory-policy", "noeviction")  # ... until it is noeviction
        assert await backend.claim(third, instance_id="a", run_id="r3", timeout=2)
    finally:
        admin.close()
        await backend.stop()


async def test_the_lease_backend_sheds_new_leases_only(server: RedisServer) -> None:
    clock = TestClock(datetime.now(UTC))
    backend = RedisLeaseBackend(server.url, prefix="budget", budget_interval="1s")
    admin = redis.Redis(port=server.port)
    policy = JobPolicy("job")
    await backend.start(clock)
    try:
        held = await acquire(backend, Slot("job", clock.now_ms()), policy, instance="a", timeout=2)
        assert not isinstance(held, str)
        admin.config_set("maxmemory-policy", "volatile-lru")
        fill(admin, (SHED + 1) / 2)
        await read_again(backend, clock)
        assert backend.budget is not None and backend.budget.state == "shed"
        later, allowed = Slot("job", clock.now_ms() + 1000), JobPolicy("job", overlap="allow")
        with pytest.raises(BackendError, match="shedding: the lease of job:"):
            await acquire(backend, later, allowed, instance="a", timeout=2)
        assert await backend.renew(held)  # a lease held goes on
        await backend.release(held)
    finally:
        admin.close()
        await backend.stop()


async def test_under_noeviction_a_full_server_only_warns(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = TestClock(datetime.now(UTC))
    backend = RedisBackend(server.url, prefix="budget", budget_interval="1s")
    admin = redis.Redis(port=server.port)
    await backend.start(clock)
    try:
        fill(admin, (SHED + 1) / 2)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await read_again(backend, clock)
        reading = backend.budget
        assert reading is not None and reading.state == "warn" and reading.used >= SHED
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warning.startswith("RedisBackend: the server is at ")
        slot = Slot("tick", clock.now_ms() + 60_000)
        assert await backend.claim(slot, instance_id="a", run_id="r", timeout=2)
    finally:
        admin.close()
        await backend.stop()


async def test_budget_interval_none_reads_nothing(server: RedisServer) -> None:
    backend = RedisBackend(server.url, prefix="budget", budget_interval=None)
    await backend.start(TestClock(datetime.now(UTC)))
    try:
        assert backend.budget is None
    finally:
        await backend.stop()

"""The JetStream account's budget on a nats-server of the test's own (a free
port, stopped at the end) whose account has JetStream limits: another application's stream
fills the account's storage, and both NATS backends, reading the account at start and every
``budget_interval`` of their virtual clock, shed (no new claim published, no new lease taken:
the slot is skipped, never run twice) with the metric saying so; emptied, they claim again."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from brokersched import BackendError, Scheduler
from brokersched._metrics import PrometheusMetrics
from brokersched.abc import Claim, JobPolicy, Slot
from brokersched.backends._budget import SHED
from brokersched.backends.nats import NATSBackend, NATSLeaseBackend
from brokersched.testing import TestClock
from tests.support.budget import read_again
from tests.support.leases import acquire
from tests.support.nats_helpers import nats_server_with_account_limits

MAX_FILE = 1024 * 1024
LOGGER = "brokersched.backends.nats"


@pytest.fixture
async def url(tmp_path: Path) -> AsyncIterator[str]:
    async with nats_server_with_account_limits(
        tmp_path / "nats", max_file=MAX_FILE, max_mem=MAX_FILE, max_streams=20
    ) as found:
        yield found


async def fill(url: str, share: float) -> None:
    """Another application's stream ``filler`` (file storage) grows until the account
    stores ``share`` of ``max_file``."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="filler", subjects=["filler.>"]))
        while (await js.account_info()).storage < share * MAX_FILE:
            for _ in range(8):
                await js.publish("filler.x", b"x" * 4096)
    finally:
        await nc.close()


async def empty(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream("filler")
    finally:
        await nc.close()


async def test_a_full_account_sheds_claims_and_the_metric_shows_it(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = TestClock(datetime.now(UTC))
    backend = NATSBackend(url, prefix="budget", budget_interval="1s")
    metrics = PrometheusMetrics().attach(Scheduler(backend, clock=clock))

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"backend": "nats"})

    await backend.start(clock)
    try:
        reading = backend.budget
        assert reading is not None and reading.state == "ok"
        assert reading.detail.startswith("streams ")  # the backend's own streams, of 20
        assert "storage " in reading.detail and "of 1.0 MB" in reading.detail
        assert "server 2." in reading.detail and "max_payload 1.0 MB" in reading.detail
        assert sample("brokersched_broker_shedding") == 0.0
        first = Slot("tick", clock.now_ms())
        assert await backend.claim(first, instance_id="a", run_id="r1", timeout=2)

        await fill(url, (SHED + 1) / 2)
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            await read_again(backend, clock)
        reading = backend.budget
        assert reading is not None and reading.state == "shed", reading
        assert reading.detail.startswith("storage ")
        assert sample("brokersched_broker_shedding") == 1.0
        assert sample("brokersched_broker_budget_used") == pytest.approx(reading.used)
        [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert error.startswith("NATSBackend: shedding: the JetStream account is at ")

        second = Slot("tick", first.slot_ms + 1000)
        with pytest.raises(BackendError, match=r"shedding: the claim of tick:\d+ is not published"):
            await backend.claim(second, instance_id="a", run_id="r2", timeout=2)
        many = [Claim(Slot(job, second.slot_ms), "r", JobPolicy(job)) for job in ("a", "b")]
        outcomes = await backend.claim_many(many, instance_id="a", timeout=2)
        assert all(isinstance(o, BackendError) and "shedding" in str(o) for o in outcomes)

        await empty(url)
        await read_again(backend, clock)
        assert backend.budget is not None and backend.budget.state == "ok"
        assert sample("brokersched_broker_shedding") == 0.0
        assert await backend.claim(second, instance_id="a", run_id="r2", timeout=2)
    finally:
        await backend.stop()


async def test_the_lease_backend_sheds_new_leases_only(url: str) -> None:
    clock = TestClock(datetime.now(UTC))
    backend = NATSLeaseBackend(url, bucket="budget-leases", budget_interval="1s")
    await backend.start(clock)
    try:
        held = await acquire(backend, Slot("job", clock.now_ms()), instance="a", timeout=2)
        assert not isinstance(held, str)
        await fill(url, (SHED + 1) / 2)
        await read_again(backend, clock)
        assert backend.budget is not None and backend.budget.state == "shed"
        with pytest.raises(BackendError, match="shedding: the lease of other:"):
            await acquire(backend, Slot("other", clock.now_ms()), instance="a", timeout=2)
        assert await backend.renew(held)  # a lease held goes on
        await backend.release(held)
    finally:
        await backend.stop()


async def test_budget_interval_none_reads_nothing(url: str) -> None:
    backend = NATSBackend(url, prefix="budget", budget_interval=None)
    await backend.start(TestClock(datetime.now(UTC)))
    try:
        assert backend.budget is None
    finally:
        await backend.stop()

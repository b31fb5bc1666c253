"""NATSLeaseBackend against the real nats-servers (2.9 and the current one): two schedulers
share a job's slots through it, runs are kept with a per-message TTL where the server has them,
an unusable existing bucket is refused at start, and purge removes all it made."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import timedelta

import nats
import pytest
from nats.js.api import KeyValueConfig

from brokersched import ConfigurationError, JobContext, Scheduler, SystemClock
from brokersched.abc import JobPolicy, Lease, RunRecord, Slot
from brokersched.backends.nats import NATSLeaseBackend
from tests.support.names import unique
from tests.support.nats_helpers import delete_named_streams, lease_streams
from tests.support.wait import until

pytestmark = pytest.mark.nats_servers


@pytest.fixture
async def bucket(nats_url: str) -> AsyncIterator[str]:
    name = unique("lease")
    yield name
    await delete_named_streams(nats_url, *lease_streams(name))


@pytest.mark.asyncio
async def test_two_schedulers_run_each_slot_once(nats_url: str, bucket: str) -> None:
    """Two instances claim every slot of a 1 s job at the same instant (no jitter): each slot
    runs once, and its run is in the history both read."""
    ran: list[tuple[int, str]] = []

    async def work(ctx: JobContext) -> None:
        ran.append((ctx.slot_ms, ctx.instance_id))

    schedulers = [
        Scheduler(NATSLeaseBackend(nats_url, bucket=bucket, lease_ttl="5s"), instance_id=f"i{n}")
        for n in range(2)
    ]
    for scheduler in schedulers:
        scheduler.every("tick", "1s", work, jitter=0, overlap="skip", max_attempts=2)
    for scheduler in schedulers:
        await scheduler.start()
    try:
        await until(lambda: len(ran) >= 3, what="three runs")
        slots = [slot for slot, _ in ran]
        assert len(slots) == len(set(slots)), ran
        job = schedulers[1].get("tick")
        assert job is not None
        records = await job.history(10)
        assert {r.slot_ms for r in records} <= set(slots)
        assert records and all(r.outcome == "completed" for r in records)
    finally:
        for scheduler in schedulers:
            await scheduler.stop()


@pytest.mark.asyncio
async def test_runs_carry_a_ttl_where_the_server_keeps_one(nats_url: str, bucket: str) -> None:
    backend = NATSLeaseBackend(nats_url, bucket=bucket)
    await backend.start(SystemClock())
    try:
        policy = JobPolicy("aged", history_ttl=timedelta(hours=1))
        now = SystemClock().now()
        await backend.prepare([policy])
        record = RunRecord("aged", 1, "r1", "i1", "schedule", 1, now, now, "completed")
        await backend.record(policy, record)
        assert [r.run_id for r in await backend.history(policy, 5)] == ["r1"]
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(f"{bucket}-history")
            version = nc.connected_server_version
            has_ttl = (version.major, version.minor) >= (2, 11)
            assert bool(info.config.allow_msg_ttl) is has_ttl
            msg = await js.get_last_msg(f"{bucket}-history", f"{bucket}.history.aged")
            assert (msg.headers or {}).get("Nats-TTL") == ("3600" if has_ttl else None)
        finally:
            await nc.close()
    finally:
        await backend.stop()


@pytest.mark.asyncio
async def test_a_bucket_whose_rows_would_expire_is_refused(nats_url: str, bucket: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().create_key_value(KeyValueConfig(bucket=bucket, ttl=60))
    finally:
        await nc.close()
    backend = NATSLeaseBackend(nats_url, bucket=bucket)
    with pytest.raises(ConfigurationError, match="its TTL is 60s") as caught:
        await backend.start(SystemClock())
    assert caught.value.option == "bucket" and bucket in str(caught.value)


@pytest.mark.asyncio
async def test_purge_removes_the_bucket_and_the_history(nats_url: str, bucket: str) -> None:
    backend = NATSLeaseBackend(nats_url, bucket=bucket, lease_ttl="2s")
    await backend.start(SystemClock())
    try:
        policy = JobPolicy("job")
        await backend.prepare([policy])
        slot = Slot("job", time.time_ns() // 1_000_000)
        lease = await backend.acquire(
            slot, policy=policy, instance_id="i1", run_id="r", reason="schedule", timeout=5.0
        )
        assert isinstance(lease, Lease)
        await backend.release(lease)
    finally:
        await backend.stop()
    found = await backend.inventory()
    assert {o.name for o in found.objects} == {f"KV_{bucket}", f"{bucket}-history"}
    assert found.live  # the clock probe was written a moment ago
    assert (await backend.purge(found)).objects == ()
    assert any(f.check == "server version" for f in await backend.doctor())

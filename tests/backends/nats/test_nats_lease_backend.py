"""NATSLeaseBackend against the real nats-servers (2.9 and the current one): two schedulers
share a job's slots through it, runs are kept with a per-message TTL where the server has them,
an unusable existing bucket (or history stream) is refused at start and reported by doctor,
and purge removes all it made."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StreamConfig

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


async def _kv(js: JetStreamContext, bucket: str, **options: Any) -> None:
    await js.create_key_value(KeyValueConfig(bucket=bucket, **options))


async def _edited(js: JetStreamContext, bucket: str, **changes: Any) -> None:
    """A bucket made by ``nats kv add``, then its stream edited."""
    await _kv(js, bucket)
    config = (await js.stream_info(f"KV_{bucket}")).config
    await js.update_stream(dataclasses.replace(config, **changes))


async def _by_hand(js: JetStreamContext, bucket: str, **limits: Any) -> None:
    """The stream of a bucket made by hand (as a KV bucket's, discard 'old')."""
    config = StreamConfig(
        name=f"KV_{bucket}",
        subjects=[f"$KV.{bucket}.>"],
        max_msgs_per_subject=1,
        allow_rollup_hdrs=True,
        deny_delete=True,
        discard=DiscardPolicy.OLD,
        **limits,
    )
    await js.add_stream(config)


Premade = Callable[[JetStreamContext, str], Awaitable[None]]

#: A pre-made bucket whose limits drop or refuse what the backend writes, and what start()
#: says of it: the setting, its value and what is accepted.
_UNUSABLE_BUCKETS: dict[str, tuple[Premade, str]] = {
    # An operator's trial: two instances, 40 one-second jobs, 194 of ~240 slots ran.
    "max_bytes, discard new": (
        lambda js, b: _kv(js, b, max_bytes=8192),
        "max_bytes is 8192 (with discard 'new' the bucket refuses every write once full",
    ),
    "max_msgs, discard old": (
        lambda js, b: _by_hand(js, b, max_msgs=100),
        "max_msgs is 100 (with discard 'old' it drops the oldest rows once full",
    ),
    "max_bytes, discard old": (
        lambda js, b: _by_hand(js, b, max_bytes=1 << 20),
        "max_bytes is 1048576 (with discard 'old' it drops the oldest rows",
    ),
    "max_value_size": (
        lambda js, b: _kv(js, b, max_value_size=1024),
        "max_msg_size is 1024 bytes (the bucket's max_value_size",
    ),
    "unlimited history": (
        lambda js, b: _edited(js, b, max_msgs_per_subject=-1),
        "max_msgs_per_subject is unlimited",
    ),
    "discard new per key": (
        lambda js, b: _edited(js, b, discard_new_per_subject=True),
        "discard_new_per_subject is true",
    ),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(_UNUSABLE_BUCKETS))
async def test_a_bucket_whose_limits_drop_or_refuse_rows_is_refused(
    nats_url: str, bucket: str, case: str
) -> None:
    """Refused at start (naming the bucket, the setting, its value, what is accepted) and
    reported by doctor as an error, instead of a fleet that silently skips slots once the
    bucket is full, or forgets fences."""
    make, said = _UNUSABLE_BUCKETS[case]
    nc = await nats.connect(nats_url)
    try:
        await make(nc.jetstream(), bucket)
    finally:
        await nc.close()
    backend = NATSLeaseBackend(nats_url, bucket=bucket)
    with pytest.raises(ConfigurationError) as caught:
        await backend.start(SystemClock())
    message = str(caught.value)
    assert f"the existing KV bucket {bucket!r} cannot be used" in message, message
    assert said in message and "accepted" in message, message
    assert caught.value.option == "bucket"
    errors = [f for f in await backend.doctor() if f.severity == "error"]
    assert [f.check for f in errors] == [f"stream KV_{bucket}"], errors
    assert said.startswith(errors[0].found), errors


@pytest.mark.asyncio
async def test_a_bucket_whose_limits_cannot_bind_is_used(nats_url: str, bucket: str) -> None:
    """Discard 'new' (nats kv add's), a history of 5 revisions and a value size as large as
    the server's max_payload limit nothing the backend writes."""
    nc = await nats.connect(nats_url)
    try:
        await _kv(nc.jetstream(), bucket, history=5, max_value_size=nc.max_payload)
    finally:
        await nc.close()
    backend = NATSLeaseBackend(nats_url, bucket=bucket)
    await backend.start(SystemClock())
    try:
        policy = JobPolicy("job")
        slot = Slot("job", time.time_ns() // 1_000_000)
        lease = await backend.acquire(
            slot, policy=policy, instance_id="i1", run_id="r", reason="schedule", timeout=5.0
        )
        assert isinstance(lease, Lease)
        await backend.release(lease)
    finally:
        await backend.stop()
    assert not [f for f in await backend.doctor() if f.severity == "error"]


@pytest.mark.asyncio
async def test_a_history_stream_that_refuses_runs_is_refused(nats_url: str, bucket: str) -> None:
    """The history stream, pre-made with discard 'new' and a size limit: once full every run
    record would be refused."""
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=f"{bucket}-history",
                subjects=[f"{bucket}.history.>"],
                max_msgs_per_subject=100,
                max_bytes=8192,
                discard=DiscardPolicy.NEW,
            )
        )
    finally:
        await nc.close()
    backend = NATSLeaseBackend(nats_url, bucket=bucket)
    with pytest.raises(ConfigurationError, match="discard is 'new' with max_bytes=8192") as caught:
        await backend.start(SystemClock())
    assert f"{bucket}-history" in str(caught.value)
    errors = [f for f in await backend.doctor() if f.severity == "error"]
    assert [f.check for f in errors] == [f"stream {bucket}-history"], errors


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

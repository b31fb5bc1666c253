"""The README's Redis ACL is enough: a user with exactly the commands it lists runs both Redis
backends (claims, leases, renewal, hand-over and take-over, history trimmed by count and age)
on a ``redis-server`` of this test's own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis

from brokersched import BackendError, RedisBackend, RedisLeaseBackend
from brokersched._clock import SystemClock
from brokersched.abc import ControlChange, Instance, JobPolicy, Lease, Slot
from brokersched.testing.conformance import make_record
from tests.support.redis_helpers import RedisServer, readme_acl

PASSWORD = "acl-test-password-0123"


@pytest.fixture
def acl_url(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path / "acl").start()
    try:
        admin = redis.Redis(port=server.port)
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "app", "on", f">{PASSWORD}", "~acl:*", "-@all", *readme_acl()
        )
        admin.close()
        yield f"redis://app:{PASSWORD}@127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def test_the_readme_lists_commands() -> None:
    assert {"+evalsha", "+script|load", "+time"} <= set(readme_acl())


async def test_a_command_the_acl_refuses_to_a_script_is_named_an_acl_refusal(
    acl_url: str,
) -> None:
    port = int(acl_url.rsplit(":", 1)[1].split("/")[0])
    admin = redis.Redis(port=port)
    admin.execute_command("ACL", "SETUSER", "app", "-time")  # type: ignore[no-untyped-call]
    admin.close()
    backend = RedisBackend(acl_url, prefix="acl")
    with pytest.raises(BackendError, match="the server's ACL refused it") as caught:
        await backend.start(SystemClock())
    assert PASSWORD not in str(caught.value)


async def test_the_readme_acl_runs_both_redis_backends(acl_url: str) -> None:
    clock, now_ms = SystemClock(), int(time.time() * 1000)
    policy = JobPolicy("acl.job", history_size=2, history_ttl=timedelta(hours=1))
    claims = RedisBackend(acl_url, prefix="acl")
    await claims.start(clock)
    try:
        await claims.prepare([policy])
        slot = Slot("acl.job", clock.now_ms())  # after the fleet's record was made
        assert await claims.claim(slot, instance_id="a", run_id="r1", timeout=5)
        assert not await claims.claim(slot, instance_id="b", run_id="r2", timeout=5)
        for n in range(3):
            await claims.record(policy, make_record("acl.job", now_ms, n))
        assert len(await claims.history(policy, 10)) == 2
        await fleet_records(claims)
    finally:
        await claims.stop()

    leases = RedisLeaseBackend(acl_url, prefix="acl", lease_ttl="3s")
    lease_policy = JobPolicy("acl.lease", history_size=2, history_ttl=timedelta(hours=1))
    await leases.start(clock)
    try:
        await leases.prepare([lease_policy])
        lease = await leases.acquire(
            Slot("acl.lease", now_ms),
            policy=lease_policy,
            instance_id="a",
            run_id="r1",
            reason="schedule",
            timeout=5,
        )
        assert isinstance(lease, Lease)
        assert await leases.renew(lease)
        await leases.release(lease, handover=True)
        [taken] = await leases.take_over([lease_policy], instance_id="b")
        assert taken.attempt == 1
        await leases.release(taken)
        for n in range(3):
            await leases.record(lease_policy, make_record("acl.lease", now_ms, n))
        assert len(await leases.history(lease_policy, 10)) == 2
    finally:
        await leases.stop()


async def fleet_records(backend: RedisBackend) -> None:
    """Presence and a control change, as a running scheduler makes them."""
    now = SystemClock().now()
    me = Instance("a", "host", 1, "v", now, now, timedelta(seconds=5))
    await backend.publish_instance(me)
    assert await backend.instances() == [me]
    await backend.change_control(ControlChange("acl.job", "pause", "ops", now))
    assert (await backend.controls())["acl.job"].paused

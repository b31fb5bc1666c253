"""RedisLeaseBackend beyond the conformance suite: the lease rules of ``backends/_lease.py``
(the server's clock bounds a slot, manual runs, the retry window, stale tokens), races, the
optimistic take-over commit, on a single server and on a Redis Cluster.

A lease that expired long ago is made so by moving its expiry back in the job's runs hash
(``backdate``); the few real expiries wait for the lease to pass, as the conformance suite does.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import redis.asyncio

from brokersched import BackendError, ClockSkewError, ConfigurationError
from brokersched._clock import Clock, SystemClock
from brokersched.abc import JobPolicy, Lease, Slot
from brokersched.backends.redis import RedisLeaseBackend, history_key, runs_key
from tests.support.leases import SLOT, TTL, SkewedClock, acquire, expire, lease_of, now_ms, race
from tests.support.names import unique
from tests.support.paths import REPO_ROOT
from tests.support.redis_helpers import delete_keys, redis_cluster_url
from tests.support.stall_proxy import StallProxy

__all__ = ["redis_cluster_url"]

RACERS = 8
AHEAD_MS = 120_000
OLD_MS = 32_000
WINDOW = timedelta(seconds=5)


@dataclass
class Fleet:
    url: str
    cluster: bool
    prefix: str = field(default_factory=lambda: unique("t"))
    started: list[RedisLeaseBackend] = field(default_factory=list)

    async def start(self, clock: Clock | None = None, **options: Any) -> RedisLeaseBackend:
        options.setdefault("lease_ttl", TTL)
        backend = RedisLeaseBackend(self.url, prefix=self.prefix, cluster=self.cluster, **options)
        await backend.start(clock or SystemClock())
        self.started.append(backend)
        return backend

    async def many(self, count: int) -> list[RedisLeaseBackend]:
        return [await self.start() for _ in range(count)]

    def client(self) -> Any:
        if self.cluster:
            return redis.asyncio.RedisCluster.from_url(self.url)
        return redis.asyncio.Redis.from_url(self.url)


@pytest.fixture(params=["server", "cluster"])
async def fleet(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[Fleet]:
    cluster = request.param == "cluster"
    url = request.getfixturevalue("redis_cluster_url") if cluster else redis_url
    fleet = Fleet(url, cluster)
    yield fleet
    for backend in reversed(fleet.started):
        await backend.stop()
    await delete_keys(url, fleet.prefix, cluster=cluster)


async def backdate(fleet: Fleet, slot: Slot, ms: int) -> None:
    """The lease of ``slot`` expired (or was handed over) ``ms`` earlier than it did."""
    client = fleet.client()
    try:
        key = runs_key(fleet.prefix, slot.job)
        run = json.loads(await client.hget(key, str(slot.slot_ms)))
        run["expires"] = str(int(run["expires"]) - ms)
        await client.hset(key, str(slot.slot_ms), json.dumps(run))
    finally:
        await client.aclose()


# -- the server's clock bounds the slot it accepts ----------------------------------------------


@pytest.mark.parametrize("reason", ["schedule", "manual", "catch-up"])
async def test_a_slot_far_ahead_of_the_servers_clock_is_refused(fleet: Fleet, reason: str) -> None:
    backend = await fleet.start()
    now = now_ms()
    await backend.release(lease_of(await acquire(backend, Slot("job", now - 60_000))))
    with pytest.raises(ClockSkewError) as caught:
        await acquire(backend, Slot("job", now + AHEAD_MS), reason=reason)
    error = caught.value
    assert isinstance(error, BackendError)
    assert error.ahead_ms > AHEAD_MS - 10_000
    message = str(error)
    assert f"job:{now + AHEAD_MS}" in message
    assert "max_clock_skew (5s)" in message and "NTP" in message
    assert "the Redis server's clock (TIME)" in message
    assert isinstance(await acquire(backend, Slot("job", now), instance="honest"), Lease)


async def test_the_bound_reads_the_servers_clock_not_the_instances(fleet: Fleet) -> None:
    fast_clock = SkewedClock(timedelta(milliseconds=AHEAD_MS))
    fast = await fleet.start(clock=fast_clock)
    with pytest.raises(ClockSkewError):
        await acquire(fast, Slot("job", fast_clock.now_ms()))
    assert isinstance(await acquire(fast, Slot("job", now_ms())), Lease)


async def test_a_server_clock_stepped_back_is_named(fleet: Fleet) -> None:
    """Issue 24 (4): the server's clock stepped back 10 s (``store_time``, the scripts' clock
    override): the refusal names it, not this instance's clock."""
    backend = await fleet.start()
    await backend.release(lease_of(await acquire(backend, Slot("job", now_ms()))))
    backend.store_time = now_ms() - 10_000
    with pytest.raises(ClockSkewError) as caught:
        await acquire(backend, Slot("job", now_ms()))
    message = str(caught.value)
    assert caught.value.moved == "store", message
    assert "the Redis server's clock (TIME) appears to have stepped back by ~10s" in message
    assert "fix the time sync (NTP) of the Redis server" in message


async def test_max_clock_skew_is_the_allowance(fleet: Fleet) -> None:
    tolerant = await fleet.start()
    strict = await fleet.start(max_clock_skew=0)
    policy = JobPolicy("job", overlap="allow")
    assert isinstance(await acquire(tolerant, Slot("job", now_ms() + 2_000), policy), Lease)
    with pytest.raises(ClockSkewError, match=r"max_clock_skew \(0s\)"):
        await acquire(strict, Slot("job", now_ms() + 60_000), policy)
    assert tolerant.max_clock_skew == timedelta(seconds=5)


def test_options_are_validated() -> None:
    for options, option in (
        ({"max_clock_skew": "-1s"}, "max_clock_skew"),
        ({"lease_ttl": 0}, "lease_ttl"),
        ({"prefix": "a{b}"}, "prefix"),
    ):
        with pytest.raises(ConfigurationError) as caught:
            RedisLeaseBackend("redis://127.0.0.1", **options)
        assert caught.value.option == option


# -- manual runs -------------------------------------------------------------------------------


async def test_a_manual_run_does_not_fence_scheduled_slots(fleet: Fleet) -> None:
    backend = await fleet.start()
    now = now_ms()
    manual = lease_of(await acquire(backend, Slot("job", now), reason="manual"))
    assert manual.reason == "manual"
    await backend.release(manual)
    earlier = lease_of(await acquire(backend, Slot("job", now - 1_000), instance="i2"))
    await backend.release(earlier)
    assert await acquire(backend, Slot("job", now - 1_000)) == "not-acquired"


async def test_manual_runs_are_fenced_among_themselves_and_respect_overlap(fleet: Fleet) -> None:
    one, two = await fleet.many(2)
    now = now_ms()
    manual = lease_of(await acquire(one, Slot("job", now - 5_000), reason="manual"))
    assert await acquire(two, Slot("job", now - 4_000), instance="i2") == "overlap"
    assert await acquire(two, Slot("job", now - 3_000), reason="manual") == "overlap"
    await one.release(manual)
    assert await acquire(two, Slot("job", now - 5_000), reason="manual") == "not-acquired"
    assert await acquire(two, Slot("job", now - 2_000), reason="catch-up") == "not-acquired"
    scheduled = lease_of(await acquire(two, Slot("job", now - 6_000), instance="i2"))
    assert await acquire(one, Slot("job", now - 1_000), reason="manual") == "overlap"
    await two.release(scheduled)
    assert isinstance(await acquire(one, Slot("job", now - 1_000), reason="manual"), Lease)


async def test_a_manual_run_at_a_running_slots_instant_is_refused(fleet: Fleet) -> None:
    backend = await fleet.start()
    now = now_ms() - 1_000
    allow = JobPolicy("job", overlap="allow")
    lease_of(await acquire(backend, Slot("job", now), allow))
    assert await acquire(backend, Slot("job", now), allow, reason="manual") == "not-acquired"


async def test_a_dead_manual_run_is_restarted_while_it_is_the_latest(fleet: Fleet) -> None:
    runner, taker = await fleet.many(2)
    policy = JobPolicy("job", max_attempts=3)
    now = now_ms()
    lease_of(await acquire(runner, Slot("job", now - 10_000), policy, reason="manual"))
    await expire()
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt, retry.reason) == (now - 10_000, 2, "retry")
    await expire()
    lease_of(await acquire(runner, Slot("job", now - 5_000), policy, instance="runner"))
    assert await taker.take_over([policy], instance_id="taker") == []
    history = await taker.history(policy, 10)
    assert [(r.outcome, r.reason, r.attempt, r.error) for r in history] == [
        ("interrupted", "retry", 2, "runner lost its lease"),
        ("interrupted", "manual", 1, "runner lost its lease"),
    ]


# -- the retry window --------------------------------------------------------------------------


async def test_a_slot_handed_over_at_a_full_fleet_stop_is_not_rerun_later(fleet: Fleet) -> None:
    stopping, starting = await fleet.many(2)
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - 1_000)
    await stopping.release(lease_of(await acquire(stopping, slot, policy)), handover=True)
    await backdate(fleet, slot, OLD_MS)
    assert await starting.take_over([policy], instance_id="starting") == []
    assert await starting.history(policy, 10) == []
    assert await starting.take_over([policy], instance_id="again") == []


async def test_a_long_run_handed_over_by_a_rolling_restart_is_resumed(fleet: Fleet) -> None:
    stopping, starting = await fleet.many(2)
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - 20 * 60_000)
    await stopping.release(lease_of(await acquire(stopping, slot, policy)), handover=True)
    (taken,) = await starting.take_over([policy], instance_id="starting")
    assert (taken.slot_ms, taken.attempt, taken.reason) == (slot.slot_ms, 1, "retry")


async def test_a_dead_runners_slot_left_longer_than_the_retry_window_is_recorded_interrupted(
    fleet: Fleet,
) -> None:
    runner, taker = await fleet.many(2)
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - 1_000)
    lease_of(await acquire(runner, slot, policy, instance="dead"))
    await backdate(fleet, slot, OLD_MS)
    assert await taker.take_over([policy], instance_id="taker") == []
    (record,) = await taker.history(policy, 10)
    assert (record.slot_ms, record.outcome, record.instance_id) == (
        slot.slot_ms,
        "interrupted",
        "dead",
    )
    assert record.error is not None
    assert record.error.startswith("runner lost its lease; not restarted: it waited 3")
    assert record.error.endswith("for a runner, longer than its retry window (5s)")
    assert await taker.take_over([policy], instance_id="taker") == []


async def test_a_dead_runners_slot_within_the_retry_window_is_restarted(fleet: Fleet) -> None:
    runner, taker = await fleet.many(2)
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - OLD_MS)
    lease_of(await acquire(runner, slot, policy))
    await backdate(fleet, slot, 3_000)
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt) == (slot.slot_ms, 2)
    ((outcome, error),) = [(r.outcome, r.error) for r in await taker.history(policy, 10)]
    assert (outcome, error) == ("interrupted", "runner lost its lease")


async def test_the_retry_window_is_never_shorter_than_the_lease(fleet: Fleet) -> None:
    """The lease expired half a second ago, on the store's clock (set, not waited for: the
    outcome must not depend on how long the calls take): within a lease of its expiry the
    slot is retried although ``retry_window`` is 0."""
    runner, taker = await fleet.many(2)
    policy = JobPolicy("job", max_attempts=3, retry_window=timedelta(0))
    granted = now_ms()
    slot = Slot("job", granted - 1_000)
    runner.store_time = taker.store_time = granted
    lease_of(await acquire(runner, slot, policy))
    taker.store_time = granted + TTL // timedelta(milliseconds=1) + 500
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt) == (slot.slot_ms, 2)


# -- races and tokens --------------------------------------------------------------------------


async def test_racing_claimers_of_newer_slots_respect_a_just_granted_lease(fleet: Fleet) -> None:
    backends = await fleet.many(RACERS)
    for n in range(6):
        calls = [
            partial(acquire, b, Slot("skip", SLOT + n * 1000 + i + 1), instance=f"i{i}")
            for i, b in enumerate(backends)
        ]
        results = await race(calls)
        leases = [r for r in results if isinstance(r, Lease)]
        assert len(leases) == 1, results
        await backends[0].release(leases[0])


async def test_racing_takers_share_dead_slots_exactly_once_and_record_each_once(
    fleet: Fleet,
) -> None:
    backends = await fleet.many(RACERS)
    policies = [JobPolicy(f"job{n}") for n in range(4)]  # on several nodes of a cluster
    for policy in policies:
        lease_of(await acquire(backends[0], Slot(policy.name, SLOT), policy))
    await expire()
    calls = [partial(b.take_over, policies, instance_id=f"i{i}") for i, b in enumerate(backends)]
    taken = [lease for leases in await race(calls) for lease in leases]
    assert sorted(lease.job for lease in taken) == [p.name for p in policies]
    assert {lease.attempt for lease in taken} == {2}
    for policy in policies:
        history = await backends[0].history(policy, 10)
        assert [(r.outcome, r.attempt) for r in history] == [("interrupted", 1)]


async def test_a_stale_token_never_touches_the_newer_lease(fleet: Fleet) -> None:
    dead, alive = await fleet.many(2)
    policy = JobPolicy("job")
    old = lease_of(await acquire(dead, Slot("job", SLOT), policy))
    await expire()
    (new,) = await alive.take_over([policy], instance_id="i2")
    await dead.release(old, handover=True)
    await dead.release(old)
    assert await alive.take_over([policy], instance_id="i3") == []
    assert await acquire(dead, Slot("job", SLOT + 1000), policy) == "overlap"
    assert await dead.renew(old) is False
    assert await alive.renew(new) is True


async def test_an_older_slot_is_refused_after_a_newer_ones_lease_expired(fleet: Fleet) -> None:
    one, two = await fleet.many(2)
    policy = JobPolicy("job")
    lease_of(await acquire(one, Slot("job", SLOT + 60_000), policy))
    await expire()
    assert await acquire(two, Slot("job", SLOT), policy, instance="i2") == "not-acquired"
    assert await acquire(two, Slot("job", SLOT), policy, reason="catch-up") == "not-acquired"
    (retry,) = await two.take_over([policy], instance_id="i2")
    assert (retry.slot_ms, retry.attempt) == (SLOT + 60_000, 2)


async def test_a_handed_over_slot_not_latest_is_dropped(fleet: Fleet) -> None:
    backend = await fleet.start()
    policy = JobPolicy("job")
    await backend.release(
        lease_of(await acquire(backend, Slot("job", SLOT), policy)), handover=True
    )
    lease_of(await acquire(backend, Slot("job", SLOT + 1000), policy))
    assert await backend.take_over([policy], instance_id="i2") == []
    assert await backend.history(policy, 10) == []


async def test_a_take_over_decided_on_a_stale_fence_commits_nothing(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the take-over's read and its commit, another instance claims a newer slot: the
    dead slot is no longer the latest, so the decision to restart it must not be applied; the
    next sweep drops it and records the lost attempt once."""
    runner, taker, other = await fleet.many(3)
    allow = JobPolicy("job", overlap="allow", max_attempts=3)
    slot = Slot("job", SLOT)
    lease_of(await acquire(runner, slot, allow))
    await expire()
    connection = taker._redis
    real_script = connection.script

    async def script(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "COMMIT_TAKE_OVER":
            lease_of(await acquire(other, Slot("job", SLOT + 1000), allow, instance="other"))
        return await real_script(name, *args, **kwargs)

    monkeypatch.setattr(connection, "script", script)
    assert await taker.take_over([allow], instance_id="taker") == []
    monkeypatch.undo()
    assert await backend_history(taker, allow) == []
    assert await taker.take_over([allow], instance_id="taker") == []  # not the latest: dropped
    assert [(r.slot_ms, r.outcome) for r in await backend_history(taker, allow)] == [
        (SLOT, "interrupted")
    ]


async def backend_history(backend: RedisLeaseBackend, policy: JobPolicy) -> list[Any]:
    return await backend.history(policy, 10)


async def test_a_run_is_kept_only_while_it_runs(fleet: Fleet) -> None:
    """A finished run leaves nothing but the fence: the runs hash stays as small as the runs
    in progress."""
    backend = await fleet.start()
    for n in range(5):
        lease = lease_of(await acquire(backend, Slot("job", SLOT + n)))
        await backend.release(lease)
    client = fleet.client()
    try:
        assert await client.hlen(runs_key(fleet.prefix, "job")) == 0
        assert await client.exists(history_key(fleet.prefix, "job")) == 0
    finally:
        await client.aclose()


# -- a runner killed mid-run is restarted by another process -----------------------------------

LONG_RUNNER = """
import asyncio, json, sys
from datetime import UTC, datetime
from brokersched import RedisLeaseBackend, Scheduler

url, prefix, when = sys.argv[1], sys.argv[2], float(sys.argv[3])


def say(**fields):
    print(json.dumps(fields), flush=True)


async def run(ctx):
    say(ran=[ctx.slot_ms, ctx.reason, ctx.attempt, ctx.instance_id])
    await asyncio.sleep(60)


async def main():
    scheduler = Scheduler(RedisLeaseBackend(url, prefix=prefix, lease_ttl="1s"), jitter=0)
    scheduler.at("long", datetime.fromtimestamp(when, UTC), run, max_late="1m", max_attempts=3)
    async with scheduler:
        say(ready=True)
        await asyncio.sleep(60)


asyncio.run(main())
"""


async def test_a_runner_killed_mid_run_is_restarted_by_another_process(redis_url: str) -> None:
    prefix = unique("t")
    when = time.time() + 3
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", LONG_RUNNER, redis_url, prefix, str(when),
            stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
        )
        for _ in range(2)
    ]  # fmt: skip
    lines: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()

    async def read(index: int, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            if line.startswith(b"{"):
                await lines.put((index, json.loads(line)))

    readers = [asyncio.ensure_future(read(i, p)) for i, p in enumerate(processes)]
    try:
        async with asyncio.timeout(30):
            runs: list[tuple[int, list[Any]]] = []
            while len(runs) < 1:
                index, line = await lines.get()
                if "ran" in line:
                    runs.append((index, line["ran"]))
            first, (slot_ms, reason, attempt, _) = runs[0]
            assert (reason, attempt) == ("schedule", 1)
            processes[first].kill()  # SIGKILL: no release, no hand-over, no record
            while len(runs) < 2:
                index, line = await lines.get()
                if "ran" in line:
                    runs.append((index, line["ran"]))
        second, retried = runs[1]
        assert second != first
        assert retried[:3] == [slot_ms, "retry", 2]
        backend = RedisLeaseBackend(redis_url, prefix=prefix)
        await backend.start(SystemClock())
        try:
            (record,) = await backend.history(JobPolicy("long"), 10)
        finally:
            await backend.stop()
        assert (record.slot_ms, record.outcome, record.attempt) == (slot_ms, "interrupted", 1)
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
            await process.wait()
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await delete_keys(redis_url, prefix)


# -- a stalled link ----------------------------------------------------------------------------


async def test_calls_answer_in_time_on_a_stalled_link_and_resume_after(redis_url: str) -> None:
    """A partition, not a reset: the socket stays open and nothing comes back. A renewal
    fails within a third of the lease (before the lease could be taken over), a claim within
    its timeout; once the link is back, a fresh connection serves the next calls."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    prefix = unique("t")
    async with StallProxy(port) as proxy:
        backend = RedisLeaseBackend(
            f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix, lease_ttl="1500ms"
        )
        await backend.start(SystemClock())
        try:
            lease = lease_of(await acquire(backend, Slot("job", SLOT)))
            proxy.stall()
            started = time.monotonic()
            with pytest.raises(BackendError, match="no answer"):
                await backend.renew(lease)
            assert time.monotonic() - started < 0.5 + 0.2  # ttl / 3, and a margin
            started = time.monotonic()
            with pytest.raises(BackendError, match="no answer"):
                await backend.acquire(
                    Slot("job", SLOT + 1),
                    policy=JobPolicy("job"),
                    instance_id="i",
                    run_id="r",
                    reason="schedule",
                    timeout=0.3,
                )
            assert time.monotonic() - started < 0.6
            proxy.resume()
            assert await backend.renew(lease) is True
            assert await acquire(backend, Slot("job", SLOT + 2)) == "overlap"
        finally:
            proxy.resume()
            await backend.stop()
            await delete_keys(redis_url, prefix)

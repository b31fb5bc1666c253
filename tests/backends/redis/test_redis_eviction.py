"""Eviction: a Redis whose ``maxmemory-policy`` may evict keys drops claims, fences and leases
under memory pressure, and a slot runs twice; both Redis backends refuse to start on one.

Each test starts its own ``redis-server`` (a free port, a temporary directory) with
``--maxmemory 10mb`` and the policy under test; the cluster test changes one primary of the
session's cluster and puts it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from brokersched import BackendError, ConfigurationError, JobContext, Scheduler, SkipEvent
from brokersched._clock import SystemClock, ms_to_datetime
from brokersched.abc import JobPolicy, Slot
from brokersched.backends.redis import RedisBackend, RedisLeaseBackend
from brokersched.testing import TestClock
from brokersched.testing.conformance import make_record
from tests.support.leases import acquire
from tests.support.redis_helpers import RedisServer, readme_acl, redis_cluster_url
from tests.support.wait import until

__all__ = ["redis_cluster_url"]

CLOCK = SystemClock()
LOGGER = "brokersched.backends.redis"
NO_CONFIG = ("--rename-command", "CONFIG", "")

Backend = RedisBackend | RedisLeaseBackend


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for server in started:
        server.stop()


def start_server(
    servers: list[RedisServer], directory: Path, policy: str, *args: str
) -> RedisServer:
    server = RedisServer(directory).start(
        "--maxmemory", "10mb", "--maxmemory-policy", policy, *args
    )
    servers.append(server)
    return server


def both(url: str, **options: Any) -> list[Backend]:
    return [RedisBackend(url, **options), RedisLeaseBackend(url, **options)]


def records_of(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


@pytest.mark.parametrize(
    "policy", ["volatile-lru", "allkeys-lru", "allkeys-random", "volatile-ttl"]
)
async def test_an_evicting_policy_is_refused_by_both_backends(
    servers: list[RedisServer], tmp_path: Path, policy: str
) -> None:
    server = start_server(servers, tmp_path / policy, policy)
    for backend in both(server.url):
        with pytest.raises(ConfigurationError) as caught:
            await backend.start(CLOCK)
        await backend.stop()  # not started: nothing to do
        error = caught.value
        assert (error.option, error.backend) == ("maxmemory-policy", backend.name)
        message = str(error)
        assert message.startswith(
            f"{backend.name}: {server.url} may evict keys (maxmemory-policy {policy}): "
        )
        assert "claims, fences, leases, the fleet's slot-memory record" in message
        assert "a slot would run twice" in message
        assert "CONFIG SET maxmemory-policy noeviction" in message
        assert "a Redis server of its own with noeviction" in message
        assert "\n" not in message


async def test_noeviction_starts_without_a_word(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(servers, tmp_path / "noeviction", "noeviction", "--appendonly", "yes")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for backend in both(server.url):
            await backend.start(CLOCK)
            await backend.stop()
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


async def test_without_config_the_policy_is_read_from_info(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Managed Redis disables CONFIG (ElastiCache's default policy is volatile-lru); INFO
    memory still tells the policy."""
    evicting = start_server(servers, tmp_path / "hidden-lru", "volatile-lru", *NO_CONFIG)
    for backend in both(evicting.url):
        with pytest.raises(ConfigurationError, match=r"\(maxmemory-policy volatile-lru\)"):
            await backend.start(CLOCK)
    safe = start_server(servers, tmp_path / "hidden-safe", "noeviction", *NO_CONFIG)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for backend in both(safe.url):
            await backend.start(CLOCK)
            await backend.stop()
    assert records_of(caplog, logging.WARNING) == []
    assert not any("eviction policy" in message for message in caplog.messages)


async def test_a_user_the_acl_refuses_config_reads_info(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    """The README's ACL with CONFIG GET taken away: the policy is still read (+info)."""
    server = start_server(servers, tmp_path / "acl", "allkeys-lru")
    admin = redis.Redis(port=server.port)
    commands = [c for c in readme_acl() if c != "+config|get"]
    admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", "app", "on", ">pw", "~p:*", "-@all", *commands
    )
    admin.close()
    url = f"redis://app:pw@127.0.0.1:{server.port}/0"
    for backend in both(url, prefix="p"):
        with pytest.raises(ConfigurationError, match=r"\(maxmemory-policy allkeys-lru\)"):
            await backend.start(CLOCK)


async def test_when_neither_config_nor_info_answers_start_warns(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(
        servers, tmp_path / "blind", "volatile-lru", *NO_CONFIG, "--rename-command", "INFO", ""
    )
    backend = RedisBackend(server.url)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        await backend.start(CLOCK)  # not refused: the policy is unknown
    await backend.stop()
    # and, once, that the server's budget (INFO memory and clients) is not read
    message, budget = records_of(caplog, logging.WARNING)
    assert budget.startswith("RedisBackend: the server's budget could not be read: ")
    assert "unknown command 'INFO'" in budget
    assert message.startswith(f"RedisBackend could not check the eviction policy of {server.url}")
    assert "CONFIG GET maxmemory-policy: ResponseError" in message
    assert "INFO memory: ResponseError" in message
    assert "make sure it is noeviction" in message


@pytest.mark.parametrize("kind", [RedisBackend, RedisLeaseBackend])
async def test_a_policy_changed_at_runtime_is_logged_once_after_a_record(
    servers: list[RedisServer],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    kind: type[Backend],
) -> None:
    """Read again at most once a minute (the backend's clock), after a record. (The budget's
    own reading of INFO, every 30 s of that clock, is not this test's: it stays off.)"""
    server = start_server(servers, tmp_path / "runtime", "noeviction")
    clock = TestClock()
    backend = kind(server.url, prefix="evict", budget_interval=None)
    policy = JobPolicy("job")
    await backend.start(clock)
    admin = redis.Redis(port=server.port)
    try:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            await backend.record(policy, make_record("job", clock.now_ms(), 0))
            assert records_of(caplog, logging.ERROR) == []  # read at start, under a minute ago
            for minute in (1, 2):
                await clock.advance("1m")
                await backend.record(policy, make_record("job", clock.now_ms(), minute))
        [message] = records_of(caplog, logging.ERROR)  # once per change, not every minute
        assert message.startswith(f"{kind.__name__}: {server.url} may evict keys")
        assert "(maxmemory-policy allkeys-lru)" in message
        assert message.endswith("; it was noeviction at start")
        admin.config_set("maxmemory-policy", "noeviction")
        await clock.advance("1m")
        await backend.record(policy, make_record("job", clock.now_ms(), 3))
        admin.config_set("maxmemory-policy", "volatile-lfu")
        await clock.advance("1m")
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            await backend.record(policy, make_record("job", clock.now_ms(), 4))
        assert "(maxmemory-policy volatile-lfu)" in records_of(caplog, logging.ERROR)[-1]
        assert len(records_of(caplog, logging.ERROR)) == 2
    finally:
        admin.close()
        await backend.stop()


async def test_every_primary_of_a_cluster_is_checked(redis_cluster_url: str) -> None:
    cluster = redis.RedisCluster.from_url(redis_cluster_url)
    last = cluster.get_primaries()[-1]
    cluster.config_set("maxmemory-policy", "volatile-lru", target_nodes=last)
    try:
        for backend in both(redis_cluster_url, cluster=True):
            with pytest.raises(ConfigurationError) as caught:
                await backend.start(CLOCK)
            assert caught.value.option == "maxmemory-policy"
            assert f"(maxmemory-policy volatile-lru on {last.name})" in str(caught.value)
    finally:
        cluster.config_set("maxmemory-policy", "noeviction", target_nodes=last)
        cluster.close()
    backend = RedisBackend(redis_cluster_url, cluster=True)
    await backend.start(CLOCK)  # every primary noeviction again
    await backend.stop()


# -- a policy set to evict while the backends run ------------------------------------------------

HIDDEN_CONFIG = ("--rename-command", "CONFIG", "admin-config")  # managed Redis: no CONFIG


def set_policy(admin: redis.Redis, policy: str, *, hidden: bool) -> None:
    command = "admin-config" if hidden else "CONFIG"
    admin.execute_command(command, "SET", "maxmemory-policy", policy)  # type: ignore[no-untyped-call]


def evict(admin: redis.Redis, key: str) -> int:
    """Write filler keys (8 KB, no TTL) until Redis has evicted ``key``; how many."""
    count = 0
    while admin.exists(key):
        try:
            admin.set(f"fill:{count}", b"x" * 8192)
        except redis.exceptions.OutOfMemoryError:  # nothing left it may evict: it must be gone
            break
        count += 1
        assert count < 20_000, f"{key} was never evicted"
    assert admin.exists(key) == 0
    return count


def unfill(admin: redis.Redis) -> None:
    keys = list(admin.scan_iter("fill:*", count=1000))
    for start in range(0, len(keys), 500):
        admin.delete(*keys[start : start + 500])


async def claim(backend: Backend, slot: Slot, instance: str) -> bool:
    """The slot's claim by ``instance``: won (a lease is released at once: its run ended)."""
    if isinstance(backend, RedisBackend):
        return await backend.claim(slot, instance_id=instance, run_id=instance, timeout=5)
    lease = await acquire(backend, slot, instance=instance, timeout=5)
    if isinstance(lease, str):
        return False
    await backend.release(lease)
    return True


async def due(slot_ms: int) -> Slot:
    """The slot of job ``job`` at ``slot_ms``, once it has fallen due (real time: the
    eviction guard judges a claim against the server's clock)."""
    await until(lambda: CLOCK.now_ms() >= slot_ms, what="the slot to fall due")
    return Slot("job", slot_ms)


async def claims(backends: list[Backend], slot: Slot) -> list[bool | BaseException]:
    """Every backend claims ``slot`` at the same moment."""
    return await asyncio.gather(
        *(claim(backend, slot, f"late{n}") for n, backend in enumerate(backends)),
        return_exceptions=True,
    )


@pytest.mark.parametrize("hidden", [False, True], ids=["config", "no-config"])
@pytest.mark.parametrize(
    ("kind", "policy"),
    [(RedisBackend, "volatile-lru"), (RedisLeaseBackend, "allkeys-lru")],
    ids=["claims", "leases"],
)
async def test_a_policy_set_to_evict_while_running_runs_no_slot_twice(
    servers: list[RedisServer], tmp_path: Path, kind: type[Backend], policy: str, hidden: bool
) -> None:
    """A slot is claimed and run; then the policy is set to evict (``volatile-lru`` evicts
    RedisBackend's claim keys, the only keys with a TTL; ``allkeys-lru`` the lease backend's
    fences) and a burst evicts that claim. Late claims of the slot, made together by three
    other instances, are refused naming the policy, as they read it with the claim (through
    INFO where CONFIG is disabled); once the policy is noeviction again, they are refused
    naming the evictions; a slot that falls due afterwards is claimed again."""
    args = HIDDEN_CONFIG if hidden else ()
    server = start_server(servers, tmp_path / "runtime", "noeviction", "--maxmemory", "4mb", *args)
    admin = redis.Redis(port=server.port)
    extra = {"lease_ttl": "2s", "max_clock_skew": "1s"} if kind is RedisLeaseBackend else {}
    backends = [kind(server.url, prefix="evict", budget_interval=None, **extra) for _ in range(4)]
    for backend in backends:
        await backend.start(CLOCK)
    winner, late = backends[0], backends[1:]
    try:
        slot = await due(CLOCK.now_ms() + 500)  # after the fleet's record was made
        assert await claim(winner, slot, "winner")  # ... and run
        decided = (
            f"evict:{{job}}:claim:{slot.slot_ms}" if kind is RedisBackend else "evict:{job}:job"
        )
        set_policy(admin, policy, hidden=hidden)
        evict(admin, decided)

        refused = await claims(late, slot)
        assert all(isinstance(outcome, BackendError) for outcome in refused), refused
        for outcome in refused:
            message = str(outcome)
            assert message.startswith(f"{kind.__name__}: the ") and " is not made: " in message
            assert f"(maxmemory-policy {policy}, read with the claim)" in message
            assert "only maxmemory-policy noeviction is accepted" in message
        assert admin.exists(decided) == 0  # a refused claim writes nothing

        set_policy(admin, "noeviction", hidden=hidden)
        unfill(admin)
        refused = await claims(late, slot)
        assert all(isinstance(outcome, BackendError) for outcome in refused), refused
        evicted = admin.info("stats")["evicted_keys"]
        for outcome in refused:
            assert f"(evicted_keys {evicted} in INFO stats, first seen by a claim" in str(outcome)
            assert "keep noeviction" in str(outcome)

        later = await due(CLOCK.now_ms() + 2500)  # past the clocks' skew and a lease's life
        assert sorted(await claims(late, later), key=str) == [False, False, True]
    finally:
        admin.close()
        for backend in backends:
            await backend.stop()


@pytest.mark.parametrize(
    ("kind", "policy"),
    [(RedisBackend, "volatile-lru"), (RedisLeaseBackend, "allkeys-lru")],
    ids=["claims", "leases"],
)
async def test_an_evicting_policy_set_under_a_running_fleet_runs_no_slot_twice(
    servers: list[RedisServer], tmp_path: Path, kind: type[Backend], policy: str
) -> None:
    """Three schedulers run one job; each has a virtual clock of its own, kept on real time
    (the guard judges claims on the server's): A runs a slot; the policy is set to evict and a
    burst evicts A's claim; B's clock reaches that slot late, then, with the policy back to
    noeviction, C's. The slot ran once: B and C skip it as ``backend-error``, saying why; the
    next slot runs once."""
    server = start_server(servers, tmp_path / "fleet", "noeviction", "--maxmemory", "4mb")
    admin = redis.Redis(port=server.port)
    extra = {"lease_ttl": "2s", "max_clock_skew": "1s"} if kind is RedisLeaseBackend else {}
    runs: list[tuple[str, int]] = []
    skips: dict[str, list[SkipEvent]] = {"a": [], "b": [], "c": []}
    clocks = {name: TestClock(datetime.now(UTC)) for name in skips}
    fleet: dict[str, Scheduler[Any]] = {}
    for name, clock in clocks.items():
        backend = kind(server.url, prefix="fleet", budget_interval=None, **extra)
        scheduler = Scheduler(backend, clock=clock, jitter=0, instance_id=name)

        async def tick(ctx: JobContext) -> None:
            runs.append((ctx.instance_id, ctx.slot_ms))

        scheduler.every("tick", "4s", tick)
        scheduler.on("skip", skips[name].append)
        fleet[name] = scheduler
    try:
        for scheduler in fleet.values():
            await scheduler.start()
        first = (CLOCK.now_ms() // 4000 + 1) * 4000  # the first slot after the fleet's start
        await due(first)
        await clocks["a"].advance_to(ms_to_datetime(first))
        assert runs == [("a", first)]

        admin.config_set("maxmemory-policy", policy)
        evict(
            admin, f"fleet:{{tick}}:claim:{first}" if kind is RedisBackend else "fleet:{tick}:job"
        )
        await clocks["b"].advance_to(ms_to_datetime(first + 500))  # late, within max_late
        admin.config_set("maxmemory-policy", "noeviction")
        unfill(admin)
        await clocks["c"].advance_to(ms_to_datetime(first + 600))
        assert runs == [("a", first)]
        (b,) = [skip for skip in skips["b"] if skip.slot_ms == first]
        (c,) = [skip for skip in skips["c"] if skip.slot_ms == first]
        assert b.reason == c.reason == "backend-error"
        assert f"(maxmemory-policy {policy}, read with the claim)" in (b.detail or "")
        assert "may have evicted keys since a claim of this slot" in (
            c.detail or ""
        ) and "keep noeviction" in (c.detail or "")

        after = first + 4000
        await due(after)
        for clock in clocks.values():
            await clock.advance_to(ms_to_datetime(after))
        assert [slot for _, slot in runs] == [first, after]
    finally:
        for scheduler in fleet.values():
            await scheduler.stop()
        admin.close()


async def test_a_take_over_restarts_no_run_while_keys_may_be_evicted(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    """A take-over restarting a dead run writes a lease as a claim does: refused while the
    policy evicts, it restarts the run once the policy is noeviction again (nothing was
    evicted meanwhile)."""
    server = start_server(servers, tmp_path / "take-over", "noeviction")
    admin = redis.Redis(port=server.port)
    backend = RedisLeaseBackend(server.url, prefix="dead", budget_interval=None, lease_ttl="2s")
    await backend.start(CLOCK)
    try:
        policy = JobPolicy("job")
        held = await acquire(backend, Slot("job", CLOCK.now_ms()), policy, instance="dead")
        assert not isinstance(held, str)
        backend.store_time = CLOCK.now_ms() + 10_000  # its runner died: the lease expired
        admin.config_set("maxmemory-policy", "volatile-lfu")
        with pytest.raises(BackendError) as refused:
            await backend.take_over([policy], instance_id="b")
        assert str(refused.value).startswith(
            f"RedisLeaseBackend: the take-over of job:{held.slot_ms} is not made: "
        )
        assert "(maxmemory-policy volatile-lfu, read with the claim)" in str(refused.value)
        admin.config_set("maxmemory-policy", "noeviction")
        (restarted,) = await backend.take_over([policy], instance_id="b")
        assert (restarted.slot_ms, restarted.attempt) == (held.slot_ms, 2)
    finally:
        admin.close()
        await backend.stop()


async def test_where_only_config_answers_start_says_claims_go_unguarded(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CONFIG tells the policy at start, but claims read it (and the eviction count) with
    INFO: without INFO, a policy set to evict later goes unseen, and start says so."""
    server = start_server(
        servers, tmp_path / "no-info", "noeviction", "--appendonly", "yes",
        "--rename-command", "INFO", "",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for backend in both(server.url, budget_interval=None):
            await backend.start(CLOCK)
            await backend.stop()
    messages = records_of(caplog, logging.WARNING)
    assert len(messages) == 2
    for name, message in zip(("RedisBackend", "RedisLeaseBackend"), messages, strict=True):
        assert message.startswith(f"{name}: INFO is refused on {server.url} (ResponseError: ")
        assert "one set to evict while the backend runs would go unseen" in message
        assert message.endswith("allow INFO for this user (+info)")

"""Eviction: a Redis whose ``maxmemory-policy`` may evict keys drops claims, fences and leases
under memory pressure, and a slot runs twice; both Redis backends refuse to start on one.

Each test starts its own ``redis-server`` (a free port, a temporary directory) with
``--maxmemory 10mb`` and the policy under test; the cluster test changes one primary of the
session's cluster and puts it back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from brokersched import ConfigurationError
from brokersched._clock import SystemClock
from brokersched.abc import JobPolicy
from brokersched.backends.redis import RedisBackend, RedisLeaseBackend
from brokersched.testing import TestClock
from brokersched.testing.conformance import make_record
from tests.support.redis_helpers import RedisServer, readme_acl, redis_cluster_url

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
    # and, once, that the server's budget (issue 28.2, INFO memory and clients) is not read
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

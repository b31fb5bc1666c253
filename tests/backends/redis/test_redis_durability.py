"""Durability: a Redis that restarts without its append-only file forgets claims and leases.

Each test starts its own ``redis-server`` (a free port, a temporary directory), crashes it with
SIGKILL and starts it again on the same directory: with ``appendonly yes`` and ``appendfsync
always`` a claimed slot stays claimed (and a lease's fence stays), without it the slot is
forgotten, and ``start()`` said so in one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokersched import ConfigurationError
from brokersched._clock import SystemClock
from brokersched.abc import Lease, Slot
from brokersched.backends.redis import RedisBackend, RedisLeaseBackend
from tests.support.leases import acquire
from tests.support.redis_helpers import RedisServer, redis_cluster_url

__all__ = ["redis_cluster_url"]

CLOCK = SystemClock()
SLOT = 1_700_000_000_000
AOF = ("--appendonly", "yes", "--appendfsync", "always")
NO_AOF = ("--appendonly", "no")
LOGGER = "brokersched.backends.redis"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for server in started:
        server.stop()


def start_server(servers: list[RedisServer], directory: Path, *args: str) -> RedisServer:
    server = RedisServer(directory).start(*args)
    servers.append(server)
    return server


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING
    ]


async def claim(backend: RedisBackend, slot: Slot) -> bool:
    return await backend.claim(slot, instance_id="i", run_id="r", timeout=5.0)


async def claim_then_crash(server: RedisServer) -> None:
    claims = RedisBackend(server.url, prefix="p")
    leases = RedisLeaseBackend(server.url, prefix="p")
    await claims.start(CLOCK)
    await leases.start(CLOCK)
    try:
        assert await claim(claims, Slot("job", SLOT)) is True
        lease = await acquire(leases, Slot("lease", SLOT))
        assert isinstance(lease, Lease)
        await leases.release(lease)
    finally:
        await claims.stop()
        await leases.stop()
    server.kill()  # a crash: nothing more is written
    server.start()  # the same directory and settings


async def test_with_an_append_only_file_a_claimed_slot_stays_claimed_after_a_crash(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(servers, tmp_path / "aof", *AOF)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        await claim_then_crash(server)
        late = RedisBackend(server.url, prefix="p", require_persistence=True)
        await late.start(CLOCK)
        leases = RedisLeaseBackend(server.url, prefix="p", require_persistence=True)
        await leases.start(CLOCK)
    try:
        assert await claim(late, Slot("job", SLOT)) is False  # remembered: never run twice
        fenced = await acquire(leases, Slot("lease", SLOT))
        assert fenced == "not-acquired"  # the fence survived too
        assert isinstance(await acquire(leases, Slot("lease", SLOT + 1000)), Lease)
    finally:
        await late.stop()
        await leases.stop()
    assert warnings_of(caplog) == []


async def test_without_an_append_only_file_a_restart_forgets_and_start_warns(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(servers, tmp_path / "plain", *NO_AOF)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        await claim_then_crash(server)
        late = RedisBackend(server.url, prefix="p")
        await late.start(CLOCK)
    try:
        assert await claim(late, Slot("job", SLOT)) is True  # forgotten: a late rerun
    finally:
        await late.stop()
    messages = warnings_of(caplog)
    assert len(messages) == 3  # one per start(): two before the crash, one after
    message = messages[-1]
    assert message.startswith(f"RedisBackend: {server.url} has no append-only file")
    assert "forgets the slots claimed and the leases held" in message
    assert "set appendonly yes" in message
    assert "\n" not in message


async def test_require_persistence_refuses_a_server_without_an_append_only_file(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path / "plain", *NO_AOF)
    for backend in (
        RedisBackend(server.url, require_persistence=True),
        RedisLeaseBackend(server.url, require_persistence=True),
    ):
        with pytest.raises(ConfigurationError) as caught:
            await backend.start(CLOCK)
        assert caught.value.option == "require_persistence"
        assert "appendonly no" in str(caught.value) and "\n" not in str(caught.value)
        await backend.stop()  # not started: nothing to do


async def test_a_server_that_hides_its_config_is_noted_or_refused(
    servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Managed Redis often disables CONFIG: the check is skipped with a note, unless
    persistence is required, which cannot then be verified."""
    server = start_server(servers, tmp_path / "hidden", *NO_AOF, "--rename-command", "CONFIG", "")
    backend = RedisBackend(server.url)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        await backend.start(CLOCK)
    await backend.stop()
    assert warnings_of(caplog) == []
    assert any("could not check the persistence" in r.getMessage() for r in caplog.records)
    strict = RedisBackend(server.url, require_persistence=True)
    with pytest.raises(ConfigurationError, match="cannot check that"):
        await strict.start(CLOCK)


async def test_every_primary_of_a_cluster_is_checked(
    redis_cluster_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = RedisLeaseBackend(redis_cluster_url, cluster=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        await backend.start(CLOCK)
    await backend.stop()
    assert len(warnings_of(caplog)) == 1
    with pytest.raises(ConfigurationError, match="appendonly no"):
        await RedisBackend(redis_cluster_url, cluster=True, require_persistence=True).start(CLOCK)

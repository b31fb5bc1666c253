"""RedisBackend (claim-only) beyond the conformance suite: configuration, key names, start
errors, expiry on the server's clock, racing claimers, outages, and three scheduler processes
running every slot exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from brokersched import (
    BackendError,
    BackendUnavailableError,
    ConfigurationError,
    JobContext,
    Scheduler,
)
from brokersched._clock import SystemClock
from brokersched.abc import Claim, JobPolicy, RunRecord, Slot
from brokersched.backends.redis import (
    RedisBackend,
    RedisLeaseBackend,
    claim_key,
    hash_tag,
    history_key,
    job_key,
    runs_key,
)
from tests.support.fleet import run_fleet
from tests.support.names import unique
from tests.support.redis_helpers import RedisServer, delete_keys, redis_cluster_url, redis_fleet
from tests.support.wait import free_port

__all__ = ["redis_cluster_url"]

CLOCK = SystemClock()
SLOT = 1_700_000_000_000
PASSWORD = "s3cr%t@pw/x"  # characters a URL parser would cut at
QUOTED = "s3cr%25t%40pw%2Fx"


@pytest.fixture
def prefix() -> str:
    return unique("t")


@pytest.fixture
async def fleet(redis_url: str, prefix: str) -> AsyncIterator[Callable[..., Any]]:
    """``await fleet(**options)``: a started RedisBackend of this test's prefix."""
    async with redis_fleet(redis_url, prefix) as start:
        yield start


async def claim(backend: RedisBackend, slot: Slot, timeout: float = 5.0) -> bool:
    return await backend.claim(slot, instance_id="i", run_id="r", timeout=timeout)


def run_record(job: str, slot_ms: int, n: int, *, age_s: float = 0) -> RunRecord:
    started = CLOCK.now() - timedelta(seconds=age_s)
    return RunRecord(job, slot_ms, f"run-{n}", "i", "schedule", 1, started, started, "completed")


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("amqp://guest:guest@127.0.0.1/", "must start with redis://"),
        ("127.0.0.1:6379", "must start with redis://"),
        ("redis://127.0.0.1:notaport/0", "is not a valid URL"),
        ("redis:///0", "names no host"),
        (42, "is not a valid URL"),
    ],
)
def test_a_bad_url_is_refused_at_construction(url: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RedisBackend(url)
    assert needle in str(caught.value)
    assert caught.value.option == "url" and caught.value.backend == "RedisBackend"


def test_a_bad_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigurationError) as caught:
        RedisBackend(f"http://u:{PASSWORD}@127.0.0.1/")
    assert PASSWORD not in str(caught.value) and "***" in str(caught.value)


def test_a_cluster_is_not_reached_through_a_unix_socket() -> None:
    with pytest.raises(ConfigurationError, match="unix socket"):
        RedisBackend("unix:///tmp/redis.sock", cluster=True)
    RedisBackend("unix:///tmp/redis.sock")  # a single server: fine


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "a b", "x" * 101, "a/b", 3])
def test_a_bad_prefix_is_refused(prefix: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RedisLeaseBackend("redis://127.0.0.1", prefix=prefix)
    assert caught.value.option == "prefix"


@pytest.mark.parametrize("slot_ttl", ["0s", "-1s", "abc", 0])
def test_slot_ttl_is_validated(slot_ttl: Any) -> None:
    with pytest.raises(ConfigurationError):
        RedisBackend("redis://127.0.0.1", slot_ttl=slot_ttl)


def test_construction_never_connects_and_repr_hides_the_password() -> None:
    backend = RedisBackend(f"redis://user:{QUOTED}@127.0.0.1:1/0", slot_ttl="90s", prefix="app")
    lease = RedisLeaseBackend(f"rediss://:{QUOTED}@127.0.0.1:1/0", cluster=True)
    for text in (repr(backend), repr(lease)):
        assert QUOTED not in text and PASSWORD not in text and "***" in text
    assert repr(backend) == (
        "RedisBackend('redis://user:***@127.0.0.1:1/0', slot_ttl='1m30s', prefix='app')"
    )
    caps = backend.capabilities
    assert (caps.leases, caps.slot_memory, caps.history_ttl, caps.history_size_per_job) == (
        False,
        backend.slot_ttl,
        True,
        True,
    )
    assert lease.capabilities.leases is True and lease.capabilities.slot_memory is None


def test_the_scheduler_refuses_lease_options_and_a_too_short_slot_ttl() -> None:
    scheduler = Scheduler(RedisBackend("redis://127.0.0.1", slot_ttl="30s"))

    async def handler(ctx: JobContext) -> None: ...

    with pytest.raises(ConfigurationError) as caught:
        scheduler.every("a", "1m", handler, overlap="allow")  # type: ignore[call-overload]
    assert caught.value.option == "overlap" and "RedisBackend" in str(caught.value)
    with pytest.raises(ConfigurationError, match="slot_ttl"):
        scheduler.every("b", "5m", handler, jitter="10s", max_late="1m")


# -- key names ---------------------------------------------------------------------------------


def test_key_names_are_injective_and_share_the_jobs_hash_tag() -> None:
    jobs = ["x.y", "x:y", "x_y", "x-y", "x$y", "X.Y", "x%7By", "x{y", "x}y", "é", "%C3%A9", "x/y"]
    keys = [claim_key(p, Slot(j, SLOT)) for p in ("a", "a:b", "a.b") for j in jobs]
    assert len(set(keys)) == len(keys)
    for job in jobs:
        tag = hash_tag(job)
        assert tag.count("{") == 1 and tag.count("}") == 1 and tag.startswith("{")
        names = [
            claim_key("p", Slot(job, SLOT)),
            job_key("p", job),
            runs_key("p", job),
            history_key("p", job),
        ]
        assert len(set(names)) == 4
        assert all(name.startswith(f"p:{tag}:") for name in names)
    assert claim_key("brokersched", Slot("report", 5)) == "brokersched:{report}:claim:5"


async def test_every_key_of_a_job_lies_in_one_cluster_slot(redis_cluster_url: str) -> None:
    client = redis.asyncio.RedisCluster.from_url(redis_cluster_url)
    try:
        for job in ("report", "a" * 128, "x}y", "x{y}z", "é"):
            names = [
                claim_key("p", Slot(job, SLOT)),
                job_key("p", job),
                runs_key("p", job),
                history_key("p", job),
            ]
            slots = {await client.execute_command("CLUSTER KEYSLOT", n) for n in names}
            assert len(slots) == 1, (job, slots)
            assert client.keyslot(names[0]) in slots
    finally:
        await client.aclose()


# -- claims ------------------------------------------------------------------------------------


async def test_a_claim_is_one_set_nx_px_slot_ttl(fleet: Callable[..., Any], redis_url: str) -> None:
    backend = await fleet(slot_ttl="90s")
    slot = Slot("report", SLOT)
    assert await claim(backend, slot) is True
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        key = claim_key(backend.prefix, slot)
        ttl = await client.pttl(key)
        assert 85_000 < ttl <= 90_000
        assert json.loads(await client.get(key)) == {"instance_id": "i", "run_id": "r"}
    finally:
        await client.aclose()


async def test_a_slot_is_forgotten_after_slot_ttl_on_the_servers_clock(
    fleet: Callable[..., Any],
) -> None:
    one, two = await fleet(slot_ttl="300ms"), await fleet(slot_ttl="300ms")
    slot = Slot("short", SLOT)
    assert await claim(one, slot) is True
    assert await claim(two, slot) is False
    await asyncio.sleep(0.5)  # the point: Redis expires the key by itself
    assert await claim(two, slot) is True


async def test_many_racing_claimers_have_one_winner_per_slot(fleet: Callable[..., Any]) -> None:
    backends = [await fleet() for _ in range(12)]
    slots = [Slot("race", SLOT + n) for n in range(25)]
    barrier = asyncio.Barrier(len(backends))

    async def racer(backend: RedisBackend) -> list[bool]:
        await barrier.wait()
        # 300 claims at once: on a loaded machine they answer in more than the usual 5 s, and
        # only the race decides here (a claim that times out fails closed, tested apart)
        return list(await asyncio.gather(*(claim(backend, slot, 60) for slot in slots)))

    rows = await asyncio.gather(*(racer(backend) for backend in backends))
    assert [sum(row[n] for row in rows) for n in range(len(slots))] == [1] * len(slots)


async def test_a_batch_larger_than_the_pool_is_claimed_in_one_round_trip(
    fleet: Callable[..., Any],
) -> None:
    """The slots of one instant (200 jobs every second) outnumber the pool's connections:
    claimed one by one, concurrently, the claims beyond it failed (``MaxConnectionsError``)."""
    backend = await fleet(max_connections=4)
    now_ms = int(time.time() * 1000)  # on time: the slot memory is read with the claims
    claims = [Claim(Slot(f"pool.{n}", now_ms), f"r{n}", JobPolicy(f"pool.{n}")) for n in range(40)]
    assert await backend.claim_many(claims, instance_id="i1", timeout=5.0) == [True] * 40
    assert await backend.claim_many(claims, instance_id="i2", timeout=5.0) == [False] * 40


async def test_history_keeps_its_size_and_age(fleet: Callable[..., Any], redis_url: str) -> None:
    backend = await fleet()
    policy = JobPolicy("hist", history_size=3, history_ttl=timedelta(hours=1))
    await backend.record(policy, run_record("hist", SLOT, 0, age_s=7200))
    for n in range(1, 6):
        await backend.record(policy, run_record("hist", SLOT + n, n))
    assert [r.run_id for r in await backend.history(policy, 10)] == ["run-5", "run-4", "run-3"]
    assert [r.run_id for r in await backend.history(policy, 2)] == ["run-5", "run-4"]
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        key = history_key(backend.prefix, "hist")
        assert await client.llen(key) == 3  # trimmed on the server, not only on read
        assert 0 < await client.pttl(key) <= 3_600_000  # the list goes once all are too old
    finally:
        await client.aclose()


# -- start errors: one line each, never the password -------------------------------------------


def one_line_without_secrets(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    for secret in (PASSWORD, QUOTED, "hunter2"):
        assert secret not in text, text
        assert secret not in repr(error.__cause__), repr(error.__cause__)
    return text


async def test_an_unreachable_server_is_one_line_at_start() -> None:
    port = free_port()
    backend = RedisBackend(f"redis://:{QUOTED}@127.0.0.1:{port}/0")
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError) as caught:
        await backend.start(CLOCK)
    assert time.monotonic() - started < 10
    text = one_line_without_secrets(caught.value)
    assert text.startswith(f"RedisBackend could not connect to redis://:***@127.0.0.1:{port}/0")
    assert "refused" in text.lower() or "connect" in text.lower()


async def test_an_unreachable_cluster_is_one_line_at_start() -> None:
    port = free_port()
    backend = RedisLeaseBackend(f"redis://:{QUOTED}@127.0.0.1:{port}/0", cluster=True)
    with pytest.raises(BackendUnavailableError) as caught:
        await backend.start(CLOCK)
    text = one_line_without_secrets(caught.value)
    assert text.startswith(f"RedisLeaseBackend could not connect to redis://:***@127.0.0.1:{port}")


async def test_client_options_cannot_change_how_answers_are_read(
    fleet: Callable[..., Any],
) -> None:
    backend = await fleet(decode_responses=True, max_connections=4)
    policy = JobPolicy("opts", history_size=5)
    assert await claim(backend, Slot("opts", SLOT)) is True
    await backend.record(policy, run_record("opts", SLOT, 1))
    assert [r.run_id for r in await backend.history(policy, 5)] == ["run-1"]


@pytest.fixture
def password_server(tmp_path: Path) -> Any:
    server = RedisServer(tmp_path / "auth").start("--requirepass", "hunter2")
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("userinfo", "backend_class"),
    [(f":{QUOTED}@", RedisBackend), ("", RedisBackend), (f":{QUOTED}@", RedisLeaseBackend)],
)
async def test_a_wrong_or_missing_password_is_one_line_at_start(
    password_server: RedisServer, userinfo: str, backend_class: type[Any]
) -> None:
    backend = backend_class(f"redis://{userinfo}127.0.0.1:{password_server.port}/0")
    with pytest.raises(BackendUnavailableError) as caught:
        await backend.start(CLOCK)
    text = one_line_without_secrets(caught.value)
    if userinfo:
        assert "refused the credentials" in text and "check the user name and password" in text
    else:
        assert "the server requires a password and the URL gives none" in text


async def test_the_right_password_and_a_unix_socket_work(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    socket_path = tmp_path / "r.sock"
    server = RedisServer(tmp_path / "unix").start(
        "--requirepass", "hunter2", "--unixsocket", str(socket_path), "--unixsocketperm", "700"
    )
    try:
        for url in (
            f"redis://:hunter2@127.0.0.1:{server.port}/0",
            f"unix://:hunter2@{socket_path}?db=0",
        ):
            backend = RedisBackend(url, prefix="p")
            assert "hunter2" not in repr(backend)
            await backend.start(CLOCK)
            try:
                assert await claim(backend, Slot("job", SLOT)) is (url.startswith("redis"))
            finally:
                await backend.stop()
    finally:
        server.stop()
    assert "hunter2" not in caplog.text


async def test_a_missing_extra_is_named_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'brokersched\[redis\]'"):
        await RedisBackend("redis://127.0.0.1:1").start(CLOCK)


# -- outages fail closed -----------------------------------------------------------------------


async def test_a_server_that_goes_away_fails_claims_closed_and_claims_resume(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "gone").start()
    backend = RedisBackend(server.url, prefix="p")
    await backend.start(CLOCK)
    try:
        assert await claim(backend, Slot("job", SLOT)) is True
        server.kill()
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError) as caught:
            await claim(backend, Slot("job", SLOT + 1), timeout=1.0)
        assert time.monotonic() - started < 2.5
        assert "\n" not in str(caught.value)
        server.start()  # same port, a fresh (empty) server
        deadline = time.monotonic() + 10
        while True:
            try:
                assert await claim(backend, Slot("job", SLOT + 2)) is True
                break
            except BackendError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await backend.stop()
        server.stop()


async def test_a_claim_that_cannot_answer_in_time_fails_closed(
    fleet: Callable[..., Any], redis_url: str
) -> None:
    backend = await fleet()
    blocker = redis.asyncio.Redis.from_url(redis_url)
    try:
        # a busy script blocks the whole server for a second, as a stalled one would
        sleeping = asyncio.ensure_future(blocker.eval(BUSY_SECOND, 0))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError, match=r"no answer .* in time"):
            await claim(backend, Slot("slow", SLOT), timeout=0.3)
        assert time.monotonic() - started < 0.8
        await sleeping
    finally:
        await blocker.aclose()
    # The answer was lost, not the server: later claims get their own answers (the lost
    # reply is never read as the answer to a later command), whether or not SLOT was won.
    assert await claim(backend, Slot("slow", SLOT + 1)) is True
    assert await claim(backend, Slot("slow", SLOT + 1)) is False
    assert await claim(backend, Slot("slow", SLOT + 2)) is True


async def test_a_call_that_outlives_the_backends_stop_leaves_no_connection(
    fleet: Callable[..., Any], redis_url: str
) -> None:
    """A call begun before ``stop()`` that sends its command after it (a task the stop did not
    wait for) closes what it opened: redis-py's pool would open a fresh connection."""
    backend = await fleet()
    go = asyncio.Event()

    async def late(client: Any) -> Any:
        await go.wait()
        return await client.ping()

    call = asyncio.ensure_future(backend._redis.call("ping late", late))
    await asyncio.sleep(0)  # the call has taken the client
    await backend.stop()
    go.set()
    assert await call is True
    observer = redis.asyncio.Redis.from_url(redis_url)
    try:
        names = [client["name"] for client in await observer.client_list()]
    finally:
        await observer.aclose()
    assert backend._redis.client_name not in names


BUSY_SECOND = """
local function now() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end
local start = now()
while now() - start < 1000000 do end
return 1
"""


# -- a fleet of schedulers in separate processes -----------------------------------------------


@pytest.mark.parametrize("kind", ["claim", "lease"])
async def test_three_scheduler_processes_run_every_slot_exactly_once(
    redis_url: str, prefix: str, kind: str
) -> None:
    jobs = {"fleet.tick": "250ms", "fleet:tock$": "250ms"}
    options = {"lease_ttl": "5s"} if kind == "lease" else {"slot_ttl": "2m"}
    spec = {"backend": f"redis-{kind}", "url": redis_url, "prefix": prefix, "jobs": jobs}
    spec |= {"options": options, "scheduler": {"max_late": "10s"}}
    try:
        fleet = await run_fleet(spec)
    finally:
        await delete_keys(redis_url, prefix)
    window = fleet.assert_every_slot_ran_once(dict.fromkeys(jobs, 250), settle=4)
    skips = fleet.skips()
    assert skips["not-acquired"] + skips["overlap"] >= 2 * window
    logging.getLogger(__name__).info("%d runs, skips %s", len(fleet.runs()), dict(skips))


async def test_jobs_spread_over_the_primaries_of_a_cluster(redis_cluster_url: str) -> None:
    prefix = unique("t")
    backend = RedisBackend(redis_cluster_url, prefix=prefix, cluster=True)
    await backend.start(CLOCK)
    client = redis.asyncio.RedisCluster.from_url(redis_cluster_url)
    try:
        await client.initialize()
        jobs = [f"job{n}" for n in range(30)]
        for job in jobs:
            assert await claim(backend, Slot(job, SLOT)) is True
        owners = {client.get_node_from_key(claim_key(prefix, Slot(job, SLOT))).name for job in jobs}
        assert len(owners) == 3
    finally:
        await backend.stop()
        await client.aclose()
        await delete_keys(redis_cluster_url, prefix, cluster=True)

"""``brokersched purge`` and ``brokersched doctor`` against the real servers.

Purge, on every backend: a scheduler of the prefix runs a slot (the objects are made by the
backend itself); ``purge`` refuses while it runs; ``--dry-run`` lists and leaves everything;
``purge`` after it stopped removes everything, checked with the server's own view
(``rabbitmqctl``, ``SCAN``, the JetStream API, the catalogs). Doctor: a server set up the wrong
way (an evicting Redis, a claims stream with a short duplicate window, a RabbitMQ policy on
the claim queues, a schema of a newer release) fails; a correct one passes.

The application is ``tests/support/cli_apps/ops_app.py``; the CLI runs as a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from brokersched import RabbitMQBackend, RedisBackend, Scheduler
from brokersched.abc import Backend, ClaimBackend, Slot
from brokersched.backends._ops import recent_claims
from brokersched.backends.rabbitmq import (
    claim_queue_name,
    fence_exchange_name,
    fleet_lock_name,
    fleet_queue_name,
    history_queue_name,
    history_stream_name,
    lock_queue_name,
    record_queue_name,
)
from brokersched.backends.rabbitmq._ops import (
    Management,
    Names,
    claim_policy_findings,
    fd_finding,
    kind_of,
    known_names,
)
from brokersched.testing import TestClock
from tests.support.cli_apps.ops_app import make_backend, make_scheduler
from tests.support.cli_apps.process import RunningCLI, brokersched
from tests.support.helpers import missing
from tests.support.names import unique
from tests.support.nats_helpers import claims_stream, lease_streams
from tests.support.private_rabbitmq import RABBITMQ_SBIN, PrivateRabbitMQ
from tests.support.redis_helpers import RedisServer, redis_cluster_url
from tests.support.wait import until

__all__ = ["redis_cluster_url"]  # a fixture

APP = "tests.support.cli_apps.ops_app:create"
QUIET_APP = "tests.support.cli_apps.quiet_app:create"


def ops_name(kind: str) -> str:
    name = unique("ops")
    return name if kind not in ("sqlite",) else f"{name}_"


def env_of(kind: str, url: str, prefix: str, management: str | None = None) -> dict[str, str]:
    env = {"BROKERSCHED_TEST_BACKEND": kind, "BROKERSCHED_TEST_URL": url}
    env["BROKERSCHED_TEST_PREFIX"] = prefix
    if management is not None:
        env["BROKERSCHED_TEST_MANAGEMENT_URL"] = management
    return env


async def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(brokersched, *args, env=env, timeout=90)


@contextlib.asynccontextmanager
async def running(
    kind: str, url: str, prefix: str, management: str | None = None
) -> AsyncIterator[Scheduler[Backend]]:
    """A scheduler of the prefix, once it has run a slot of ``tick``."""
    scheduler = make_scheduler(make_backend(kind, url, prefix, management))
    done = asyncio.Event()
    scheduler.on("complete", lambda event: done.set())
    await scheduler.start()
    try:
        await asyncio.wait_for(done.wait(), 20)
        yield scheduler
    finally:
        await scheduler.stop()


# -- what each server holds, by its own account ---------------------------------------------


def rabbitmqctl(*args: str, node: PrivateRabbitMQ | None = None) -> str:
    """The shared broker's ``rabbitmqctl`` (the package's wrapper, which runs it as the
    rabbitmq user, with its cookie), or the private node's, with its own."""
    command = ["rabbitmqctl", *args]
    env = None
    if node is not None:
        command = [str(RABBITMQ_SBIN / "rabbitmqctl"), "-n", node.nodename, *args]
        env = {**os.environ, **node.env}
    found = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert found.returncode == 0, found.stderr
    return found.stdout


def rabbitmq_objects(prefix: str, node: PrivateRabbitMQ | None = None) -> set[str]:
    names: set[str] = set()
    for kind in ("list_queues", "list_exchanges"):
        out = rabbitmqctl(kind, "name", "--quiet", "--no-table-headers", node=node)
        names |= {line.strip() for line in out.splitlines() if line.startswith(f"{prefix}.")}
    return names


async def nats_objects(url: str, prefix: str, *, lease: bool = False) -> set[str]:
    import nats

    from brokersched.backends.nats._fleet import bucket_streams

    fleet = set(bucket_streams(prefix))
    made = set(lease_streams(prefix)) if lease else {f"{prefix}-claims", *fleet}
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return {info.config.name for info in await js.streams_info() if info.config.name} & {
            *made,
            f"{prefix}-history",
        }
    finally:
        await nc.close()


async def redis_objects(url: str, prefix: str) -> set[str]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    try:
        return {key.decode() async for key in client.scan_iter(match=f"{prefix}:*")}
    finally:
        await client.aclose()


async def postgres_objects(dsn: str, schema: str) -> set[str]:
    import asyncpg  # pyright: ignore[reportMissingTypeStubs]

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT nspname AS name FROM pg_namespace WHERE nspname = $1"
            " UNION ALL SELECT relname FROM pg_class c JOIN pg_namespace n"
            " ON n.oid = c.relnamespace WHERE nspname = $1",
            schema,
        )
        return {row["name"] for row in rows}
    finally:
        await conn.close()


def sqlite_objects(path: str, prefix: str) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    return {name for name in names if name.startswith(prefix)}


@dataclass
class Server:
    kind: str
    url: str

    async def objects(self, prefix: str) -> set[str]:
        if self.kind == "rabbitmq":
            return await asyncio.to_thread(rabbitmq_objects, prefix)
        if self.kind.startswith("nats"):
            return await nats_objects(self.url, prefix, lease=self.kind == "nats-lease")
        if self.kind.startswith("redis"):
            return await redis_objects(self.url, prefix)
        if self.kind == "postgres":
            return await postgres_objects(self.url, prefix)
        return sqlite_objects(self.url, prefix)


@pytest.fixture(
    params=["rabbitmq", "nats", "nats-lease", "redis", "redis-lease", "postgres", "sqlite"]
)
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Server:
    kind: str = request.param
    if kind == "rabbitmq":
        if shutil.which("rabbitmqctl") is None:
            missing("needs rabbitmqctl to look at the broker")
        return Server(kind, request.getfixturevalue("amqp_url"))
    if kind.startswith("nats"):
        return Server(kind, request.getfixturevalue("nats_url"))
    if kind.startswith("redis"):
        return Server(kind, request.getfixturevalue("redis_url"))
    if kind == "postgres":
        return Server(kind, request.getfixturevalue("postgres_dsn"))
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:  # the application's own table
        conn.execute("CREATE TABLE ops_app_users (name TEXT)")
    return Server(kind, str(path))


# -- purge ----------------------------------------------------------------------------------


async def test_purge_refuses_while_running_then_removes_everything(server: Server) -> None:
    prefix = ops_name(server.kind)
    env = env_of(server.kind, server.url, prefix)
    try:
        async with running(server.kind, server.url, prefix):
            made = await server.objects(prefix)
            assert made, "the scheduler made nothing on the server"
            refused = await cli("purge", APP, env=env)
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert "refused: an instance of the prefix seems to run" in refused.stderr
            assert "live: " in refused.stdout
            assert made <= await server.objects(prefix)  # nothing removed
        listed = await cli("purge", APP, "--dry-run", env=env)
        assert listed.returncode == 0, listed.stderr
        before = await server.objects(prefix)
        for name in before:
            if server.kind in ("postgres", "sqlite") and name.endswith(
                ("_pkey", "history_started")
            ):
                continue  # indexes go with their tables
            if server.kind == "rabbitmq" and ".claim." in name:
                continue  # a claim queue of a manual run's instant is not named from the app
            shown = name if server.kind != "postgres" or name == prefix else f"{prefix}.{name}"
            assert shown in listed.stdout, f"{name} not listed:\n{listed.stdout}"
        # Claims and runs of the last minute still count as an instance running.
        again = await cli("purge", APP, env=env)
        assert again.returncode == 1, again.stdout + again.stderr
        purged = await cli("purge", APP, "--force", env=env)
        assert purged.returncode == 0, purged.stdout + purged.stderr
        assert "removed" in purged.stdout
        assert await server.objects(prefix) == set()
    finally:
        await cli("purge", APP, "--force", env=env)
    if server.kind == "sqlite":
        assert sqlite_objects(server.url, "ops_app_") == {"ops_app_users"}  # not the app's


async def test_purge_refuses_while_an_instance_publishes_its_presence(server: Server) -> None:
    """An instance of the prefix runs in a process of its own and does nothing else (its one
    job is due in 2100): no claim, lease, run or connection name says so, only the presence
    that `brokersched instances` lists. Purge refuses, names it and leaves everything; once it
    stopped, purge removes everything without --force."""
    prefix = ops_name(server.kind)
    instance = f"{prefix}-member"
    env = {**env_of(server.kind, server.url, prefix), "BROKERSCHED_TEST_INSTANCE": instance}
    member = RunningCLI("run", QUIET_APP, env=env)
    try:

        async def alive() -> bool:
            if member.process.poll() is not None:
                member.stop()
                pytest.fail(f"the instance exited:\n{member.output()}")
            listed = await cli("instances", QUIET_APP, "--json", env=env)
            rows = [json.loads(line) for line in listed.stdout.splitlines()]
            return any(r["id"] == instance and r["liveness"] == "alive" for r in rows)

        await until(alive, timeout=60, what="the instance listed alive", every=0.2)
        made = await server.objects(prefix)
        assert made, "the instance made nothing on the server"
        listed = await cli("purge", QUIET_APP, "--dry-run", env=env)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert f"live: instance {instance!r} (host " in listed.stdout, listed.stdout
        refused = await cli("purge", QUIET_APP, env=env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "refused: an instance of the prefix seems to run" in refused.stderr
        [sign] = [line for line in refused.stdout.splitlines() if instance in line]
        assert sign.startswith(f"live: instance {instance!r}"), refused.stdout
        assert "is alive: last seen" in sign, sign
        assert await server.objects(prefix) == made  # nothing removed
        assert member.stop() == 0, member.output()
        purged = await cli("purge", QUIET_APP, env=env)
        assert purged.returncode == 0, purged.stdout + purged.stderr
        assert "removed" in purged.stdout and instance not in purged.stdout, purged.stdout
        assert await server.objects(prefix) == set()
    finally:
        member.kill()
        await cli("purge", QUIET_APP, "--force", env=env)


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
async def test_purge_refuses_while_a_claim_is_still_remembered(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A claim of a slot 70 s ago (slot_ttl 20 s: the fleet's memory raised to 2 minutes by
    another instance, say) is still what refuses a late claim of that slot: removing it could
    run the slot twice, however long ago its slot fell due."""
    url = request.getfixturevalue("redis_url" if kind == "redis" else "amqp_url")
    prefix = ops_name(kind)
    env = env_of(kind, url, prefix)
    clock = TestClock(datetime.now(UTC) - timedelta(seconds=70))
    backend: ClaimBackend = (RedisBackend if kind == "redis" else RabbitMQBackend)(
        url, slot_ttl="2m", prefix=prefix
    )
    await backend.start(clock)
    try:
        slot = Slot("tick", (clock.now_ms() // 1000 + 1) * 1000)  # after the record is made
        assert await backend.claim(slot, instance_id="i", run_id="r", timeout=5)
    finally:
        await backend.stop()
    try:
        refused = await cli("purge", APP, env=env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "still remembered" in refused.stdout, refused.stdout
    finally:
        await cli("purge", APP, "--force", env=env)


def test_a_claim_found_is_live_however_old_its_slot() -> None:
    now = 10_000_000
    [sign] = recent_claims([now - 180_000, now - 240_000], now, "claim keys")
    assert sign.startswith("2 claim(s) still remembered, the newest of a slot 3m ago")
    assert recent_claims([], now, "claim keys") == []


async def test_purge_without_anything_says_so(server: Server) -> None:
    prefix = ops_name(server.kind)
    result = await cli("purge", APP, env=env_of(server.kind, server.url, prefix))
    assert result.returncode == 0, result.stderr
    assert "nothing to remove" in result.stdout
    assert await server.objects(prefix) == set()


async def test_jobs_reads_a_fleet_wide_pause_without_starting_the_backend(server: Server) -> None:
    """A job paused for the fleet while an instance ran: ``brokersched jobs`` reads its
    control from the backend, not started (it makes nothing there), and says ``paused``."""
    prefix = ops_name(server.kind)
    env = {**env_of(server.kind, server.url, prefix), "COLUMNS": "160"}
    try:
        async with running(server.kind, server.url, prefix) as scheduler:
            job = scheduler.get("tick")
            assert job is not None
            await job.pause(by="ops")
        made = await server.objects(prefix)
        listed = await cli("jobs", APP, "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        table = await cli("jobs", APP, env=env)
        (line,) = [line for line in table.stdout.splitlines() if "tick" in line]
        assert (row["state"], row["controls_read"]) == ("paused", True)
        assert "paused" in line and "enabled" not in line, table.stdout
        assert await server.objects(prefix) == made  # nothing made by reading
    finally:
        await cli("purge", APP, "--force", env=env)


async def test_purge_of_another_prefix(redis_url: str) -> None:
    """--prefix purges a retired fleet's keys, and not those of a longer prefix."""
    retired, longer = unique("redis"), None
    longer = f"{retired}:more"
    env = env_of("redis", redis_url, "ops-unused")
    try:
        for prefix in (retired, longer):
            async with running("redis", redis_url, prefix):
                pass
        result = await cli("purge", APP, "--prefix", retired, "--force", env=env)
        assert result.returncode == 0, result.stderr
        assert await redis_objects(redis_url, f"{retired}:{{") == set()
        assert await redis_objects(redis_url, f"{retired}:slot-memory") == set()
        assert await redis_objects(redis_url, longer), "a longer prefix's keys were removed"
    finally:
        for prefix in (retired, longer):
            await cli("purge", APP, "--prefix", prefix, "--force", env=env)


# -- doctor ---------------------------------------------------------------------------------


def findings_of(result: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    report = json.loads(result.stdout)
    findings: list[dict[str, str]] = report["findings"]
    assert report["errors"] == sum(f["severity"] == "error" for f in findings)
    return findings


def errors_of(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return {f["check"]: f["found"] for f in findings_of(result) if f["severity"] == "error"}


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for each in started:
        each.stop()


async def test_doctor_redis_evicting_fails_and_noeviction_passes(
    redis_servers: list[RedisServer], tmp_path: Path
) -> None:
    for name, args in (("lru", ("--maxmemory-policy", "allkeys-lru")), ("ok", ())):
        redis_servers.append(RedisServer(tmp_path / name).start("--appendonly", "yes", *args))
    lru, ok = redis_servers
    for kind in ("redis", "redis-lease"):
        bad = await cli("doctor", APP, "--json", env=env_of(kind, lru.url, "ops-doctor"))
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert "allkeys-lru" in errors_of(bad)["maxmemory-policy"]
        good = await cli("doctor", APP, "--json", env=env_of(kind, ok.url, "ops-doctor"))
        assert good.returncode == 0, good.stdout + good.stderr
        assert errors_of(good) == {}
    table = await cli("doctor", APP, env=env_of("redis", lru.url, "ops-doctor"))
    assert table.returncode == 1
    assert "maxmemory-policy" in table.stdout and "noeviction" in table.stdout


async def test_doctor_redis_without_persistence_fails(
    redis_servers: list[RedisServer], tmp_path: Path
) -> None:
    redis_servers.append(RedisServer(tmp_path / "no-aof").start("--appendonly", "no"))
    result = await cli("doctor", APP, "--json", env=env_of("redis", redis_servers[0].url, "x"))
    assert result.returncode == 1
    assert "appendonly no" in errors_of(result)["persistence"]


@pytest.mark.nats_servers
async def test_doctor_nats_short_duplicate_window_fails(nats_url: str) -> None:
    import nats

    prefix = unique("nats")
    env = env_of("nats", nats_url, prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(claims_stream(prefix, duplicate_window=5, max_age=5))
        bad = await cli("doctor", APP, "--json", env=env)
        assert bad.returncode == 1, bad.stdout + bad.stderr
        found = [f for f in findings_of(bad) if f["severity"] == "error"]
        assert any("duplicate_window is 5s" in f["found"] for f in found), found
        assert any("nats stream edit" in f["fix"] for f in found), found
        await js.delete_stream(f"{prefix}-claims")
        async with running("nats", nats_url, prefix):  # the streams brokersched makes
            pass
        good = await cli("doctor", APP, "--json", env=env)
        assert good.returncode == 0, good.stdout + good.stderr
    finally:
        await nc.close()
        await cli("purge", APP, "--force", env=env)


async def test_doctor_nats_lease_bucket_with_a_ttl_fails(nats_url: str) -> None:
    """A bucket whose rows expire (a TTL) would forget the fences: an error, with its fix;
    the bucket brokersched makes passes."""
    import nats
    from nats.js.api import KeyValueConfig

    prefix = unique("natsl")
    env = env_of("nats-lease", nats_url, prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.create_key_value(KeyValueConfig(bucket=prefix, ttl=60))
        bad = await cli("doctor", APP, "--json", env=env)
        assert bad.returncode == 1, bad.stdout + bad.stderr
        found = [f for f in findings_of(bad) if f["severity"] == "error"]
        assert any("its TTL is 60s" in f["found"] for f in found), found
        await js.delete_stream(f"KV_{prefix}")
        async with running("nats-lease", nats_url, prefix):  # the bucket brokersched makes
            pass
        good = await cli("doctor", APP, "--json", env=env)
        assert good.returncode == 0, good.stdout + good.stderr
        assert any(f["check"] == f"stream KV_{prefix}" for f in findings_of(good))
    finally:
        await nc.close()
        await cli("purge", APP, "--force", env=env)


@pytest.mark.parametrize("server", ["postgres", "sqlite"], indirect=True)
async def test_doctor_sql_newer_schema_fails(server: Server) -> None:
    prefix = ops_name(server.kind)
    env = env_of(server.kind, server.url, prefix)
    try:
        async with running(server.kind, server.url, prefix):
            pass
        good = await cli("doctor", APP, "--json", env=env)
        assert good.returncode == 0, good.stdout + good.stderr
        checks = {f["check"] for f in findings_of(good)}
        assert {"server version", "schema"} <= checks
        assert ("clock offset" if server.kind == "postgres" else "journal mode") in checks
        await _set_schema_version(server, prefix, 99)
        bad = await cli("doctor", APP, "--json", env=env)
        assert bad.returncode == 1
        assert "version 99" in errors_of(bad)["schema"]
    finally:
        await cli("purge", APP, "--force", env=env)


async def _set_schema_version(server: Server, prefix: str, version: int) -> None:
    if server.kind == "sqlite":
        with contextlib.closing(sqlite3.connect(server.url)) as conn:
            conn.execute(f'UPDATE "{prefix}schema_version" SET version = {version}')
            conn.commit()
        return
    import asyncpg  # pyright: ignore[reportMissingTypeStubs]

    conn = await asyncpg.connect(server.url)
    try:
        await conn.execute(f'UPDATE "{prefix}".schema_version SET version = {version}')
    finally:
        await conn.close()


async def test_doctor_rabbitmq_without_management_tells_what_it_cannot_check(
    amqp_url: str,
) -> None:
    result = await cli("doctor", APP, "--json", env=env_of("rabbitmq", amqp_url, unique("rmq")))
    assert result.returncode == 0, result.stdout + result.stderr
    found = {f["check"]: f for f in findings_of(result)}
    assert found["server version"]["found"].startswith("RabbitMQ 3.")
    assert found["management API"]["severity"] == "warning"
    assert found["fleet slot memory"]["severity"] == "ok"


# -- RabbitMQ with the management API: a private node -----------------------------------------


async def listed_queues(management: Management, prefix: str) -> set[str]:
    rows = await management.get(f"queues/{management.vhost}?columns=name")
    return {row["name"] for row in rows if row["name"].startswith(f"{prefix}.")}


# a private node boots in the test's first call: up to 120 s on a machine under stress
@pytest.mark.timeout(360)
async def test_purge_rabbitmq_with_management_lists_and_sees_connections(
    private_rabbitmq: PrivateRabbitMQ,
) -> None:
    node, prefix = private_rabbitmq, unique("rmq")
    env = env_of("rabbitmq", node.amqp_url, prefix, node.management_url)
    async with running("rabbitmq", node.amqp_url, prefix) as scheduler:
        job = scheduler.get("tick")
        assert job is not None
        await job.trigger()  # a claim queue at an instant no schedule names
        # The management API lists a connection once the node has emitted its statistics
        # (every 5 s by default).
        management = Management(node.management_url, "/")
        deadline = time.monotonic() + 20
        while not await management.connections(prefix):
            assert time.monotonic() < deadline, "the management API never listed the connection"
            await asyncio.sleep(0.2)
        refused = await cli("purge", APP, env=env)
        assert refused.returncode == 1
        assert "connection(s) named 'brokersched (" in refused.stdout
        assert "not enumerated" not in refused.stdout  # listed, not guessed
    # The management API lists a queue once the node's statistics have it (every 5 s, much
    # later on a machine under CPU stress): the claim queues were made a moment ago. The bound
    # says "never"; what exists is read again each time (a claim queue may expire meanwhile).
    deadline = time.monotonic() + 120
    while True:
        made = await asyncio.to_thread(rabbitmq_objects, prefix, node)
        if {n for n in made if ".claim." in n} <= await listed_queues(management, prefix):
            break
        assert time.monotonic() < deadline, "the management API never listed the claim queues"
        await asyncio.sleep(0.5)
    listed = await cli("purge", APP, "--dry-run", env=env)
    # What existed before the listing and still does after it existed all along (a claim queue
    # that expired is not made again); one of the first ones may have expired meanwhile.
    kept = made & await asyncio.to_thread(rabbitmq_objects, prefix, node)
    assert f"{prefix}.history" in kept
    for name in kept:
        assert name in listed.stdout, f"{name} not listed:\n{listed.stdout}"
    purged = await cli("purge", APP, "--force", env=env)
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert await asyncio.to_thread(rabbitmq_objects, prefix, node) == set()


# a private node boots in the test's first call: up to 120 s on a machine under stress
@pytest.mark.timeout(360)
async def test_doctor_rabbitmq_policy_on_claim_queues_fails(
    private_rabbitmq: PrivateRabbitMQ,
) -> None:
    node, prefix = private_rabbitmq, unique("rmq")
    env = env_of("rabbitmq", node.amqp_url, prefix, node.management_url)
    policy = f"{prefix}-ttl"
    good = await cli("doctor", APP, "--json", env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    found = {f["check"]: f for f in findings_of(good)}
    assert found["policies"]["severity"] == "ok"
    assert "open-files limit (1024)" in found["file descriptors"]["found"]
    assert found["file descriptors"]["severity"] == "warning"  # 1024: below 4096
    assert found["footprint"]["found"].startswith(f"prefix {prefix!r}: 0 claim queue(s)")
    definition = json.dumps({"message-ttl": 1000, "max-length": 5})
    pattern = f"^{prefix}\\.claim\\."
    await asyncio.to_thread(
        rabbitmqctl, "set_policy", policy, pattern, definition, "--apply-to", "queues", node=node
    )
    try:
        bad = await cli("doctor", APP, "--json", env=env)
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert "max-length, message-ttl" in errors_of(bad)["policies"]
    finally:
        await asyncio.to_thread(rabbitmqctl, "clear_policy", policy, node=node)


# -- the naming rules, without a server -----------------------------------------------------

NAMES = Names(
    record=record_queue_name,
    lock=lock_queue_name,
    fence=fence_exchange_name,
    history=history_queue_name,
    stream=history_stream_name,
    claim=claim_queue_name,
    fleet=fleet_queue_name,
    fleet_lock=fleet_lock_name,
)


def test_known_names_cover_every_kind_and_kind_of_recognises_them() -> None:
    from brokersched.abc import Slot

    found = known_names(
        NAMES, "app", jobs=["sync"], slots=[Slot("sync", 1000)], memories_ms=[20_000]
    )
    assert [(item.kind, item.name) for item in found] == [
        ("queue", "app.slot-memory"),
        ("queue", "app.slot-memory.lock"),
        ("queue", "app.history"),
        ("queue", "app.fleet"),
        ("queue", "app.fleet.lock"),
        ("exchange", "app.slot-memory.20000ms"),
        ("queue", "app.history.sync"),
        ("queue", "app.claim.sync.1000"),
    ]
    assert all(kind_of(NAMES, "app", item.name, item.kind) for item in found)
    # Another prefix's, or an application's own, are not.
    for name, kind in (
        ("app2.claim.sync.1", "queue"),
        ("apps.history.x", "queue"),
        ("app.orders", "queue"),
        ("app.slot-memory.lock", "exchange"),
        ("app.slot-memory.x", "exchange"),
    ):
        assert not kind_of(NAMES, "app", name, kind), name


def test_claim_policy_findings() -> None:
    sample = claim_queue_name("app", __import__("brokersched").abc.Slot("x", 0))
    policies: list[dict[str, Any]] = [
        {"name": "ha", "pattern": ".*", "apply-to": "all", "definition": {"ha-mode": "all"}},
        {"name": "ttl", "pattern": "^app\\.", "apply-to": "queues", "definition": {"expires": 1}},
        {"name": "other", "pattern": "^orders", "apply-to": "queues", "definition": {"expires": 1}},
        {"name": "ex", "pattern": ".*", "apply-to": "exchanges", "definition": {"expires": 1}},
    ]
    found = claim_policy_findings(sample, policies)
    assert [(f.severity, f.found.split()[1]) for f in found] == [("error", "'ttl'")]
    assert claim_policy_findings(sample, policies[:1])[0].severity == "ok"


def test_fd_finding_against_the_quorum_queue_budget() -> None:
    node = {"name": "n", "fd_total": 1024, "fd_used": 100}  # no version told: both rules
    quorum = [{"type": "quorum"}]
    assert fd_finding(node, quorum * 300).severity == "error"  # (1024 - 97) / 3 = 309
    assert fd_finding(node, quorum * 10).severity == "warning"
    assert fd_finding({**node, "fd_total": 65536}, quorum * 300).severity == "ok"


async def test_purge_redis_cluster_removes_keys_on_every_node(redis_cluster_url: str) -> None:
    """Keys of several jobs live on several primaries: inventory scans each of them."""
    import redis.asyncio.cluster

    from brokersched import RedisBackend

    prefix = unique("redis")
    backend = RedisBackend(redis_cluster_url, slot_ttl="20s", prefix=prefix, cluster=True)
    scheduler = Scheduler(backend, jitter=0, max_late="5s")
    done: set[str] = set()
    finished = asyncio.Event()

    def complete(event: Any) -> None:
        done.add(event.job)
        if len(done) == 6:
            finished.set()

    for n in range(6):
        scheduler.every(f"job{n}", "1s", lambda ctx: None)
    scheduler.on("complete", complete)
    await scheduler.start()
    try:
        await asyncio.wait_for(finished.wait(), 20)
    finally:
        await scheduler.stop()
    client = redis.asyncio.cluster.RedisCluster.from_url(redis_cluster_url)
    await client.initialize()
    try:

        async def keys_by_node() -> dict[str, set[str]]:
            found: dict[str, set[str]] = {}
            for node in client.get_primaries():
                cursor, keys = 0, set()
                while True:
                    cursor, batch = await client.execute_command(
                        "SCAN", cursor, "MATCH", f"{prefix}:*", target_nodes=node
                    )
                    keys |= {key.decode() for key in batch}
                    (cursor,) = cursor.values()  # {node: cursor}
                    if int(cursor) == 0:
                        break
                if keys:
                    found[node.name] = keys
            return found

        before = await keys_by_node()
        assert len(before) >= 2, f"the jobs' keys all fell on one node: {before}"
        found = await backend.inventory()
        assert {item.name for item in found.objects} == set().union(*before.values())
        assert found.live  # claims of the last minute
        left = await backend.purge(found)
        assert left.objects == ()
        assert await keys_by_node() == {}
        checks = {finding.check: finding for finding in await backend.doctor()}
        assert checks["cluster mode"].severity == "ok"
        assert checks["server version"].found.startswith("Redis ")
        assert checks["persistence"].severity == "error"  # the test cluster runs without AOF
        assert checks["maxmemory-policy"].severity == "ok"
    finally:
        await client.aclose()


async def test_purge_leaves_an_applications_tables_named_like_brokerscheds(
    postgres_dsn: str,
) -> None:
    """A schema of the application's with a Flyway ``schema_version`` and an audit ``history``
    of its own: purge (``--prefix`` naming it) drops neither, and says the schema was kept."""
    import asyncpg

    schema = unique("postgres")
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute(
            f'CREATE SCHEMA "{schema}";'
            f'CREATE TABLE "{schema}".schema_version (installed_rank int, version text);'
            f'CREATE TABLE "{schema}".history (id int, started_at timestamptz, what text);'
            f'CREATE TABLE "{schema}".orders (id int)'
        )
        env = env_of("postgres", postgres_dsn, unique("postgres"))
        result = await cli("purge", APP, "--prefix", schema, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "removed 0 objects" in result.stdout, result.stdout
        assert f"schema {schema} kept" in result.stdout
        assert "is not brokersched's" in result.stdout
        assert await postgres_objects(postgres_dsn, schema) >= {"schema_version", "history"}
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()

"""RedisLeaseBackend beyond the conformance suite and beyond the lease rules every lease backend
shares (tests/backends/multi/test_lease_rules.py runs those on a Redis server and on a Redis
Cluster too): the optimistic take-over's commit decided on a stale fence, a run kept only while
it runs, a runner process killed mid-run, a stalled link, the options; on a single server and on
a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from brokersched import BackendError, ConfigurationError
from brokersched._clock import SystemClock
from brokersched.abc import JobPolicy, LeaseBackend, Slot
from brokersched.backends.redis import RedisLeaseBackend, history_key, runs_key
from tests.support.leases import SLOT, Fleet, acquire, expire, fleet_of, lease_of
from tests.support.names import unique
from tests.support.paths import REPO_ROOT
from tests.support.redis_helpers import delete_keys, redis_cluster_url
from tests.support.stall_proxy import StallProxy

__all__ = ["redis_cluster_url"]


@pytest.fixture(params=["redis", "redis-cluster"])
async def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with fleet_of(request.param, request, tmp_path) as fleet:
        yield fleet


def test_options_are_validated() -> None:
    """A lease of no time, and a prefix with braces (the job's hash tag follows the prefix in
    every key). ``max_clock_skew`` is checked with the other lease backends' in
    tests/backends/multi/test_lease_rules.py."""
    for options, option in (
        ({"lease_ttl": 0}, "lease_ttl"),
        ({"prefix": "a{b}"}, "prefix"),
    ):
        with pytest.raises(ConfigurationError) as caught:
            RedisLeaseBackend("redis://127.0.0.1", **options)
        assert caught.value.option == option


# -- the optimistic take-over ------------------------------------------------------------------


async def test_a_take_over_decided_on_a_stale_fence_commits_nothing(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the take-over's read and its commit, another instance claims a newer slot: the
    dead slot is no longer the latest, so the decision to restart it must not be applied; the
    next sweep drops it and records the lost attempt once."""
    runner, taker, other = await fleet.many(3)
    assert isinstance(taker, RedisLeaseBackend)
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


async def backend_history(backend: LeaseBackend, policy: JobPolicy) -> list[Any]:
    return await backend.history(policy, 10)


async def test_a_run_is_kept_only_while_it_runs(fleet: Fleet) -> None:
    """A finished run leaves nothing but the fence: the runs hash stays as small as the runs
    in progress."""
    backend = await fleet.start()
    for n in range(5):
        lease = lease_of(await acquire(backend, Slot("job", SLOT + n)))
        await backend.release(lease)
    client = fleet.redis()
    try:
        assert await client.hlen(runs_key(fleet.namespace, "job")) == 0
        assert await client.exists(history_key(fleet.namespace, "job")) == 0
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

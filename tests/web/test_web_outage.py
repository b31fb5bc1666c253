"""The admin API during a backend outage, on a real Redis behind a proxy this test controls: a
stalled link (nothing comes back, nothing is reset) and a cut one (every connection reset,
new ones refused). The API says the backend is unreachable, answers at once instead of waiting
on it, and ``/health`` knows within seconds; once the backend is back, so is the API."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from brokersched import JobContext, RedisLeaseBackend, Scheduler
from brokersched.web import _watch, create_app
from brokersched.web._watch import READ_TIMEOUT_S, RETRY_S, STALE_S
from tests.support.redis_helpers import delete_keys
from tests.support.stall_proxy import StallProxy
from tests.support.tcp_proxy import TcpProxy

# /health answers within: nothing heard for STALE_S, then a read bounded by READ_TIMEOUT_S
WITHIN_S = STALE_S + READ_TIMEOUT_S + 1
FAST_S = 0.5  # "at once": a backend that does not answer costs a request nothing


async def noop(ctx: JobContext) -> None:
    pass


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@asynccontextmanager
async def served(redis_url: str, proxy_port: int) -> AsyncIterator[httpx.AsyncClient]:
    prefix = "t" + secrets.token_hex(5)
    backend = RedisLeaseBackend(f"redis://127.0.0.1:{proxy_port}/0", prefix=prefix)
    scheduler = Scheduler(backend, instance_id="web-a")
    scheduler.every("flush", "1h", noop)
    scheduler.every("report", "1h", noop)
    try:
        async with scheduler, client(create_app(scheduler)) as api:
            yield api
    finally:
        await delete_keys(redis_url, prefix)


async def until_status(api: httpx.AsyncClient, status: str, within_s: float) -> dict[str, Any]:
    """``/health`` polled until it says ``status``; fails after ``within_s``."""
    started = time.monotonic()
    while True:
        body: dict[str, Any] = (await api.get("/health")).json()
        if body["status"] == status:
            body["after_s"] = time.monotonic() - started
            return body
        assert time.monotonic() - started < within_s, f"still {body} after {within_s}s"
        await asyncio.sleep(0.2)


async def timed(api: httpx.AsyncClient, path: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await api.get(path)
    return response, time.monotonic() - started


def _port(redis_url: str) -> int:
    return int(redis_url.rsplit(":", 1)[1].split("/")[0])


async def test_a_stalled_backend_is_reported_within_seconds_and_reads_fail_fast(
    redis_url: str,
) -> None:
    async with StallProxy(_port(redis_url)) as proxy, served(redis_url, proxy.port) as api:
        try:
            healthy = await api.get("/health")
            assert healthy.status_code == 200
            assert healthy.json()["backend"]["reachable"] is True
            proxy.stall()
            down = await until_status(api, "unreachable", WITHIN_S)
            assert down["backend"]["reachable"] is False
            assert down["backend"]["error"] == f"no answer within {READ_TIMEOUT_S:g}s"
            # every read now fails at once, and says why
            jobs, jobs_s = await timed(api, "/jobs")
            history, history_s = await timed(api, "/jobs/flush/history")
            health, health_s = await timed(api, "/health")
            assert max(jobs_s, history_s, health_s) < FAST_S, (jobs_s, history_s, health_s)
            listed = jobs.json()
            assert listed["backend_status"]["reachable"] is False
            assert listed["jobs"][0]["history_error"].startswith(
                "the backend (RedisLeaseBackend) is unreachable"
            )
            assert history.status_code == 503
            assert history.json()["error"].startswith(
                "cannot read the history of job 'flush': the backend (RedisLeaseBackend) is "
                "unreachable"
            )
            assert health.status_code == 503
        finally:
            proxy.resume()
        back = await until_status(api, "ok", RETRY_S + READ_TIMEOUT_S + 2)
        assert back["backend"]["reachable"] is True
        assert (await api.get("/jobs/flush/history")).status_code == 200


async def test_a_cut_backend_is_reported_and_comes_back(redis_url: str) -> None:
    async with (
        TcpProxy("127.0.0.1", _port(redis_url)) as proxy,
        served(redis_url, proxy.port) as api,
    ):
        try:
            assert (await api.get("/jobs")).json()["backend_status"]["reachable"] is True
            await proxy.cut()
            down = await until_status(api, "unreachable", WITHIN_S)
            assert "Error" in down["backend"]["error"] or "no answer" in down["backend"]["error"]
            overview, overview_s = await timed(api, "/overview")
            assert overview_s < FAST_S
            assert overview.json()["backend_status"]["reachable"] is False
        finally:
            proxy.restore()
        back = await until_status(api, "ok", RETRY_S + READ_TIMEOUT_S + 2)
        assert back["backend"]["reachable"] is True


async def test_reads_left_waiting_on_a_stalled_backend_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read that never answers is left to finish on its own, not cancelled; while the backend
    is unreachable a trial read starts at most every RETRY_S (the others are refused at once),
    and never more than MAX_PENDING wait at once."""
    release = asyncio.Event()
    started: list[str] = []

    async def read() -> list[int]:
        started.append("read")
        await release.wait()
        raise ConnectionError("reset")

    monkeypatch.setattr(_watch, "READ_TIMEOUT_S", 0.05)
    scheduler = Scheduler()
    scheduler.every("flush", "1h", noop)
    watch = _watch.BackendWatch(scheduler)
    with pytest.raises(_watch.BackendUnreachableError, match=r"no answer within 0\.05s"):
        await watch.read("q", read)
    for _ in range(5):  # within RETRY_S of the failure: refused at once, no new read
        with pytest.raises(_watch.BackendUnreachableError):
            await asyncio.wait_for(watch.read("q", read), 0.01)
    assert (watch.reachable, len(started)) == (False, 1)
    monkeypatch.setattr(_watch, "RETRY_S", 0)  # now every call may try
    for _ in range(2 * _watch.MAX_PENDING):
        with pytest.raises(_watch.BackendUnreachableError):
            await watch.read("q", read)
    assert len(started) == _watch.MAX_PENDING
    release.set()
    await asyncio.sleep(0.01)  # they all end (with the error), and are forgotten
    assert watch.status()["error"] == "ConnectionError: reset"
    with pytest.raises(ConnectionError):
        await watch.read("q", read)  # a trial again: it fails with the backend's error
    assert len(started) == _watch.MAX_PENDING + 1

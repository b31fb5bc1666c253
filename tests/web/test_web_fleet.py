"""The admin API's view of the fleet: instances and their liveness, runs in progress
anywhere, fleet-wide pause with its audit trail, abort of a run on another instance, trigger
with data. Two instances on one memory store, on virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest

from brokersched import JobContext, Scheduler
from brokersched.abc import Instance, Lease, RunInProgress, Slot
from brokersched.backends.memory import MemoryBackend, MemoryStore
from brokersched.testing import TestClock
from brokersched.web import create_app

START = "2026-03-02T12:00:00+00:00"
TOKEN = "t0ken-t0ken-t0ken-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Fleet = tuple[TestClock, Scheduler[MemoryBackend], Scheduler[MemoryBackend], list[Any]]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    clock, store = TestClock(START), MemoryStore()
    seen: list[Any] = []
    started = asyncio.Event()

    async def slow(ctx: JobContext) -> None:
        seen.append(ctx.data)
        started.set()
        try:
            await ctx.wait_aborted()  # cancelled here by the abort
        finally:
            seen.append(ctx.abort_reason)

    members = []
    for name in ("web-a", "web-b"):
        sched = Scheduler(MemoryBackend(store=store), clock=clock, jitter=0, instance_id=name)
        sched.every("tick", "1m", lambda ctx: seen.append("tick"), catch_up=0)
        sched.every("slow", "1h", slow, catch_up=0)
        members.append(sched)
    a, b = members
    async with a, b:
        yield clock, a, b, seen


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def test_the_api_shows_the_fleet_pauses_it_and_aborts_a_run_elsewhere(fleet: Fleet) -> None:
    clock, a, b, seen = fleet
    async with (
        client(create_app(a, token=TOKEN)) as api,
        client(create_app(b, token=TOKEN)) as on_b,
    ):
        # Trigger with data, on b; a's API sees the run in progress there.
        accepted = await on_b.post("/jobs/slow/trigger", headers=AUTH, json={"user": 7})
        assert accepted.status_code == 202
        await clock.advance("2s")  # b publishes its run
        assert seen == [{"user": 7}]
        running = (await api.get("/runs", params={"state": "running"})).json()["runs"]
        assert [(r["job"], r["instance_id"], r["liveness"]) for r in running] == [
            ("slow", "web-b", "alive")
        ]
        run_id = running[0]["run_id"]
        assert (await api.post(f"/runs/{run_id}/abort", headers=AUTH)).status_code == 202
        assert (await api.post("/runs/nope/abort", headers=AUTH)).status_code == 404
        await clock.advance("5s")  # b reads the controls at its next heartbeat
        assert seen[-1] == "aborted"
        record = (await on_b.get("/jobs/slow/history")).json()["records"][0]
        assert (record["outcome"], record["error"]) == ("interrupted", "aborted on request")

        # A pause through a's API stops the job on b too, and says who did it.
        paused = (await api.post("/jobs/tick/pause", headers=AUTH)).json()
        assert paused["scope"] == "the fleet"
        before = seen.count("tick")
        await clock.advance("3m")
        assert seen.count("tick") == before
        assert (await on_b.get("/jobs/tick")).json()["state"] == "paused"
        await on_b.post("/jobs/tick/resume", headers=AUTH)
        audit = (await api.get("/jobs/tick/audit")).json()
        assert [c["action"] for c in audit["control"]["changes"]] == ["resume", "pause"]
        await clock.advance("1m")
        assert seen.count("tick") == before + 1

        # Disabled: no manual run either.
        await api.post("/jobs/slow/disable", headers=AUTH)
        await clock.advance("5s")  # b's next heartbeat
        refused = await on_b.post("/jobs/slow/trigger", headers=AUTH)
        assert refused.status_code == 409 and "disabled" in refused.json()["error"]
        assert (await on_b.get("/jobs/slow")).json()["state"] == "disabled"
        bad = await api.post("/jobs/tick/trigger", headers=AUTH, content=b"{nope")
        assert bad.status_code == 400 and "must be JSON" in bad.json()["error"]
        assert (await api.get("/runs", params={"state": "done"})).status_code == 400


async def test_the_instances_and_a_dead_ones_held_lease(fleet: Fleet) -> None:
    clock, a, _, _ = fleet
    lease = await a.backend.acquire(
        Slot("slow", clock.now_ms()),
        policy=a.get("slow").settings.policy,
        instance_id="web-c",
        run_id="r9",
        reason="schedule",
        timeout=5.0,
    )
    assert isinstance(lease, Lease)
    ghost = Instance(
        "web-c",
        "host-c",
        99,
        "0.1",
        clock.now(),
        clock.now(),
        timedelta(seconds=5),
        (RunInProgress("slow", "r9", lease.slot_ms, clock.now(), "schedule", leased=True),),
    )
    await a.backend.publish_instance(ghost)  # then kill -9: it never beats again
    async with client(create_app(a)) as api:
        await clock.advance("16s")
        listed = (await api.get("/instances")).json()["instances"]
        assert [(i["id"], i["liveness"], i["here"]) for i in listed] == [
            ("web-a", "alive", True),
            ("web-b", "alive", False),
            ("web-c", "dead", False),
        ]
        assert listed[2]["running"][0]["held"] is True
        overview = (await api.get("/overview")).json()["fleet"]
        assert [i["id"] for i in overview["instances"]] == ["web-a", "web-b", "web-c"]
        assert [(r["run_id"], r["liveness"]) for r in overview["runs"]] == [("r9", "dead")]


async def test_a_dead_ones_run_is_no_longer_in_progress_once_taken_over(fleet: Fleet) -> None:
    """The dead instance's record keeps listing its run for 10 minutes; once another instance
    took the slot over and recorded the run ``interrupted``, no view shows it in progress."""
    clock, a, _, _ = fleet
    lease = await a.backend.acquire(
        Slot("slow", clock.now_ms()),
        policy=a.get("slow").settings.policy,
        instance_id="web-c",
        run_id="r9",
        reason="schedule",
        timeout=5.0,
    )
    assert isinstance(lease, Lease)
    ghost = Instance(
        "web-c", "host-c", 99, "0.1", clock.now(), clock.now(), timedelta(seconds=5),
        (RunInProgress("slow", "r9", lease.slot_ms, clock.now(), "schedule", leased=True),),
    )  # fmt: skip
    await a.backend.publish_instance(ghost)  # then kill -9: it never beats again
    async with client(create_app(a)) as api:
        await clock.advance("1m")  # its lease expired; a sweep took the slot over
        records = (await api.get("/jobs/slow/history")).json()["records"]
        assert [(r["run_id"], r["outcome"]) for r in records if r["run_id"] == "r9"] == [
            ("r9", "interrupted")
        ]
        listed = (await api.get("/instances")).json()["instances"]
        assert [(i["id"], i["liveness"], i["running"]) for i in listed][2] == ("web-c", "dead", [])
        running = (await api.get("/runs", params={"state": "running"})).json()["runs"]
        assert "r9" not in [r["run_id"] for r in running]
        overview = (await api.get("/overview")).json()["fleet"]
        assert "r9" not in [r["run_id"] for r in overview["runs"]]
    assert "r9" not in [run.run_id for _, run in await a.runs_in_progress()]

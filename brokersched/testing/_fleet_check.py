"""The conformance suite's check of a backend's fleet records (``Backend.fleet``): each
instance's presence as it last published it, every change of a job's control kept under
concurrent writers (its note, a pause's end, a skip's slots), and another namespace isolated."""

from __future__ import annotations

import asyncio
import secrets
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from .._clock import SystemClock
from ..abc import Backend, ControlChange, Instance, JobControl, RunInProgress, Slot

__all__ = ["SLOT", "Factory", "FleetRecordsCheck"]

#: ``await fleet(**options)``: another instance's backend, started, in the test's namespace.
Factory = Callable[..., Awaitable[Any]]
SLOT = 1_700_000_000_000  # 2023-11-14T22:13:20Z: in the past, as a claimed slot is


class FleetRecordsCheck:
    """Mixed into a backend's conformance suite, which gives ``make_backend`` and ``fleet``."""

    @abstractmethod
    def make_backend(self, namespace: str, **options: Any) -> Backend:
        """A new, unstarted backend on the shared server state of ``namespace``."""

    @pytest.mark.asyncio
    async def test_fleet_records_presence_and_control(self, fleet: Factory) -> None:
        """Presence as published (the latest record of each instance), every control change
        of concurrent writers kept, a stale compare-and-set refused, and another namespace
        isolated."""
        a, b = await fleet(), await fleet()
        if not a.fleet:
            pytest.skip(f"{a.name} keeps no fleet records")
        now = datetime.now(UTC)
        run = RunInProgress("j", "r1", SLOT, now, "retry", attempt=2, leased=True)
        mine = Instance("i-a", "host", 1, "v", now, now, timedelta(seconds=5), (run,))
        await a.publish_instance(mine)
        await b.publish_instance(replace(mine, id="i-b", running=()))
        later = replace(mine, last_seen=now + timedelta(seconds=5), running=())
        await a.publish_instance(later)
        seen = {instance.id: instance for instance in await b.instances()}
        assert seen == {"i-a": later, "i-b": replace(mine, id="i-b", running=())}
        actors = [f"actor-{n}" for n in range(6)]
        changes = [
            ControlChange("job.x", "pause" if n % 2 else "resume", actor, now)
            for n, actor in enumerate(actors)
        ]
        await asyncio.gather(
            *(backend.change_control(c) for backend, c in zip([a, b] * 3, changes, strict=True))
        )
        control = (await a.controls())["job.x"]
        assert sorted(c.actor for c in control.changes) == actors
        assert control.paused == (control.changes[-1].action == "pause")
        note = ("päused for the 06:00 window: ticket OPS-1 " * 12)[:500]  # long, not ASCII
        pause = ControlChange(
            "job.y", "pause", "ops", now, note=note, until=now + timedelta(hours=2)
        )
        skip = ControlChange("job.y", "skip", "ops", now, count=2, through_ms=SLOT + 120_000)
        await b.change_control(pause, skip)
        assert (await a.controls())["job.y"] == JobControl("job.y").apply(pause).apply(skip)
        other = self.make_backend("o" + secrets.token_hex(5))
        await other.start(SystemClock())
        try:
            assert await other.instances() == [] and await other.controls() == {}
        finally:
            await other.stop()

    @pytest.mark.asyncio
    async def test_fleet_records_of_each_kind_apart(self, fleet: Factory) -> None:
        """Each kind of record apart from the others: a missed-slot report and a stored
        schedule beside the controls."""
        a, b = await fleet(), await fleet()
        if not a.fleet:
            pytest.skip(f"{a.name} keeps no fleet records")
        now = datetime.now(UTC)
        await a.change_control(ControlChange("job.z", "pause", "ops", now))
        assert await a.report_missed(Slot("job.z", SLOT), instance_id="i-a")
        assert not await b.report_missed(Slot("job.z", SLOT), instance_id="i-b")
        assert await b.swap_fleet_record("schedule", "tenant-1", None, '{"v":1}')
        assert not await a.swap_fleet_record("schedule", "tenant-1", None, '{"v":2}')
        assert list(await b.controls()) == ["job.z"]
        assert await a.fleet_records("schedule") == {"tenant-1": '{"v":1}'}
        assert await a.fleet_records("schedule-log") == {}

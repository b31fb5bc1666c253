"""Schedules as data in the fleet simulator (``brokersched.testing.simulate``), drawn from an
RNG of their own (so that the draws a seed made before them stay as they were):

* most instances have the task (``@scheduler.task``), some do not (a deploy adding it);
* schedules of two tenants written, changed (trigger, time zone, jitter, max_late, data) and
  deleted at run time through a live instance whose clock keeps within the documented bound
  (a second), while the fleet claims their slots and the store's faults go on;
* their runs go to the ledger under the schedule's id, so that its invariants hold for them
  (a slot runs once; on a lease backend again only after a run cut short);
* at the end, every run of a stored schedule's slot is a slot of the version in force at its
  instant (the records' timelines as the store keeps them): no instance decided a slot from a
  version it should not have.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from .._options import parse_job_options
from .._registry import TriggerMaker
from .._stored import Record, VersionedTrigger
from ..triggers.base import Trigger
from ._sim_coverage import EFFECT_MS

if TYPE_CHECKING:
    from .simulate import Instance, Simulation

__all__ = ["StoredOps"]

TASK = "stored.tick"
IDS = ("tenant-a", "tenant-b")
_TRIGGERS: tuple[dict[str, Any], ...] = (
    {"every": "1s"},
    {"every": "2s"},
    {"every": "3s"},
    {"every": "5s"},
    {"cron": "*/2 * * * * *"},
    {"cron": "*/5 * * * * *", "timezone": "Europe/Paris"},
)
#: The writer's clock within this of the fleet's (README: a second between any two clocks).
_WRITER_SKEW_MS = 500


class StoredOps:
    """The stored schedules of ``sim``, from ``rng``."""

    def __init__(self, sim: Simulation, rng: random.Random) -> None:
        self.sim = sim
        self.rng = rng
        self.options: dict[str, Any] = {}
        if sim.lease:  # one overlap and max_attempts for every version: the ledger's rules
            self.options = {
                "overlap": rng.choice(("skip", "allow")),
                "max_attempts": rng.choice((1, 2, 3)),
            }
        self.records: dict[str, Record] = {}  # read at the end

    def register(self, instance: Instance) -> None:
        """The task on ``instance`` (most instances have it)."""
        if self.rng.random() >= 0.85:
            return
        sim, options = self.sim, self.options

        async def task(ctx: Any) -> None:
            await sim.stand_in(instance, ctx.job, options)(ctx)

        instance.scheduler.task(TASK)(task)

    def step(self, live: list[Instance]) -> None:
        rng = self.rng
        if rng.random() >= 0.05:
            return
        writers = [i for i in live if abs(i.clock.ahead_ms) <= _WRITER_SKEW_MS]
        writers = [i for i in writers if i.scheduler.running]
        if writers:
            self.write(rng.choice(writers), rng.choice(IDS))

    def write(self, instance: Instance, schedule_id: str) -> None:
        """A put (a new trigger, jitter, max_late, data) or, three times in ten, a delete."""
        sim, rng = self.sim, self.rng
        now = sim.fleet.now_ms()
        schedules = instance.scheduler.schedules
        if rng.random() < 0.3:
            kind = "schedule-delete"
            call: Any = schedules.delete(schedule_id, by=instance.name)
            what = f"delete {schedule_id}"
        else:
            kind = "schedule-put"
            given = {
                **rng.choice(_TRIGGERS),
                "jitter": f"{rng.choice((0, 0, 300, 1500))}ms",
                "max_late": f"{rng.choice((1000, 2000, 2000, 10_000))}ms",
                "data": {"n": rng.randrange(1000)},
                **self.options,
            }
            call = schedules.put(schedule_id, task=TASK, by=instance.name, **given)
            what = f"put {schedule_id} {given}"
        op = sim.coverage.op(kind, now, instance=instance.name, key=schedule_id)

        async def written() -> None:
            try:
                await call
            except Exception as exc:  # refused (options), or the store failed: nothing changed
                sim.log.append(f"{what} through {instance.name}: {exc!r}")
            finally:
                op.end = max(sim.fleet.now_ms(), now + EFFECT_MS)

        instance.drive(written(), kind)
        sim.log.append(f"{what} through {instance.name}")

    async def read(self, live: list[Instance]) -> None:
        """The records as the store keeps them, through any instance that can read them."""
        for instance in live:
            try:
                self.records = await instance.scheduler.schedules.read_all()
                return
            except Exception:
                continue

    def violations(self) -> list[str]:
        """Every run of a stored schedule's scheduled slot is a slot of the version in force
        at its instant (by the records read at the end)."""
        found = []
        for run in self.sim.ledger.runs:
            record = self.records.get(run.key)
            if record is None or run.reason not in ("schedule", "catch-up"):
                continue
            if not self._in_force(record, run.slot_ms):
                found.append(
                    f"{run.instance} ran {run.key}:{run.slot_ms}, no slot of the version in "
                    f"force then ({record.in_force(run.slot_ms)})"
                )
        return found

    @staticmethod
    def _in_force(record: Record, slot_ms: int) -> bool:
        parts: list[tuple[int, Trigger | None]] = []
        for effective_ms, spec in record.timeline:
            trigger = None
            if spec is not None:
                options = parse_job_options(record.id, spec.job_options())
                trigger = TriggerMaker(spec.kind, spec.schedule, lambda: "UTC")(options)
            parts.append((effective_ms, trigger))
        return VersionedTrigger(parts).next_ms(slot_ms - 1) == slot_ms

"""An export that sometimes takes longer than the time between two of its slots: two instances
in one process on the embedded backend (no server). Run it with
``python examples/nightly_export.py --seconds 7``.

In production this is a nightly job (``"0 2 * * *"``) that some nights runs past the next one;
here the schedule is every 2 s and the first export takes 3 s. With ``overlap="skip"`` the slot
that comes while an export still runs is skipped on every instance: two exports never write the
same files at once. See "Job options" in README.md.
"""

from __future__ import annotations

import argparse
import asyncio

from brokersched import JobContext, MemoryBackend, RunEvent, Scheduler, SkipEvent
from brokersched.backends.memory import MemoryStore

SCHEDULE = "*/2 * * * * *"  # six fields, seconds first; production: "0 2 * * *"
running: set[str] = set()  # exports going on now, fleet-wide
events: list[str] = []


async def export(ctx: JobContext) -> None:
    running.add(ctx.run_id)
    overlapping = len(running) > 1
    try:
        first = not any(e.startswith("completed") for e in events)
        # a big backlog the first time: longer than the 2 s between slots
        await asyncio.sleep(3.0 if first else 0.5)
    finally:
        running.discard(ctx.run_id)
    if overlapping:
        events.append("overlapping")


def build_instance(name: str, store: MemoryStore) -> Scheduler[MemoryBackend]:
    scheduler = Scheduler(MemoryBackend(store=store), instance_id=name)
    scheduler.cron(
        "export.nightly",
        SCHEDULE,
        export,
        overlap="skip",  # the default, said out loud: never two exports at once, fleet-wide
        timeout="5s",  # a hard cap (production: "2h"): a stuck export ends, the next can run
        max_attempts=2,  # an instance that dies mid-export: restarted once elsewhere, no more
        catch_up="2s",  # up to the interval: after an outage, the export missed meanwhile runs
    )

    def ran(event: RunEvent) -> None:
        events.append(f"{event.outcome} {event.scheduled_at:%H:%M:%S}")
        print(f"  {name}: export {event.scheduled_at:%H:%M:%S} {event.outcome}")

    def skipped(event: SkipEvent) -> None:
        if event.reason == "overlap":  # the export of an earlier slot is still running
            events.append(f"skipped {event.scheduled_at:%H:%M:%S}")
            print(f"  {name}: slot {event.scheduled_at:%H:%M:%S} skipped: export still running")

    scheduler.on("complete", ran)
    scheduler.on("fail", ran)
    scheduler.on("skip", skipped)
    return scheduler


async def main(seconds: float) -> int:
    store = MemoryStore()  # what a shared database would be to two processes
    fleet = [build_instance(f"instance-{n}", store) for n in (1, 2)]
    print(f"two instances, an export every 2 s that first takes 3 s, for {seconds:g} s:")
    for scheduler in fleet:
        await scheduler.start()
    await asyncio.sleep(seconds)
    for scheduler in fleet:
        await scheduler.stop()

    done = sum(1 for e in events if e.startswith("completed"))
    skipped = {e for e in events if e.startswith("skipped")}  # both instances skip a slot
    print(f"\nexports completed: {done}; slots skipped while one ran: {len(skipped)}")
    print(f"exports running at the same time: {events.count('overlapping')}")
    return 1 if "overlapping" in events or not done else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=7.0, help="how long to run")
    raise SystemExit(asyncio.run(main(parser.parse_args().seconds)))

"""A cache refresh every few seconds, shared by a fleet: two instances in one process on the
embedded backend (no server). Run it with ``python examples/cache_refresh.py --seconds 7``.

A missed refresh does not matter (the next one comes a moment later), so the options keep each
run short and never catch up; see "Job options" in README.md.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

from brokersched import JobContext, MemoryBackend, Scheduler, SkipEvent
from brokersched.backends.memory import MemoryStore

INTERVAL = "2s"
cache: dict[str, str] = {}  # what a shared cache (Redis, memcached) would be to the fleet
refreshes: list[tuple[str, str, str]] = []  # (slot, instance, reason)


async def refresh(ctx: JobContext) -> None:
    await asyncio.sleep(0.1)  # pretend to read the rates from upstream
    cache["rates"] = f"rates as of {ctx.scheduled_at:%H:%M:%S}"
    refreshes.append((f"{ctx.scheduled_at:%H:%M:%S}", ctx.instance_id, ctx.reason))
    print(f"  {ctx.instance_id}: refreshed slot {ctx.scheduled_at:%H:%M:%S} ({ctx.reason})")


def build_instance(name: str, store: MemoryStore) -> Scheduler[MemoryBackend]:
    scheduler = Scheduler(MemoryBackend(store=store), instance_id=name)
    scheduler.every(
        "cache.refresh",
        INTERVAL,
        refresh,
        jitter="600ms",  # about a third of the interval: the instances' claims spread out
        max_late="1s",  # a refresh that could not start within 1 s is skipped: the next comes
        timeout="1500ms",  # a refresh stuck on a slow upstream ends before the next slot
        catch_up=0,  # after a deploy, no refresh for the slot missed meanwhile (default 5m)
        history_size=50,  # frequent runs: keep a short history
    )

    def skipped(event: SkipEvent) -> None:
        if event.reason != "not-acquired":  # the other instance refreshed it: nothing to say
            print(f"  {name}: skipped slot {event.scheduled_at:%H:%M:%S} ({event.reason})")

    scheduler.on("skip", skipped)
    return scheduler


async def run_fleet(store: MemoryStore, seconds: float) -> None:
    fleet = [build_instance(f"instance-{n}", store) for n in (1, 2)]
    for scheduler in fleet:
        await scheduler.start()
    await asyncio.sleep(seconds)
    for scheduler in fleet:
        await scheduler.stop()


async def main(seconds: float) -> int:
    store = MemoryStore()  # what a shared database would be to two processes
    print(f"two instances refresh the cache every {INTERVAL}, for {seconds:g} s:")
    await run_fleet(store, seconds / 2)
    print("  -- a deploy: every instance is down for 2.5 s, a slot passes --")
    await asyncio.sleep(2.5)
    await run_fleet(store, seconds / 2)

    twice = [slot for slot, n in Counter(slot for slot, _, _ in refreshes).items() if n > 1]
    catch_ups = sum(1 for _, _, reason in refreshes if reason == "catch-up")
    print(f"\n{len(refreshes)} refreshes, slots refreshed twice: {len(twice)}")
    print(f"catch-up runs after the deploy: {catch_ups}; cache: {cache.get('rates', 'empty')}")
    return 1 if twice or catch_ups or not refreshes else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=7.0, help="how long to run")
    raise SystemExit(asyncio.run(main(parser.parse_args().seconds)))

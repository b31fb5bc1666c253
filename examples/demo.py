"""A fleet of three instances in one process, on the embedded backend: no server needed.

Each instance registers the same jobs; every slot runs on exactly one of them. Run it with
``make demo`` (or ``python examples/demo.py --seconds 6``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections import Counter, defaultdict

from brokersched import JobContext, MemoryBackend, RunEvent, Scheduler
from brokersched.backends.memory import MemoryStore

runs: dict[str, list[str]] = defaultdict(list)  # slot key -> instances that ran it


async def flush_outbox(ctx: JobContext) -> None:
    runs[f"{ctx.job}@{ctx.scheduled_at:%H:%M:%S}"].append(ctx.instance_id)
    await asyncio.sleep(0.05)  # pretend to publish a batch


def refresh_cache(ctx: JobContext) -> None:  # sync handlers run in a worker thread
    runs[f"{ctx.job}@{ctx.scheduled_at:%H:%M:%S}@{ctx.instance_id}"].append(ctx.instance_id)


def build_instance(name: str, store: MemoryStore) -> Scheduler[MemoryBackend]:
    scheduler = Scheduler(MemoryBackend(store=store), instance_id=name, jitter="300ms")
    scheduler.every("outbox.flush", "1s", flush_outbox, timeout="900ms")
    scheduler.cron("report.every-2s", "*/2 * * * * *", flush_outbox)  # 6 fields: seconds first
    scheduler.every("cache.refresh", "2s", refresh_cache, claim=False)  # per-instance work

    def show(event: RunEvent) -> None:
        print(f"  {name}: {event.job} {event.scheduled_at:%H:%M:%S} {event.outcome}")

    scheduler.on("complete", show)
    scheduler.on("fail", show)
    return scheduler


async def main(seconds: float) -> int:
    store = MemoryStore()  # what a shared database would be to three processes
    fleet = [build_instance(f"instance-{n}", store) for n in (1, 2, 3)]
    print(f"three instances, same jobs, {seconds:g} s of real time (Ctrl-C stops it early):")
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ctrl-C ends the wait, then the fleet stops as at the end (runs finish, nothing is left
    # running); a second Ctrl-C during the stop interrupts for good.
    with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows' loop
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
    async with contextlib.AsyncExitStack() as fleet_running:
        for scheduler in fleet:
            await fleet_running.enter_async_context(scheduler)  # stopped in reverse at the end
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(interrupted.wait(), seconds)
        if interrupted.is_set():
            print("\ninterrupted: stopping the fleet")
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGINT)

    claimed = {key: who for key, who in runs.items() if not key.startswith("cache.refresh")}
    twice = {key: who for key, who in claimed.items() if len(who) > 1}
    spread = Counter(who[0] for who in claimed.values())
    local = sum(1 for key in runs if key.startswith("cache.refresh"))
    print(f"\n{len(claimed)} claimed slots ran; run twice: {len(twice)}")
    print("spread over instances:", dict(sorted(spread.items())))
    print(f"per-instance cache refreshes (claim=False): {local}")
    return 1 if twice or not claimed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=6.0)
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(asyncio.run(main(parser.parse_args().seconds)))

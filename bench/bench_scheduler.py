"""Memory and CPU of a scheduler with 10,000 registered ``every("1m")`` jobs on MemoryBackend.

Targets: under 50 MB above the interpreter's baseline, under 2% of a core while idle.
Prints: baseline RSS, RSS with the jobs armed, idle CPU between two minute boundaries, and how
long one minute boundary (10,000 claims and runs) takes. Run: ``.venv/bin/python
bench/bench_scheduler.py [--jobs 10000] [--idle 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import time

import brokersched  # noqa: F401 - counted in the baseline
from brokersched import JobContext, MemoryBackend, RunEvent, Scheduler


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 1e6


async def noop(ctx: JobContext) -> None:
    pass


async def until_next_second(second: int) -> None:
    """Sleep until the wall clock's seconds read ``second``."""
    now = time.time()
    await asyncio.sleep((second - now % 60) % 60 or 60)


async def main(jobs: int, idle_s: float) -> None:
    gc.collect()
    baseline = rss_mb()
    scheduler = Scheduler(MemoryBackend())
    for n in range(jobs):
        scheduler.every(f"job.{n}", "1m", noop)
    finished = 0

    def count(event: RunEvent) -> None:
        nonlocal finished
        finished += 1

    scheduler.on("complete", count)
    await scheduler.start()
    gc.collect()
    armed = rss_mb()
    print(f"jobs: {jobs}")
    print(f"RSS baseline (interpreter + brokersched): {baseline:.1f} MB")
    print(f"RSS with jobs armed: {armed:.1f} MB (+{armed - baseline:.1f} MB; target < 50 MB)")

    # Idle: a window between two minute boundaries (jitter is at most 2 s after :00), after the
    # start's own work (a catch-up check and a take-over sweep per job) has settled.
    await asyncio.sleep(3)
    if time.time() % 60 > 60 - idle_s - 5:
        await until_next_second(5)
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.sleep(min(idle_s, 60 - time.time() % 60 - 1))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    print(f"idle CPU: {100 * cpu / wall:.2f}% of a core over {wall:.1f} s (target < 2%)")

    # One boundary: every job claims and runs once.
    await until_next_second(59)
    cpu0, wall0 = time.process_time(), time.monotonic()
    before = finished
    while finished - before < jobs and time.monotonic() - wall0 < 30:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    print(
        f"minute boundary: {finished - before} runs; {time.process_time() - cpu0:.2f} s CPU, "
        f"{time.monotonic() - wall0:.1f} s wall (includes up to 2 s of jitter)"
    )
    gc.collect()
    print(f"RSS after one boundary: {rss_mb():.1f} MB (+{rss_mb() - baseline:.1f} MB)")
    await scheduler.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--idle", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(main(args.jobs, args.idle))

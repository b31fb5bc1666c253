"""What ``ctx.previous`` costs a run, by backend: a run whose handler never asks, beside one whose
handler reads it (``await ctx.previous``), both returning a small result that is recorded.

    .venv/bin/python bench/bench_previous.py [--runs 30] [--backends rabbitmq,postgres,...]

Each case is ``--runs`` manual runs (``job.trigger()``: claim, handler, record queued) one after
the other on a fresh prefix or schema, after two warm-up runs, on the local servers
(``BROKERSCHED_*_URL`` or the defaults of ``tests/support/servers.py``). Prints the median and
the 90th percentile of a run's wall time for each case side by side; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from brokersched import JobContext, Scheduler  # noqa: E402
from brokersched.abc import Backend  # noqa: E402
from brokersched.backends.memory import MemoryBackend  # noqa: E402
from brokersched.backends.nats import NATSBackend  # noqa: E402
from brokersched.backends.postgres import PostgresBackend  # noqa: E402
from brokersched.backends.rabbitmq import RabbitMQBackend  # noqa: E402
from brokersched.backends.redis import RedisBackend  # noqa: E402
from brokersched.backends.sqlite import SQLiteBackend  # noqa: E402

RUN = f"prev{uuid.uuid4().hex[:6]}"
AMQP = os.environ.get("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222")
REDIS = os.environ.get("BROKERSCHED_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES = os.environ.get("BROKERSCHED_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def backends(folder: Path) -> dict[str, Callable[[], Backend]]:
    return {
        "memory": lambda: MemoryBackend(),
        "sqlite": lambda: SQLiteBackend(folder / f"{RUN}.db"),
        "postgres": lambda: PostgresBackend(POSTGRES, schema=RUN),
        "redis": lambda: RedisBackend(REDIS, prefix=RUN),
        "nats": lambda: NATSBackend(NATS, prefix=RUN),
        "rabbitmq": lambda: RabbitMQBackend(AMQP, prefix=RUN),
    }


async def quiet(ctx: JobContext) -> dict[str, Any]:
    return {"exported": 100}


async def asks(ctx: JobContext) -> dict[str, Any]:
    previous = await ctx.previous
    since = previous.result["until"] if previous and previous.result else 0
    return {"until": since + 100}


async def timed_runs(backend: Backend, runs: int) -> dict[str, list[float]]:
    scheduler = Scheduler(backend, enabled=False, jitter=0)
    jobs = {"never asks": scheduler.every("quiet", "1h", quiet)}
    jobs["reads ctx.previous"] = scheduler.every("asks", "1h", asks)
    times: dict[str, list[float]] = {case: [] for case in jobs}
    async with scheduler:
        for case, job in jobs.items():
            for n in range(runs + 2):
                await asyncio.sleep(0.005)  # a manual run claims its instant: one per instant
                began = time.perf_counter()
                record = await job.trigger()
                took = time.perf_counter() - began
                assert record is not None and record.outcome == "completed", record
                if n >= 2:  # the first runs make the backend's objects
                    times[case].append(took * 1000)
        (last,) = await jobs["reads ctx.previous"].history(1)
        assert last.result == {"until": 100 * (runs + 2)}, last  # each run saw the one before
    return times


async def cleanup(backend: Backend) -> None:
    """Remove what the prefix made (claim queues the inventory cannot name expire by
    themselves after slot_ttl)."""
    if isinstance(backend, MemoryBackend | SQLiteBackend):
        return  # gone with the process, and with the temporary folder
    await backend.purge(await backend.inventory(jobs=["quiet", "asks"]))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backends", default="memory,sqlite,postgres,redis,nats,rabbitmq")
    args = parser.parse_args()
    print(f"{'backend':<10} {'never asks (ms)':>22} {'reads ctx.previous (ms)':>26}")
    print(f"{'':<10} {'median':>10} {'p90':>10}  {'median':>12} {'p90':>12}")
    with TemporaryDirectory() as folder:
        made = backends(Path(folder))
        for name in args.backends.split(","):
            backend = made[name]()
            try:
                times = await timed_runs(backend, args.runs)
            finally:
                await cleanup(backend)
            cells = []
            for case in ("never asks", "reads ctx.previous"):
                ordered = sorted(times[case])
                p90 = ordered[int(len(ordered) * 0.9) - 1]
                cells.append((statistics.median(ordered), p90))
            (a_med, a_p90), (b_med, b_p90) = cells
            print(f"{name:<10} {a_med:>10.2f} {a_p90:>10.2f}  {b_med:>12.2f} {b_p90:>12.2f}")


if __name__ == "__main__":
    asyncio.run(main())

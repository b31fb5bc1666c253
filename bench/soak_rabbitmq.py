"""Soak: fleets on a RabbitMQ node with Debian's soft open-files limit of 1024.

A private node of its own (the Debian package, as the tests start it: management plugin,
``ulimit -n 1024``), then for each of ``--prefixes`` successive prefixes: ``--instances``
schedulers of ``--jobs`` jobs each (``every(--every)``, ``jitter=--jitter``,
``slot_ttl=--slot-ttl``) run for
``--seconds``, while a probe opens an AMQP connection every second (as any other client of
the broker would); then the fleet stops and ``purge`` removes what the prefix made. Prints,
per prefix: the slots run (and run twice), the probe's slowest connect and its failures, the
node's peak file descriptors, queues and memory, and what was left after the purge.

    .venv/bin/python bench/soak_rabbitmq.py            # 5 prefixes x 3 x 300 jobs, 60 s each
    .venv/bin/python bench/soak_rabbitmq.py --prefixes 1 --seconds 20

Needs the rabbitmq-server package (the node runs as this user, on free ports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aio_pika

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, from a checkout

from brokersched import JobContext, RabbitMQBackend, Scheduler
from brokersched.backends.rabbitmq._ops import Management
from tests.support.private_rabbitmq import PrivateRabbitMQ
from tests.support.wait import free_port


async def probe(url: str, until: float, seen: list[float], failed: list[str]) -> None:
    """An AMQP connect a second, as another client of the broker: its time, or its failure."""
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            async with asyncio.timeout(1):
                connection = await aio_pika.connect(url)
            seen.append(time.monotonic() - began)
            await connection.close()
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(max(0.0, 1 - (time.monotonic() - began)))


async def sample(management: Management, until: float, peaks: Counter[str]) -> None:
    """The node's file descriptors, queues and memory every 2 s: the peaks."""
    while time.monotonic() < until:
        with contextlib.suppress(Exception):
            [node] = await management.get("nodes")
            overview = await management.get("overview")
            peaks["fd_used"] = max(peaks["fd_used"], node.get("fd_used") or 0)
            peaks["fd_total"] = node.get("fd_total") or 0
            peaks["mem_mb"] = max(peaks["mem_mb"], (node.get("mem_used") or 0) // 2**20)
            queues = (overview.get("object_totals") or {}).get("queues") or 0
            peaks["queues"] = max(peaks["queues"], queues)
        await asyncio.sleep(2)


async def one_prefix(node: PrivateRabbitMQ, args: argparse.Namespace, n: int) -> dict[str, Any]:
    prefix = f"soak{n}{uuid.uuid4().hex[:4]}"
    runs: Counter[str] = Counter()

    async def tick(ctx: JobContext) -> None:
        runs[f"{ctx.job}@{ctx.slot_ms}"] += 1

    fleet = []
    for k in range(args.instances):
        backend = RabbitMQBackend(
            node.amqp_url,
            prefix=prefix,
            slot_ttl=args.slot_ttl,
            management_url=node.management_url,
        )
        scheduler = Scheduler(backend, instance_id=f"i{k}", jitter=args.jitter)
        for j in range(args.jobs):
            scheduler.every(f"job{j:03d}", args.every, tick)
        fleet.append(scheduler)
    management = Management(node.management_url, "/")
    connects: list[float] = []
    failed: list[str] = []
    peaks: Counter[str] = Counter()
    skips: Counter[str] = Counter()

    def count_skip(event: Any) -> None:
        detail = event.detail or ""
        kind = next((k for k in ("shedding", "overloaded") if k in detail), event.reason)
        skips[kind] += 1

    async with contextlib.AsyncExitStack() as running:
        for scheduler in fleet:
            scheduler.on("skip", count_skip)
            await running.enter_async_context(scheduler)
        until = time.monotonic() + args.seconds
        await asyncio.gather(
            probe(node.amqp_url, until, connects, failed), sample(management, until, peaks)
        )
    backend = fleet[0].backend
    found = await backend.inventory(jobs=[job.key for job in fleet[0].jobs()])
    left = await backend.purge(found)
    return {
        "prefix": prefix,
        "slots": len(runs),
        "twice": sum(count > 1 for count in runs.values()),
        "skips": dict(skips) or 0,
        "connect_max_ms": round(max(connects, default=0) * 1000),
        "probe_failures": len(failed),
        "first_failure": failed[0] if failed else "",
        **peaks,
        "objects": len(found.objects),
        "left": len(left.objects),
    }


async def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.ERROR)  # skips are counted, not logged one by one
    base = Path(tempfile.mkdtemp(prefix="brokersched-soak-"))
    node = PrivateRabbitMQ(base, f"soak{uuid.uuid4().hex[:6]}@localhost", free_port(), free_port())
    try:
        await asyncio.to_thread(node.start)
        print(
            f"private node {node.nodename}, soft open-files limit 1024; {args.prefixes} prefixes"
            f" x {args.instances} instances x {args.jobs} jobs every {args.every},"
            f" slot_ttl {args.slot_ttl}, {args.seconds:g} s each"
        )
        worst = 0
        for n in range(args.prefixes):
            row = await one_prefix(node, args, n)
            print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
            bad = row["twice"] or row["probe_failures"] or row["left"]
            worst = max(worst, 1 if bad or row["connect_max_ms"] >= 1000 else 0)
        return worst
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=5)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--every", default="10s")
    parser.add_argument("--slot-ttl", default="2m")
    parser.add_argument("--jitter", default="4s")
    parser.add_argument("--seconds", type=float, default=60)
    raise SystemExit(asyncio.run(main(parser.parse_args())))

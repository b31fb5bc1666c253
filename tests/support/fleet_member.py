"""A scheduler process of the three-process fleet tests (``tests/support/fleet.py``): one
Scheduler on a real server, a job per name every given interval; one JSON line per run
(``ran``), per skip (``skip``), when it is up (``ready``) and when it stopped (``stopped``);
SIGTERM stops it (a drain)::

    python -m tests.support.fleet_member '{"backend": "rabbitmq", "url": ..., "prefix": ...,
        "jobs": {"fleet.tick": "500ms"}, "options": {...}, "scheduler": {...}}'
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from typing import Any

from brokersched import (
    JobContext,
    NATSBackend,
    RabbitMQBackend,
    RedisBackend,
    RedisLeaseBackend,
    Scheduler,
    SkipEvent,
)

BACKENDS: dict[str, Any] = {
    "rabbitmq": RabbitMQBackend,
    "nats": NATSBackend,
    "redis-claim": RedisBackend,
    "redis-lease": RedisLeaseBackend,
}


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def serve(spec: dict[str, Any]) -> None:
    backend = BACKENDS[spec["backend"]](spec["url"], prefix=spec["prefix"], **spec["options"])
    scheduler = Scheduler(backend, **spec["scheduler"])

    async def run(ctx: JobContext) -> None:
        say(ran=[ctx.job, ctx.slot_ms], instance=ctx.instance_id)

    def skipped(event: SkipEvent) -> None:
        say(skip=[event.job, event.slot_ms, event.reason])

    for job, every in spec["jobs"].items():
        scheduler.every(job, every, run)
    scheduler.on("skip", skipped)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with scheduler:
        say(ready=now_ms())
        await stop.wait()
    say(stopped=now_ms())


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))

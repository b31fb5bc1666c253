"""The fleet member of tests/backends/sql/test_store_clock.py run under ``faketime`` (a process
whose clock is fast): the same job on the same SQLite file; it logs what it runs and skips::

    python -m tests.support.store_clock_worker '{"db": ..., "log": ...}'
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from brokersched import Scheduler, SQLiteBackend

TICK_MS = 500


async def worker(spec: dict[str, Any]) -> None:
    """The faked process: the same job on the same file; it logs what it runs and skips."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    log = Path(spec["log"])

    def write(line: str) -> None:
        with log.open("a") as file:
            file.write(line.replace("\n", " ") + "\n")

    scheduler = Scheduler(SQLiteBackend(spec["db"], lease_ttl="3s"), instance_id="fast", jitter=0)
    scheduler.every("tick", f"{TICK_MS}ms", lambda ctx: write(f"ran {ctx.slot_ms}"), catch_up=0)
    scheduler.on("skip", lambda event: write(f"skip {event.reason} {event.detail}"))
    async with scheduler:
        print("ready", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(worker(json.loads(sys.argv[1])))

"""A fleet member of the SQL backend tests in its own process: one Scheduler on the shared
database, appending a line per run it starts to a log file (one small O_APPEND write: lines of
several processes never mix)::

    python -m tests.support.sql_worker '{"kind": ..., "scenario": ..., ...}'
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from brokersched import (
    JobContext,
    Scheduler,
)
from brokersched.abc import LeaseBackend
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.sqlite import SQLiteBackend
from tests.support.leases import (
    TTL,
)


@dataclass
class Started:
    """A run as a handler saw it start."""

    instance: str
    job: str
    slot_ms: int
    reason: str
    attempt: int
    at_ms: int = 0

    @classmethod
    def parse(cls, line: str) -> Started:
        instance, job, slot, reason, attempt, at = line.split()
        return cls(instance, job, int(slot), reason, int(attempt), int(at))


def read_log(path: Path) -> list[Started]:
    text = path.read_text() if path.exists() else ""
    return [Started.parse(line) for line in text.splitlines() if line]


def log_start(path: Path, instance: str, ctx: JobContext) -> None:
    line = (
        f"{instance} {ctx.job} {ctx.slot_ms} {ctx.reason} {ctx.attempt} {time.time_ns() // 10**6}\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def worker_backend(spec: dict[str, Any]) -> LeaseBackend:
    if spec["kind"] == "sqlite":
        return SQLiteBackend(spec["target"], lease_ttl=TTL)
    return PostgresBackend(spec["target"], schema=spec["namespace"], lease_ttl=TTL, max_size=2)


async def worker(spec: dict[str, Any]) -> None:
    """A fleet member in its own process; SIGTERM stops it gracefully."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    instance, log = spec["instance"], Path(spec["log"])
    scheduler = Scheduler(worker_backend(spec), instance_id=instance)

    async def quick(ctx: JobContext) -> None:
        log_start(log, instance, ctx)

    async def hang(ctx: JobContext) -> None:
        log_start(log, instance, ctx)
        await asyncio.Event().wait()  # until the process is killed

    if spec["scenario"] == "every":
        scheduler.every("tick", spec["interval"], quick)
    else:  # "hang": two one-off jobs that never finish
        when = datetime.fromtimestamp(spec["when_ms"] / 1000, UTC)
        scheduler.at("retry", when, hang, max_attempts=3)
        scheduler.at("charge", when, hang, max_attempts=1)
    async with scheduler:
        print("ready", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(worker(json.loads(sys.argv[1])))

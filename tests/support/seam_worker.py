"""One fleet member of the real-server seam tests (``tests/cluster/test_seams_real.py``).

A scheduler, its backend and its jobs come from a JSON spec; every run's start and end, and
every skip, is appended as a JSON line to the spec's ``log`` file, which all the members of a
test share (one ``write`` per line on a file opened for appending: lines never interleave).

* ``python -m tests.support.seam_worker '<spec>'``: logs ``loaded``, waits until
  ``start_at_ms`` (the host's clock) if given, or with ``go`` until ``offset_ms`` after the
  instant read from standard input, starts, logs ``ready``, runs until SIGTERM.
* ``brokersched trigger tests.support.seam_worker:from_env JOB``: the CLI loads the same
  scheduler, the spec in ``BROKERSCHED_SEAM_SPEC``.

A handler sleeps ``hold[ctx.reason]`` seconds (``hold["*"]`` otherwise, default 0.1), so a test
can keep a run going (to kill its process, or to overlap it) without a signal of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from brokersched import JobContext, Scheduler
from brokersched.abc import Backend, JobPolicy, RunRecord, Slot

SPEC_ENV = "BROKERSCHED_SEAM_SPEC"

try:  # the host's kernel clock, which libfaketime does not move (not in older releases)
    from brokersched._clock import host_time_ms
except ImportError:  # pragma: no cover - an older tree, checked against its own fix

    def host_time_ms() -> int:
        return time.time_ns() // 1_000_000


class Log:
    """The shared JSON-lines file; each line names this instance."""

    def __init__(self, path: str, instance: str) -> None:
        self.path, self.instance = Path(path), instance

    def write(self, event: str, **fields: Any) -> None:
        line = {"event": event, "instance": self.instance, "host_ms": host_time_ms(), **fields}
        line["own_ms"] = time.time_ns() // 1_000_000  # this process's clock (faked or not)
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _rabbitmq(spec: dict[str, Any], options: dict[str, Any]) -> Backend:
    """A RabbitMQ backend that notes every queue it may have made, for the test to delete."""
    from brokersched import RabbitMQBackend
    from brokersched.backends.rabbitmq import (
        claim_queue_name,
        history_stream_name,
    )

    touched = Path(spec["queues"])

    def note(*names: str) -> None:
        with touched.open("a") as file:
            file.writelines(f"{name}\n" for name in names)

    class Tracked(RabbitMQBackend):
        @property
        def name(self) -> str:
            return "RabbitMQBackend"  # as messages name the real one

        async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
            note(claim_queue_name(self.prefix, slot))
            return await super().claim(
                slot, instance_id=instance_id, run_id=run_id, timeout=timeout
            )

        async def claim_boot(
            self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
        ) -> bool:
            note(claim_queue_name(self.prefix, slot))
            return await super().claim_boot(  # type: ignore[misc, unused-ignore]
                slot, instance_id=instance_id, run_id=run_id, timeout=timeout
            )

        async def prepare(self, jobs: Any) -> None:
            note(history_stream_name(self.prefix))
            await super().prepare(jobs)

        async def prepare_claims(self, slots: Any) -> None:
            note(*(claim_queue_name(self.prefix, slot) for slot in slots))
            await super().prepare_claims(slots)

        async def record(self, job: JobPolicy, record: RunRecord) -> None:
            note(history_stream_name(self.prefix))
            await super().record(job, record)

    return Tracked(spec["url"], **options)


def make_backend(spec: dict[str, Any]) -> Backend:
    kind, options = spec["kind"], dict(spec.get("options", {}))
    if kind == "rabbitmq":
        return _rabbitmq(spec, options)
    if kind == "redis":
        from brokersched import RedisBackend

        return RedisBackend(spec["url"], **options)
    if kind == "redis-lease":
        from brokersched import RedisLeaseBackend

        return RedisLeaseBackend(spec["url"], **options)
    if kind == "nats":
        from brokersched import NATSBackend

        return NATSBackend(spec["url"], **options)
    if kind == "postgres":
        from brokersched import PostgresBackend

        return PostgresBackend(spec["url"], **options)
    if kind == "sqlite":
        from brokersched import SQLiteBackend

        return SQLiteBackend(spec["url"], **options)
    raise ValueError(f"no backend kind {kind!r}")


def build(spec: dict[str, Any]) -> Scheduler[Any]:
    """The scheduler the spec describes, its runs and skips logged."""
    log = Log(spec["log"], spec["instance"])
    hold: dict[str, float] = spec.get("hold", {})
    scheduler: Scheduler[Any] = Scheduler(
        make_backend(spec["backend"]),
        instance_id=spec["instance"],
        **spec.get("scheduler", {"jitter": 0}),
    )

    async def handler(ctx: JobContext) -> None:
        fields = {"job": ctx.job, "slot": ctx.slot_ms, "reason": ctx.reason, "run": ctx.run_id}
        log.write("start", attempt=ctx.attempt, **fields)
        await asyncio.sleep(hold.get(ctx.reason, hold.get("*", 0.1)))
        log.write("end", **fields)

    for job in spec["jobs"]:
        name, options = job["name"], job.get("options", {})
        if job["kind"] == "at":
            when = datetime.fromtimestamp(job["when_ms"] / 1000, UTC)
            scheduler.at(name, when, handler, **options)
        elif job["kind"] == "every":
            scheduler.every(name, job["every"], handler, **options)
        else:
            scheduler.after(name, job["delay"], handler, **options)
    scheduler.on(
        "skip",
        lambda skip: log.write(
            "skip", job=skip.job, slot=skip.slot_ms, reason=skip.reason, detail=skip.detail
        ),
    )
    return scheduler


def from_env() -> Scheduler[Any]:
    """The CLI's factory: the spec in ``BROKERSCHED_SEAM_SPEC``."""
    return build(json.loads(os.environ[SPEC_ENV]))


async def _start_at(spec: dict[str, Any]) -> int:
    """When to start (the host's clock): ``start_at_ms``, or ``offset_ms`` after the instant the
    test writes to standard input once every member has loaded (``go``); now without either.
    With ``relative``, ``start_at_ms`` and the ``at()`` jobs' ``when_ms`` count from that
    instant (``_from_go``): the test picks the slot once every member has loaded, however
    long a loaded machine took to start them."""
    if "start_at_ms" in spec:
        return int(spec["start_at_ms"])
    if not spec.get("go"):
        return 0
    return int(spec["go_ms"]) + int(spec.get("offset_ms", 0))


async def _from_go(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with the instant the test wrote (``go_ms``), its relative times made absolute."""
    go = int(await asyncio.to_thread(sys.stdin.readline))
    spec = {**spec, "go_ms": go}
    if spec.get("relative"):
        if "start_at_ms" in spec:
            spec["start_at_ms"] = go + int(spec["start_at_ms"])
        spec["jobs"] = [
            {**job, "when_ms": go + int(job["when_ms"])} if job["kind"] == "at" else job
            for job in spec["jobs"]
        ]
    return spec


async def serve(spec: dict[str, Any]) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    log = Log(spec["log"], spec["instance"])
    if spec.get("go"):  # loaded (imports done); the jobs once the test says when
        log.write("loaded")
        spec = await _from_go(spec)
    try:
        scheduler = build(spec)
    except Exception as exc:  # a refused registration: the test says what it was
        log.write("refused", error=f"{type(exc).__name__}: {exc}")
        raise
    if not spec.get("go"):
        log.write("loaded")
    await asyncio.sleep(max(0.0, (await _start_at(spec) - host_time_ms()) / 1000))
    async with scheduler:
        log.write("ready")
        await stop.wait()
    log.write("stopped")


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    asyncio.run(serve(json.loads(sys.argv[1])))

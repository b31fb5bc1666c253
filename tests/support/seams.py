"""The fleet of the real-server seam tests (tests/cluster/test_seams_real.py, test_breakit.py):
each member a process of its own (tests/support/seam_worker.py) on a shared store, with the
shared log of what they did, and the stores' specs (each deleted after the test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support.helpers import faketime
from tests.support.names import unique
from tests.support.nats_helpers import delete_streams
from tests.support.paths import REPO_ROOT
from tests.support.rabbitmq_helpers import delete_queues, fleet_queues
from tests.support.redis_helpers import delete_keys

ROOT = REPO_ROOT


Event = dict[str, Any]
# How long before the slot a ``relative`` test's members are told when it is, once every one
# has loaded: the slot is picked then, so however long a loaded machine took to start them the
# scenario keeps its timing (time to connect and start before the test freezes one).
LEAD_MS = 3000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Member:
    name: str
    process: asyncio.subprocess.Process
    stderr: Path
    told: bool = False  # the go instant was written to it


class Fleet:
    """The worker processes of one test, the JSON-lines file they share, and what to delete
    afterwards (``cleanups``: coroutines run at teardown, after every member has stopped)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = tmp / "events.jsonl"
        self.queues = tmp / "queues.txt"  # RabbitMQ queues the members may have made
        self.members: dict[str, Member] = {}
        self.killed_ms: dict[str, int] = {}
        self.cleanups: list[Callable[[], Any]] = []

    def spec(
        self, instance: str, backend: dict[str, Any], jobs: list[dict[str, Any]], **more: Any
    ) -> dict[str, Any]:
        backend = {**backend, "queues": str(self.queues)}
        return {
            "instance": instance,
            "log": str(self.log),
            "backend": backend,
            "jobs": jobs,
            **more,
        }

    def env(self, **more: str) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path, **more}

    async def start(self, spec: dict[str, Any], *, skew: str | None = None) -> Member:
        """A worker for ``spec`` (``skew``: run under ``faketime -f <skew>``); returns once
        it has loaded (imports done, jobs registered): ``start_at_ms`` is then met."""
        if spec.get("relative"):
            spec = {**spec, "go": True}
        name = spec["instance"]
        argv = [sys.executable, "-m", "tests.support.seam_worker", json.dumps(spec)]
        if skew is not None:
            argv = [faketime(), "-f", skew, *argv]
        stderr = self.tmp / f"{name}.stderr"
        stdin = asyncio.subprocess.PIPE if spec.get("go") else asyncio.subprocess.DEVNULL
        with stderr.open("wb") as sink:
            process = await asyncio.create_subprocess_exec(
                *argv, cwd=ROOT, env=self.env(), stdin=stdin, stdout=asyncio.subprocess.DEVNULL,
                stderr=sink, start_new_session=True,
            )  # fmt: skip
        member = self.members[name] = Member(name, process, stderr)
        await self.wait(f"{name} loaded", lambda: self.has("loaded", instance=name), 30)
        return member

    async def start_together(self, *specs: dict[str, Any]) -> None:
        """Members that start ``offset_ms`` after one instant, told once every one has loaded."""
        await asyncio.gather(*(self.start({**spec, "go": True}) for spec in specs))
        await self.go(now_ms() + 100)

    async def go(self, instant_ms: int) -> int:
        """Tell every member started with ``go`` (or ``relative``) the instant its times count
        from; answers it."""
        for member in self.members.values():
            if member.process.stdin is not None and not member.told:
                member.process.stdin.write(f"{instant_ms}\n".encode())
                await member.process.stdin.drain()
                member.told = True
        return instant_ms

    def events(self, event: str | None = None, **match: Any) -> list[Event]:
        if not self.log.exists():
            return []
        text = self.log.read_text()
        # The members append while this reads: a line not ended yet is read next time.
        whole = text[: text.rfind("\n") + 1]
        lines = [json.loads(line) for line in whole.splitlines() if line]
        return [
            e
            for e in lines
            if (event is None or e["event"] == event)
            and all(e.get(k) == v for k, v in match.items())
        ]

    def has(self, event: str, **match: Any) -> bool:
        return bool(self.events(event, **match))

    async def wait(self, what: str, condition: Callable[[], bool], within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while not condition():
            refused = self.events("refused")
            if refused:
                pytest.fail(f"a member refused its jobs: {refused}\n{self.diagnostics()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not so within {within_s}s\n{self.diagnostics()}")
            await asyncio.sleep(0.05)

    async def kill(self, name: str) -> None:
        """SIGKILL the member's whole process group (faketime's child too)."""
        process = self.members[name].process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self.killed_ms[name] = now_ms()
        await process.wait()

    def freeze(self, name: str) -> None:
        """SIGSTOP the member (a VM paused, a long GC): its timers fire late, once thawed."""
        os.killpg(self.members[name].process.pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        os.killpg(self.members[name].process.pid, signal.SIGCONT)

    async def stop(self, name: str) -> None:
        """SIGTERM (the member drains and stops), SIGKILL if it has not exited 15 s later."""
        process = self.members[name].process
        for signum in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)
                os.killpg(process.pid, signal.SIGCONT)  # a frozen member must see it
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(15):
                    await process.wait()
                    return

    async def close(self) -> None:
        for name in self.members:
            await self.stop(name)
        errors = []
        for cleanup in self.cleanups:  # each one, whatever the others did
            try:
                await cleanup()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def diagnostics(self) -> str:
        lines = [f"events:\n{self.log.read_text() if self.log.exists() else '(none)'}"]
        for member in self.members.values():
            tail = member.stderr.read_text(errors="replace")[-3000:]
            lines.append(f"--- {member.name} stderr (last 3000 chars):\n{tail}")
        return "\n".join(lines)

    def runs(self, job: str | None = None) -> list[Event]:
        return self.events("start", **({} if job is None else {"job": job}))

    def decided(self, instance: str, job: str, slot: int | None = None) -> bool:
        """Whether ``instance`` ran or skipped ``job`` (its slot ``slot``)."""
        match: dict[str, Any] = {"instance": instance, "job": job}
        if slot is not None:
            match["slot"] = slot
        return self.has("start", **match) or self.has("skip", **match)


async def until_ms(instant_ms: int) -> None:
    """Until the host's clock reads ``instant_ms``: an action the scenario puts at an instant
    (the servers' timers run on the same clock)."""
    await asyncio.sleep(max(0.0, (instant_ms - now_ms()) / 1000))


def redis_store(fleet: Fleet, url: str, kind: str, **options: Any) -> dict[str, Any]:
    prefix = unique("seamr")
    fleet.cleanups.append(lambda: delete_keys(url, prefix))
    return {"kind": kind, "url": url, "options": {"prefix": prefix, **options}}


def nats_store(fleet: Fleet, url: str, **options: Any) -> dict[str, Any]:
    prefix = unique("seamn")
    fleet.cleanups.append(lambda: delete_streams(url, prefix))
    return {"kind": "nats", "url": url, "options": {"prefix": prefix, **options}}


def rabbitmq_store(fleet: Fleet, url: str, **options: Any) -> dict[str, Any]:
    prefix = unique("seamq")

    async def remove() -> None:
        names = set(fleet.queues.read_text().split()) if fleet.queues.exists() else set()
        await delete_queues(url, sorted(names | set(fleet_queues(prefix))))

    fleet.cleanups.append(remove)
    return {"kind": "rabbitmq", "url": url, "options": {"prefix": prefix, **options}}


def postgres_store(fleet: Fleet, dsn: str, **options: Any) -> dict[str, Any]:
    schema = unique("seamp")

    async def drop() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    fleet.cleanups.append(drop)
    return {"kind": "postgres", "url": dsn, "options": {"schema": schema, **options}}


def claim_store(
    fleet: Fleet, request: pytest.FixtureRequest, kind: str, **options: Any
) -> dict[str, Any]:
    """A claim-only backend of ``kind`` (its server's fixture asked for only now)."""
    if kind == "redis":
        return redis_store(fleet, request.getfixturevalue("redis_url"), "redis", **options)
    if kind == "nats":
        return nats_store(fleet, request.getfixturevalue("nats_url"), **options)
    return rabbitmq_store(fleet, request.getfixturevalue("amqp_url"), **options)


def at(name: str, when_ms: int, **options: Any) -> dict[str, Any]:
    return {"kind": "at", "name": name, "when_ms": when_ms, "options": options}


def with_ttl(store: dict[str, Any], slot_ttl: str) -> dict[str, Any]:
    return {**store, "options": {**store["options"], "slot_ttl": slot_ttl}}


def starts_by_slot(runs: list[Event]) -> Counter[tuple[str, int]]:
    return Counter((run["job"], run["slot"]) for run in runs)

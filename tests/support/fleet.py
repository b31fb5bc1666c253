"""Three scheduler processes on one real server (``tests/support/fleet_member.py``), for the
backends' "every slot runs exactly once" tests: started, run together for a few seconds of
real time (the real server is the point), stopped with SIGTERM, their JSON lines read."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tests.support.paths import REPO_ROOT
from tests.support.wait import until


@dataclass
class Member:
    """A scheduler process and the JSON lines it printed (stderr kept for a failure)."""

    process: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)
    stderr: bytes = b""

    def __post_init__(self) -> None:
        self.reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None and self.process.stderr is not None
        errors = asyncio.ensure_future(self.process.stderr.read())
        async for line in self.process.stdout:
            if line.startswith(b"{"):
                self.lines.append(json.loads(line))
        self.stderr = await errors

    def first(self, key: str) -> int | None:
        return next((int(line[key]) for line in self.lines if key in line), None)


@dataclass
class FleetRun:
    members: list[Member]
    up_ms: int  # when the last member was up
    stop_ms: int  # when they were told to stop

    @property
    def lines(self) -> list[dict[str, Any]]:
        return [line for member in self.members for line in member.lines]

    def runs(self) -> list[tuple[str, int]]:
        return [(line["ran"][0], int(line["ran"][1])) for line in self.lines if "ran" in line]

    def skips(self) -> collections.Counter[str]:
        return collections.Counter(line["skip"][2] for line in self.lines if "skip" in line)

    def assert_every_slot_ran_once(self, every_ms: dict[str, int], *, settle: int = 2) -> int:
        """No slot ran twice, and every slot of each job from ``settle`` periods after the
        last member was up until a second before the stop ran; the count of those slots."""
        runs = self.runs()
        twice = [run for run, count in collections.Counter(runs).items() if count > 1]
        assert twice == [], f"slots run more than once: {twice}"
        expected = 0
        for job, period in every_ms.items():
            first = (self.up_ms // period + settle) * period
            window = range(first, self.stop_ms - 1000, period)
            missing = [ms for ms in window if (job, ms) not in set(runs)]
            assert missing == [], f"{job}: slots that never ran: {missing} ({self.skips()})"
            expected += len(window)
        return expected


async def run_fleet(spec: dict[str, Any], *, members: int = 3, run_s: float = 4) -> FleetRun:
    """``members`` processes of ``spec`` (see fleet_member.py), all up (however long a loaded
    machine takes to start them), then ``run_s`` seconds of real time together."""
    processes = [
        Member(
            await asyncio.create_subprocess_exec(
                sys.executable,
                *("-m", "tests.support.fleet_member", json.dumps(spec)),
                cwd=REPO_ROOT,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        )
        for _ in range(members)
    ]
    try:

        def all_up() -> bool:
            return all(m.first("ready") is not None or m.reading.done() for m in processes)

        await until(all_up, timeout=60, what="the fleet's processes to start")
        up_ms = max(m.first("ready") or 0 for m in processes)
        await asyncio.sleep(run_s)  # the fleet runs on real time: the real server is the point
        stop_ms = time.time_ns() // 1_000_000
        for member in processes:
            if member.process.returncode is None:
                member.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await asyncio.gather(*(m.reading for m in processes))
        codes = [await m.process.wait() for m in processes]
    finally:
        for member in processes:
            if member.process.returncode is None:
                member.process.kill()
                await member.process.wait()
    errors = b"\n".join(m.stderr for m in processes).decode(errors="replace")[-3000:]
    assert codes == [0] * members, errors
    return FleetRun(processes, up_ms, stop_ms)

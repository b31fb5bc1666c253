"""A 3-node RabbitMQ cluster (scripts/cluster.sh rabbitmq) and a fleet of scheduler processes on
it, for tests/cluster/test_rabbitmq_cluster.py and bench/chaos_rabbitmq.py. No pytest in here.

The fleet: ``PROCESSES`` OS processes, process ``i`` given every node's URL with node ``i``
first (so each starts on a different node and fails over to the others), each running
``JOBS`` jobs ``every("job.N", "1s")`` on one prefix. Every process prints a JSON line per run
it starts and per skip other than ``not-acquired``; the lines are read here with the time they
arrived. From the runs: slots run twice (must be 0) and slots lost (run nowhere).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.names import unique
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = ROOT / "scripts" / "cluster.sh"
PROCESSES = 3
JOBS = 20
INTERVAL_MS = 1000
# The clients' AMQP heartbeat: a client whose node is cut off silently learns it only from
# missed heartbeats (aiormq's default is 60 s) and only then fails over to another node.
HEARTBEAT_S = 5

MEMBER = """
import asyncio, json, logging, sys, time
from brokersched import RabbitMQBackend, Scheduler

urls, prefix, jobs = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def say(**fields):
    print(json.dumps(fields), flush=True)


async def run(ctx):
    say(run=ctx.job, slot=ctx.slot_ms, instance=ctx.instance_id)


def skipped(event):
    if event.reason != "not-acquired":  # another process has the slot
        say(skip=event.reason, job=event.job, slot=event.slot_ms, detail=event.detail)


async def main():
    scheduler = Scheduler(RabbitMQBackend(urls, prefix=prefix))
    for n in range(jobs):
        scheduler.every(f"job.{n}", "1s", run)
    scheduler.on("skip", skipped)
    async with scheduler:
        say(ready=scheduler.instance_id)
        await asyncio.to_thread(sys.stdin.readline)  # a line, or EOF: stop


asyncio.run(main())
"""


def cluster_name_and_subnet(kind: str) -> tuple[str, str]:
    """A name and a subnet of this run's own: two runs at once (two worktrees) would share the
    network namespaces of a fixed name, and the second would find the subnet in use and fall
    back to nodes on 127.0.0.1, without partitions."""
    token = os.getpid() % 10_000
    return f"bsr{kind}{token}", f"10.237.{100 + token % 150}"


class ClusterUnavailable(RuntimeError):
    """The cluster could not be started here (no rabbitmq-server package, say)."""


class RabbitCluster:
    """scripts/cluster.sh rabbitmq, with its own name, directory and subnet."""

    def __init__(self, name: str, directory: Path, subnet: str, net_ticktime: int = 60) -> None:
        self.env = {
            **os.environ,
            "BROKERSCHED_RMQ_CLUSTER_NAME": name,
            "BROKERSCHED_RMQ_CLUSTER_DIR": str(directory),
            "BROKERSCHED_RMQ_CLUSTER_SUBNET": subnet,
            "BROKERSCHED_RMQ_NET_TICKTIME": str(net_ticktime),
        }
        self.name = name
        self.directory = directory
        self.urls: list[str] = []

    def _run(self, *args: str, timeout: float = 240) -> str:
        done = subprocess.run(
            ["bash", str(SCRIPT), "rabbitmq", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"cluster.sh rabbitmq {' '.join(args)} failed ({done.returncode}):"
                f" {done.stderr.strip()[-2000:]}"
            )
        return done.stdout

    def up(self) -> list[str]:
        if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
            raise ClusterUnavailable("the rabbitmq-server package is not installed")
        out = self._run("up")
        self.urls = [line for line in out.splitlines() if line.startswith("amqp://")]
        return self.urls

    def down(self) -> None:
        self._run("down", timeout=60)

    def kill(self, node: int) -> None:
        self._run("kill", str(node))

    def stop(self, node: int) -> None:
        self._run("stop", str(node))

    def start(self, node: int) -> None:
        self._run("start", str(node))

    def partition(self, node: int) -> None:
        self._run("partition", str(node))

    def heal(self) -> None:
        self._run("heal")

    def status(self) -> str:
        return self._run("status", timeout=60)

    @property
    def partition_unavailable(self) -> str | None:
        """Why ``partition`` cannot work here, or ``None`` when it can (network namespaces)."""
        state = (self.directory / "state").read_text()
        if "MODE=netns" in state:
            return None
        reasons = [line for line in state.splitlines() if line.startswith("NO_PARTITION=")]
        return reasons[0].partition("=")[2] if reasons else "nodes on 127.0.0.1"


@dataclass
class Line:
    at: float  # time.time() when read
    member: int
    data: dict[str, Any]


@dataclass
class Fleet:
    urls: list[str]
    prefix: str = field(default_factory=lambda: unique("chaos"))
    lines: list[Line] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, timeout: float = 60) -> None:
        nodes = [f"{url}?heartbeat={HEARTBEAT_S}" for url in self.urls]
        for member in range(PROCESSES):
            mine = nodes[member:] + nodes[:member]  # node `member` first
            process = subprocess.Popen(
                [sys.executable, "-c", MEMBER, json.dumps(mine), self.prefix, str(JOBS)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                start_new_session=True,
            )
            self.processes.append(process)
            self.readers += [
                threading.Thread(target=self._read, args=(member, process), daemon=True),
                threading.Thread(target=self._errors, args=(process,), daemon=True),
            ]
            self.readers[-2].start()
            self.readers[-1].start()
        deadline = time.monotonic() + timeout
        while self.count("ready") < PROCESSES:
            dead = [p.returncode for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not start: {self.errors[-20:]}")
            time.sleep(0.05)

    def _read(self, member: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for text in process.stdout:
            with self._lock:
                self.lines.append(Line(time.time(), member, json.loads(text)))

    def _errors(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for text in process.stderr:
            with self._lock:
                self.errors.append(text.rstrip())

    def count(self, key: str) -> int:
        with self._lock:
            return sum(key in line.data for line in self.lines)

    def runs(self) -> list[Line]:
        with self._lock:
            return [line for line in self.lines if "run" in line.data]

    def skips(self) -> list[Line]:
        with self._lock:
            return [line for line in self.lines if "skip" in line.data]

    def stop(self) -> None:
        for process in self.processes:
            with contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        for process in self.processes:
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()


@contextlib.contextmanager
def running_fleet(urls: list[str]) -> Iterator[Fleet]:
    fleet = Fleet(urls)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def slot_grid(start_s: float, end_s: float) -> list[int]:
    """The 1 s slots falling in [start_s, end_s), in ms."""
    first = int(start_s * 1000) // INTERVAL_MS * INTERVAL_MS + INTERVAL_MS
    return list(range(first, int(end_s * 1000), INTERVAL_MS))


@dataclass
class Figures:
    slots: int  # slots due in the window, all jobs
    twice: list[tuple[str, int]]  # slots run more than once (anywhere in the run)
    lost: list[tuple[str, int]]  # slots of the window run nowhere
    resume_s: float  # from the fault to the end of its last lost slot, 0 if none lost
    skips: Counter[str]

    def line(self, label: str) -> str:
        return (
            f"{label}: {self.slots} slots, run twice {len(self.twice)}, lost {len(self.lost)},"
            f" claims resume {self.resume_s:.1f} s after the fault;"
            f" skips {dict(self.skips) or '{}'}"
        )


def figures(fleet: Fleet, window: tuple[float, float], fault_s: float | None = None) -> Figures:
    """Slots run twice (the whole run), lost in ``window`` (wall seconds), and how long after
    ``fault_s`` the last lost slot of the window fell due (+1 s: claims ran again after it)."""
    ran = Counter((line.data["run"], line.data["slot"]) for line in fleet.runs())
    twice = sorted(key for key, count in ran.items() if count > 1)
    due = [(f"job.{n}", slot) for slot in slot_grid(*window) for n in range(JOBS)]
    lost = [key for key in due if key not in ran]
    resume = 0.0
    if fault_s is not None:
        after = [slot for _, slot in lost if slot >= fault_s * 1000 - INTERVAL_MS]
        if after:
            resume = max(0.0, (max(after) + INTERVAL_MS) / 1000 - fault_s)
    in_window = [
        line for line in fleet.skips() if window[0] * 1000 <= line.data["slot"] < window[1] * 1000
    ]
    skips = Counter(str(line.data["skip"]) for line in in_window)
    return Figures(len(due), twice, lost, resume, skips)


def members_running(fleet: Fleet, since_s: float) -> set[int]:
    """The processes that ran a slot falling due at or after ``since_s``."""
    return {line.member for line in fleet.runs() if line.data["slot"] >= since_s * 1000}

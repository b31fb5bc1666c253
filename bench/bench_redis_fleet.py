"""A fleet of scheduler processes on Redis: is every slot run exactly once, and how late?

    .venv/bin/python bench/bench_redis_fleet.py [--url URL] [--seconds 15] [--serial]

The bar: 3 processes x 20 jobs every 1s, 0 duplicates, on a single server and on a cluster.
For each backend kind (``RedisBackend``, then ``RedisLeaseBackend``) and each target (the server
at ``--url``, and a 3-master Redis Cluster this script starts from the installed
``redis-server`` on free ports of 127.0.0.1), three OS processes each run
``Scheduler(<backend>(url, prefix=<unique>))`` with the same 20 ``every("job.N", "1s")`` jobs
and default options. Each run prints a JSON line (job, slot_ms, instance, start time). Once all
three are started, each is sent one stop instant ``--seconds`` ahead, the same for all three.

Columns: runs; distinct slots run; duplicates (slots run more than once; must be 0); missed
(slots falling after every process had started and at least 1s before the stop, run nowhere);
spread (runs per process); p50/p99 lateness, handler start - slot, which includes the jitter
(default: a quarter of the interval, 250ms, drawn per instance; the earliest claimer wins).
The server and cluster fleets of one kind run side by side (6 processes) to keep the default
under a minute; ``--serial`` runs the four fleets one at a time. The prefix's keys are deleted
from the server afterwards; the cluster is stopped and its directory removed. Prints; asserts
nothing (duplicates are printed loudly, the exit status stays 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

DEFAULT_URL = os.environ.get("BROKERSCHED_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 3
JOBS = 20
KINDS = {"claim": "RedisBackend", "lease": "RedisLeaseBackend"}

MEMBER = """
import asyncio, json, sys, time
from brokersched import RedisBackend, RedisLeaseBackend, Scheduler

url, prefix, kind, cluster, jobs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
backend_type = RedisLeaseBackend if kind == "lease" else RedisBackend


def say(**fields):
    print(json.dumps(fields), flush=True)


async def run(ctx):
    say(job=ctx.job, slot_ms=ctx.slot_ms, instance=ctx.instance_id, start_ms=time.time() * 1000)


def skipped(event):
    if event.reason not in ("not-acquired", "overlap"):  # another instance has the slot
        say(skip=event.reason)


async def main():
    scheduler = Scheduler(backend_type(url, prefix=prefix, cluster=cluster == "cluster"))
    for n in range(int(jobs)):
        scheduler.every(f"job.{n}", "1s", run)
    scheduler.on("skip", skipped)
    async with scheduler:
        say(ready=scheduler.instance_id)
        until = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, until - time.time()))


asyncio.run(main())
"""


# -- a throwaway 3-master cluster (as tests/support/redis_helpers.py, which needs pytest) ---


def _port_pair_is_free(port: int) -> bool:
    """``port`` and its cluster bus port (+10000) are both free on 127.0.0.1."""
    for candidate in (port, port + 10000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


def free_cluster_ports(count: int) -> list[int]:
    """``count`` distinct ports whose bus ports are free too (chosen before any node binds)."""
    ports: list[int] = []
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port <= 55535 and port not in ports and _port_pair_is_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError("no free port pairs for the cluster's nodes")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this script dies (Linux), so that a bench killed
    half-way leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: main() stops them anyway
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Node:
    directory: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    def start(self, binary: str) -> None:
        self.directory.mkdir(parents=True)
        self.process = subprocess.Popen(
            [
                binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                "--logfile", str(self.directory / "redis.log"), "--daemonize", "no",
                "--cluster-enabled", "yes", "--cluster-node-timeout", "5000",
                "--cluster-config-file", str(self.directory / "nodes.conf"),
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            address = ("127.0.0.1", self.port)
            with contextlib.suppress(OSError), socket.create_connection(address, 1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(100).startswith(b"+PONG"):
                    return
            if self.process is not None and self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server on {self.port} exited: {log[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} not ready")
            time.sleep(0.05)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _join(nodes: list[Node], timeout: float = 30) -> None:
    """Give each node a third of the hash slots, introduce them, wait for ``cluster_state:ok``."""
    clients = [redis.Redis(host="127.0.0.1", port=node.port) for node in nodes]
    try:
        bounds = [0, 5461, 10923, 16384]
        for n, client in enumerate(clients):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[n], bounds[n + 1] - 1)
        for node in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + timeout
        while True:
            infos = [client.execute_command("CLUSTER", "INFO") for client in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and "cluster_known_nodes:3" in t for t in texts):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster never became ok: {texts}")
            time.sleep(0.1)
    finally:
        for client in clients:
            client.close()


@contextlib.contextmanager
def redis_cluster(binary: str) -> Iterator[str]:
    """The URL of a fresh 3-master cluster (through its first node), stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="bench-redis-fleet-") as directory:
        nodes: list[Node] = []
        try:
            for n, port in enumerate(free_cluster_ports(3)):
                nodes.append(Node(Path(directory) / f"node{n}", port))
                nodes[-1].start(binary)
            for node in nodes:
                node.wait_ready()
            _join(nodes)
            yield f"redis://127.0.0.1:{nodes[0].port}/0"
        finally:
            for node in nodes:
                node.stop()


# -- a fleet ----------------------------------------------------------------------------------


class Member:
    """One scheduler process: its JSON lines and its stderr, read by a task of its own (so that
    a Ctrl-C, which cancels the fleet, still lets it read to the end once the process is
    killed, and no pipe is left open when the loop closes)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []
        self.stderr = b""
        self.ready = asyncio.Event()
        self.reader = asyncio.ensure_future(self.read())

    @classmethod
    async def start(cls, url: str, prefix: str, kind: str, target: str) -> Member:
        return cls(await asyncio.create_subprocess_exec(
            sys.executable, "-c", MEMBER, url, prefix, kind, target, str(JOBS),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        ))  # fmt: skip

    async def read(self) -> None:
        assert self.process.stdout is not None and self.process.stderr is not None
        errors = asyncio.ensure_future(self.process.stderr.read())
        try:
            while line := await self.process.stdout.readline():
                if line.startswith(b"{") and line.endswith(b"\n"):  # not cut by a kill
                    self.lines.append(json.loads(line))
                    if "ready" in self.lines[-1]:
                        self.ready.set()
            self.stderr = await errors
            await self.process.wait()
        finally:
            self.ready.set()  # an early exit must not leave the fleet waiting

    async def stop_at(self, until: float) -> None:
        assert self.process.stdin is not None
        with contextlib.suppress(ConnectionError):
            self.process.stdin.write(f"{until}\n".encode())
            await self.process.stdin.drain()

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        if self.process.stdin is not None:
            self.process.stdin.close()
        await asyncio.wait([self.reader])
        await self.process.wait()


@dataclass
class Fleet:
    kind: str
    target: str
    members: list[Member] = field(default_factory=list)
    go_ms: int = 0
    until_ms: int = 0


async def run_fleet(kind: str, target: str, url: str, prefix: str, seconds: float) -> Fleet:
    """Start the processes, let them run ``seconds`` from when the last one is ready, stop them
    at one instant and collect what they printed."""
    fleet = Fleet(kind, target)
    try:
        for _ in range(PROCESSES):
            fleet.members.append(await Member.start(url, prefix, kind, target))
        async with asyncio.timeout(60):
            await asyncio.gather(*(member.ready.wait() for member in fleet.members))
        go = time.time()
        until = go + seconds
        fleet.go_ms, fleet.until_ms = int(go * 1000), int(until * 1000)
        await asyncio.gather(*(member.stop_at(until) for member in fleet.members))
        async with asyncio.timeout(seconds + 60):
            await asyncio.wait([member.reader for member in fleet.members])  # cancels none
    finally:
        await asyncio.gather(*(member.kill() for member in fleet.members))
    return fleet


# -- figures ----------------------------------------------------------------------------------


@dataclass
class Figures:
    runs: int
    slots: int
    duplicates: dict[tuple[str, int], list[str]]
    missed: list[tuple[str, int]]
    expected: int
    spread: list[int]
    lateness_ms: list[float]
    skips: collections.Counter[str]
    failures: list[str]


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def figures(fleet: Fleet) -> Figures:
    runs = [line for member in fleet.members for line in member.lines if "slot_ms" in line]
    where: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for run in runs:
        where[(run["job"], run["slot_ms"])].append(run["instance"])
    first = (fleet.go_ms // 1000 + 1) * 1000  # every process had armed it
    window = range(first, fleet.until_ms - 1000, 1000)  # due with time to spare before the stop
    expected = [(f"job.{n}", ms) for n in range(JOBS) for ms in window]
    failures = [
        f"process {n} exited {m.process.returncode}: {m.stderr.decode(errors='replace').strip()}"
        for n, m in enumerate(fleet.members)
        if m.process.returncode != 0
    ]
    if failures:  # the whole tail of the first failure, the last line of each
        failures = [failures[0][-1500:]] + [f.splitlines()[-1] for f in failures[1:]]
    return Figures(
        runs=len(runs),
        slots=len(where),
        duplicates={slot: names for slot, names in where.items() if len(names) > 1},
        missed=[slot for slot in expected if slot not in where],
        expected=len(expected),
        spread=[sum("slot_ms" in line for line in member.lines) for member in fleet.members],
        lateness_ms=[run["start_ms"] - run["slot_ms"] for run in runs],
        skips=collections.Counter(
            line["skip"] for member in fleet.members for line in member.lines if "skip" in line
        ),
        failures=failures,
    )


HEADER = (
    f"{'backend':18} {'target':8} {'runs':>5} {'slots':>5} {'dups':>5} {'missed':>11} "
    f"{'spread':>12} {'p50 ms':>7} {'p99 ms':>7}"
)


def row(fleet: Fleet, f: Figures) -> str:
    spread = "/".join(str(count) for count in f.spread)
    missed = f"{len(f.missed)}/{f.expected}"
    p50, p99 = percentile(f.lateness_ms, 0.5), percentile(f.lateness_ms, 0.99)
    return (
        f"{KINDS[fleet.kind]:18} {fleet.target:8} {f.runs:5} {f.slots:5} "
        f"{len(f.duplicates):5} {missed:>11} {spread:>12} {p50:7.1f} {p99:7.1f}"
    )


def notes(name: str, f: Figures) -> list[str]:
    """What the table cannot show: which slots ran twice or nowhere, odd skips, crashes."""
    out = []
    if f.duplicates:
        shown = ", ".join(
            f"{job}@{ms} x{len(names)}" for (job, ms), names in sorted(f.duplicates.items())[:10]
        )
        out.append(f"!!! DUPLICATES, {name}: {len(f.duplicates)} slots ran more than once: {shown}")
    if f.missed:
        out.append(f"missed, {name}: " + ", ".join(f"{job}@{ms}" for job, ms in f.missed[:10]))
    if f.skips:
        out.append(f"skips other than not-acquired/overlap, {name}: {dict(f.skips)}")
    return out + [f"!!! {name}: {failure}" for failure in f.failures]


def report(fleets: list[Fleet], seconds: float) -> None:
    print(
        f"{PROCESSES} processes x {JOBS} jobs every 1s, {seconds:g}s from the last start to one "
        "stop instant; missed = of the slots due in the steady window"
    )
    print(HEADER)
    remarks: list[str] = []
    duplicates = 0
    for fleet in fleets:
        f = figures(fleet)
        duplicates += len(f.duplicates)
        print(row(fleet, f))
        remarks += notes(f"{KINDS[fleet.kind]} on the {fleet.target}", f)
    for remark in remarks:
        print(remark)
    if not duplicates:
        print("duplicates: none")


# -- main -------------------------------------------------------------------------------------


def server_is_up(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError as exc:
        print(f"the server at {url} does not answer ({exc}): its rounds are skipped")
        return False
    finally:
        client.close()


def delete_prefix(url: str, prefix: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
        return len(keys)
    finally:
        client.close()


async def run_all(
    targets: dict[str, str], prefix: str, seconds: float, serial: bool
) -> list[Fleet]:
    fleets: list[Fleet] = []
    for kind in KINDS:
        if serial:
            for target, url in targets.items():
                fleets.append(await run_fleet(kind, target, url, f"{prefix}-{kind}", seconds))
            continue
        async with asyncio.TaskGroup() as group:  # unlike gather, waits for every cleanup
            tasks = [
                group.create_task(run_fleet(kind, target, url, f"{prefix}-{kind}", seconds))
                for target, url in targets.items()
            ]
        fleets += [task.result() for task in tasks]
    return fleets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=DEFAULT_URL, help="the single server")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--serial", action="store_true", help="one fleet at a time")
    args = parser.parse_args()
    prefix = "benchfleet" + uuid.uuid4().hex[:8]
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server is not installed: the cluster rounds are skipped")
    with contextlib.ExitStack() as stack:
        targets = {"server": args.url} if server_is_up(args.url) else {}
        if binary is not None:
            targets["cluster"] = stack.enter_context(redis_cluster(binary))
        if not targets:
            return
        try:
            fleets = asyncio.run(run_all(targets, prefix, args.seconds, args.serial))
        finally:
            if "server" in targets:
                for kind in KINDS:
                    delete_prefix(args.url, f"{prefix}-{kind}")
    report(fleets, args.seconds)


if __name__ == "__main__":
    main()

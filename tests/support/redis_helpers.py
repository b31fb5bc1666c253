"""Redis test helpers: started backends of a test's prefix and removing its keys, and throwaway
servers (a single one, a cluster) started with ``redis-server`` on free ports of 127.0.0.1 in a
temporary directory."""

from __future__ import annotations

import contextlib
import ctypes
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from brokersched._clock import SystemClock
from brokersched.backends.redis import RedisBackend
from tests.support.helpers import missing
from tests.support.paths import REPO_ROOT
from tests.support.wait import free_port


@asynccontextmanager
async def redis_fleet(
    url: str, prefix: str, **defaults: Any
) -> AsyncIterator[Callable[..., Awaitable[RedisBackend]]]:
    """``await start(**options)``: a started RedisBackend of ``prefix`` on ``url`` (``url=``
    another way to the server), options over ``defaults``; afterwards all are stopped and the
    prefix's keys deleted."""
    started: list[RedisBackend] = []

    async def start(**options: Any) -> RedisBackend:
        backend = RedisBackend(options.pop("url", url), prefix=prefix, **{**defaults, **options})
        await backend.start(SystemClock())
        started.append(backend)
        return backend

    try:
        yield start
    finally:
        for backend in started:
            await backend.stop()
        await delete_keys(url, prefix)


async def delete_keys(url: str, prefix: str, *, cluster: bool = False) -> None:
    """Delete every key under ``prefix:`` (on every primary of a cluster)."""
    if cluster:
        nodes = redis.asyncio.RedisCluster.from_url(url)
        try:
            keys = [key async for key in nodes.scan_iter(match=f"{prefix}:*", count=1000)]
            for key in keys:  # one by one: the keys of a test lie in several hash slots
                await nodes.delete(key)
        finally:
            await nodes.aclose()
        return
    client = redis.asyncio.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (so at most 55535)."""
    for _ in range(200):
        port = free_port()
        if port <= 55535 and _port_is_free(port + 10000):
            return port
    for port in range(20000, 55535, 7):
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies (Linux), so that a test
    run killed half-way leaves no server behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the fixtures' teardown still stops them
        pass


def _need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        missing(f"{binary} is not installed: apt-get install redis-server")
    return path


@dataclass
class RedisServer:
    """One ``redis-server`` this test process started (and stops)."""

    directory: Path
    port: int = field(default_factory=free_port)
    args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *args: str) -> RedisServer:
        self.args = args or self.args
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                _need("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--daemonize", "no",
                "--logfile", str(self.directory / "redis.log"), *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def wait_ready(self, timeout: float = 15) -> None:
        """Until the server answers PING (``+PONG``, or ``-NOAUTH`` when it wants a password;
        not ``-LOADING`` while it reads its append-only file)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    reply = sock.recv(100)
                if reply and not reply.startswith(b"-LOADING"):
                    return
            except OSError:
                pass
            if self.process is not None and self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server exited: {log[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} not ready")
            time.sleep(0.05)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: redis-server flushes the AOF and exits
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """SIGKILL: no shutdown save, as a crash."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


@dataclass
class RedisClusterServers:
    """Three masters started with ``--cluster-enabled yes``, slots assigned with ADDSLOTSRANGE,
    met with CLUSTER MEET; ``url`` reaches the cluster through its first node."""

    servers: list[RedisServer]

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def ports(self) -> list[int]:
        return [server.port for server in self.servers]


def _create_cluster(servers: list[RedisServer], timeout: float = 30) -> None:
    clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in servers]
    try:
        bounds = [0, 5461, 10923, 16384]
        for n, client in enumerate(clients):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[n], bounds[n + 1] - 1)
        for server in servers[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)
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
def redis_cluster(directory: Path) -> Iterator[RedisClusterServers]:
    servers = [RedisServer(directory / f"node{n}", port=free_cluster_port()) for n in range(3)]
    try:
        for server in servers:
            server.start(
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(server.directory / "nodes.conf"),
                "--cluster-node-timeout", "5000",
                "--appendonly", "no",
            )  # fmt: skip
        _create_cluster(servers)
        yield RedisClusterServers(servers)
    finally:
        for server in servers:
            server.stop()


_SHARED: dict[str, str] = {}


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster, started once per test session, however many modules import
    this fixture (each import is a fixture of its own to pytest), and stopped at its end."""
    if "url" in _SHARED:
        yield _SHARED["url"]
        return
    _need("redis-server")
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        _SHARED["url"] = cluster.url
        try:
            yield cluster.url
        finally:
            _SHARED.clear()


README = REPO_ROOT / "docs" / "backends.md"  # its Redis section


def readme_acl() -> list[str]:
    """The commands of the docs' Redis sentence "An ACL user needs ...", e.g. ``+script|load``."""
    text = " ".join(README.read_text().split())
    sentence = text.split("An ACL user needs", 1)[1].split("`.", 1)[0]
    return re.findall(r"\+[a-z|]+", sentence)

"""A RabbitMQ node of the tests' own, with the management plugin and the soft open-files limit
of 1024 that Debian's wrapper gives it without systemd: for what must not be done to the
shared broker (purge with the management API, a broker driven near its file-handle budget).

``private_rabbitmq`` is a 3.10 node (this machine's package); ``private_rabbitmq4`` a RabbitMQ
4.0 node from the Debian 13 root that ``scripts/rabbitmq4.sh`` builds, started in that root
(as root) with a directory, ports and node name of its own; ``private_rabbitmq_of_run`` the one
of the run's broker's line (``RABBITMQ_SERVER``: 3.10, else 4.0)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from brokersched.backends.rabbitmq._ops import Management
from tests.support.helpers import missing
from tests.support.wait import free_port

__all__ = [
    "RABBITMQ4_ROOT",
    "RABBITMQ_SBIN",
    "PrivateRabbitMQ",
    "private_rabbitmq",
    "private_rabbitmq4",
    "private_rabbitmq_of_run",
]

RABBITMQ_SBIN = Path("/usr/lib/rabbitmq/bin")
#: scripts/rabbitmq4.sh's Debian 13 root (its BROKERSCHED_RMQ4_ROOT)
RABBITMQ4_ROOT = Path(
    os.environ.get("BROKERSCHED_RMQ4_ROOT", "/var/lib/brokersched/rabbitmq4-trixie")
)


@dataclass
class PrivateRabbitMQ:
    """One RabbitMQ node with the management plugin, started from the Debian package as
    ``scripts/cluster-rabbitmq.sh`` starts its nodes, with a soft open-files limit of 1024."""

    base: Path
    nodename: str
    amqp_port: int
    http_port: int
    process: subprocess.Popen[bytes] | None = None
    root: Path | None = None  # a root to run the node in (RabbitMQ 4.0's); base is under it
    nofile: int = 1024

    def _inside(self, path: Path) -> Path:
        """``path`` as the node sees it (within its root)."""
        return path if self.root is None else Path("/") / path.relative_to(self.root)

    @property
    def beam_pid(self) -> int:
        """The node's Erlang VM (its open files are read under /proc)."""
        return int((self.base / "beam.pid").read_text().strip())

    def rabbitmqctl(self, *args: str) -> list[str]:
        """The command that runs rabbitmqctl ``args`` on this node."""
        ctl = [str(RABBITMQ_SBIN / "rabbitmqctl"), "-n", self.nodename, *args]
        if self.root is None:
            return ctl
        env = [f"{key}={value}" for key, value in self._env_inside().items()]
        return ["chroot", str(self.root), "env", "-i", *env, *ctl]

    def _env_inside(self) -> dict[str, str]:
        return {
            "HOME": str(self._inside(self.base / "home")),
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LC_ALL": "C.UTF-8",
            "RABBITMQ_CONF_ENV_FILE": str(self._inside(self.base / "env.conf")),
        }

    @property
    def env(self) -> dict[str, str]:
        return {
            "HOME": str(self.base / "home"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "env.conf"),
            "ERL_FLAGS": "",
        }

    @property
    def amqp_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def management_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.http_port}/"

    def start(self) -> None:
        home = self.base / "home"
        home.mkdir(parents=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex)
        cookie.chmod(0o400)
        (self.base / "enabled_plugins").write_text("[rabbitmq_management].\n")
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"management.tcp.port = {self.http_port}\nmanagement.tcp.ip = 127.0.0.1\n"
            "log.console = false\n"
        )
        b, inside = self.base, self._inside(self.base)
        (b / "env.conf").write_text(
            f"RABBITMQ_NODENAME={self.nodename}\nRABBITMQ_NODE_PORT={self.amqp_port}\n"
            f"RABBITMQ_DIST_PORT={free_port()}\nRABBITMQ_CONFIG_FILE={inside}/rabbitmq.conf\n"
            f"RABBITMQ_ENABLED_PLUGINS_FILE={inside}/enabled_plugins\n"
            f"RABBITMQ_MNESIA_BASE={inside}/mnesia\nRABBITMQ_LOG_BASE={inside}/log\n"
            f"RABBITMQ_PID_FILE={inside}/beam.pid\nERL_EPMD_ADDRESS=127.0.0.1\n"
        )
        nofile = self.nofile

        def limits() -> None:
            os.setsid()
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        command, env = [str(RABBITMQ_SBIN / "rabbitmq-server")], {**os.environ, **self.env}
        if self.root is not None:  # the root's own environment, as scripts/rabbitmq4.sh runs it
            command = ["chroot", str(self.root), "env", "-i"]
            command += [f"{key}={value}" for key, value in self._env_inside().items()]
            command += [str(RABBITMQ_SBIN / "rabbitmq-server")]
        with (b / "stdout.log").open("wb") as out:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=limits,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = list((b / "log").glob("*.log")) if (b / "log").exists() else []
            if any("Server startup complete" in log.read_text(errors="replace") for log in logs):
                self._wait_for_statistics(deadline)
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the private RabbitMQ node did not start: {b / 'stdout.log'}")

    def _wait_for_statistics(self, deadline: float) -> None:
        """Until the management API tells the node's file descriptors (its first statistics
        come a few seconds after the start)."""
        management = Management(self.management_url, "/")
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                nodes = asyncio.run(management.get("nodes"))
                if nodes and all(isinstance(node.get("fd_total"), int) for node in nodes):
                    return
            time.sleep(0.2)
        raise RuntimeError("the private RabbitMQ node's management API tells no fd_total")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        beam = self.base / "beam.pid"
        if beam.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(beam.read_text().strip()), signal.SIGKILL)


@pytest.fixture(scope="session")
def private_rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRabbitMQ]:
    if not (RABBITMQ_SBIN / "rabbitmq-server").exists():
        missing("needs the rabbitmq-server package")
    base = tmp_path_factory.mktemp("rmq")
    node = PrivateRabbitMQ(base, f"ops{uuid.uuid4().hex[:6]}@localhost", free_port(), free_port())
    try:
        node.start()
        yield node
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def rabbitmq4_node(nofile: int = 1024) -> Iterator[PrivateRabbitMQ]:
    """A private RabbitMQ 4.0 node in scripts/rabbitmq4.sh's root, removed afterwards."""
    if not (RABBITMQ4_ROOT / ".brokersched-installed").exists():
        missing(f"needs the RabbitMQ 4.0 root at {RABBITMQ4_ROOT} (scripts/rabbitmq4.sh up)")
    if os.geteuid() != 0:
        missing("needs root to start a node in the RabbitMQ 4.0 root (chroot)")
    name = f"private-{uuid.uuid4().hex[:8]}"
    base = RABBITMQ4_ROOT / "var" / "lib" / "rabbitmq" / name
    base.mkdir(parents=True)
    node = PrivateRabbitMQ(
        base, f"{name}@localhost", free_port(), free_port(), root=RABBITMQ4_ROOT, nofile=nofile
    )
    try:
        node.start()
        yield node
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def private_rabbitmq4() -> Iterator[PrivateRabbitMQ]:
    with rabbitmq4_node() as node:
        yield node


@pytest.fixture(scope="session")
def private_rabbitmq_of_run(request: pytest.FixtureRequest) -> PrivateRabbitMQ:
    """A private node of the run's broker's line: 3.10, or 4.0 when ``RABBITMQ_SERVER`` is a
    4.x broker."""
    from tests.support.servers import rabbitmq_server_id

    fixture = "private_rabbitmq" if rabbitmq_server_id() == "3.10" else "private_rabbitmq4"
    node: PrivateRabbitMQ = request.getfixturevalue(fixture)
    return node

"""A RabbitMQ node of the tests' own, with the management plugin and the soft open-files limit
of 1024 that Debian's wrapper gives it without systemd: for what must not be done to the
shared broker (purge with the management API, a broker driven near its file-handle budget)."""

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

__all__ = ["RABBITMQ_SBIN", "PrivateRabbitMQ", "private_rabbitmq"]

RABBITMQ_SBIN = Path("/usr/lib/rabbitmq/bin")


@dataclass
class PrivateRabbitMQ:
    """One RabbitMQ node with the management plugin, started from the Debian package as
    ``scripts/cluster-rabbitmq.sh`` starts its nodes, with a soft open-files limit of 1024."""

    base: Path
    nodename: str
    amqp_port: int
    http_port: int
    process: subprocess.Popen[bytes] | None = None

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
        b = self.base
        (b / "env.conf").write_text(
            f"RABBITMQ_NODENAME={self.nodename}\nRABBITMQ_NODE_PORT={self.amqp_port}\n"
            f"RABBITMQ_DIST_PORT={free_port()}\nRABBITMQ_CONFIG_FILE={b}/rabbitmq.conf\n"
            f"RABBITMQ_ENABLED_PLUGINS_FILE={b}/enabled_plugins\n"
            f"RABBITMQ_MNESIA_BASE={b}/mnesia\nRABBITMQ_LOG_BASE={b}/log\n"
            f"RABBITMQ_PID_FILE={b}/beam.pid\nERL_EPMD_ADDRESS=127.0.0.1\n"
        )

        def limits() -> None:
            os.setsid()
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

        with (b / "stdout.log").open("wb") as out:
            self.process = subprocess.Popen(
                [str(RABBITMQ_SBIN / "rabbitmq-server")],
                env={**os.environ, **self.env},
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

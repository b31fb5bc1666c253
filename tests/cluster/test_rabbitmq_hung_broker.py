"""A RabbitMQ node that hangs (accepts frames, answers none, as a node out of file handles does)
must not be made worse by the library: the channel pool does not open a channel for
every timed-out claim, and a failed start leaves no connection behind. The hang is a private
node of this test (never the shared broker) whose Erlang VM is stopped with SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from brokersched import BackendError
from brokersched.abc import Slot
from brokersched.backends.rabbitmq import RabbitMQBackend
from tests.support.rabbitmq_helpers import CLOCK
from tests.support.wait import free_port

SBIN = Path("/usr/lib/rabbitmq/bin")


@dataclass
class Node:
    base: Path
    name: str
    port: int
    env: dict[str, str]
    server: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def beam(self) -> int:
        return int((self.base / "beam.pid").read_text())

    def ctl(self, *args: str) -> str:
        command = [str(SBIN / "rabbitmqctl"), "-n", self.name, "-q", *args]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        return done.stdout

    def channels(self) -> int:
        return len([line for line in self.ctl("list_channels", "pid").splitlines() if line])

    def connections(self) -> int:
        return len([line for line in self.ctl("list_connections", "pid").splitlines() if line])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One RabbitMQ node from the installed Debian package, on free ports, data in tmp."""
    if not (SBIN / "rabbitmq-server").exists():
        pytest.skip(f"{SBIN}/rabbitmq-server is missing (the rabbitmq-server package)")
    base = tmp_path_factory.mktemp("rmq-hung")
    (base / "home").mkdir()
    cookie = base / "home" / ".erlang.cookie"
    cookie.write_text(secrets.token_hex(20))
    cookie.chmod(0o400)
    (base / "enabled_plugins").write_text("[].")
    (base / "rabbitmq.conf").write_text("loopback_users = none\nlog.console = false\n")
    port, dist, epmd = free_port(), free_port(), free_port()
    name = f"hung{os.getpid()}@127.0.0.1"
    (base / "env.conf").write_text(
        f"RABBITMQ_NODENAME={name}\nRABBITMQ_USE_LONGNAME=true\n"
        f"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1\nRABBITMQ_NODE_PORT={port}\n"
        f"RABBITMQ_DIST_PORT={dist}\nRABBITMQ_CONFIG_FILE={base}/rabbitmq.conf\n"
        f"RABBITMQ_ENABLED_PLUGINS_FILE={base}/enabled_plugins\n"
        f"RABBITMQ_MNESIA_BASE={base}/mnesia\nRABBITMQ_LOG_BASE={base}/log\n"
        f"RABBITMQ_PID_FILE={base}/beam.pid\nERL_EPMD_ADDRESS=127.0.0.1\nERL_EPMD_PORT={epmd}\n"
    )
    env = {
        **os.environ,
        "HOME": str(base / "home"),
        "RABBITMQ_CONF_ENV_FILE": str(base / "env.conf"),
        "ERL_EPMD_PORT": str(epmd),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        "ERL_FLAGS": "",
    }
    server = subprocess.Popen(
        [str(SBIN / "rabbitmq-server")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    started = Node(base, name, port, env, server)
    try:
        deadline = time.monotonic() + 120
        while "Server startup complete" not in _log(base):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the private RabbitMQ node did not start: {_log(base)[-2000:]}")
            time.sleep(0.2)
        yield started
    finally:
        with_pid = (base / "beam.pid").exists()
        if with_pid:
            os.kill(started.beam, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGKILL)
        if with_pid:
            subprocess.run(["kill", "-9", str(started.beam)], check=False)
        subprocess.run(  # the node's own epmd, on its own port
            f"ss -ltnpH 'sport = :{epmd}' | grep -o 'pid=[0-9]*' | cut -d= -f2 | xargs -r kill -9",
            shell=True,
            check=False,
        )
        server.wait()


def _log(base: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in (base / "log").glob("*.log"))


@pytest.fixture
async def hang(node: Node) -> AsyncIterator[Node]:
    """The node, stopped once the test says so (``os.kill(node.beam, SIGSTOP)``), always
    resumed after."""
    try:
        yield node
    finally:
        os.kill(node.beam, signal.SIGCONT)


def client_channels(backend: RabbitMQBackend) -> int:
    connection = backend._connection
    assert connection is not None and connection.transport is not None
    return len(connection.transport.connection.channels)


async def test_a_hung_broker_gets_no_new_channel_per_timed_out_claim(hang: Node) -> None:
    """8 claimers, each claiming every 0.2 s with a 1 s timeout, against a hung node for 12 s:
    before the fix the pool opened a channel for every timed-out claim (8 -> 80 in 12 s);
    now at most one open per place of the pool is in flight, and after a failed one only one
    at a time. Once the node answers again, claims win again and nothing is left over."""
    backend = RabbitMQBackend(hang.url, prefix="hung", slot_ttl="1m", claim_timeout="1s")
    await backend.start(CLOCK)
    stop = asyncio.Event()
    wins: list[float] = []

    async def claimer(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            slot = Slot(f"job{k}", CLOCK.now_ms() // 200 * 200)
            try:
                if await backend.claim(slot, instance_id="i", run_id=f"{k}-{n}", timeout=1):
                    wins.append(time.monotonic())
            except BackendError:
                pass
            await asyncio.sleep(0.2)

    claimers = [asyncio.create_task(claimer(k)) for k in range(8)]
    try:
        await asyncio.sleep(1)
        assert wins, "no claim won before the hang"
        os.kill(hang.beam, signal.SIGSTOP)
        most = 0
        for _ in range(24):  # 12 s of claims against the hung node
            await asyncio.sleep(0.5)
            most = max(most, client_channels(backend))
        assert most <= 2 * 8 + 2, f"{most} channels opened against a hung broker"
        os.kill(hang.beam, signal.SIGCONT)
        resumed = time.monotonic()
        deadline = resumed + 40  # the pool's back-off is 10 s at most, an open 10 s
        while not any(at > resumed for at in wins):
            assert time.monotonic() < deadline, "claims did not resume after the hang"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*claimers)
        await backend.stop()
    deadline = time.monotonic() + 20
    while hang.channels() or hang.connections():  # the broker catches up with the closes
        assert time.monotonic() < deadline, "channels or connections left on the broker"
        await asyncio.sleep(0.2)


def established(port: int) -> int:
    """This machine's TCP connections to ``port`` (the node's), as ss lists them."""
    listed = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( dport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len([line for line in listed.splitlines() if line.strip()])


async def test_a_start_against_a_hung_broker_leaves_no_connection(hang: Node) -> None:
    """Two ways a start fails on a hung node: the handshake is never answered, or the node
    hangs once connected (while the fleet's record is read). Either way the start raises and
    closes what it opened: no TCP connection stays, and none is on the broker once it answers."""
    assert established(hang.port) == 0
    os.kill(hang.beam, signal.SIGSTOP)
    for _ in range(3):
        backend = RabbitMQBackend(hang.url, prefix="hung", slot_ttl="1m", timeout=1)
        with pytest.raises(BackendError):
            await backend.start(CLOCK)
    assert established(hang.port) == 0
    os.kill(hang.beam, signal.SIGCONT)

    backend = RabbitMQBackend(hang.url, prefix="hung", slot_ttl="1m")
    read_record = backend._memory.read

    async def hangs_first(*, write: bool) -> object:
        os.kill(hang.beam, signal.SIGSTOP)
        return await read_record(write=write)

    backend._memory.read = hangs_first  # type: ignore[method-assign]
    with pytest.raises(BackendError):
        await backend.start(CLOCK)
    assert established(hang.port) == 0
    os.kill(hang.beam, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while hang.connections():
        assert time.monotonic() < deadline, "a connection of a failed start is on the broker"
        await asyncio.sleep(0.2)

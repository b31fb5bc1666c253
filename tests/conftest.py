"""Where the servers are.

Each backend's URL comes from the environment (``BROKERSCHED_AMQP_URL``, ``BROKERSCHED_NATS_URL``,
``BROKERSCHED_POSTGRES_DSN``), else the local default on 127.0.0.1, else a testcontainers
container for people with Docker. In CI (``CI=true``) a server that cannot be reached fails the
test: it never silently skips.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from urllib.parse import urlsplit

import pytest
from hypothesis import settings

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# In CI, property tests replay the same examples every run: a red build is reproducible, and new
# examples are explored on developers' machines.
settings.register_profile("ci", derandomize=True, print_blob=True)
if IN_CI:
    settings.load_profile("ci")

_DEFAULTS = {
    "amqp": ("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "nats": ("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222"),
    "postgres": ("BROKERSCHED_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
}
_DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "nats": 4222, "tls": 4222, "postgresql": 5432}


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def _from_container(kind: str, stack: ExitStack) -> str | None:
    """Start a throwaway server with testcontainers, if it and Docker are available."""
    try:
        if kind == "amqp":
            from testcontainers.rabbitmq import RabbitMqContainer  # type: ignore[import-not-found]

            rabbit = stack.enter_context(RabbitMqContainer("rabbitmq:3.13"))
            port = rabbit.get_exposed_port(5672)
            return f"amqp://guest:guest@{rabbit.get_container_host_ip()}:{port}/"
        if kind == "nats":
            from testcontainers.nats import NatsContainer  # type: ignore[import-not-found]

            nats = stack.enter_context(NatsContainer("nats:2.10").with_command("-js"))
            return str(nats.nats_uri())
        if kind == "postgres":
            from testcontainers.postgres import PostgresContainer  # type: ignore[import-not-found]

            pg = stack.enter_context(PostgresContainer("postgres:16", driver=None))
            return str(pg.get_connection_url())
    except Exception:  # no testcontainers, no Docker: the caller decides what that means
        return None
    return None


def server_url(kind: str, stack: ExitStack) -> str:
    env, default = _DEFAULTS[kind]
    url = os.environ.get(env, default)
    if _reachable(url):
        return url
    if not IN_CI and (container_url := _from_container(kind, stack)):
        return container_url
    message = f"{kind} server not reachable at {urlsplit(url).hostname}:{urlsplit(url).port}"
    if IN_CI:
        pytest.fail(f"{message} (set {env}); CI never skips a backend test", pytrace=False)
    pytest.skip(f"{message}; set {env} or install testcontainers with Docker")


@pytest.fixture(scope="session")
def _servers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture(scope="session")
def amqp_url(_servers: ExitStack) -> str:
    return server_url("amqp", _servers)


@pytest.fixture(scope="session")
def nats_url(_servers: ExitStack) -> str:
    return server_url("nats", _servers)


@pytest.fixture(scope="session")
def postgres_dsn(_servers: ExitStack) -> str:
    return server_url("postgres", _servers)

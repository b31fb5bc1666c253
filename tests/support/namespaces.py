"""A fresh namespace of one backend kind on its real server, for the tests of one behaviour on
several backends (tests/backends/multi): ``fresh_namespace`` gives a factory of backends of it
(one per instance) and removes what they made afterwards (``remove_namespace``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from brokersched import (
    NATSBackend,
    NATSLeaseBackend,
    PostgresBackend,
    RabbitMQBackend,
    RedisBackend,
    RedisLeaseBackend,
    SQLiteBackend,
)
from brokersched.abc import Backend
from tests.support.leases import drop_schema
from tests.support.leftovers import remove_rabbitmq
from tests.support.names import unique
from tests.support.nats_helpers import delete_streams
from tests.support.redis_helpers import delete_keys

#: The server fixture of each kind (SQLite has none: a file of the test's ``tmp_path``).
SERVERS = {
    "postgres": "postgres_dsn",
    "rabbitmq": "amqp_url",
    "nats": "nats_url",
    "nats-lease": "nats_url",
    "redis": "redis_url",
    "redis-lease": "redis_url",
}


@asynccontextmanager
async def fresh_namespace(
    request: pytest.FixtureRequest, kind: str, stem: str
) -> AsyncIterator[Callable[..., Backend]]:
    """``make(**options)``: a new backend of ``kind`` in a namespace of its own (a prefix, a
    PostgreSQL schema, a SQLite file), on the server of ``kind``'s fixture (asked for only
    now); what the backends made there is removed afterwards."""
    name = unique(stem)
    if kind == "sqlite":
        url = str(request.getfixturevalue("tmp_path") / f"{stem}.db")
    else:
        url = request.getfixturevalue(SERVERS[kind])

    def make(**options: Any) -> Backend:
        if kind == "postgres":
            return PostgresBackend(url, schema=name, **options)
        if kind == "sqlite":
            return SQLiteBackend(url, **options)
        if kind == "rabbitmq":
            return RabbitMQBackend(url, prefix=name, **options)
        if kind == "nats":
            return NATSBackend(url, prefix=name, **options)
        if kind == "nats-lease":
            return NATSLeaseBackend(url, bucket=name, **options)
        if kind == "redis":
            return RedisBackend(url, prefix=name, **options)
        return RedisLeaseBackend(url, prefix=name, **options)

    try:
        yield make
    finally:
        await remove_namespace(kind, url, name)


async def remove_namespace(kind: str, url: str, name: str) -> None:
    """Remove what backends of ``kind`` made under ``name`` on ``url`` (SQLite's file goes with
    the test's ``tmp_path``)."""
    if kind == "postgres":
        await drop_schema(url, name)
    elif kind == "rabbitmq":
        await remove_rabbitmq(url, name)
    elif kind.startswith("nats"):
        await delete_streams(url, name)
    elif kind.startswith("redis"):
        await delete_keys(url, name)

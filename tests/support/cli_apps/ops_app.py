"""A scheduler for ``brokersched purge`` and ``doctor`` (tests/deploy/test_cli_ops.py): the backend
named by ``BROKERSCHED_TEST_BACKEND`` (rabbitmq, nats, nats-lease, redis, redis-lease, postgres,
sqlite),
its prefix (schema, table prefix) ``BROKERSCHED_TEST_PREFIX``, its server's URL in the
variable the test sets (``BROKERSCHED_TEST_URL``; RabbitMQ: ``BROKERSCHED_TEST_MANAGEMENT_URL``
too, when given). One job, ``tick``, every second."""

from __future__ import annotations

import os

from brokersched import (
    JobContext,
    NATSBackend,
    NATSLeaseBackend,
    PostgresBackend,
    RabbitMQBackend,
    RedisBackend,
    RedisLeaseBackend,
    Scheduler,
    SQLiteBackend,
)
from brokersched.abc import Backend


def make_backend(kind: str, url: str, prefix: str, management_url: str | None = None) -> Backend:
    if kind == "rabbitmq":
        return RabbitMQBackend(url, slot_ttl="20s", prefix=prefix, management_url=management_url)
    if kind == "nats":
        return NATSBackend(url, slot_ttl="20s", prefix=prefix)
    if kind == "nats-lease":
        return NATSLeaseBackend(url, lease_ttl="5s", bucket=prefix)
    if kind == "redis":
        return RedisBackend(url, slot_ttl="20s", prefix=prefix)
    if kind == "redis-lease":
        return RedisLeaseBackend(url, lease_ttl="5s", prefix=prefix)
    if kind == "postgres":
        return PostgresBackend(url, schema=prefix, lease_ttl="5s")
    if kind == "sqlite":
        return SQLiteBackend(url, table_prefix=prefix, lease_ttl="5s")
    raise ValueError(f"unknown backend kind {kind!r}")


def make_scheduler(backend: Backend) -> Scheduler[Backend]:
    scheduler = Scheduler(backend, jitter=0, max_late="5s", drain_timeout="2s")

    @scheduler.every("tick", "1s")
    async def tick(ctx: JobContext) -> None:
        pass

    return scheduler


def create() -> Scheduler[Backend]:
    backend = make_backend(
        os.environ["BROKERSCHED_TEST_BACKEND"],
        os.environ["BROKERSCHED_TEST_URL"],
        os.environ["BROKERSCHED_TEST_PREFIX"],
        os.environ.get("BROKERSCHED_TEST_MANAGEMENT_URL"),
    )
    return make_scheduler(backend)

"""Applications for ``brokersched simulate``: the typical outbox flush on RabbitMQ, and a
PostgreSQL fleet whose jobs use the lease options. Neither talks to its server: the simulator
reads their jobs and runs them on a model of the backend. ``CALLS`` counts the handlers' own
runs (``--real-handlers``)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

from brokersched import (
    JobContext,
    PostgresBackend,
    RabbitMQBackend,
    RedisBackend,
    Scheduler,
    SQLiteBackend,
)

CALLS: Counter[str] = Counter()

outbox = Scheduler(RabbitMQBackend("amqp://guest:secret-password@127.0.0.1:5672/"))


@outbox.every("outbox.flush", "5s")
async def flush(ctx: JobContext) -> None:
    CALLS["outbox.flush"] += 1


@outbox.cron("digest", "*/2 * * * *", timezone="Europe/Paris")
def digest(ctx: JobContext) -> None:
    CALLS["digest"] += 1
    if CALLS["digest"] % 3 == 0:
        raise RuntimeError("the digest failed")  # the fleet goes on


ledger = Scheduler(PostgresBackend("postgresql://127.0.0.1/test"), jitter="1s")


@ledger.every("sync", "10s", overlap="skip", max_attempts=2)
async def sync(ctx: JobContext) -> None:
    """Replaced by a timed stand-in."""


@ledger.cron("report", "* * * * *", catch_up="5m")
async def report(ctx: JobContext) -> None:
    """Replaced by a timed stand-in."""


def empty() -> Scheduler[PostgresBackend]:
    return Scheduler(PostgresBackend("postgresql://127.0.0.1/test"))


per_instance = Scheduler(RedisBackend("redis://:secret-password@127.0.0.1:6379/0"))


@per_instance.every("cache.refresh", "10s", claim=False)
async def refresh(ctx: JobContext) -> None:
    """Every instance refreshes its own cache: nothing to judge."""


@per_instance.after("cache.warm", "2s", claim=False)
async def warm(ctx: JobContext) -> None:
    """Every instance warms its own cache at its start."""


@per_instance.every("outbox.flush", "5s")
async def flush_too(ctx: JobContext) -> None:
    """Claimed: judged."""


updated = Scheduler(SQLiteBackend("updated.db"))


@updated.every("export", "30s")
async def export(ctx: JobContext) -> None:
    await ctx.sleep(5)
    CALLS["export completed"] += 1


updated.get("export").update(timeout="1s")  # type: ignore[union-attr]

migration = Scheduler(SQLiteBackend("migration.db"))


@migration.at("migrate", datetime(2027, 1, 1, tzinfo=UTC))
async def migrate(ctx: JobContext) -> None:
    """Once, at a fixed instant."""

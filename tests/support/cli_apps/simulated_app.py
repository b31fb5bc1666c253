"""Applications for ``brokersched simulate``: the typical outbox flush on RabbitMQ, and a
PostgreSQL fleet whose jobs use the lease options. Neither talks to its server: the simulator
reads their jobs and runs them on a model of the backend. ``CALLS`` counts the handlers' own
runs (``--real-handlers``)."""

from __future__ import annotations

from collections import Counter

from brokersched import JobContext, PostgresBackend, RabbitMQBackend, Scheduler

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

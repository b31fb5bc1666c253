"""The transactional outbox, flushed by a brokersched job that runs on one instance per slot.

Each instance of this application takes orders (here: a few made-up ones) and writes every
order with its outbox row in one transaction. Every instance registers ``outbox.flush`` every
2 s; brokersched claims each slot through the backend, so one instance publishes the pending
rows of that slot. See README.md for running three instances against RabbitMQ.

    python examples/outbox/app.py                        # no server: SQLite + the log
    python examples/outbox/app.py --backend rabbitmq --sink rabbitmq --instance-id a
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
from typing import Any

from sinks import LogSink, RabbitMQSink, Sink
from store import Store

from brokersched import JobContext, Scheduler
from brokersched.abc import Backend

BATCH = 100  # rows per flush
LOCK_S = 30.0  # how long a flush may hold rows before another flush may take them

logger = logging.getLogger("outbox")


def build_backend(args: argparse.Namespace) -> Backend:
    """Where instances claim flush slots; the default needs no server."""
    if args.backend == "rabbitmq":
        from brokersched import RabbitMQBackend

        return RabbitMQBackend(args.amqp_url, prefix=args.prefix)
    if args.backend == "nats":
        from brokersched import NATSBackend

        return NATSBackend(args.nats_url, prefix=args.prefix)
    if args.backend == "postgres":
        from brokersched import PostgresBackend

        return PostgresBackend(args.postgres_dsn, schema=args.prefix.replace("-", "_"))
    from brokersched import SQLiteBackend

    return SQLiteBackend(args.db)  # its own tables, in the application's database file


def build_sink(args: argparse.Namespace) -> Sink:
    return RabbitMQSink(args.amqp_url, args.queue) if args.sink == "rabbitmq" else LogSink()


def build_scheduler(
    store: Store, sink: Sink, backend: Backend, instance_id: str | None
) -> Scheduler[Any]:
    scheduler: Scheduler[Any] = Scheduler(backend, instance_id=instance_id)

    @scheduler.every("outbox.flush", "2s", timeout="5s", max_late="10s")
    async def flush(ctx: JobContext) -> None:
        rows = await store.lock_pending(ctx.run_id, BATCH, LOCK_S)
        sent: list[str] = []
        try:
            for row in rows:
                await sink.publish(row)
                sent.append(row.id)
        finally:
            # Cut short (timeout, shutdown): still mark what the broker confirmed.
            if sent:
                await asyncio.shield(store.mark_sent(ctx.run_id, sent))
        if rows:
            ctx.logger.info("published %d outbox row(s)", len(sent))

    return scheduler


async def place_orders(store: Store, count: int, every_s: float) -> None:
    """Stand-in for the application's real work: ``count`` orders, one every ``every_s``."""
    for _ in range(count):
        customer = random.choice(["ada", "grace", "linus", "barbara"])
        await store.place_order(customer, random.randint(100, 10_000))
        await asyncio.sleep(every_s)
    logger.info("placed %d order(s)", count)


async def main(args: argparse.Namespace) -> None:
    store = Store(args.db)
    await store.open()
    sink = build_sink(args)
    await sink.start()
    scheduler = build_scheduler(store, sink, build_backend(args), args.instance_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with scheduler:  # on exit: stop() drains a flush in progress
            orders = asyncio.create_task(place_orders(store, args.orders, args.order_every))
            with contextlib.suppress(TimeoutError):  # --seconds passed
                await asyncio.wait_for(stop.wait(), args.seconds)
            orders.cancel()
    finally:
        await sink.stop()
        await store.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", choices=["sqlite", "rabbitmq", "nats", "postgres"], default="sqlite"
    )
    parser.add_argument("--sink", choices=["log", "rabbitmq"], default="log")
    parser.add_argument("--db", default="outbox.db", help="the application's SQLite database")
    parser.add_argument("--instance-id", help="name of this instance in logs and history")
    parser.add_argument("--orders", type=int, default=10, help="orders this instance places")
    parser.add_argument("--order-every", type=float, default=0.5, help="seconds between orders")
    parser.add_argument("--seconds", type=float, default=None, help="stop after (default: never)")
    parser.add_argument("--prefix", default="outbox-example", help="backend names prefix")
    parser.add_argument("--queue", default="outbox.orders", help="RabbitMQ queue of the sink")
    parser.add_argument(
        "--amqp-url", default=env("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    parser.add_argument("--nats-url", default=env("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument(
        "--postgres-dsn",
        default=env("BROKERSCHED_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    logging.basicConfig(
        level=arguments.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(main(arguments))

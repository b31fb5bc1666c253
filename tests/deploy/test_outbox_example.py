"""examples/outbox as its README runs it: three processes, one RabbitMQ, one shared store.

RabbitMQ holds both the claims of ``outbox.flush`` and the sink queue; the orders and the outbox
live in one SQLite file in a temporary directory. Every row must reach the queue exactly once
(by ``message_id``), and every flush slot must have run on one instance.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from brokersched._clock import SystemClock
from brokersched.abc import JobPolicy, RunRecord, Slot
from brokersched.backends.rabbitmq import RabbitMQBackend, claim_queue_name, history_queue_name
from tests.support.names import unique
from tests.support.paths import REPO_ROOT
from tests.support.rabbitmq_helpers import delete_queues, fleet_queues

ROOT = REPO_ROOT
APP = ROOT / "examples" / "outbox" / "app.py"
INSTANCES = 3
ORDERS_EACH = 10
JOB = "outbox.flush"


class Instance:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("w") as sink:
            self.process = subprocess.Popen(
                [sys.executable, str(APP), *args],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def output(self) -> str:
        return self.log.read_text()


def store_counts(db: Path) -> tuple[int, int]:
    """(outbox rows, rows not sent yet); (0, 0) before the first instance created the tables."""
    try:
        with sqlite3.connect(db, timeout=5) as conn:
            total, pending = conn.execute(
                "SELECT count(*), count(*) - count(sent_at) FROM outbox"
            ).fetchone()
    except sqlite3.OperationalError:  # no such table yet
        return 0, 0
    return total, pending


async def wait_until_all_sent(db: Path, expected: int, instances: list[Instance]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if store_counts(db) == (expected, 0):
            return
        for instance in instances:
            assert instance.process.poll() is None, instance.output()
        await asyncio.sleep(0.1)
    raise AssertionError(f"outbox not flushed: (rows, pending) = {store_counts(db)}")


@pytest.fixture
async def names(amqp_url: str) -> AsyncIterator[tuple[str, str]]:
    """A queue prefix and a sink queue of the test's own; deleted afterwards with the claims."""
    prefix = unique("outbox_test")
    queue = f"{prefix}.orders"
    yield prefix, queue
    history = RabbitMQBackend(amqp_url, prefix=prefix)
    await history.start(SystemClock())
    try:
        slots = [r.slot_ms for r in await history.history(JobPolicy(JOB), 1000)]
    finally:
        await history.stop()
    claims = [claim_queue_name(prefix, Slot(JOB, slot)) for slot in slots]
    await delete_queues(
        amqp_url, [queue, history_queue_name(prefix, JOB), *fleet_queues(prefix), *claims]
    )


async def consume_message_ids(amqp_url: str, queue: str) -> list[str]:
    import aio_pika

    ids: list[str] = []
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        source = await channel.declare_queue(queue, durable=True, passive=True)
        while (message := await source.get(no_ack=False, fail=False)) is not None:
            assert message.message_id is not None
            ids.append(message.message_id)
            await message.ack()
    return ids


async def read_history(amqp_url: str, prefix: str) -> list[RunRecord]:
    backend = RabbitMQBackend(amqp_url, prefix=prefix)
    await backend.start(SystemClock())
    try:
        return await backend.history(JobPolicy(JOB), 1000)
    finally:
        await backend.stop()


async def test_three_instances_publish_each_row_once(
    amqp_url: str, names: tuple[str, str], tmp_path: Path
) -> None:
    prefix, queue = names
    db = tmp_path / "store.db"
    common = ["--backend", "rabbitmq", "--sink", "rabbitmq", "--amqp-url", amqp_url]
    common += ["--prefix", prefix, "--queue", queue, "--db", str(db)]
    common += ["--orders", str(ORDERS_EACH), "--order-every", "0.15"]
    instances = [
        Instance([*common, "--instance-id", f"instance-{n}"], tmp_path / f"instance-{n}.log")
        for n in range(INSTANCES)
    ]
    try:
        await wait_until_all_sent(db, INSTANCES * ORDERS_EACH, instances)
    finally:
        codes = [instance.stop() for instance in instances]
    logs = "\n".join(instance.output() for instance in instances)
    assert codes == [0] * INSTANCES, logs

    with sqlite3.connect(db) as conn:
        rows = {row_id for (row_id,) in conn.execute("SELECT id FROM outbox")}
        orders = conn.execute("SELECT count(*) FROM orders").fetchone()[0]
    assert orders == len(rows) == INSTANCES * ORDERS_EACH

    published = Counter(await consume_message_ids(amqp_url, queue))
    assert set(published) == rows
    assert [row for row, count in published.items() if count != 1] == []

    runs = await read_history(amqp_url, prefix)
    slots = Counter(run.slot_ms for run in runs)
    assert runs and [slot for slot, count in slots.items() if count != 1] == []
    assert {run.instance_id for run in runs} <= {f"instance-{n}" for n in range(INSTANCES)}
    # a flush that SIGTERM caught mid-way is "interrupted"; none may fail
    assert {run.outcome for run in runs} <= {"completed", "interrupted"}
    assert all(slot % 2000 == 0 for slot in slots)  # the 2 s grid, aligned on the epoch


async def test_runs_with_no_server(tmp_path: Path) -> None:
    """The default: SQLite for the store and the claims, the log as the sink."""
    db = tmp_path / "store.db"
    instance = Instance(
        ["--db", str(db), "--orders", "2", "--order-every", "0.05"], tmp_path / "alone.log"
    )
    try:
        await wait_until_all_sent(db, 2, [instance])
    finally:
        code = instance.stop()
    assert code == 0, instance.output()
    assert instance.output().count("outbox.sink: published") == 2

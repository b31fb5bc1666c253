"""The application's database: orders, and their outbox rows written in the same transaction.

An order and the message announcing it are committed together or not at all; publishing is the
job of ``outbox.flush``. A flush *locks* the rows it is about to publish (``locked_by``,
``locked_until``) before it publishes them and marks them sent after the broker confirmed them,
so two flushes that overlap never publish the same row, and a flush that dies mid-batch leaves its
rows to the next flush once the lock expires (the consumer deduplicates by ``message_id``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiosqlite

SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS orders (
    id          TEXT PRIMARY KEY,
    customer    TEXT NOT NULL,
    total_cents INTEGER NOT NULL,
    created_at  TEXT NOT NULL
)""",
    """
CREATE TABLE IF NOT EXISTS outbox (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,  -- publishing order
    id           TEXT NOT NULL UNIQUE,               -- the AMQP message_id
    topic        TEXT NOT NULL,
    payload      TEXT NOT NULL,                      -- JSON
    created_at   TEXT NOT NULL,
    locked_by    TEXT,                               -- run_id of the flush publishing it
    locked_until REAL,                               -- Unix time the lock ends
    sent_at      TEXT
)""",
    "CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (seq) WHERE sent_at IS NULL",
)

_LOCK = """
UPDATE outbox SET locked_by = :run_id, locked_until = :until
WHERE seq IN (
    SELECT seq FROM outbox
    WHERE sent_at IS NULL AND (locked_until IS NULL OR locked_until < :now)
    ORDER BY seq LIMIT :limit
)
"""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: str
    topic: str
    payload: str


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class Store:
    """One connection per process; several processes share the file (WAL mode)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()  # one transaction at a time on the connection

    async def open(self) -> None:
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        await conn.execute("PRAGMA busy_timeout = 10000")  # first: other processes write too
        await conn.execute("PRAGMA journal_mode = WAL")
        self._conn = conn
        async with self._transaction() as tx:
            for statement in SCHEMA:
                await tx.execute(statement)

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        assert self._conn is not None, "open() the store first"
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE")  # take the write lock now, not midway
            try:
                yield self._conn
            except BaseException:
                await self._conn.execute("ROLLBACK")
                raise
            await self._conn.execute("COMMIT")

    async def place_order(self, customer: str, total_cents: int) -> str:
        """Write an order and its ``orders.placed`` message, atomically; returns the order id."""
        order_id = str(uuid.uuid4())
        created = _now()
        payload: dict[str, Any] = {"order_id": order_id, "customer": customer, "total": total_cents}
        async with self._transaction() as tx:
            await tx.execute(
                "INSERT INTO orders (id, customer, total_cents, created_at) VALUES (?, ?, ?, ?)",
                (order_id, customer, total_cents, created),
            )
            await tx.execute(
                "INSERT INTO outbox (id, topic, payload, created_at) VALUES (?, ?, ?, ?)",
                (str(uuid.uuid4()), "orders.placed", json.dumps(payload), created),
            )
        return order_id

    async def lock_pending(self, run_id: str, limit: int, lock_s: float) -> list[OutboxRow]:
        """Lock up to ``limit`` unsent rows for the flush ``run_id``, oldest first."""
        now = time.time()
        params = {"run_id": run_id, "until": now + lock_s, "now": now, "limit": limit}
        async with self._transaction() as tx:
            await tx.execute(_LOCK, params)
            rows = await tx.execute_fetchall(
                "SELECT id, topic, payload FROM outbox WHERE locked_by = ? AND sent_at IS NULL "
                "ORDER BY seq",
                (run_id,),
            )
        return [OutboxRow(*row) for row in rows]

    async def mark_sent(self, run_id: str, ids: list[str]) -> None:
        """Mark rows the broker confirmed; only while this flush still holds their lock."""
        async with self._transaction() as tx:
            await tx.executemany(
                "UPDATE outbox SET sent_at = ?, locked_by = NULL, locked_until = NULL "
                "WHERE id = ? AND locked_by = ?",
                [(_now(), row_id, run_id) for row_id in ids],
            )

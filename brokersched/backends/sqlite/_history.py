"""The run history of ``SQLiteBackend``: a job's records numbered in the statement that
writes them and trimmed right after, in the writer's transaction; read newest first."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...abc import JobPolicy, RunRecord
from .._sql import (
    datetime_to_us,
    history_cutoff,
    history_limit,
    result_text,
    run_record,
    us_to_datetime,
)
from ._connection import SQLiteCalls

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["SQLiteHistory"]


class SQLiteHistory(SQLiteCalls):
    """Records and reads of the history table."""

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        async def append(conn: aiosqlite.Connection) -> None:
            await self._append(conn, job, record)

        await self._run(f"record a run of {job.name}", append, transaction=True)

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """One transaction: all the records or none."""

        async def append(conn: aiosqlite.Connection) -> None:
            for policy, record in records:
                await self._append(conn, policy, record)

        await self._run(f"record {len(records)} runs", append, transaction=True)

    async def _append(self, conn: aiosqlite.Connection, job: JobPolicy, record: RunRecord) -> None:
        finished = record.finished_at
        rows = await conn.execute_fetchall(
            self._sql.insert_record,
            {
                "job": job.name,
                "slot_ms": record.slot_ms,
                "run_id": record.run_id,
                "instance_id": record.instance_id,
                "reason": record.reason,
                "attempt": record.attempt,
                "started_us": datetime_to_us(record.started_at),
                "finished_us": None if finished is None else datetime_to_us(finished),
                "outcome": record.outcome,
                "error": record.error,
                "traceback": record.traceback,
                "result": result_text(record.result),
            },
        )
        (n,) = next(iter(rows))
        await conn.execute(self._sql.trim_size, {"job": job.name, "n": n, "size": job.history_size})
        cutoff = history_cutoff(job, self._now())
        if cutoff is not None:
            params = {"job": job.name, "cutoff_us": datetime_to_us(cutoff)}
            await conn.execute(self._sql.trim_age, params)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        cutoff = history_cutoff(job, self._now())
        params = {
            "job": job.name,
            "cutoff_us": None if cutoff is None else datetime_to_us(cutoff),
            "limit": history_limit(job, limit),
        }

        async def read(conn: aiosqlite.Connection) -> Iterable[Sequence[Any]]:
            return await conn.execute_fetchall(self._sql.history, params)

        rows = await self._run(f"read the history of {job.name}", read)
        return [_history_record(row) for row in rows]


def _history_record(row: Sequence[Any]) -> RunRecord:
    """A row of ``_HISTORY``."""
    finished_us = row[11]
    finished = None if finished_us is None else us_to_datetime(finished_us)
    return run_record(row[:10], us_to_datetime(row[10]), finished)

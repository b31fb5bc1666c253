"""The run history of ``PostgresBackend``: a job's records numbered by a counter row and
trimmed in the statement that writes them (``_RECORD``, and ``_RELEASE_RECORDED`` when a
release writes its run's record), read newest first."""

from __future__ import annotations

from collections.abc import Sequence

from ...abc import JobPolicy, Lease, RunRecord
from .._lease import Ending
from .._sql import history_cutoff, history_limit, result_text, run_record
from ._connection import Connection, PostgresCalls, Row

__all__ = ["PostgresHistory"]


class PostgresHistory(PostgresCalls):
    """Records and reads of the ``history`` table."""

    def _release_args(
        self,
        lease: Lease,
        record: Ending,
        *,
        handover: bool = False,
    ) -> tuple[object, ...]:
        """``_RELEASE_RECORDED``'s arguments: the record's (none: no record written), then the
        lease's."""
        written = () if record is None else self._record_args(*record)
        padded = written or (None,) * 14
        return (*padded, lease.job, lease.slot_ms, lease.token, handover, bool(written))

    def _record_args(self, job: JobPolicy, record: RunRecord) -> tuple[object, ...]:
        return (
            job.name, record.slot_ms, record.run_id, record.instance_id, record.reason,
            record.attempt, record.started_at, record.finished_at, record.outcome, record.error,
            job.history_size, history_cutoff(job, self._now()), record.traceback,
            result_text(record.result),
        )  # fmt: skip

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        args = self._record_args(job, record)

        async def record_run(conn: Connection) -> None:
            await conn.execute(self._sql.record, *args)

        await self._call(f"record a run of {job.name}", record_run)

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """One pipelined round trip, in one transaction (asyncpg's ``executemany`` is atomic):
        all the records or none. In the order of job names (each job's records in their own
        order): a record locks its job's counter until the commit, and two batches taking
        the same jobs' locks in different orders would wait on each other."""
        ordered = sorted(records, key=lambda item: item[0].name)
        args = [self._record_args(policy, record) for policy, record in ordered]

        async def record_runs(conn: Connection) -> None:
            await conn.executemany(self._sql.record, args)

        await self._call(f"record {len(args)} runs", record_runs)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        args = (job.name, history_cutoff(job, self._now()), history_limit(job, limit))

        async def read(conn: Connection) -> list[Row]:
            return await conn.fetch(self._sql.history, *args)

        return [
            _run_record(row) for row in await self._call(f"read the history of {job.name}", read)
        ]


def _run_record(row: Row) -> RunRecord:
    fields = (
        "job", "slot_ms", "run_id", "instance_id", "reason", "attempt", "outcome", "error",
        "traceback", "result",
    )  # fmt: skip
    return run_record([row[field] for field in fields], row["started_at"], row["finished_at"])

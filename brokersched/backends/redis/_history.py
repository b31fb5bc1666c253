"""The history of both Redis backends: one list per job, ``P:{J}:history``, newest first, each
entry ``<started_ms>:<the record's JSON>``, trimmed by the scripts to the job's size and age
(``_scripts.RECORD``, and the lease backend's release and take-over)."""

from __future__ import annotations

from typing import Any

from ..._clock import datetime_to_ms
from ..._durations import to_ms
from ...abc import JobPolicy, RunRecord
from ._keys import history_key
from ._link import RedisLink

__all__ = ["history_entry", "history_ttl_args", "read_history", "record_run"]


def history_entry(record: RunRecord) -> str:
    """``<started_ms>:<the record's JSON>``: the scripts trim by age on the number alone."""
    return f"{datetime_to_ms(record.started_at)}:{record.to_json()}"


def history_ttl_args(redis: RedisLink, job: JobPolicy) -> list[str | int]:
    """The scripts' cutoff (ms, the scheduler's clock, like the records' times) and the
    history list's expiry, for ``history_ttl``; empty strings without one."""
    if job.history_ttl is None:
        return ["", ""]
    return [redis.now_ms() - to_ms(job.history_ttl), max(1, to_ms(job.history_ttl))]


async def record_run(redis: RedisLink, job: JobPolicy, record: RunRecord) -> None:
    args: list[str | int] = [
        history_entry(record),
        job.history_size,
        *history_ttl_args(redis, job),
    ]
    await redis.script(
        "RECORD", f"record a run of {job.name}", [history_key(redis.prefix, job.name)], args
    )


async def read_history(redis: RedisLink, job: JobPolicy, limit: int) -> list[RunRecord]:
    count = max(0, min(limit, job.history_size))
    if count == 0:
        return []
    key = history_key(redis.prefix, job.name)

    async def read(client: Any) -> list[bytes]:
        entries: list[bytes] = await client.lrange(key, 0, count - 1)
        return entries

    entries = await redis.call(f"read the history of {job.name}", read)
    cutoff = None if job.history_ttl is None else redis.now_ms() - to_ms(job.history_ttl)
    records: list[RunRecord] = []
    for entry in entries:
        started, _, text = entry.partition(b":")
        if cutoff is not None and int(started) < cutoff:
            continue
        records.append(RunRecord.from_json(text))
    return records

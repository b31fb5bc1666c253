"""How a run and its times are shown as JSON, alike by the CLI's ``--json`` and the admin API:
times in ISO 8601 UTC, and no error, traceback or result that has not been through ``redact``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from ._clock import datetime_to_ms, ms_to_datetime
from ._options import JobSettings
from ._redact import data_secrets, redact_text, scrub
from ._results import mask_result
from .abc import RunRecord

__all__ = ["iso", "record_json", "shown_error", "shown_result"]


class _HasSettings(Protocol):
    @property
    def settings(self) -> JobSettings: ...


def iso(value: datetime) -> str:
    """ISO 8601 in UTC with milliseconds and ``Z``."""
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def shown_error(text: str, job: _HasSettings | None) -> str:
    """An error message or a traceback as shown: URLs' passwords and ``password=`` values
    redacted, and every string of the job's ``data`` masked (a handler's error may quote it:
    ``KeyError: 'no account for sk-live-...'``; the runner masked them when it wrote the
    record, an earlier release or another backend may not have)."""
    text = redact_text(text)
    if job is None or job.settings.data is None:
        return text
    return scrub(text, data_secrets(job.settings.data))


def record_json(
    record: RunRecord, job: _HasSettings | None, *, duration: bool = False
) -> dict[str, Any]:
    """A run, every key always there; ``duration``: with ``duration_ms`` (the CLI's)."""
    finished = record.finished_at
    shown: dict[str, Any] = {
        "job": record.job,
        "slot_ms": record.slot_ms,
        "slot": iso(ms_to_datetime(record.slot_ms)),
        "run_id": record.run_id,
        "instance_id": record.instance_id,
        "reason": record.reason,
        "attempt": record.attempt,
        "started_at": iso(record.started_at),
        "finished_at": iso(finished) if finished is not None else None,
    }
    if duration:
        shown["duration_ms"] = (
            (finished - record.started_at) // timedelta(milliseconds=1) if finished else None
        )
    shown["late_ms"] = datetime_to_ms(record.started_at) - record.slot_ms
    shown["outcome"] = record.outcome
    shown["error"] = shown_error(record.error, job) if record.error else None
    shown["traceback"] = shown_error(record.traceback, job) if record.traceback else None
    shown["result"] = shown_result(record.result, job)
    return shown


def shown_result(result: Any, job: _HasSettings | None) -> Any:
    """A run's result as shown: its strings redacted as ``shown_error`` redacts an error."""
    if result is None:
        return None
    secrets = data_secrets(job.settings.data) if job is not None else ()
    return mask_result(result, secrets)

"""``SQLiteBackend``'s options, declared and checked in one call (``backends/_options``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from pydantic import ValidationInfo, field_validator

from .._lease import check_lock_wait
from .._options import LeaseOptions, backend_of, checked
from .._sql import check_identifier

__all__ = ["SQLiteOptions"]

_DEFAULT_BUSY_TIMEOUT = timedelta(seconds=5)


def _table_prefix(value: object, backend: str) -> str:
    return check_identifier(value, option="table_prefix", backend=backend, max_length=40)


class SQLiteOptions(LeaseOptions):
    table_prefix: Annotated[str, checked(_table_prefix)]
    #: Unset: 5 s, or a third of ``lease_ttl`` if shorter (``check_lock_wait``).
    busy_timeout: timedelta

    @field_validator("busy_timeout", mode="before")
    @classmethod
    def _lock_wait(cls, value: Any, info: ValidationInfo) -> timedelta:
        lease_ttl = info.data.get("lease_ttl", timedelta.max)  # absent: its own error is first
        return check_lock_wait(
            value,
            lease_ttl,
            option="busy_timeout",
            default=_DEFAULT_BUSY_TIMEOUT,
            backend=backend_of(info),
        )

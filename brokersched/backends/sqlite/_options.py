"""``SQLiteBackend``'s options, declared and checked in one call (``backends/_options``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from pydantic import ValidationInfo, field_validator

from ..._durations import format_duration
from ..._exceptions import ConfigurationError
from .._options import LeaseOptions, backend_of, checked, duration
from .._sql import check_identifier

__all__ = ["SQLiteOptions", "check_table_prefix"]

_DEFAULT_BUSY_TIMEOUT = timedelta(seconds=5)


check_table_prefix = check_identifier("table_prefix", 40)


class SQLiteOptions(LeaseOptions):
    table_prefix: Annotated[str, checked(check_table_prefix)]
    busy_timeout: timedelta

    @field_validator("busy_timeout", mode="before")
    @classmethod
    def _lock_wait(cls, value: Any, info: ValidationInfo) -> timedelta:
        """How long a statement waits for another process's lock: at most a third of
        ``lease_ttl``, as the runner renews every third, and a release (or renewal) left
        waiting longer could land after the lease expired, when another instance has already
        restarted the slot. Unset: 5 s, or a third of ``lease_ttl`` if shorter."""
        # lease_ttl absent: it was refused, and its error comes first.
        lease_ttl: timedelta = info.data.get("lease_ttl", timedelta.max)
        bound = lease_ttl / 3
        if value is None:
            return min(_DEFAULT_BUSY_TIMEOUT, bound)
        wait = duration(value, info)
        if wait > bound:
            raise ConfigurationError(
                f"busy_timeout ({format_duration(wait)}) of {backend_of(info)} must be at most "
                f"a third of lease_ttl ({format_duration(lease_ttl)}): a release or renewal "
                f"waiting {format_duration(wait)} for another process's lock can land after the "
                "lease expired, and another instance runs the slot again; raise lease_ttl to "
                f"{format_duration(wait * 3)} or more, or lower busy_timeout to "
                f"{format_duration(bound)} or less (or leave it unset)",
                option="busy_timeout",
                backend=backend_of(info),
            )
        return wait

"""``at``: one instant."""

from __future__ import annotations

from datetime import datetime, timedelta

from .._clock import datetime_to_ms, ms_to_datetime
from .._exceptions import ConfigurationError
from .base import Trigger

__all__ = ["AtTrigger", "parse_when"]


def parse_when(value: object) -> datetime:
    """An ``at`` override's instant: a datetime, or an ISO 8601 string with its offset (from
    JSON configuration); other values are left for ``AtTrigger`` to refuse."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            raise ConfigurationError(
                f"at {value!r} is not an ISO 8601 instant such as '2027-01-15T08:00:00+00:00'",
                option="at",
            ) from None
    return value  # type: ignore[return-value]  # AtTrigger refuses what is not a datetime


class AtTrigger(Trigger):
    """Fires once, at ``when``."""

    kind = "at"
    __slots__ = ("_when_ms", "when")

    def __init__(self, when: datetime) -> None:
        if not isinstance(when, datetime):
            raise ConfigurationError(
                f"at() takes a datetime, not {type(when).__name__} {when!r}", option="when"
            )
        if when.tzinfo is None:
            raise ConfigurationError(
                f"at() needs an aware datetime; {when.isoformat()} has no time zone "
                "(use datetime(..., tzinfo=UTC) or ZoneInfo)",
                option="when",
            )
        self._when_ms = datetime_to_ms(when)
        self.when = ms_to_datetime(self._when_ms)

    def next_ms(self, after_ms: int) -> int | None:
        return self._when_ms if self._when_ms > after_ms else None

    def min_gap(self) -> timedelta | None:
        return None

    def describe(self) -> str:
        return f"at {self.when.isoformat()}"

"""``every``: a period on a grid aligned to the Unix epoch, shifted by an offset."""

from __future__ import annotations

from datetime import timedelta

from .._durations import format_duration, to_ms
from .._exceptions import ConfigurationError
from .base import Trigger

__all__ = ["IntervalTrigger"]


class IntervalTrigger(Trigger):
    """Fires at ``k * interval + offset`` ms since the epoch, for every integer ``k``.

    Every replica computes the same slots whenever it started, and a restart never shifts them.
    """

    kind = "every"
    __slots__ = ("_interval_ms", "_offset_ms", "interval", "offset")

    def __init__(self, interval: timedelta, offset: timedelta = timedelta(0)) -> None:
        self._interval_ms = to_ms(interval)
        self._offset_ms = to_ms(offset)
        if self._interval_ms < 1:
            raise ConfigurationError(
                f"interval {format_duration(interval)} must be at least 1ms", option="interval"
            )
        if not 0 <= self._offset_ms < self._interval_ms:
            raise ConfigurationError(
                f"offset {format_duration(offset)} must be >= 0 and smaller than the interval "
                f"({format_duration(interval)})",
                option="offset",
            )
        self.interval = interval
        self.offset = offset

    def next_ms(self, after_ms: int) -> int:
        periods = (after_ms - self._offset_ms) // self._interval_ms + 1
        return periods * self._interval_ms + self._offset_ms

    def latest_ms(self, at_or_before_ms: int, window_ms: int) -> int | None:
        latest = self.next_ms(at_or_before_ms) - self._interval_ms
        return latest if latest > at_or_before_ms - window_ms else None

    def min_gap(self) -> timedelta:
        return self.interval

    def describe(self) -> str:
        text = f"every {format_duration(self.interval)}"
        return f"{text} + {format_duration(self.offset)}" if self._offset_ms else text

"""What every trigger answers: when it fires next."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime, timedelta

from .._clock import datetime_to_ms, ms_to_datetime

__all__ = ["Trigger"]


class Trigger(ABC):
    """A schedule: a strictly increasing sequence of instants in UTC milliseconds."""

    kind: str  # "every", "cron" or "at"

    @abstractmethod
    def next_ms(self, after_ms: int) -> int | None:
        """The first fire time strictly after ``after_ms``, or ``None`` if it never fires again."""

    @abstractmethod
    def min_gap(self) -> timedelta | None:
        """The shortest time between two fires (over the next year for cron); ``None`` if it
        fires at most once."""

    @abstractmethod
    def describe(self) -> str:
        """A short description: ``"every 5s"``, ``"cron '0 8 * * *' (Europe/Paris)"``."""

    def latest_ms(self, at_or_before_ms: int, window_ms: int) -> int | None:
        """The last fire time in ``(at_or_before_ms - window_ms, at_or_before_ms]``, if any."""
        latest = None
        fire = self.next_ms(at_or_before_ms - window_ms)
        while fire is not None and fire <= at_or_before_ms:
            latest = fire
            fire = self.next_ms(fire)
        return latest

    def next_runs(self, n: int, after: datetime | None = None) -> list[datetime]:
        """The next ``n`` fire times after ``after`` (default: now) as aware UTC datetimes."""
        if after is None:
            after = datetime.now().astimezone()
        cursor: int | None = datetime_to_ms(after)
        runs: list[datetime] = []
        while len(runs) < n and cursor is not None:
            cursor = self.next_ms(cursor)
            if cursor is not None:
                runs.append(ms_to_datetime(cursor))
        return runs

"""``after``: once, a delay after the scheduler starts (or after the job is added to a running
scheduler). Its one run is not a slot of the schedule: the scheduler arms it at start, as it
arms the boot run of ``run_on_start`` jobs."""

from __future__ import annotations

from datetime import timedelta

from .._durations import format_duration, to_ms
from .._exceptions import ConfigurationError
from .base import Trigger

__all__ = ["AfterTrigger"]


class AfterTrigger(Trigger):
    """No slot on the clock: ``next_ms`` is always ``None``; ``delay`` says when the one run
    comes, counted from ``start()``."""

    kind = "after"
    __slots__ = ("delay", "delay_ms")

    def __init__(self, delay: timedelta) -> None:
        if delay < timedelta(0):
            raise ConfigurationError(
                f"delay {format_duration(delay)} must be 0 or more", option="delay"
            )
        self.delay = delay
        self.delay_ms = to_ms(delay)

    def next_ms(self, after_ms: int) -> int | None:
        return None

    def min_gap(self) -> timedelta | None:
        return None

    def describe(self) -> str:
        return f"once, {format_duration(self.delay)} after start"

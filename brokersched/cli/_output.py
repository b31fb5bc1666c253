"""How the commands print: the console, times, durations and the backend's name."""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

from rich.console import Console

from .._durations import format_duration
from .._redact import redact_text
from .._scheduler import Scheduler
from ..abc import Backend, RunRecord

__all__ = [
    "WIDE",
    "ago",
    "clock_time",
    "duration_of",
    "local_time",
    "make_console",
    "shown_backend",
    "utc_time",
]


def make_console() -> Console:
    # Piped output is not cut at 80 columns: a table row stays one line for grep.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=200 if wide else None, highlight=False)


def clock_time(value: datetime) -> str:
    """``2027-01-15 08:00:00``, with milliseconds only when there are some."""
    text = value.strftime("%Y-%m-%d %H:%M:%S")
    return f"{text}.{value.microsecond // 1000:03d}" if value.microsecond else text


def local_time(value: datetime, zone: tzinfo) -> str:
    local = value.astimezone(zone)
    return f"{clock_time(local)} {local.strftime('%Z')}".strip()


def utc_time(value: datetime) -> str:
    return f"{clock_time(value.astimezone(UTC))}Z"


def shown_backend(scheduler: Scheduler[Any]) -> str:
    backend: Backend = scheduler.backend
    if "__repr__" not in vars(type(backend)):  # no useful repr: the class name will do
        return f"{backend.name}()"
    return redact_text(repr(backend))


def duration_of(record: RunRecord) -> str:
    if record.finished_at is None:
        return "-"
    elapsed = record.finished_at - record.started_at
    if elapsed < timedelta(seconds=1):  # "0ms" rather than format_duration's "0s"
        return f"{elapsed // timedelta(milliseconds=1)}ms"
    return format_duration(elapsed)


# Below this many columns (an 80-column terminal), tables drop or merge their less important
# columns; piped output is 200 wide and keeps them all (see make_console).
WIDE = 120


def ago(elapsed: timedelta) -> str:
    seconds = max(0, int(elapsed.total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    return format_duration(timedelta(minutes=seconds // 60))

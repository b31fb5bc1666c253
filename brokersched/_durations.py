"""Durations: ``timedelta``, a number of seconds, or a string such as ``"1h30m"``."""

from __future__ import annotations

import math
import re
from datetime import timedelta

from ._exceptions import ConfigurationError

__all__ = ["Duration", "format_duration", "parse_duration", "to_ms"]

Duration = timedelta | int | float | str

_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w))+")
_ZERO = re.compile(r"0+(?:\.0*)?")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_ACCEPTED = "a timedelta, a number of seconds, or a string like '250ms', '2s', '35m', '1h30m', '1d'"
# Longer would put slots and boot runs past the year 9999 (or overflow ``timedelta``).
_LONGEST = timedelta(days=36_500)


def parse_duration(value: Duration, *, name: str = "duration") -> timedelta:
    """Turn ``value`` into a ``timedelta``; ``name`` is used in the error message.

    Negative values and values over 100 years are refused; whether zero is acceptable is for
    the caller to decide.
    """
    try:
        result = _parse(value, name)
    except OverflowError:
        result = timedelta.min if isinstance(value, int | float) and value < 0 else timedelta.max
    if result < timedelta(0):
        raise ConfigurationError(f"{name} {value!r} is negative; a duration must be >= 0")
    if result > _LONGEST:
        raise ConfigurationError(
            f"{name} {value!r} is too long; a duration must be at most 36500d (100 years)"
        )
    return result


def _parse(value: Duration, name: str) -> timedelta:
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, bool):
        raise ConfigurationError(f"{name} {value!r} is not a duration; use {_ACCEPTED}")
    elif isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigurationError(f"{name} {value!r} is not a finite duration; use {_ACCEPTED}")
        result = timedelta(seconds=value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.startswith("-") and _WHOLE.fullmatch(text[1:]):
            raise ConfigurationError(
                f"{name} {value!r} is negative; a duration must be >= 0 (write '{text[1:]}')"
            )
        if _ZERO.fullmatch(text):
            result = timedelta(0)  # zero needs no unit
        elif not _WHOLE.fullmatch(text):
            hint = f"add a unit, e.g. '{text}s'; " if _NUMBER.fullmatch(text) else ""
            raise ConfigurationError(f"{name} {value!r} is not a duration; {hint}use {_ACCEPTED}")
        else:
            ms = sum(float(number) * _UNITS_MS[unit] for number, unit in _PART.findall(text))
            result = timedelta(milliseconds=ms)
    else:
        raise ConfigurationError(
            f"{name} {value!r} ({type(value).__name__}) is not a duration; use {_ACCEPTED}"
        )
    return result


def to_ms(value: timedelta) -> int:
    """Whole milliseconds in ``value`` (rounded)."""
    return round(value / timedelta(milliseconds=1))


def format_duration(value: timedelta) -> str:
    """The shortest string ``parse_duration`` reads back: ``"1h30m"``, ``"250ms"``, ``"0s"``."""
    ms = to_ms(value)
    if ms == 0:
        return "0s"
    parts: list[str] = []
    for unit in ("d", "h", "m", "s", "ms"):
        size = _UNITS_MS[unit]
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)

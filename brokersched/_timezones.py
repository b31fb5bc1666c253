"""Time zones: read what users write, name it back, and find where a zone's UTC offset changes.

``parse_timezone`` accepts an IANA name (``"Europe/Paris"``, through ``zoneinfo`` and the
``tzdata`` package), ``"UTC"``/``"Z"``, a fixed offset (``"+05:30"``, ``"-0800"``, ``"+05"``) or
a ``tzinfo``. Names are kept as written: ``"US/Eastern"`` stays ``"US/Eastern"``.

``OffsetTimeline`` answers the questions the cron trigger's daylight-saving layer asks: the UTC
offset at an instant, and the *transitions* (instants where the offset changes) in a range. It
only ever converts UTC instants to local time (``tzinfo.fromutc``), never the other way, so it
works with any correct ``tzinfo``, including ones that ignore PEP 495 ``fold``.
"""

from __future__ import annotations

import difflib
import re
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from functools import lru_cache
from typing import NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from ._exceptions import ConfigurationError

__all__ = [
    "OffsetTimeline",
    "Transition",
    "parse_timezone",
    "timeline_for",
    "timezone_name",
]

_OFFSET = re.compile(r"([+-])(\d{2})(?::?(\d{2}))?")
_UTC_SPELLINGS = frozenset({"utc", "z"})
_SUGGESTION_SPREAD = 0.1
_ACCEPTED = "an IANA name such as 'Europe/Paris', 'UTC', or a fixed offset such as '+05:30'"

_ONE_MS = timedelta(milliseconds=1)
# Offsets are sampled this often; a change of offset that is undone within one step would be
# missed. Since 1970 no zone in tzdata has two transitions less than six days apart.
_STEP_MS = 3_600_000
_CHUNK_MS = 32 * 24 * _STEP_MS
_MAX_CACHED_CHUNKS = 1024


def parse_timezone(value: str | tzinfo) -> tzinfo:
    """The ``tzinfo`` for ``value``; raises ``ConfigurationError`` (``option="timezone"``)."""
    if isinstance(value, tzinfo):
        return value
    if not isinstance(value, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ConfigurationError(
            f"time zone {value!r} ({type(value).__name__}) is not a time zone; use {_ACCEPTED}",
            option="timezone",
        )
    text = value.strip()
    if not text:
        raise ConfigurationError(f"time zone is empty; use {_ACCEPTED}", option="timezone")
    if text.lower() in _UTC_SPELLINGS:
        return UTC
    if text[:1] in ("+", "-"):
        return _parse_offset(text)
    try:
        return ZoneInfo(text)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        # OSError: a directory of the database ("America"); ValueError: not a relative key.
        raise ConfigurationError(_unknown_zone_message(text), option="timezone") from None


def timezone_name(tz: tzinfo) -> str:
    """A printable name for ``tz``: the IANA key as written, ``"UTC"``, or the offset."""
    if tz is UTC:
        return "UTC"
    key = getattr(tz, "key", None) or getattr(tz, "zone", None)  # zoneinfo, then pytz
    if isinstance(key, str):
        return key
    name = tz.tzname(None)
    return name if name else repr(tz)


def _parse_offset(text: str) -> tzinfo:
    match = _OFFSET.fullmatch(text)
    if match is None:
        raise ConfigurationError(
            f"time zone offset '{text}' is not valid; write it like '+05:30', '-0800' or '+05'",
            option="timezone",
        )
    sign, hours, minutes = match.group(1), int(match.group(2)), int(match.group(3) or 0)
    if hours > 23 or minutes > 59:
        raise ConfigurationError(
            f"time zone offset '{text}' is out of range -23:59 to +23:59", option="timezone"
        )
    offset = timedelta(hours=hours, minutes=minutes)
    # Named as written, so that describe() and logs show what the user typed.
    return timezone(-offset if sign == "-" else offset, text)


def _unknown_zone_message(text: str) -> str:
    suggestions = _closest_zones(text)
    if not suggestions:
        return f"unknown time zone '{text}'; use {_ACCEPTED}"
    quoted = [f"'{name}'" for name in suggestions]
    choices = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"unknown time zone '{text}'; did you mean {choices}?"


def _closest_zones(text: str) -> list[str]:
    """Up to three names about as close to ``text`` as the closest one."""
    # Compared without case, because "europe/paris" is a typo too.
    by_lower = _zones_by_lower_name()
    wanted = text.lower()
    matches = difflib.get_close_matches(wanted, by_lower, n=3, cutoff=0.6)
    ratios = [difflib.SequenceMatcher(None, wanted, match).ratio() for match in matches]
    # "Europe/Pari" suggests only Europe/Paris, not also Europe/Madrid and Europe/Riga.
    return [
        by_lower[match]
        for match, ratio in zip(matches, ratios, strict=True)
        if ratio >= ratios[0] - _SUGGESTION_SPREAD
    ]


@lru_cache(maxsize=1)
def _zones_by_lower_name() -> dict[str, str]:
    return {name.lower(): name for name in sorted(available_timezones())}


class Transition(NamedTuple):
    """An instant where a zone's UTC offset changes (all values in milliseconds)."""

    at_ms: int  # the first instant, in UTC ms since the epoch, with the new offset
    offset_before_ms: int
    offset_after_ms: int

    @property
    def is_gap(self) -> bool:
        """Clocks jump forward: the local times in between do not exist."""
        return self.offset_after_ms > self.offset_before_ms


class OffsetTimeline:
    """The UTC offsets of one zone over time.

    Transitions are found by sampling the offset every hour and bisecting each change down to
    the millisecond, a 32-day chunk at a time; chunks are cached, so a zone is scanned once.
    """

    def __init__(self, tz: tzinfo) -> None:
        self._tz = tz
        self._fixed_ms = _fixed_offset_ms(tz)
        self._chunks: dict[int, tuple[Transition, ...]] = {}

    def offset_ms(self, at_ms: int) -> int:
        """The UTC offset in force at the UTC instant ``at_ms``."""
        if self._fixed_ms is not None:
            return self._fixed_ms
        offset = datetime.fromtimestamp(at_ms / 1000, self._tz).utcoffset()
        return 0 if offset is None else offset // _ONE_MS

    def first_transition(self, after_ms: int, until_ms: int) -> Transition | None:
        """The first transition in ``(after_ms, until_ms]``, if any."""
        if self._fixed_ms is not None:
            return None
        for chunk in range(after_ms // _CHUNK_MS, (until_ms - 1) // _CHUNK_MS + 1):
            for transition in self._chunk(chunk):
                if after_ms < transition.at_ms <= until_ms:
                    return transition
        return None

    def last_transition(self, at_or_before_ms: int, since_ms: int) -> Transition | None:
        """The last transition in ``(since_ms, at_or_before_ms]``, if any."""
        if self._fixed_ms is not None:
            return None
        for chunk in range((at_or_before_ms - 1) // _CHUNK_MS, since_ms // _CHUNK_MS - 1, -1):
            for transition in reversed(self._chunk(chunk)):
                if since_ms < transition.at_ms <= at_or_before_ms:
                    return transition
        return None

    def _chunk(self, chunk: int) -> tuple[Transition, ...]:
        """The transitions in ``(chunk * _CHUNK_MS, (chunk + 1) * _CHUNK_MS]``."""
        found = self._chunks.get(chunk)
        if found is None:
            if len(self._chunks) >= _MAX_CACHED_CHUNKS:
                self._chunks.clear()
            found = self._chunks[chunk] = self._scan(chunk * _CHUNK_MS)
        return found

    def _scan(self, start_ms: int) -> tuple[Transition, ...]:
        found: list[Transition] = []
        low, low_offset = start_ms, self.offset_ms(start_ms)
        for high in range(start_ms + _STEP_MS, start_ms + _CHUNK_MS + 1, _STEP_MS):
            high_offset = self.offset_ms(high)
            if high_offset != low_offset:
                self._bisect(low, low_offset, high, high_offset, found)
            low, low_offset = high, high_offset
        return tuple(found)

    def _bisect(
        self, low: int, low_offset: int, high: int, high_offset: int, found: list[Transition]
    ) -> None:
        """Append the transitions in ``(low, high]``, whose ends have different offsets."""
        while high - low > 1:
            middle = (low + high) // 2
            middle_offset = self.offset_ms(middle)
            if middle_offset != low_offset and middle_offset != high_offset:
                # Two changes inside one step: find both.
                self._bisect(low, low_offset, middle, middle_offset, found)
                low, low_offset = middle, middle_offset
            elif middle_offset == low_offset:
                low = middle
            else:
                high = middle
        found.append(Transition(high, low_offset, high_offset))


def timeline_for(tz: tzinfo) -> OffsetTimeline:
    """A shared ``OffsetTimeline`` for ``tz`` (a fresh one if ``tz`` is not hashable)."""
    try:
        return _shared_timeline(tz)
    except TypeError:  # e.g. dateutil zones define __eq__ without __hash__
        return OffsetTimeline(tz)


@lru_cache(maxsize=64)
def _shared_timeline(tz: tzinfo) -> OffsetTimeline:
    return OffsetTimeline(tz)


def _fixed_offset_ms(tz: tzinfo) -> int | None:
    if isinstance(tz, timezone):
        offset = tz.utcoffset(None)
        return offset // _ONE_MS
    return None

"""The cron trigger: croniter matches naive wall-clock times; this module maps them to UTC.

croniter parses the expression and finds the next *naive* local time that matches; it is never
given an aware datetime, because its own time-zone handling is not Vixie cron's. Local times
become UTC instants under Vixie cron's daylight-saving rules:

* a *fixed-time* job (minute and hour fields not starting with ``*``) whose local time falls in
  a spring gap fires once, at the first instant after the gap, however many of its times fall
  in the gap; a local time that occurs twice (autumn fold) fires at its first occurrence only;
* a job whose minute or hour field starts with ``*`` follows real time: in a fold the repeated
  times fire again, in a gap the missing times do not exist.

So a fixed-time daily job never runs twice nor is skipped around a switch. (Where a gap ends
at midnight, as America/Nuuk's does, springing forward from 23:00, a 23:xx run comes at 00:00
the next day: the first instant after the gap.)

A fixed-time job may choose another policy with ``dst=`` (``DST_POLICIES``):

* ``"run-once"`` (the default): the rules above;
* ``"skip"``: a local time in a spring gap does not fire at all; a fold fires once, at the first
  occurrence, as with ``"run-once"``;
* ``"run-twice"``: a gap as with ``"run-once"``; a local time in a fold fires at both of its
  occurrences (two instants, so two distinct slots).

A job whose minute or hour field starts with ``*`` has no policy to choose: it follows real
time, and ``dst=`` is refused for it rather than silently ignored.

Days follow Vixie cron (and cronie) too: when the day-of-month or the day-of-week field starts
with ``*`` (``*``, ``*/2``; ``?`` counts as ``*``), a day must match *both* fields; only when
neither does is a day matching *either* one enough. So ``15 1-3 */2 * 1-5`` fires on odd days
that are weekdays, ``0 0 1 * MON`` on the 1st and on every Monday, ``0 0 1-31 * MON`` every day.
croniter is told which with its ``day_or`` flag, by every search: the schedule, the
daylight-saving layer (it searches through the same croniter) and the never-fires probe.

The mapping works on *segments*: stretches of UTC time with one UTC offset, separated by the
zone's transitions (``OffsetTimeline``). Inside a segment local time is UTC plus a constant, so
the first fire is croniter's first match after the local time; when that match lies beyond the
next transition, the search restarts in the next segment. No rule assumes that a transition
moves clocks by one hour (Australia/Lord_Howe moves them by 30 minutes).
"""

from __future__ import annotations

import functools
import re
import threading
import time
from array import array
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Literal, get_args

from croniter import (
    HOUR_FIELD,
    MINUTE_FIELD,
    SECOND_FIELD,
    CroniterBadDateError,
    CroniterError,
    croniter,
)

from .._exceptions import ConfigurationError
from .._timezones import Transition, parse_timezone, timeline_for, timezone_name
from .base import Trigger

__all__ = ["DST_POLICIES", "CronTrigger", "DstPolicy", "parse_cron", "parse_dst"]

DstPolicy = Literal["skip", "run-once", "run-twice"]
#: What a fixed-time job does with a local time that a switch skips or repeats.
DST_POLICIES: tuple[DstPolicy, ...] = get_args(DstPolicy)
DEFAULT_DST: DstPolicy = "run-once"

_DAY_MS = 86_400_000
_ONE_MS = timedelta(milliseconds=1)
_NAIVE_EPOCH = datetime(1970, 1, 1)
# Datetime arithmetic ends in year 9999; the schedule stops well before.
_LAST_MS = int(datetime(9000, 1, 1, tzinfo=UTC).timestamp()) * 1000
# Longer than any fold, so a fixed-time job still sees the transition it has just crossed.
_LOOKBACK_MS = 2 * _DAY_MS
# Between 1901 and 2099 the calendar repeats every 28 years: a schedule that fires at all
# fires within that span.
_NEVER_FIRES_YEARS = 29
_MIN_GAP_WINDOW_MS = 366 * _DAY_MS
_MAX_KNOWN_DAYS = 4096

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_FIELD_SEPARATOR = re.compile(
    r"[^ \t\r\n\f\v]+"
)  # not str.split(): no-break spaces are not separators
_NUMBER = re.compile(r"[0-9]+")
_HASHED = re.compile(r"[HR](?:\(|/|$)", re.IGNORECASE)
_NEAREST_WEEKDAY = re.compile(r"([0-9]+)W", re.IGNORECASE)


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: Mapping[str, int] = field(default_factory=dict[str, int])


_SECOND = _Field("second", 0, 59)
_MINUTE = _Field("minute", 0, 59)
_HOUR = _Field("hour", 0, 23)
_DAY_OF_MONTH = _Field("day-of-month", 1, 31)
_MONTH = _Field(
    "month",
    1,
    12,
    {
        name: number
        for number, name in enumerate(
            ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"), 1
        )
    },
)
_DAY_OF_WEEK = _Field(
    "day-of-week",
    0,
    7,
    {name: number for number, name in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))},
)
_FIVE_FIELDS = (_MINUTE, _HOUR, _DAY_OF_MONTH, _MONTH, _DAY_OF_WEEK)
_SIX_FIELDS = (_SECOND, *_FIVE_FIELDS)


@dataclass(frozen=True)
class _Spec:
    """A validated expression and what croniter is given for it."""

    croniter_expression: str
    with_seconds: bool
    fixed_time: bool  # neither the minute nor the hour field starts with "*"
    day_or: bool  # neither day field starts with "*": a day matches either (else both)
    day_fields: tuple[str, str]  # day-of-month and day-of-week as written, for messages


def parse_cron(
    expression: str, timezone: str | tzinfo = "UTC", *, dst: DstPolicy | None = None
) -> CronTrigger:
    """Validate ``expression`` in ``timezone`` and return its trigger.

    As in Vixie cron, a day must match both day fields when either starts with ``*``
    (``0 0 */2 * MON-FRI``: odd days that are weekdays), and either field otherwise
    (``0 0 1 * MON``: the 1st and every Monday). ``dst`` is the daylight-saving policy of a
    fixed-time expression (module docstring); ``None`` is ``"run-once"``.

    Raises ``ConfigurationError`` (``option="cron"``, ``"timezone"`` or ``"dst"``) naming what
    is wrong.
    """
    return _shared_cron(expression, timezone, dst)


@functools.lru_cache(maxsize=4096)
def _shared_cron(expression: str, timezone: str | tzinfo, dst: DstPolicy | None) -> CronTrigger:
    """The trigger of ``expression`` in ``timezone``, built once (a trigger answers the same
    to every job, and checking one walks a year of its fires: a thousand tenants' schedules
    share a few dozen expressions)."""
    return CronTrigger(expression, timezone, dst=dst)


def parse_dst(value: object) -> DstPolicy:
    """``value`` as a daylight-saving policy; raises ``ConfigurationError`` (``option="dst"``)."""
    for policy in DST_POLICIES:
        if value == policy:
            return policy
    accepted = ", ".join(repr(policy) for policy in DST_POLICIES)
    raise ConfigurationError(
        f"option 'dst' = {value!r} is not a daylight-saving policy; accepted: {accepted}",
        option="dst",
    )


class CronTrigger(Trigger):
    """A cron expression in a time zone; see the module docstring for daylight saving."""

    kind = "cron"

    def __init__(
        self, expression: str, timezone: str | tzinfo = "UTC", *, dst: DstPolicy | None = None
    ) -> None:
        if not isinstance(expression, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ConfigurationError(
                f"cron expression {expression!r} ({type(expression).__name__}) is not a string",
                option="cron",
            )
        self._expression = expression.strip()
        spec = _parse(self._expression)
        self._tz = parse_timezone(timezone)
        self._timezone_name = timezone_name(self._tz)
        self._fixed_time = spec.fixed_time
        self._dst = _checked_dst(dst, spec, self._expression)
        self._wall_clock = _WallClock(spec, self._expression)
        _refuse_never_firing(spec, self._expression)
        self._timeline = timeline_for(self._tz)
        self._min_gap: timedelta | None = None

    @property
    def expression(self) -> str:
        """The expression as written (without surrounding spaces)."""
        return self._expression

    @property
    def timezone(self) -> tzinfo:
        return self._tz

    @property
    def timezone_name(self) -> str:
        return self._timezone_name

    @property
    def dst(self) -> DstPolicy | None:
        """The daylight-saving policy given (``None``: the default, ``"run-once"``)."""
        return self._dst

    @property
    def dst_rule(self) -> str:
        """What a switch does to this job: its policy, or ``"real time"`` for a job whose minute
        or hour field starts with ``*``."""
        return (self._dst or DEFAULT_DST) if self._fixed_time else "real time"

    def describe(self) -> str:
        shown = (
            self._timezone_name if self._dst is None else f"{self._timezone_name}, dst={self._dst}"
        )
        return f"cron '{self._expression}' ({shown})"

    def __repr__(self) -> str:
        dst = "" if self._dst is None else f", dst={self._dst!r}"
        return f"CronTrigger({self._expression!r}, timezone={self._timezone_name!r}{dst})"

    def next_ms(self, after_ms: int) -> int | None:
        start = after_ms + 1
        if start >= _LAST_MS:
            return None
        offset = self._timeline.offset_ms(start)
        segment_start = self._recent_transition(start)
        while True:
            fire = self._first_fire_in_segment(start, offset, segment_start)
            if fire is None:
                return None
            crossing = self._timeline.first_transition(start, fire)
            if crossing is None:
                return fire if fire < _LAST_MS else None
            start, offset = crossing.at_ms, crossing.offset_after_ms
            segment_start = crossing if self._fixed_time else None

    def min_gap(self) -> timedelta:
        """The shortest time between two consecutive fires over the next year (cached).

        Daylight saving can shorten it: ``0 2 * * *`` in Europe/Paris fires at 03:00 CEST on
        the spring-forward day (the first instant after the gap), 24h after the day before,
        then at 02:00 CEST the next day, 23h later; so a year that holds a spring transition
        gives 23h.
        """
        if self._min_gap is None:
            now_ms = time.time_ns() // 1_000_000
            gap = self.min_gap_between(now_ms, now_ms + _MIN_GAP_WINDOW_MS)
            if gap is None:  # pragma: no cover - parse time refuses schedules that stop firing
                raise RuntimeError(f"{self.describe()} does not fire twice after now")
            self._min_gap = gap
        return self._min_gap

    def min_gap_between(self, start_ms: int, end_ms: int) -> timedelta | None:
        """The shortest time between consecutive fires in ``(start_ms, end_ms]``.

        The window is stretched to hold at least two fires; ``None`` if there are not two.
        """
        first = self.next_ms(start_ms)
        second = None if first is None else self.next_ms(first)
        if second is None:
            return None
        end_ms = max(end_ms, second)
        tracker = _GapTracker()
        start = start_ms + 1
        offset = self._timeline.offset_ms(start)
        segment_start = self._recent_transition(start)
        while True:
            crossing = self._timeline.first_transition(start, end_ms)
            stop = end_ms + 1 if crossing is None else crossing.at_ms
            self._track_segment(start, stop, offset, segment_start, tracker)
            if crossing is None:
                break
            start, offset = crossing.at_ms, crossing.offset_after_ms
            segment_start = crossing if self._fixed_time else None
        return None if tracker.smallest_ms is None else tracker.smallest_ms * _ONE_MS

    def _recent_transition(self, start_ms: int) -> Transition | None:
        """The transition that began the segment holding ``start_ms``, if it matters.

        Only fixed-time jobs care: right after a gap they may owe a fire, right after a fold
        they must not fire again at the repeated local times.
        """
        if not self._fixed_time:
            return None
        return self._timeline.last_transition(start_ms, start_ms - _LOOKBACK_MS)

    def _first_fire_in_segment(
        self, start_ms: int, offset_ms: int, segment_start: Transition | None
    ) -> int | None:
        """The first fire at or after ``start_ms``, assuming ``offset_ms`` holds from there on."""
        if self._owes_gap_fire(start_ms, segment_start):
            return start_ms
        found = self._wall_clock.first_at_or_after(
            self._first_local_ms(start_ms, offset_ms, segment_start)
        )
        return None if found is None else found - offset_ms

    def _owes_gap_fire(self, start_ms: int, segment_start: Transition | None) -> bool:
        """True at the end of a spring gap that swallowed a local time of a fixed-time job
        (unless its policy is ``"skip"``: the swallowed times do not fire)."""
        if segment_start is None or not segment_start.is_gap or segment_start.at_ms != start_ms:
            return False
        if self._dst == "skip":
            return False
        gap_end = start_ms + segment_start.offset_after_ms
        found = self._wall_clock.first_at_or_after(start_ms + segment_start.offset_before_ms)
        return found is not None and found < gap_end

    def _first_local_ms(
        self, start_ms: int, offset_ms: int, segment_start: Transition | None
    ) -> int:
        """The local time where the search starts; past a fold's repeat for fixed-time jobs
        (unless their policy is ``"run-twice"``: the repeated times fire again)."""
        local_ms = start_ms + offset_ms
        if segment_start is not None and not segment_start.is_gap and self._dst != "run-twice":
            # The fold's repeated local times already fired, first time round, before it.
            local_ms = max(local_ms, segment_start.at_ms + segment_start.offset_before_ms)
        return local_ms

    def _track_segment(
        self,
        start_ms: int,
        stop_ms: int,
        offset_ms: int,
        segment_start: Transition | None,
        tracker: _GapTracker,
    ) -> None:
        """Feed ``tracker`` the fires in ``[start_ms, stop_ms)``, one matching day at a time."""
        if self._owes_gap_fire(start_ms, segment_start):
            tracker.add_run(start_ms, start_ms, None)
        clock = self._wall_clock
        local_ms = self._first_local_ms(start_ms, offset_ms, segment_start)
        local_stop = stop_ms + offset_ms
        while (found := clock.first_at_or_after(local_ms)) is not None and found < local_stop:
            day_ms = found - found % _DAY_MS
            first = bisect_left(clock.times_ms, found - day_ms)
            end = bisect_left(clock.times_ms, local_stop - day_ms)
            tracker.add_run(
                day_ms + clock.times_ms[first] - offset_ms,
                day_ms + clock.times_ms[end - 1] - offset_ms,
                clock.smallest_step(first, end),
            )
            local_ms = day_ms + _DAY_MS


class _GapTracker:
    """The smallest distance between consecutive fires, fed runs of fires in order."""

    def __init__(self) -> None:
        self.smallest_ms: int | None = None
        self._last_ms: int | None = None

    def add_run(self, first_ms: int, last_ms: int, inner_ms: int | None) -> None:
        # A gap-shifted fire and a regular fire can be the same instant: one fire, no gap.
        if self._last_ms is not None and first_ms > self._last_ms:
            self._consider(first_ms - self._last_ms)
        if inner_ms is not None:
            self._consider(inner_ms)
        self._last_ms = last_ms

    def _consider(self, gap_ms: int) -> None:
        if self.smallest_ms is None or gap_ms < self.smallest_ms:
            self.smallest_ms = gap_ms


class _WallClock:
    """Naive local wall-clock matching: croniter, plus the times of day of a matching day.

    Cron's time-of-day fields do not depend on the date, so once croniter has found a match on
    a day, the rest of that day's matches come from ``times_ms`` without asking it again.
    """

    def __init__(self, spec: _Spec, expression: str) -> None:
        try:
            self._cron = _croniter(spec, _NAIVE_EPOCH)
        except CroniterError as exc:  # our own checks should have caught it first
            raise ConfigurationError(
                f"cron expression '{expression}' is not valid: {exc}", option="cron"
            ) from None
        self._lock = threading.Lock()  # croniter keeps its cursor in the object
        self.times_ms = _times_of_day(self._cron.expanded, spec.with_seconds)
        times = self.times_ms
        self._steps = array("q", (times[i + 1] - times[i] for i in range(len(times) - 1)))
        self._smallest_step = min(self._steps, default=None)
        self._matching_days: set[int] = set()

    def first_at_or_after(self, local_ms: int) -> int | None:
        """The first matching local time at or after ``local_ms`` (both naive, in ms)."""
        day, time_ms = divmod(local_ms, _DAY_MS)
        if day in self._matching_days:
            index = bisect_left(self.times_ms, time_ms)
            if index < len(self.times_ms):
                return day * _DAY_MS + self.times_ms[index]
        found = self._croniter_next(local_ms - 1)
        if found is not None:
            if len(self._matching_days) >= _MAX_KNOWN_DAYS:
                self._matching_days.clear()
            self._matching_days.add(found // _DAY_MS)
        return found

    def smallest_step(self, first: int, end: int) -> int | None:
        """The smallest distance between consecutive ``times_ms[first:end]``."""
        if end - first < 2:
            return None
        if first == 0 and end == len(self.times_ms):
            return self._smallest_step
        return min(self._steps[first : end - 1])

    def _croniter_next(self, after_local_ms: int) -> int | None:
        # croniter adds one minute (one second with seconds) and truncates: strictly after.
        start = _NAIVE_EPOCH + after_local_ms * _ONE_MS
        try:
            with self._lock:
                found = self._cron.get_next(datetime, start_time=start)
        except CroniterBadDateError:
            return None
        return (found - _NAIVE_EPOCH) // _ONE_MS


def _times_of_day(expanded: Sequence[Sequence[object]], with_seconds: bool) -> array[int]:
    seconds = _values(expanded[SECOND_FIELD], _SECOND) if with_seconds else [0]
    minutes = _values(expanded[MINUTE_FIELD], _MINUTE)
    hours = _values(expanded[HOUR_FIELD], _HOUR)
    return array(
        "q",
        sorted(
            (hour * 3600 + minute * 60 + second) * 1000
            for hour in hours
            for minute in minutes
            for second in seconds
        ),
    )


def _values(expanded: Sequence[object], spec: _Field) -> list[int]:
    if "*" in expanded:
        return list(range(spec.low, spec.high + 1))
    return sorted({int(str(value)) for value in expanded})


def _croniter(spec: _Spec, start: datetime, max_years: int | None = None) -> croniter[datetime]:
    """The one way this module builds a croniter, so every search reads the day fields alike."""
    return croniter(
        spec.croniter_expression,
        start,
        ret_type=datetime,
        day_or=spec.day_or,
        second_at_beginning=spec.with_seconds,
        max_years_between_matches=max_years,
    )


def _checked_dst(dst: object, spec: _Spec, expression: str) -> DstPolicy | None:
    """``dst`` checked; refused for a job on real time, which no policy would change."""
    if dst is None:
        return None
    policy = parse_dst(dst)
    if not spec.fixed_time:
        raise ConfigurationError(
            f"option 'dst' = {policy!r} does not apply to '{expression}': its minute or hour "
            "field starts with '*', so it runs on real time through daylight-saving switches "
            "(nothing is skipped or repeated); remove dst=",
            option="dst",
        )
    return policy


def _refuse_never_firing(spec: _Spec, expression: str) -> None:
    probe = _croniter(spec, datetime.now(UTC).replace(tzinfo=None), _NEVER_FIRES_YEARS)
    try:
        probe.get_next(datetime)
    except CroniterBadDateError:
        raise ConfigurationError(
            f"cron expression '{expression}' never fires: no date matches its day-of-month, "
            f"month and day-of-week{_day_rule_note(spec)}",
            option="cron",
        ) from None


def _day_rule_note(spec: _Spec) -> str:
    """Why both day fields had to match, when that is what made the expression impossible."""
    day_of_week = spec.day_fields[1]
    if spec.day_or or _is_any_day(day_of_week):
        return ""
    # A day-of-month starting with "*" holds the 1st, which every month has, on every weekday
    # in turn: only a starred day-of-week can turn an OR that fires into an AND that cannot.
    return (
        f" (day-of-week '{day_of_week}' starts with '*', so a day must match both day fields, "
        "as in Vixie cron)"
    )


def _starts_with_star(day_field: str) -> bool:
    return day_field.startswith(("*", "?"))


def _is_any_day(day_field: str) -> bool:
    return day_field in ("*", "?")


# --- validation: our own, because croniter's messages do not say what is wrong --------------


def _parse(expression: str) -> _Spec:
    fields = _split(expression)
    specs = _SIX_FIELDS if len(fields) == 6 else _FIVE_FIELDS
    checked = [
        _check_field(value, spec, expression) for value, spec in zip(fields, specs, strict=True)
    ]
    _check_day_fields(fields[-3], fields[-1], expression)
    minute, hour, day_of_month, day_of_week = fields[-5], fields[-4], fields[-3], fields[-1]
    return _Spec(
        croniter_expression=" ".join(checked),
        with_seconds=len(fields) == 6,
        fixed_time=not (minute.startswith("*") or hour.startswith("*")),
        # Vixie cron's rule, which croniter applies only when told: its default ORs any two
        # restricted day fields, "*/2" included.
        day_or=not (_starts_with_star(day_of_month) or _starts_with_star(day_of_week)),
        day_fields=(day_of_month, day_of_week),
    )


def _split(expression: str) -> list[str]:
    if expression.startswith("@"):
        alias = _ALIASES.get(expression.lower())
        if alias is None:
            raise ConfigurationError(_alias_message(expression), option="cron")
        return alias.split()
    fields = _FIELD_SEPARATOR.findall(expression)
    if len(fields) not in (5, 6):
        raise ConfigurationError(_field_count_message(expression, len(fields)), option="cron")
    return fields


def _alias_message(expression: str) -> str:
    if expression.lower() == "@reboot":
        return "cron expression '@reboot' is not supported: a scheduler has no reboot to follow"
    accepted = ", ".join(_ALIASES)
    return f"cron expression '{expression}' is not valid: unknown alias; accepted: {accepted}"


def _field_count_message(expression: str, count: int) -> str:
    fields = "field" if count == 1 else "fields"
    message = (
        f"cron expression '{expression}' has {count} {fields}; 5 or 6 are accepted "
        "('minute hour day-of-month month day-of-week', optionally preceded by 'second')"
    )
    if count == 7:
        message += "; a 7th (year) field is not supported"
    return message


def _invalid(spec: _Field, item: str, expression: str, reason: str = "") -> ConfigurationError:
    suffix = f": {reason}" if reason else ""
    return ConfigurationError(
        f"{spec.name} '{item}' is not valid in '{expression}'{suffix}", option="cron"
    )


def _check_field(value: str, spec: _Field, expression: str) -> str:
    """The field as croniter should read it; raises ``ConfigurationError``."""
    items = [_check_item(item, spec, expression) for item in value.split(",")]
    if spec is _DAY_OF_MONTH and len(items) > 1 and any(i.upper().endswith("W") for i in items):
        raise _invalid(spec, value, expression, "'W' must be the only day-of-month value")
    if spec is _DAY_OF_WEEK:
        special = [("#" in item or item.startswith("L")) for item in items]
        if any(special) and not all(special):
            raise _invalid(
                spec, value, expression, "'#' and 'L' days cannot be mixed with plain days"
            )
    return ",".join(items)


def _check_day_fields(day_of_month: str, day_of_week: str, expression: str) -> None:
    """Refuse the combinations where croniter does not apply cron's OR of the two fields."""
    month_restricted = day_of_month not in ("*", "?")
    week_restricted = day_of_week not in ("*", "?")
    week_special = "#" in day_of_week or day_of_week.upper().endswith("L")
    month_special = day_of_month.upper().endswith("W")
    if (month_restricted and week_special) or (week_restricted and month_special):
        raise ConfigurationError(
            f"day-of-month '{day_of_month}' and day-of-week '{day_of_week}' cannot both be set "
            f"in '{expression}' when one uses '#', 'L' (day-of-week) or 'W'; set the other to '*'",
            option="cron",
        )


def _check_item(item: str, spec: _Field, expression: str) -> str:
    if _HASHED.match(item):
        raise _invalid(
            spec, item, expression, "H and R (hashed and random) values are not standard cron"
        )
    base, slash, step = item.partition("/")
    if slash:
        _check_step(step, spec, item, expression)
    upper = base.upper()
    if base == "*":
        return item
    if base == "?":
        if slash or spec not in (_DAY_OF_MONTH, _DAY_OF_WEEK):
            raise _invalid(spec, item, expression, "'?' stands alone, in the day fields only")
        return item
    special = _check_special(upper, spec, item, expression)
    if special is not None:
        if slash:
            raise _invalid(spec, item, expression)
        return special
    return _check_range(base, slash + step, spec, item, expression)


def _check_step(step: str, spec: _Field, item: str, expression: str) -> None:
    if not _NUMBER.fullmatch(step):
        raise _invalid(spec, item, expression)
    if int(step) == 0:
        raise _invalid(spec, item, expression, "a step must be at least 1")


def _check_special(upper: str, spec: _Field, item: str, expression: str) -> str | None:
    """``L``, ``15W``, ``5#2`` and ``5L`` in the day fields; ``None`` for anything else."""
    if spec is _DAY_OF_MONTH:
        if upper == "L":
            return "L"
        nearest = _NEAREST_WEEKDAY.fullmatch(upper)
        if nearest:
            return f"{_value(nearest.group(1), spec, item, expression)}W"
    if spec is _DAY_OF_WEEK:
        if "#" in upper:
            day, _, nth = upper.partition("#")
            if not _NUMBER.fullmatch(nth) or not 1 <= int(nth) <= 5:
                raise _invalid(spec, item, expression, "the number after '#' must be 1-5")
            return f"{_value(day, spec, item, expression) % 7}#{nth}"
        if upper.startswith("L"):
            raise _invalid(
                spec, item, expression, "write the day first: '5L' is the month's last Friday"
            )
        if upper.endswith("L"):
            # croniter spells "the last Friday" as L5; cron users write 5L.
            return f"L{_value(upper[:-1], spec, item, expression) % 7}"
    return None


def _check_range(base: str, step: str, spec: _Field, item: str, expression: str) -> str:
    start, dash, end = base.partition("-")
    low = _value(start, spec, item, expression)
    if not dash:
        return base + step
    if spec is _DAY_OF_MONTH and end.upper() == "L":
        high = spec.high  # croniter reads "15-L" as 15 to the month's last day
    else:
        high = _value(end, spec, item, expression)
    # croniter reads an equal range ("5-5", "MON-MON") as the whole field; it is one value.
    return start if low == high else base + step


def _value(text: str, spec: _Field, item: str, expression: str) -> int:
    if _NUMBER.fullmatch(text):
        number = int(text)
        if not spec.low <= number <= spec.high:
            raise ConfigurationError(
                f"{spec.name} '{text}' is out of range {spec.low}-{spec.high} in '{expression}'",
                option="cron",
            )
        return number
    named = spec.names.get(text.upper())
    if named is None:
        raise _invalid(spec, item, expression)
    return named

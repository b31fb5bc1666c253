"""The cron trigger: parsing, daylight saving (Vixie cron's rules), min_gap, properties.

Expected fire times are worked out by hand from the rules and the zones' published switches,
never computed with the code under test:

* Europe/Paris: CET (+1) / CEST (+2); switches at 01:00 UTC on 2027-03-28 (local 02:00-03:00
  does not exist) and 2026-10-25 (local 02:00-03:00 happens twice).
* America/New_York: EST (-5) / EDT (-4); 2027-03-14 at 07:00 UTC (02:00-03:00 missing),
  2026-11-01 at 06:00 UTC (01:00-02:00 twice).
* Australia/Lord_Howe: +10:30 / +11:00, a 30-minute shift; 2026-10-04 (first Sunday of
  October) at 15:30 UTC the day before (02:00-02:30 missing), 2027-04-04 (first Sunday of
  April) at 15:00 UTC the day before (01:30-02:00 twice).

Weekdays come from 2027-01-01, a Friday; the 1st of each month in 2027 falls on: Jan Fri, Feb
Mon, Mar Mon, Apr Thu, May Sat, Jun Tue, Jul Thu, Aug Sun, Sep Wed, Oct Fri, Nov Mon, Dec Wed.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from datetime import UTC, date, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from brokersched._exceptions import ConfigurationError
from brokersched.triggers.base import Trigger
from brokersched.triggers.cron import CronTrigger, parse_cron
from tests.support.helpers import examples

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
DAY_MS = 86_400_000


def utc(iso: str) -> datetime:
    return datetime.fromisoformat(iso).astimezone(UTC)


def to_ms(iso: str) -> int:
    return int(utc(iso).timestamp() * 1000)


def fires(expression: str, zone: str, after: str, count: int) -> list[datetime]:
    return parse_cron(expression, zone).next_runs(count, utc(after))


# --- daylight saving: the table -------------------------------------------------------------

DST_CASES = [
    # Paris, spring 2027-03-28: local 02:00-03:00 does not exist.
    ("Europe/Paris", "30 2 * * *", "2027-03-26T12:00Z",
     ["2027-03-27T01:30Z", "2027-03-28T01:00Z", "2027-03-29T00:30Z"]),
    ("Europe/Paris", "0 2 * * *", "2027-03-26T12:00Z",
     ["2027-03-27T01:00Z", "2027-03-28T01:00Z", "2027-03-29T00:00Z"]),
    ("Europe/Paris", "0 3 * * *", "2027-03-26T12:00Z",
     ["2027-03-27T02:00Z", "2027-03-28T01:00Z", "2027-03-29T01:00Z"]),
    ("Europe/Paris", "15 1 * * *", "2027-03-26T12:00Z",
     ["2027-03-27T00:15Z", "2027-03-28T00:15Z", "2027-03-28T23:15Z"]),
    ("Europe/Paris", "0,30 2 * * *", "2027-03-26T12:00Z",
     ["2027-03-27T01:00Z", "2027-03-27T01:30Z", "2027-03-28T01:00Z", "2027-03-29T00:00Z"]),
    ("Europe/Paris", "0 2,3 * * *", "2027-03-27T12:00Z",
     ["2027-03-28T01:00Z", "2027-03-29T00:00Z", "2027-03-29T01:00Z"]),
    ("Europe/Paris", "*/30 * * * *", "2027-03-27T23:59Z",
     ["2027-03-28T00:00Z", "2027-03-28T00:30Z", "2027-03-28T01:00Z", "2027-03-28T01:30Z"]),
    ("Europe/Paris", "0 * * * *", "2027-03-27T23:30Z",
     ["2027-03-28T00:00Z", "2027-03-28T01:00Z", "2027-03-28T02:00Z"]),
    ("Europe/Paris", "*/15 * * * *", "2027-03-28T00:20Z",
     ["2027-03-28T00:30Z", "2027-03-28T00:45Z", "2027-03-28T01:00Z", "2027-03-28T01:15Z"]),
    ("Europe/Paris", "*/20 2 * * *", "2027-03-27T12:00Z",  # minute '*': no fire in the gap
     ["2027-03-29T00:00Z", "2027-03-29T00:20Z", "2027-03-29T00:40Z", "2027-03-30T00:00Z"]),
    # Paris, autumn 2026-10-25: local 02:00-03:00 happens twice.
    ("Europe/Paris", "30 2 * * *", "2026-10-23T12:00Z",
     ["2026-10-24T00:30Z", "2026-10-25T00:30Z", "2026-10-26T01:30Z"]),
    ("Europe/Paris", "0 2 * * *", "2026-10-23T12:00Z",
     ["2026-10-24T00:00Z", "2026-10-25T00:00Z", "2026-10-26T01:00Z"]),
    ("Europe/Paris", "0 3 * * *", "2026-10-23T12:00Z",
     ["2026-10-24T01:00Z", "2026-10-25T02:00Z", "2026-10-26T02:00Z"]),
    ("Europe/Paris", "15 1 * * *", "2026-10-23T12:00Z",
     ["2026-10-23T23:15Z", "2026-10-24T23:15Z", "2026-10-26T00:15Z"]),
    ("Europe/Paris", "*/30 * * * *", "2026-10-24T23:45Z",
     ["2026-10-25T00:00Z", "2026-10-25T00:30Z", "2026-10-25T01:00Z", "2026-10-25T01:30Z",
      "2026-10-25T02:00Z"]),
    ("Europe/Paris", "0 * * * *", "2026-10-24T23:30Z",
     ["2026-10-25T00:00Z", "2026-10-25T01:00Z", "2026-10-25T02:00Z"]),
    ("Europe/Paris", "*/15 * * * *", "2026-10-25T00:40Z",
     ["2026-10-25T00:45Z", "2026-10-25T01:00Z", "2026-10-25T01:15Z", "2026-10-25T01:30Z"]),
    ("Europe/Paris", "*/20 2 * * *", "2026-10-24T23:50Z",  # minute '*': the hour runs twice
     ["2026-10-25T00:00Z", "2026-10-25T00:20Z", "2026-10-25T00:40Z", "2026-10-25T01:00Z",
      "2026-10-25T01:20Z", "2026-10-25T01:40Z", "2026-10-26T01:00Z"]),
    # New York, spring 2027-03-14: local 02:00-03:00 does not exist.
    ("America/New_York", "30 2 * * *", "2027-03-12T12:00Z",
     ["2027-03-13T07:30Z", "2027-03-14T07:00Z", "2027-03-15T06:30Z"]),
    ("America/New_York", "0 2 * * *", "2027-03-12T12:00Z",
     ["2027-03-13T07:00Z", "2027-03-14T07:00Z", "2027-03-15T06:00Z"]),
    ("America/New_York", "0 3 * * *", "2027-03-12T12:00Z",
     ["2027-03-13T08:00Z", "2027-03-14T07:00Z", "2027-03-15T07:00Z"]),
    ("America/New_York", "15 1 * * *", "2027-03-12T12:00Z",
     ["2027-03-13T06:15Z", "2027-03-14T06:15Z", "2027-03-15T05:15Z"]),
    ("America/New_York", "*/30 * * * *", "2027-03-14T06:15Z",
     ["2027-03-14T06:30Z", "2027-03-14T07:00Z", "2027-03-14T07:30Z"]),
    ("America/New_York", "0 * * * *", "2027-03-14T05:30Z",
     ["2027-03-14T06:00Z", "2027-03-14T07:00Z", "2027-03-14T08:00Z"]),
    ("America/New_York", "*/15 * * * *", "2027-03-14T06:35Z",
     ["2027-03-14T06:45Z", "2027-03-14T07:00Z", "2027-03-14T07:15Z"]),
    # New York, autumn 2026-11-01: local 01:00-02:00 happens twice.
    ("America/New_York", "30 2 * * *", "2026-10-30T12:00Z",
     ["2026-10-31T06:30Z", "2026-11-01T07:30Z", "2026-11-02T07:30Z"]),
    ("America/New_York", "0 2 * * *", "2026-10-30T12:00Z",
     ["2026-10-31T06:00Z", "2026-11-01T07:00Z", "2026-11-02T07:00Z"]),
    ("America/New_York", "0 3 * * *", "2026-10-30T12:00Z",
     ["2026-10-31T07:00Z", "2026-11-01T08:00Z", "2026-11-02T08:00Z"]),
    ("America/New_York", "15 1 * * *", "2026-10-30T12:00Z",
     ["2026-10-31T05:15Z", "2026-11-01T05:15Z", "2026-11-02T06:15Z"]),
    ("America/New_York", "*/30 * * * *", "2026-11-01T04:45Z",
     ["2026-11-01T05:00Z", "2026-11-01T05:30Z", "2026-11-01T06:00Z", "2026-11-01T06:30Z",
      "2026-11-01T07:00Z"]),
    ("America/New_York", "0 * * * *", "2026-11-01T04:30Z",
     ["2026-11-01T05:00Z", "2026-11-01T06:00Z", "2026-11-01T07:00Z"]),
    ("America/New_York", "*/15 * * * *", "2026-11-01T05:40Z",
     ["2026-11-01T05:45Z", "2026-11-01T06:00Z", "2026-11-01T06:15Z"]),
    # Lord Howe, spring 2026-10-04: local 02:00-02:30 does not exist (a 30-minute shift).
    ("Australia/Lord_Howe", "15 2 * * *", "2026-10-01T12:00Z",
     ["2026-10-01T15:45Z", "2026-10-02T15:45Z", "2026-10-03T15:30Z", "2026-10-04T15:15Z"]),
    ("Australia/Lord_Howe", "0 2 * * *", "2026-10-02T12:00Z",
     ["2026-10-02T15:30Z", "2026-10-03T15:30Z", "2026-10-04T15:00Z"]),
    ("Australia/Lord_Howe", "30 2 * * *", "2026-10-02T12:00Z",
     ["2026-10-02T16:00Z", "2026-10-03T15:30Z", "2026-10-04T15:30Z"]),
    ("Australia/Lord_Howe", "0 3 * * *", "2026-10-02T12:00Z",
     ["2026-10-02T16:30Z", "2026-10-03T16:00Z", "2026-10-04T16:00Z"]),
    ("Australia/Lord_Howe", "15 1 * * *", "2026-10-02T12:00Z",
     ["2026-10-02T14:45Z", "2026-10-03T14:45Z", "2026-10-04T14:15Z"]),
    ("Australia/Lord_Howe", "*/30 * * * *", "2026-10-03T14:50Z",
     ["2026-10-03T15:00Z", "2026-10-03T15:30Z", "2026-10-03T16:00Z"]),
    ("Australia/Lord_Howe", "*/15 * * * *", "2026-10-03T14:50Z",
     ["2026-10-03T15:00Z", "2026-10-03T15:15Z", "2026-10-03T15:30Z", "2026-10-03T15:45Z"]),
    ("Australia/Lord_Howe", "0 * * * *", "2026-10-03T14:00Z",
     ["2026-10-03T14:30Z", "2026-10-03T16:00Z", "2026-10-03T17:00Z"]),
    # Lord Howe, autumn 2027-04-04: local 01:30-02:00 happens twice.
    ("Australia/Lord_Howe", "45 1 * * *", "2027-04-02T12:00Z",
     ["2027-04-02T14:45Z", "2027-04-03T14:45Z", "2027-04-04T15:15Z"]),
    ("Australia/Lord_Howe", "15 1 * * *", "2027-04-02T12:00Z",
     ["2027-04-02T14:15Z", "2027-04-03T14:15Z", "2027-04-04T14:45Z"]),
    ("Australia/Lord_Howe", "0 2 * * *", "2027-04-02T12:00Z",
     ["2027-04-02T15:00Z", "2027-04-03T15:30Z", "2027-04-04T15:30Z"]),
    ("Australia/Lord_Howe", "30 2 * * *", "2027-04-02T12:00Z",
     ["2027-04-02T15:30Z", "2027-04-03T16:00Z", "2027-04-04T16:00Z"]),
    ("Australia/Lord_Howe", "*/30 * * * *", "2027-04-03T14:20Z",
     ["2027-04-03T14:30Z", "2027-04-03T15:00Z", "2027-04-03T15:30Z"]),
    ("Australia/Lord_Howe", "*/15 * * * *", "2027-04-03T14:20Z",
     ["2027-04-03T14:30Z", "2027-04-03T14:45Z", "2027-04-03T15:00Z", "2027-04-03T15:15Z",
      "2027-04-03T15:30Z"]),
    ("Australia/Lord_Howe", "0 * * * *", "2027-04-03T13:30Z",
     ["2027-04-03T14:00Z", "2027-04-03T15:30Z", "2027-04-03T16:30Z"]),
    # America/Nuuk switches at 23:00 local (01:00 UTC), so its gap ends at midnight: a job in
    # the gap fires at 00:00 the next local day (the first instant after the gap).
    ("America/Nuuk", "59 23 * * *", "2026-03-27T12:00Z",
     ["2026-03-28T01:59Z", "2026-03-29T01:00Z", "2026-03-30T00:59Z"]),
    # The day fields' AND (day-of-month starts with '*') holds on switch days too.
    # Odd Sundays: the spring switch day, Sunday 2027-03-28, is even, so nothing fires at the
    # end of its gap (the OR would have); March 21st (CET), April 11th and 25th (CEST) do.
    ("Europe/Paris", "30 2 */2 * SUN", "2027-03-20T12:00Z",
     ["2027-03-21T01:30Z", "2027-04-11T00:30Z", "2027-04-25T00:30Z"]),
    # Sunday 2026-10-25 is odd: it fires once, at the first 02:30 (CEST); then November 1st.
    ("Europe/Paris", "30 2 */2 * SUN", "2026-10-05T00:00Z",
     ["2026-10-11T00:30Z", "2026-10-25T00:30Z", "2026-11-01T01:30Z", "2026-11-15T01:30Z"]),
    # The 1st, 14th or 27th when a Sunday: 2027-02-14 (EST), 2027-03-14, the switch day, at
    # 03:00 EDT (02:30 is in the gap), then 2027-06-27 (EDT).
    ("America/New_York", "30 2 */13 * SUN", "2027-02-01T00:00Z",
     ["2027-02-14T07:30Z", "2027-03-14T07:00Z", "2027-06-27T06:30Z"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("zone", "expression", "after", "expected"),
    DST_CASES,
    ids=[f"{zone}:{expr}:{after[:10]}" for zone, expr, after, _ in DST_CASES],
)
def test_daylight_saving_switches(
    zone: str, expression: str, after: str, expected: list[str]
) -> None:
    assert fires(expression, zone, after, len(expected)) == [utc(e) for e in expected]


@pytest.mark.parametrize(
    ("zone", "expression", "after", "expected"),
    DST_CASES,
    ids=[f"{zone}:{expr}:{after[:10]}" for zone, expr, after, _ in DST_CASES],
)
def test_each_fire_is_the_next_one_from_any_instant_before_it(
    zone: str, expression: str, after: str, expected: list[str]
) -> None:
    """Asking from one millisecond, or half-way, before a fire gives that fire."""
    trigger = parse_cron(expression, zone)
    previous = to_ms(after)
    for fire in map(to_ms, expected):
        assert trigger.next_ms(fire - 1) == fire
        assert trigger.next_ms((previous + fire) // 2) == fire
        previous = fire


# --- daylight saving: a daily job over a whole year ------------------------------------------

YEAR_ZONES = [
    "Europe/Paris",
    "America/New_York",
    "Australia/Lord_Howe",
    "America/Santiago",  # switches at local midnight
    "America/Havana",  # switches at local midnight
    "Pacific/Chatham",  # +12:45 / +13:45
    "Antarctica/Troll",  # a two-hour shift
    "Africa/Casablanca",  # clocks go back for Ramadan
    "Asia/Tehran",  # no daylight saving any more
]


@pytest.mark.parametrize("zone", YEAR_ZONES)
@pytest.mark.parametrize("expression", ["0 0 * * *", "30 2 * * *", "0 2 * * *", "15 1 * * *"])
def test_a_daily_job_fires_once_on_every_local_day(zone: str, expression: str) -> None:
    tz = ZoneInfo(zone)
    start, end = datetime(2027, 1, 1, tzinfo=tz), datetime(2028, 1, 1, tzinfo=tz)
    runs = parse_cron(expression, zone).next_runs(370, start - timedelta(milliseconds=1))
    per_day = Counter(run.astimezone(tz).date() for run in runs if run < end)
    assert len(per_day) == 365
    assert set(per_day.values()) == {1}
    assert min(per_day) == date(2027, 1, 1)


# --- parsing: what is accepted ----------------------------------------------------------------

ACCEPTED = [
    ("0 8 * * MON-FRI", "2027-01-01T00:00Z",  # 2027-01-01 is a Friday
     ["2027-01-01T08:00Z", "2027-01-04T08:00Z", "2027-01-05T08:00Z"]),
    ("0 8 * * mon-fri", "2027-01-01T00:00Z",
     ["2027-01-01T08:00Z", "2027-01-04T08:00Z", "2027-01-05T08:00Z"]),
    ("0 0 * * FRI-MON", "2027-01-01T00:00Z",  # a range across the end of the week
     ["2027-01-02T00:00Z", "2027-01-03T00:00Z", "2027-01-04T00:00Z", "2027-01-08T00:00Z"]),
    ("0 0 * * 7", "2027-01-01T00:00Z", ["2027-01-03T00:00Z", "2027-01-10T00:00Z"]),
    ("0 0 * * 0", "2027-01-01T00:00Z", ["2027-01-03T00:00Z", "2027-01-10T00:00Z"]),
    ("0 0 1 JAN,JUL *", "2027-01-01T00:00Z", ["2027-07-01T00:00Z", "2028-01-01T00:00Z"]),
    ("0 0 1 FEB-APR/2 *", "2027-01-01T00:00Z", ["2027-02-01T00:00Z", "2027-04-01T00:00Z"]),
    ("0 22-2 * * *", "2027-01-01T00:30Z",  # hours 22, 23, 0, 1, 2
     ["2027-01-01T01:00Z", "2027-01-01T02:00Z", "2027-01-01T22:00Z", "2027-01-01T23:00Z",
      "2027-01-02T00:00Z"]),
    ("5/15 * * * *", "2027-01-01T00:00Z",
     ["2027-01-01T00:05Z", "2027-01-01T00:20Z", "2027-01-01T00:35Z", "2027-01-01T00:50Z"]),
    ("10-20/5 * * * *", "2027-01-01T00:00Z",
     ["2027-01-01T00:10Z", "2027-01-01T00:15Z", "2027-01-01T00:20Z", "2027-01-01T01:10Z"]),
    ("0 5-5 * * *", "2027-01-01T00:00Z",  # croniter alone would read 5-5 as every hour
     ["2027-01-01T05:00Z", "2027-01-02T05:00Z"]),
    ("0 0 * * MON-MON", "2027-01-01T00:00Z", ["2027-01-04T00:00Z", "2027-01-11T00:00Z"]),
    ("0 0 L * *", "2027-01-15T00:00Z",
     ["2027-01-31T00:00Z", "2027-02-28T00:00Z", "2027-03-31T00:00Z", "2027-04-30T00:00Z"]),
    ("0 0 L 2 *", "2027-06-01T00:00Z", ["2028-02-29T00:00Z", "2029-02-28T00:00Z"]),
    ("0 0 28-L 2 *", "2028-01-01T00:00Z", ["2028-02-28T00:00Z", "2028-02-29T00:00Z"]),
    ("0 12 * * 5#2", "2027-01-01T00:00Z",
     ["2027-01-08T12:00Z", "2027-02-12T12:00Z", "2027-03-12T12:00Z"]),
    ("0 12 * * FRI#2", "2027-01-01T00:00Z",
     ["2027-01-08T12:00Z", "2027-02-12T12:00Z", "2027-03-12T12:00Z"]),
    ("0 12 * * 5L", "2027-01-01T00:00Z",
     ["2027-01-29T12:00Z", "2027-02-26T12:00Z", "2027-03-26T12:00Z"]),
    ("0 12 * * FRIL", "2027-01-01T00:00Z",
     ["2027-01-29T12:00Z", "2027-02-26T12:00Z", "2027-03-26T12:00Z"]),
    ("0 0 15W * *", "2027-04-20T00:00Z",  # 2027-05-15 is a Saturday
     ["2027-05-14T00:00Z", "2027-06-15T00:00Z"]),
    ("0 0 ? * MON", "2027-01-01T00:00Z", ["2027-01-04T00:00Z", "2027-01-11T00:00Z"]),
    # Both day fields set: cron's OR (the 13th, and every Friday).
    ("0 0 13 * FRI", "2027-01-01T00:00Z",
     ["2027-01-08T00:00Z", "2027-01-13T00:00Z", "2027-01-15T00:00Z"]),
    ("@yearly", "2027-03-01T00:00Z", ["2028-01-01T00:00Z", "2029-01-01T00:00Z"]),
    ("@annually", "2027-03-01T00:00Z", ["2028-01-01T00:00Z"]),
    ("@monthly", "2027-03-01T00:00Z", ["2027-04-01T00:00Z", "2027-05-01T00:00Z"]),
    ("@weekly", "2027-01-01T00:00Z", ["2027-01-03T00:00Z", "2027-01-10T00:00Z"]),
    ("@daily", "2027-01-01T00:00Z", ["2027-01-02T00:00Z", "2027-01-03T00:00Z"]),
    ("@midnight", "2027-01-01T00:00Z", ["2027-01-02T00:00Z"]),
    ("@hourly", "2027-01-01T00:00Z", ["2027-01-01T01:00Z", "2027-01-01T02:00Z"]),
    ("@DAILY", "2027-01-01T00:00Z", ["2027-01-02T00:00Z"]),
    # Six fields: seconds first.
    ("30 0 12 * * *", "2027-01-01T00:00Z", ["2027-01-01T12:00:30Z", "2027-01-02T12:00:30Z"]),
    ("*/10 * * * * *", "2027-01-01T00:00:05Z",
     ["2027-01-01T00:00:10Z", "2027-01-01T00:00:20Z", "2027-01-01T00:00:30Z"]),
    ("0 0 9 * * MON", "2027-01-01T00:00Z", ["2027-01-04T09:00Z", "2027-01-11T09:00Z"]),
    ("  0 8 * * *  ", "2027-01-01T00:00Z", ["2027-01-01T08:00Z"]),
    ("0\t8 * * *", "2027-01-01T00:00Z", ["2027-01-01T08:00Z"]),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "after", "expected"), ACCEPTED)
def test_accepted_syntax(expression: str, after: str, expected: list[str]) -> None:
    assert fires(expression, "UTC", after, len(expected)) == [utc(e) for e in expected]


@pytest.mark.parametrize(
    ("zone", "expected"),
    [("+05:30", "2027-01-01T02:30Z"), ("-08:00", "2027-01-01T16:00Z"),
     ("-0800", "2027-01-01T16:00Z"), ("Z", "2027-01-01T08:00Z"), ("UTC", "2027-01-01T08:00Z"),
     ("Asia/Kolkata", "2027-01-01T02:30Z")],
)  # fmt: skip
def test_fixed_offsets_and_utc(zone: str, expected: str) -> None:
    assert fires("0 8 * * *", zone, "2027-01-01T00:00Z", 1) == [utc(expected)]


def test_a_tzinfo_object_is_accepted() -> None:
    trigger = parse_cron("0 8 * * *", timezone(timedelta(hours=-3)))
    assert trigger.next_runs(1, utc("2027-01-01T00:00Z")) == [utc("2027-01-01T11:00Z")]


def test_attributes_and_description() -> None:
    trigger = parse_cron(" 0 8 * * MON-FRI ", "Europe/Paris")
    assert isinstance(trigger, CronTrigger)
    assert isinstance(trigger, Trigger)
    assert trigger.kind == "cron"
    assert trigger.expression == "0 8 * * MON-FRI"
    assert trigger.timezone == ZoneInfo("Europe/Paris")
    assert trigger.timezone_name == "Europe/Paris"
    assert trigger.describe() == "cron '0 8 * * MON-FRI' (Europe/Paris)"
    assert repr(trigger) == "CronTrigger('0 8 * * MON-FRI', timezone='Europe/Paris')"


def test_default_zone_is_utc_and_names_are_kept_as_written() -> None:
    assert parse_cron("@daily").describe() == "cron '@daily' (UTC)"
    assert parse_cron("0 8 * * *", "US/Eastern").describe() == "cron '0 8 * * *' (US/Eastern)"
    assert parse_cron("0 8 * * *", "+0530").describe() == "cron '0 8 * * *' (+0530)"


def test_next_runs_are_aware_utc_datetimes() -> None:
    runs = parse_cron("0 8 * * *", "Europe/Paris").next_runs(3, utc("2027-07-01T00:00Z"))
    assert [run.tzinfo for run in runs] == [UTC, UTC, UTC]
    assert runs[0] == utc("2027-07-01T06:00Z")


def test_next_runs_accepts_an_aware_datetime_in_any_zone() -> None:
    after = datetime(2027, 7, 1, 8, 0, tzinfo=ZoneInfo("Europe/Paris"))  # 06:00 UTC
    assert parse_cron("0 8 * * *", "Europe/Paris").next_runs(1, after) == [utc("2027-07-02T06:00Z")]


def test_next_runs_defaults_to_now() -> None:
    before = datetime.now(UTC)
    (run,) = parse_cron("* * * * *").next_runs(1)
    assert before < run <= before + timedelta(minutes=1)
    assert run.second == 0


def test_next_ms_is_strictly_after() -> None:
    trigger = parse_cron("0 8 * * *")
    at_eight = to_ms("2027-01-01T08:00Z")
    assert trigger.next_ms(at_eight - 1) == at_eight
    assert trigger.next_ms(at_eight) == at_eight + DAY_MS


def test_latest_ms_from_the_base_class() -> None:
    trigger = parse_cron("*/5 * * * *", "Europe/Paris")
    now = to_ms("2027-01-01T10:07:30Z")
    assert trigger.latest_ms(now, 10 * MINUTE_MS) == to_ms("2027-01-01T10:05Z")


def test_the_schedule_stops_before_datetime_runs_out() -> None:
    trigger = parse_cron("0 0 1 1 *")
    assert trigger.next_ms(to_ms("8999-06-01T00:00Z")) is None
    assert trigger.next_ms(to_ms("9500-01-01T00:00Z")) is None


# --- the day fields: Vixie cron's AND and OR -------------------------------------------------

DAY_RULE = [
    # Day-of-month starts with '*': odd days AND weekdays. January 3rd (odd, a Sunday) and 4th
    # (a Monday, even) do not fire; the OR fired on both.
    ("15 1-3 */2 * 1-5", "2027-01-01T00:00Z",
     ["2027-01-01T01:15Z", "2027-01-01T02:15Z", "2027-01-01T03:15Z", "2027-01-05T01:15Z",
      "2027-01-05T02:15Z", "2027-01-05T03:15Z", "2027-01-07T01:15Z"]),
    ("0 0 12 */2 * MON-FRI", "2027-01-01T00:00Z",  # the same rule with seconds first
     ["2027-01-01T12:00Z", "2027-01-05T12:00Z", "2027-01-07T12:00Z"]),
    ("0 0 * * 1", "2027-01-01T00:00Z",  # still every Monday
     ["2027-01-04T00:00Z", "2027-01-11T00:00Z", "2027-01-18T00:00Z"]),
    # Neither starts with '*': the 1st OR a Monday (April 1st is a Thursday).
    ("0 0 1 * 1", "2027-03-25T00:00Z",
     ["2027-03-29T00:00Z", "2027-04-01T00:00Z", "2027-04-05T00:00Z"]),
    # Days 1, 11, 21, 31 that are Mondays.
    ("0 0 */10 * MON", "2027-01-01T00:00Z",
     ["2027-01-11T00:00Z", "2027-02-01T00:00Z", "2027-03-01T00:00Z", "2027-05-31T00:00Z",
      "2027-06-21T00:00Z"]),
    # Day-of-week starts with '*' ('*/6' is Sunday and Saturday): a 1st on a weekend.
    ("0 0 1 * */6", "2027-01-01T00:00Z",
     ["2027-05-01T00:00Z", "2027-08-01T00:00Z", "2028-01-01T00:00Z"]),
    # The last day of the month when a Sunday, Tuesday, Thursday or Saturday.
    ("0 0 L * */2", "2027-01-01T00:00Z",
     ["2027-01-31T00:00Z", "2027-02-28T00:00Z", "2027-07-31T00:00Z"]),
    # '1-31' does not start with '*': the OR, with a field that holds every day, is every day.
    ("0 0 1-31 * MON", "2027-01-01T00:00Z",
     ["2027-01-02T00:00Z", "2027-01-03T00:00Z", "2027-01-04T00:00Z"]),
    ("0 0 ? * MON", "2027-01-01T00:00Z",  # '?' counts as '*'
     ["2027-01-04T00:00Z", "2027-01-11T00:00Z"]),
    # '*/31' is the 1st alone, which February has: an AND that fires.
    ("0 0 */31 2 *", "2027-01-01T00:00Z", ["2027-02-01T00:00Z", "2028-02-01T00:00Z"]),
    # The OR fires on the weekdays of February although it has no 31st.
    ("0 0 31 2 1-5", "2027-01-31T00:00Z",
     ["2027-02-01T00:00Z", "2027-02-02T00:00Z", "2027-02-03T00:00Z", "2027-02-04T00:00Z",
      "2027-02-05T00:00Z", "2027-02-08T00:00Z"]),
    # February 29th on a Sunday ('*/7' is 0 and 7): 2032-01-01 is a Thursday (5 years, one
    # leap day, after a Friday), and 59 days later is a Sunday. 2028-02-29 is a Tuesday.
    ("0 0 29 2 */7", "2027-01-01T00:00Z", ["2032-02-29T00:00Z"]),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "after", "expected"), DAY_RULE)
def test_day_fields_follow_vixie_cron(expression: str, after: str, expected: list[str]) -> None:
    assert fires(expression, "UTC", after, len(expected)) == [utc(e) for e in expected]


def test_an_and_of_the_day_fields_that_never_fires_is_refused_and_says_why() -> None:
    # Under the OR this fired on February's Sundays, Tuesdays, Thursdays and Saturdays.
    with pytest.raises(ConfigurationError) as caught:
        parse_cron("0 0 30 2 */2")
    assert str(caught.value) == (
        "cron expression '0 0 30 2 */2' never fires: no date matches its day-of-month, month "
        "and day-of-week (day-of-week '*/2' starts with '*', so a day must match both day "
        "fields, as in Vixie cron)"
    )
    assert caught.value.option == "cron"


# --- parsing: what is refused -----------------------------------------------------------------

REFUSED = [
    ("0 25 * * *", "hour '25' is out of range 0-23 in '0 25 * * *'"),
    ("60 * * * *", "minute '60' is out of range 0-59 in '60 * * * *'"),
    ("0 0 * * FOO", "day-of-week 'FOO' is not valid in '0 0 * * FOO'"),
    ("0 0 0 * *", "day-of-month '0' is out of range 1-31 in '0 0 0 * *'"),
    ("0 0 32 * *", "day-of-month '32' is out of range 1-31 in '0 0 32 * *'"),
    ("0 0 * 13 *", "month '13' is out of range 1-12 in '0 0 * 13 *'"),
    ("0 0 * 0 *", "month '0' is out of range 1-12 in '0 0 * 0 *'"),
    ("0 0 * * 8", "day-of-week '8' is out of range 0-7 in '0 0 * * 8'"),
    ("0 20-25 * * *", "hour '25' is out of range 0-23 in '0 20-25 * * *'"),
    ("0 1,2,24 * * *", "hour '24' is out of range 0-23 in '0 1,2,24 * * *'"),
    ("60 0 * * * *", "second '60' is out of range 0-59 in '60 0 * * * *'"),
    ("0 60 * * * *", "minute '60' is out of range 0-59 in '0 60 * * * *'"),
    ("0 0 * FOO *", "month 'FOO' is not valid in '0 0 * FOO *'"),
    ("0 0 MON * *", "day-of-month 'MON' is not valid in '0 0 MON * *'"),
    ("1-2-3 * * * *", "minute '1-2-3' is not valid in '1-2-3 * * * *'"),
    ("-5 * * * *", "minute '-5' is not valid in '-5 * * * *'"),
    ("1, * * * *", "minute '' is not valid in '1, * * * *'"),
    ("*/0 * * * *", "minute '*/0' is not valid in '*/0 * * * *': a step must be at least 1"),
    ("*/x * * * *", "minute '*/x' is not valid in '*/x * * * *'"),
    ("*/5/2 * * * *", "minute '*/5/2' is not valid in '*/5/2 * * * *'"),
    ("? * * * *",
     "minute '?' is not valid in '? * * * *': '?' stands alone, in the day fields only"),
    ("H * * * *", "minute 'H' is not valid in 'H * * * *': H and R (hashed and random) values "
     "are not standard cron"),
    ("0 H(0-5) * * *", "hour 'H(0-5)' is not valid in '0 H(0-5) * * *': H and R (hashed and "
     "random) values are not standard cron"),
    ("R * * * *", "minute 'R' is not valid in 'R * * * *': H and R (hashed and random) values "
     "are not standard cron"),
    ("0 0 * * L", "day-of-week 'L' is not valid in '0 0 * * L': write the day first: '5L' is "
     "the month's last Friday"),
    ("0 0 * * L5", "day-of-week 'L5' is not valid in '0 0 * * L5': write the day first: '5L' "
     "is the month's last Friday"),
    ("0 0 * * 1#6", "day-of-week '1#6' is not valid in '0 0 * * 1#6': the number after '#' "
     "must be 1-5"),
    ("0 0 * * 1#0", "day-of-week '1#0' is not valid in '0 0 * * 1#0': the number after '#' "
     "must be 1-5"),
    ("0 0 * * 1#2,3", "day-of-week '1#2,3' is not valid in '0 0 * * 1#2,3': '#' and 'L' days "
     "cannot be mixed with plain days"),
    ("0 0 * * 1-5#2", "day-of-week '1-5#2' is not valid in '0 0 * * 1-5#2'"),
    ("0 0 1,15W * *", "day-of-month '1,15W' is not valid in '0 0 1,15W * *': 'W' must be the "
     "only day-of-month value"),
    ("0 0 L/2 * *", "day-of-month 'L/2' is not valid in '0 0 L/2 * *'"),
    ("0 0 LW * *", "day-of-month 'LW' is not valid in '0 0 LW * *'"),
    ("0 0 13 * 5#2", "day-of-month '13' and day-of-week '5#2' cannot both be set in "
     "'0 0 13 * 5#2' when one uses '#', 'L' (day-of-week) or 'W'; set the other to '*'"),
    ("0 0 15W * MON", "day-of-month '15W' and day-of-week 'MON' cannot both be set in "
     "'0 0 15W * MON' when one uses '#', 'L' (day-of-week) or 'W'; set the other to '*'"),
    ("* * *", "cron expression '* * *' has 3 fields; 5 or 6 are accepted ('minute hour "
     "day-of-month month day-of-week', optionally preceded by 'second')"),
    ("*", "cron expression '*' has 1 field; 5 or 6 are accepted"),
    ("", "cron expression '' has 0 fields; 5 or 6 are accepted"),
    ("0 0 0 1 1 * 2030", "cron expression '0 0 0 1 1 * 2030' has 7 fields; 5 or 6 are accepted "
     "('minute hour day-of-month month day-of-week', optionally preceded by 'second'); a 7th "
     "(year) field is not supported"),
    ("* * * * * * * *", "cron expression '* * * * * * * *' has 8 fields; 5 or 6 are accepted"),
    ("@reboot", "cron expression '@reboot' is not supported: a scheduler has no reboot to "
     "follow"),
    ("@every 5m", "cron expression '@every 5m' is not valid: unknown alias; accepted: @yearly, "
     "@annually, @monthly, @weekly, @daily, @midnight, @hourly"),
    ("* * 31 2 *", "cron expression '* * 31 2 *' never fires: no date matches its "
     "day-of-month, month and day-of-week"),
    ("0 0 30 2 *", "cron expression '0 0 30 2 *' never fires: no date matches its "
     "day-of-month, month and day-of-week"),
    ("0 0 31 4,6,9,11 *", "cron expression '0 0 31 4,6,9,11 *' never fires"),
    ("0 0 0 31 2 *", "cron expression '0 0 0 31 2 *' never fires"),
    ("0 0 31 4,6,9,11 */3", "cron expression '0 0 31 4,6,9,11 */3' never fires: no date "
     "matches its day-of-month, month and day-of-week (day-of-week '*/3' starts with '*'"),
    ("0 0 30 2 ?", "cron expression '0 0 30 2 ?' never fires: no date matches its "
     "day-of-month, month and day-of-week"),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "message"), REFUSED, ids=[e for e, _ in REFUSED])
def test_refused_expressions_say_why(expression: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_cron(expression)
    assert str(caught.value).startswith(message)
    assert caught.value.option == "cron"
    assert isinstance(caught.value, ValueError)


def test_rare_but_possible_dates_are_not_refused() -> None:
    # February 29th, and a fifth Monday in February (2044 is the next one).
    assert fires("0 0 29 2 *", "UTC", "2027-01-01T00:00Z", 1) == [utc("2028-02-29T00:00Z")]
    assert fires("0 0 * 2 1#5", "UTC", "2027-01-01T00:00Z", 1) == [utc("2044-02-29T00:00Z")]


def test_a_non_string_expression_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"cron expression 5 \(int\) is not a string"):
        parse_cron(5)  # type: ignore[arg-type]


def test_an_unknown_zone_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_cron("0 8 * * *", "Europe/Pari")
    assert str(caught.value) == "unknown time zone 'Europe/Pari'; did you mean 'Europe/Paris'?"
    assert caught.value.option == "timezone"


# --- min_gap ----------------------------------------------------------------------------------

YEAR_2027 = (to_ms("2027-01-01T00:00Z"), to_ms("2028-01-01T00:00Z"))
SUMMER_TO_WINTER_2027 = (to_ms("2027-06-01T00:00Z"), to_ms("2027-12-31T00:00Z"))
LORD_HOWE_SPRING_2026 = (to_ms("2026-09-01T00:00Z"), to_ms("2026-11-01T00:00Z"))

MIN_GAPS = [
    ("0 8 * * MON-FRI", "Europe/Paris", YEAR_2027, timedelta(days=1)),
    ("*/5 * * * *", "Europe/Paris", YEAR_2027, timedelta(minutes=5)),
    ("*/10 * * * * *", "Europe/Paris", YEAR_2027, timedelta(seconds=10)),
    ("0 9 * * *", "UTC", YEAR_2027, timedelta(days=1)),
    ("0 0 L * *", "UTC", YEAR_2027, timedelta(days=28)),  # January 31st to February 28th
    # Spring: 02:00 is missing and fires at 03:00 CEST (24h after the day before), then 02:00
    # CEST the day after, 23h later.
    ("0 2 * * *", "Europe/Paris", YEAR_2027, timedelta(hours=23)),
    # Only the autumn switch in the window: the 25h day makes no gap shorter than 24h.
    ("0 2 * * *", "Europe/Paris", SUMMER_TO_WINTER_2027, timedelta(hours=24)),
    ("30 2 * * *", "Europe/Paris", YEAR_2027, timedelta(hours=23, minutes=30)),
    ("0 3 * * *", "Europe/Paris", YEAR_2027, timedelta(hours=23)),
    # 01:00 CET (00:00Z) then 03:00 CEST (01:00Z) on March 28th: one hour instead of two.
    ("0 1,3 * * *", "Europe/Paris", YEAR_2027, timedelta(hours=1)),
    # Real time: 00:00 CET (23:00Z) then 03:00 CEST (01:00Z): two hours instead of three.
    ("0 */3 * * *", "Europe/Paris", YEAR_2027, timedelta(hours=2)),
    # Lord Howe's 30-minute shift: 02:00 fires at 02:30 (+11), then 02:00 (+11) next day.
    ("0 2 * * *", "Australia/Lord_Howe", LORD_HOWE_SPRING_2026, timedelta(hours=23, minutes=30)),
    # A yearly job has one fire in a year: the window stretches to the next one (2028 is leap).
    ("0 0 1 1 *", "UTC", SUMMER_TO_WINTER_2027, timedelta(days=366)),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "zone", "window", "expected"), MIN_GAPS)
def test_min_gap_between(
    expression: str, zone: str, window: tuple[int, int], expected: timedelta
) -> None:
    assert parse_cron(expression, zone).min_gap_between(*window) == expected


@pytest.mark.parametrize("zone", ["Europe/Paris", "Australia/Lord_Howe", "Antarctica/Troll"])
@pytest.mark.parametrize(
    "expression",
    ["0 2 * * *", "30 2 * * *", "0 1,3 * * *", "0 */3 * * *", "45 1 * * *", "0,30 2 * * 0",
     "0 */7 * * *", "0 2 * * 1-5", "0 2 1,15 * *", "0 2 */2 * 1-5", "30 2 1,15 * */3"],
)  # fmt: skip
def test_min_gap_agrees_with_walking_every_fire(expression: str, zone: str) -> None:
    trigger = parse_cron(expression, zone)
    start, end = YEAR_2027
    walked = []
    fire = trigger.next_ms(start)
    while fire is not None and fire <= end:
        walked.append(fire)
        fire = trigger.next_ms(fire)
    smallest = min(b - a for a, b in itertools.pairwise(walked))
    assert trigger.min_gap_between(start, end) == timedelta(milliseconds=smallest)


def test_min_gap_looks_a_year_ahead_and_is_cached() -> None:
    trigger = parse_cron("*/5 * * * *", "Europe/Paris")
    gap = trigger.min_gap()
    assert gap == timedelta(minutes=5)
    assert trigger.min_gap() is gap


# --- properties -------------------------------------------------------------------------------

PROPERTY_ZONES = [
    "Europe/Paris",
    "America/New_York",
    "Australia/Lord_Howe",
    "America/Santiago",
    "Pacific/Chatham",
    "Antarctica/Troll",
    "America/Nuuk",
    "Asia/Kolkata",
    "UTC",
]


def _field(low: int, high: int) -> st.SearchStrategy[str]:
    value = st.integers(low, high)
    pair = st.tuples(value, value).filter(lambda p: p[0] < p[1])
    return st.one_of(
        st.just("*"),
        value.map(str),
        st.integers(2, 30).map(lambda step: f"*/{step}"),
        pair.map(lambda p: f"{p[0]}-{p[1]}"),
        st.tuples(pair, st.integers(2, 9)).map(lambda t: f"{t[0][0]}-{t[0][1]}/{t[1]}"),
        st.lists(value, min_size=2, max_size=4, unique=True).map(lambda v: ",".join(map(str, v))),
    )


EXPRESSIONS = st.tuples(
    st.one_of(st.none(), st.sampled_from(["0", "30", "*/20", "0,45"])),  # seconds, or none
    _field(0, 59),
    _field(0, 23),
    st.sampled_from(["*", "*", "*", "1", "15", "1-10", "L", "*/3", "28"]),
    st.sampled_from(["*", "*", "*", "3", "3,4,10", "9-11", "*/2"]),
    st.sampled_from(["*", "*", "*", "MON-FRI", "0", "SAT,SUN", "1-3", "5", "*/2"]),
).map(lambda fields: " ".join(f for f in fields if f is not None))


@functools.cache
def _switches(zone: str) -> tuple[int, ...]:
    """Where the zone's offset changes in 2026-2030, by sampling every 15 minutes."""
    tz = ZoneInfo(zone)
    step = 15 * MINUTE_MS
    found: list[int] = []
    start = to_ms("2026-01-01T00:00Z")
    previous = datetime.fromtimestamp(start / 1000, tz).utcoffset()
    for at in range(start, to_ms("2031-01-01T00:00Z"), step):
        offset = datetime.fromtimestamp(at / 1000, tz).utcoffset()
        if offset != previous:
            found.append(at)
        previous = offset
    return tuple(found)


@st.composite
def _starts(draw: st.DrawFn, zone: str) -> int:
    """A random instant, usually within a day and a half of a daylight-saving switch."""
    switches = _switches(zone)
    near_a_switch = draw(st.booleans())
    if switches and near_a_switch:
        near = draw(st.sampled_from(switches))
        return near + draw(st.integers(-36 * HOUR_MS, 36 * HOUR_MS))
    return draw(st.integers(to_ms("2026-01-01T00:00Z"), to_ms("2030-12-31T00:00Z")))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, str, int]:
    zone = draw(st.sampled_from(PROPERTY_ZONES))
    return draw(EXPRESSIONS), zone, draw(_starts(zone))


def _wall(ms: int, zone: str) -> datetime:
    return datetime.fromtimestamp(ms / 1000, ZoneInfo(zone)).replace(tzinfo=None)


def _offset(ms: int, zone: str) -> timedelta:
    offset = datetime.fromtimestamp(ms / 1000, ZoneInfo(zone)).utcoffset()
    assert offset is not None
    return offset


def _is_fixed_time(expression: str) -> bool:
    fields = expression.split()
    minute, hour = fields[-5], fields[-4]
    return not (minute.startswith("*") or hour.startswith("*"))


def _day_or(expression: str) -> bool:
    """Vixie cron: a day matches either day field only when neither starts with '*'."""
    fields = expression.split()
    return not (fields[-3].startswith("*") or fields[-1].startswith("*"))


def _cron(expression: str, start: datetime) -> croniter[datetime]:
    return croniter(
        expression,
        start,
        ret_type=datetime,
        day_or=_day_or(expression),
        second_at_beginning=len(expression.split()) == 6,
    )


def _matches(expression: str, wall: datetime) -> bool:
    six = len(expression.split()) == 6
    return bool(
        croniter.match(expression, wall, day_or=_day_or(expression), second_at_beginning=six)
    )


def _is_gap_shift(expression: str, zone: str, fire_ms: int) -> bool:
    """``fire_ms`` ends a spring gap in which the fixed-time expression has a local time."""
    before, after = _offset(fire_ms - 1, zone), _offset(fire_ms, zone)
    if not (after > before and _is_fixed_time(expression)):
        return False
    gap_start = _wall(fire_ms, zone) - (after - before)
    first = _cron(expression, gap_start - timedelta(seconds=1)).get_next(datetime)
    return first < _wall(fire_ms, zone)


def _expected_fires(expression: str, zone: str, after_ms: int, until_ms: int) -> list[int]:
    """The fires in ``(after_ms, until_ms]`` by the rules, from zoneinfo's PEP 495 folds.

    Every naive local match is placed with ``fold=0`` and ``fold=1``: one instant means an
    ordinary time, two a repeated one (fixed-time jobs keep the first), and a wall time that
    does not survive the round trip is in a gap (fixed-time jobs fire when the gap ends).
    """
    tz = ZoneInfo(zone)
    fixed = _is_fixed_time(expression)
    margin = timedelta(hours=3)
    cron = _cron(expression, _wall(after_ms, zone) - margin)
    end = _wall(until_ms, zone) + margin
    found: set[int] = set()
    while (wall := cron.get_next(datetime)) <= end:
        first = wall.replace(tzinfo=tz, fold=0)
        second = wall.replace(tzinfo=tz, fold=1)
        first_ms = int(first.timestamp() * 1000)
        second_ms = int(second.timestamp() * 1000)
        exists = first.astimezone(UTC).astimezone(tz).replace(tzinfo=None) == wall
        if not exists:
            if fixed:
                found.add(_gap_end(second_ms, zone))
        elif first_ms == second_ms or fixed:
            found.add(min(first_ms, second_ms))
        else:
            found.update((first_ms, second_ms))
    return sorted(ms for ms in found if after_ms < ms <= until_ms)


def _gap_end(before_gap_ms: int, zone: str) -> int:
    """The first whole minute after ``before_gap_ms`` where the offset has changed."""
    at = before_gap_ms - before_gap_ms % MINUTE_MS
    offset = _offset(at, zone)
    while _offset(at, zone) == offset:
        at += MINUTE_MS
    return at


@settings(max_examples=examples(150), deadline=None)
@given(case=_cases())
def test_fires_increase_and_match_the_expression(case: tuple[str, str, int]) -> None:
    expression, zone, start = case
    trigger = parse_cron(expression, zone)
    runs: list[int] = []
    cursor: int | None = start
    while len(runs) < 25 and cursor is not None:
        cursor = trigger.next_ms(cursor)
        assert cursor is not None
        runs.append(cursor)
    assert all(a < b for a, b in zip([start, *runs], runs, strict=False))
    for fire in runs:
        wall = _wall(fire, zone)
        assert _matches(expression, wall) or _is_gap_shift(expression, zone, fire), (
            f"{expression!r} in {zone} fired at {wall} local"
        )


@settings(max_examples=examples(150), deadline=None)
@given(case=_cases())
def test_fires_are_exactly_the_ones_the_rules_give(case: tuple[str, str, int]) -> None:
    expression, zone, start = case
    trigger = parse_cron(expression, zone)
    runs: list[int] = []
    cursor: int | None = start
    while len(runs) < 25 and cursor is not None:
        cursor = trigger.next_ms(cursor)
        assert cursor is not None
        runs.append(cursor)
    assert runs == _expected_fires(expression, zone, start, runs[-1])


@settings(max_examples=examples(100), deadline=None)
@given(case=_cases(), data=st.data())
def test_any_instant_between_two_fires_leads_to_the_second(
    case: tuple[str, str, int], data: st.DataObject
) -> None:
    expression, zone, start = case
    trigger = parse_cron(expression, zone)
    first = trigger.next_ms(start)
    assert first is not None
    second = trigger.next_ms(first)
    assert second is not None
    between = data.draw(st.integers(first, second - 1))
    assert trigger.next_ms(between) == second

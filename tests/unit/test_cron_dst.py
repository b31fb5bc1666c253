"""A cron job's daylight-saving policy (``dst=``): ``"skip"`` drops a local time the spring gap
swallows, ``"run-once"`` (the default) fires it once when the gap ends, ``"run-twice"`` fires a
local time of the autumn fold at both of its instants. A job on real time (minute or hour
field starting with ``*``) has no policy to choose and refuses one.

Expected fire times are worked out by hand from the zones' published switches:

* Europe/Paris: 2027-03-28 at 01:00 UTC (local 02:00-03:00 missing); 2026-10-25 at 01:00 UTC
  (local 02:00-03:00 twice, +02:00 then +01:00).
* America/New_York: 2027-03-14 at 07:00 UTC (02:00-03:00 missing); 2026-11-01 at 06:00 UTC
  (01:00-02:00 twice, -04:00 then -05:00).
* Australia/Lord_Howe, a 30-minute shift: 2026-10-03 at 15:30 UTC (local 02:00-02:30 of
  10-04 missing; +10:30 then +11:00); 2027-04-03 at 15:00 UTC (local 01:30-02:00 of 04-04
  twice; +11:00 then +10:30).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from brokersched import MemoryBackend, Scheduler
from brokersched._exceptions import ConfigurationError
from brokersched.triggers.cron import DST_POLICIES, parse_cron
from tests.support.helpers import examples

MINUTE_MS = 60_000


def utc(iso: str) -> datetime:
    return datetime.fromisoformat(iso).astimezone(UTC)


def fires(expression: str, zone: str, dst: str | None, after: str, count: int) -> list[datetime]:
    return parse_cron(expression, zone, dst=dst).next_runs(count, utc(after))  # type: ignore[arg-type]


SPRING = [
    # (zone, expression, after, run-once fires, skip fires)
    ("Europe/Paris", "30 2 * * *", "2027-03-26T12:00Z",
     ["2027-03-27T01:30Z", "2027-03-28T01:00Z", "2027-03-29T00:30Z"],
     ["2027-03-27T01:30Z", "2027-03-29T00:30Z", "2027-03-30T00:30Z"]),
    ("Europe/Paris", "0,30 2 * * *", "2027-03-27T12:00Z",
     ["2027-03-28T01:00Z", "2027-03-29T00:00Z", "2027-03-29T00:30Z"],
     ["2027-03-29T00:00Z", "2027-03-29T00:30Z", "2027-03-30T00:00Z"]),
    ("America/New_York", "30 2 * * *", "2027-03-13T00:00Z",
     ["2027-03-13T07:30Z", "2027-03-14T07:00Z", "2027-03-15T06:30Z"],
     ["2027-03-13T07:30Z", "2027-03-15T06:30Z", "2027-03-16T06:30Z"]),
    ("Australia/Lord_Howe", "15 2 * * *", "2026-10-02T00:00Z",
     ["2026-10-02T15:45Z", "2026-10-03T15:30Z", "2026-10-04T15:15Z"],
     ["2026-10-02T15:45Z", "2026-10-04T15:15Z", "2026-10-05T15:15Z"]),
]  # fmt: skip

AUTUMN = [
    # (zone, expression, after, run-once fires, run-twice fires)
    ("Europe/Paris", "30 2 * * *", "2026-10-23T12:00Z",
     ["2026-10-24T00:30Z", "2026-10-25T00:30Z", "2026-10-26T01:30Z"],
     ["2026-10-24T00:30Z", "2026-10-25T00:30Z", "2026-10-25T01:30Z", "2026-10-26T01:30Z"]),
    ("America/New_York", "30 1 * * *", "2026-10-31T00:00Z",
     ["2026-10-31T05:30Z", "2026-11-01T05:30Z", "2026-11-02T06:30Z"],
     ["2026-10-31T05:30Z", "2026-11-01T05:30Z", "2026-11-01T06:30Z", "2026-11-02T06:30Z"]),
    ("Australia/Lord_Howe", "45 1 * * *", "2027-04-02T00:00Z",
     ["2027-04-02T14:45Z", "2027-04-03T14:45Z", "2027-04-04T15:15Z"],
     ["2027-04-02T14:45Z", "2027-04-03T14:45Z", "2027-04-03T15:15Z", "2027-04-04T15:15Z"]),
]  # fmt: skip


@pytest.mark.parametrize(("zone", "expression", "after", "once", "skipped"), SPRING)
def test_the_spring_gap(
    zone: str, expression: str, after: str, once: list[str], skipped: list[str]
) -> None:
    assert fires(expression, zone, None, after, 3) == [utc(t) for t in once]
    assert fires(expression, zone, "run-once", after, 3) == [utc(t) for t in once]
    assert fires(expression, zone, "run-twice", after, 3) == [utc(t) for t in once]
    assert fires(expression, zone, "skip", after, 3) == [utc(t) for t in skipped]


@pytest.mark.parametrize(("zone", "expression", "after", "once", "twice"), AUTUMN)
def test_the_autumn_fold(
    zone: str, expression: str, after: str, once: list[str], twice: list[str]
) -> None:
    assert fires(expression, zone, None, after, 3) == [utc(t) for t in once]
    assert fires(expression, zone, "run-once", after, 3) == [utc(t) for t in once]
    assert fires(expression, zone, "skip", after, 3) == [utc(t) for t in once]
    assert fires(expression, zone, "run-twice", after, 4) == [utc(t) for t in twice]


def test_run_twice_shortens_the_gap_between_runs_to_the_fold() -> None:
    """Two slots one fold apart: an hour in Paris, 30 minutes in Lord Howe; the checks on
    jitter read that gap."""
    paris = parse_cron("30 2 * * *", "Europe/Paris", dst="run-twice")
    gap = paris.min_gap_between(int(utc("2026-10-20T00:00Z").timestamp() * 1000),
                                int(utc("2026-10-30T00:00Z").timestamp() * 1000))  # fmt: skip
    assert gap == timedelta(hours=1)
    lord_howe = parse_cron("45 1 * * *", "Australia/Lord_Howe", dst="run-twice")
    start = int(utc("2027-04-01T00:00Z").timestamp() * 1000)
    assert lord_howe.min_gap_between(start, start + 5 * 86_400_000) == timedelta(minutes=30)


def test_the_policy_is_described_and_shown() -> None:
    trigger = parse_cron("30 2 * * *", "Europe/Paris", dst="skip")
    assert trigger.dst == "skip" and trigger.dst_rule == "skip"
    assert trigger.describe() == "cron '30 2 * * *' (Europe/Paris, dst=skip)"
    assert repr(trigger) == "CronTrigger('30 2 * * *', timezone='Europe/Paris', dst='skip')"
    default = parse_cron("30 2 * * *", "Europe/Paris")
    assert default.dst is None and default.dst_rule == "run-once"
    assert default.describe() == "cron '30 2 * * *' (Europe/Paris)"
    assert parse_cron("*/5 * * * *", "Europe/Paris").dst_rule == "real time"


@pytest.mark.parametrize("expression", ["*/5 * * * *", "0 * * * *", "* 2 * * *", "0 */2 * * *"])
def test_a_job_on_real_time_refuses_a_policy(expression: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_cron(expression, "Europe/Paris", dst="run-once")
    assert raised.value.option == "dst"
    assert str(raised.value) == (
        f"option 'dst' = 'run-once' does not apply to '{expression}': its minute or hour field "
        "starts with '*', so it runs on real time through daylight-saving switches (nothing is "
        "skipped or repeated); remove dst="
    )


def test_an_unknown_policy_names_the_option_the_value_and_the_accepted_ones() -> None:
    message = "option 'dst' = 'twice' is not a daylight-saving policy; accepted: 'skip', " + (
        "'run-once', 'run-twice'"
    )
    with pytest.raises(ConfigurationError, match="^" + message + "$"):
        parse_cron("0 2 * * *", "Europe/Paris", dst="twice")  # type: ignore[arg-type]
    scheduler = Scheduler(MemoryBackend())
    with pytest.raises(ConfigurationError) as raised:
        scheduler.cron("nightly", "0 2 * * *", lambda ctx: None, dst="twice")  # type: ignore[call-overload]
    assert str(raised.value) == f"job 'nightly': {message}"
    assert raised.value.option == "dst" and raised.value.job == "nightly"


def test_a_job_option_of_cron_only() -> None:
    scheduler = Scheduler(MemoryBackend())
    job = scheduler.cron(
        "nightly", "30 2 * * *", lambda ctx: None, timezone="Europe/Paris", dst="run-twice"
    )
    assert job.describe() == "cron '30 2 * * *' (Europe/Paris, dst=run-twice)"
    assert job.next_runs(2, utc("2026-10-24T12:00Z")) == [
        utc("2026-10-25T00:30Z"),
        utc("2026-10-25T01:30Z"),
    ]
    with pytest.raises(ConfigurationError, match=r"^job 'often': option 'dst' applies to cron"):
        scheduler.every("often", "1h", lambda ctx: None, dst="skip")  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match=r"^job 'ticks': option 'dst' = 'skip' does not"):
        scheduler.cron("ticks", "*/5 * * * *", lambda ctx: None, dst="skip")


# --- properties: each policy against an oracle built on zoneinfo's PEP 495 folds -----------

ZONES = ("Europe/Paris", "America/New_York", "Australia/Lord_Howe")
SWITCHES = ("2026-10-24", "2026-10-31", "2027-03-13", "2027-03-27", "2026-10-02", "2027-04-02")


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, str, str, int]:
    minutes = draw(st.lists(st.sampled_from([0, 15, 30, 45, 59]), min_size=1, max_size=2))
    hours = draw(st.lists(st.integers(0, 4), min_size=1, max_size=2))
    expression = (
        f"{','.join(map(str, sorted(set(minutes))))} {','.join(map(str, sorted(set(hours))))} * * *"
    )
    zone = draw(st.sampled_from(ZONES))
    start = utc(draw(st.sampled_from(SWITCHES)) + "T00:00Z") + timedelta(
        minutes=draw(st.integers(0, 36 * 60))
    )
    return expression, zone, draw(st.sampled_from(DST_POLICIES)), int(start.timestamp() * 1000)


def _offset_ms(at_ms: int, zone: str) -> int:
    moment = datetime.fromtimestamp(at_ms / 1000, UTC).astimezone(ZoneInfo(zone))
    offset = moment.utcoffset()
    assert offset is not None
    return offset // timedelta(milliseconds=1)


def _gap_end(before_gap_ms: int, zone: str) -> int:
    """The first whole minute after ``before_gap_ms`` with another offset."""
    at = before_gap_ms - before_gap_ms % MINUTE_MS
    offset = _offset_ms(at, zone)
    while _offset_ms(at, zone) == offset:
        at += MINUTE_MS
    return at


def _expected(expression: str, zone: str, policy: str, after_ms: int, until_ms: int) -> list[int]:
    tz = ZoneInfo(zone)
    margin = timedelta(hours=3)
    wall_after = datetime.fromtimestamp(after_ms / 1000, UTC).astimezone(tz).replace(tzinfo=None)
    wall_until = datetime.fromtimestamp(until_ms / 1000, UTC).astimezone(tz).replace(tzinfo=None)
    cron = croniter(expression, wall_after - margin, ret_type=datetime)
    found: set[int] = set()
    while (wall := cron.get_next(datetime)) <= wall_until + margin:
        first = wall.replace(tzinfo=tz, fold=0)
        second = wall.replace(tzinfo=tz, fold=1)
        first_ms, second_ms = (int(t.timestamp() * 1000) for t in (first, second))
        if first.astimezone(UTC).astimezone(tz).replace(tzinfo=None) != wall:  # in a gap
            if policy != "skip":
                found.add(_gap_end(second_ms, zone))
        elif policy == "run-twice":
            found.update((first_ms, second_ms))
        else:
            found.add(min(first_ms, second_ms))
    return sorted(ms for ms in found if after_ms < ms <= until_ms)


@settings(max_examples=examples(150), deadline=None)
@given(case=_cases())
def test_fires_are_exactly_the_ones_the_policy_gives(case: tuple[str, str, str, int]) -> None:
    expression, zone, policy, start = case
    trigger = parse_cron(expression, zone, dst=policy)  # type: ignore[arg-type]
    runs: list[int] = []
    cursor: int | None = start
    while len(runs) < 12 and cursor is not None:
        cursor = trigger.next_ms(cursor)
        assert cursor is not None
        runs.append(cursor)
    assert runs == _expected(expression, zone, policy, start, runs[-1])


@settings(max_examples=examples(100), deadline=None)
@given(case=_cases())
def test_skip_runs_a_subset_of_run_once_a_subset_of_run_twice(
    case: tuple[str, str, str, int],
) -> None:
    expression, zone, _, start = case
    end = start + 3 * 86_400_000

    def slots(policy: str) -> set[int]:
        trigger = parse_cron(expression, zone, dst=policy)  # type: ignore[arg-type]
        found, cursor = set[int](), trigger.next_ms(start)
        while cursor is not None and cursor <= end:
            found.add(cursor)
            cursor = trigger.next_ms(cursor)
        return found

    assert slots("skip") <= slots("run-once") <= slots("run-twice")

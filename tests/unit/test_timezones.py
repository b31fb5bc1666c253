"""Time zones: parsing, names, and the offset transitions the cron trigger relies on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone, tzinfo
from importlib import resources
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brokersched._exceptions import ConfigurationError
from brokersched._timezones import (
    OffsetTimeline,
    Transition,
    parse_timezone,
    timeline_for,
    timezone_name,
)
from tests.support.helpers import examples

HOUR_MS = 3_600_000


def ms(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp() * 1000)


# --- parse_timezone ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Europe/Paris", "America/New_York", "Australia/Lord_Howe"])
def test_iana_names_become_zoneinfo(name: str) -> None:
    tz = parse_timezone(name)
    assert tz == ZoneInfo(name)
    assert timezone_name(tz) == name


def test_aliases_keep_the_name_as_written() -> None:
    tz = parse_timezone("US/Eastern")
    assert timezone_name(tz) == "US/Eastern"
    instant = datetime(2027, 7, 1, 12, tzinfo=UTC)
    assert instant.astimezone(tz).utcoffset() == timedelta(hours=-4)


def test_surrounding_spaces_are_ignored() -> None:
    assert timezone_name(parse_timezone("  Europe/Paris ")) == "Europe/Paris"


@pytest.mark.parametrize("text", ["UTC", "utc", "Z", "z"])
def test_utc_spellings(text: str) -> None:
    tz = parse_timezone(text)
    assert tz is UTC
    assert timezone_name(tz) == "UTC"


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("+05:30", 330), ("-08:00", -480), ("+0530", 330), ("-0800", -480), ("+05", 300),
     ("+00:00", 0), ("-00:00", 0), ("+14:00", 840), ("-09:30", -570)],
)  # fmt: skip
def test_fixed_offsets(text: str, minutes: int) -> None:
    tz = parse_timezone(text)
    assert tz.utcoffset(None) == timedelta(minutes=minutes)
    assert timezone_name(tz) == text


def test_tzinfo_objects_are_returned_as_is() -> None:
    paris = ZoneInfo("Europe/Paris")
    fixed = timezone(timedelta(hours=3))
    assert parse_timezone(paris) is paris
    assert parse_timezone(fixed) is fixed
    assert parse_timezone(UTC) is UTC


def test_unknown_zone_suggests_the_closest_name() -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_timezone("Europe/Pari")
    assert str(caught.value) == "unknown time zone 'Europe/Pari'; did you mean 'Europe/Paris'?"
    assert caught.value.option == "timezone"
    assert isinstance(caught.value, ValueError)


def test_wrong_case_suggests_the_right_one() -> None:
    with pytest.raises(ConfigurationError, match=r"did you mean 'America/New_York'\?$"):
        parse_timezone("america/new_york")


def test_several_equally_close_names_are_all_suggested() -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_timezone("Asia/Tokio")
    assert str(caught.value) == (
        "unknown time zone 'Asia/Tokio'; did you mean 'Asia/Tokyo' or 'Asia/Tomsk'?"
    )


@pytest.mark.parametrize("text", ["Nowhere/Land", "America", "/etc/passwd", "../Europe/Paris"])
def test_unknown_zones_without_a_close_match_name_what_is_accepted(text: str) -> None:
    with pytest.raises(ConfigurationError, match=f"unknown time zone '{text}'") as caught:
        parse_timezone(text)
    assert caught.value.option == "timezone"


def test_no_suggestion_when_nothing_is_close() -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_timezone("Nowhere/Land")
    assert str(caught.value) == (
        "unknown time zone 'Nowhere/Land'; use an IANA name such as 'Europe/Paris', 'UTC', "
        "or a fixed offset such as '+05:30'"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("+25:00", "time zone offset '+25:00' is out of range -23:59 to +23:59"),
        ("+05:61", "time zone offset '+05:61' is out of range -23:59 to +23:59"),
        ("+5:30", "time zone offset '+5:30' is not valid; write it like '+05:30', '-0800'"),
        ("-08:00:00", "time zone offset '-08:00:00' is not valid; write it like"),
        ("", "time zone is empty; use an IANA name"),
        ("   ", "time zone is empty; use an IANA name"),
    ],
)
def test_bad_offsets_and_empty_names(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_timezone(text)
    assert str(caught.value).startswith(message)
    assert caught.value.option == "timezone"


def test_a_value_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"time zone 5 \(int\) is not a time zone"):
        parse_timezone(5)  # type: ignore[arg-type]


def test_name_of_a_zone_loaded_from_a_file_falls_back_to_its_repr() -> None:
    # tzdata is the package brokersched depends on for its zone database.
    with resources.files("tzdata").joinpath("zoneinfo/Europe/Paris").open("rb") as file:
        tz = ZoneInfo.from_file(file)
    assert timezone_name(tz) == repr(tz)


# --- OffsetTimeline ---------------------------------------------------------------------------

# Real switches, checked against the published rules: EU at 01:00 UTC, US at 02:00 local,
# Lord Howe at 02:00 local by 30 minutes (first Sunday of October / April).
KNOWN_TRANSITIONS = [
    ("Europe/Paris", "2027-03-28T01:00Z", 1.0, 2.0),
    ("Europe/Paris", "2026-10-25T01:00Z", 2.0, 1.0),
    ("America/New_York", "2027-03-14T07:00Z", -5.0, -4.0),
    ("America/New_York", "2026-11-01T06:00Z", -4.0, -5.0),
    ("Australia/Lord_Howe", "2026-10-03T15:30Z", 10.5, 11.0),
    ("Australia/Lord_Howe", "2027-04-03T15:00Z", 11.0, 10.5),
]


@pytest.mark.parametrize(("zone", "at", "before_h", "after_h"), KNOWN_TRANSITIONS)
def test_first_transition_finds_real_switches(
    zone: str, at: str, before_h: float, after_h: float
) -> None:
    timeline = OffsetTimeline(ZoneInfo(zone))
    at_ms = ms(at)
    expected = Transition(at_ms, round(before_h * HOUR_MS), round(after_h * HOUR_MS))
    assert timeline.first_transition(at_ms - 40 * 24 * HOUR_MS, at_ms + HOUR_MS) == expected
    assert timeline.first_transition(at_ms - 1, at_ms) == expected
    assert timeline.first_transition(at_ms, at_ms + HOUR_MS) is None  # the range is (after, until]
    assert timeline.last_transition(at_ms + 5 * HOUR_MS, at_ms - 1) == expected
    assert timeline.last_transition(at_ms - 1, at_ms - 40 * 24 * HOUR_MS) is None
    assert expected.is_gap == (after_h > before_h)


@pytest.mark.parametrize(("zone", "at", "before_h", "after_h"), KNOWN_TRANSITIONS)
def test_offset_changes_exactly_at_the_transition(
    zone: str, at: str, before_h: float, after_h: float
) -> None:
    timeline = OffsetTimeline(ZoneInfo(zone))
    at_ms = ms(at)
    assert timeline.offset_ms(at_ms - 1) == round(before_h * HOUR_MS)
    assert timeline.offset_ms(at_ms) == round(after_h * HOUR_MS)


def test_a_year_of_paris_has_two_transitions() -> None:
    timeline = OffsetTimeline(ZoneInfo("Europe/Paris"))
    found: list[Transition] = []
    cursor, end = ms("2027-01-01T00:00Z"), ms("2028-01-01T00:00Z")
    while (transition := timeline.first_transition(cursor, end)) is not None:
        found.append(transition)
        cursor = transition.at_ms
    assert [t.at_ms for t in found] == [ms("2027-03-28T01:00Z"), ms("2027-10-31T01:00Z")]


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "Asia/Kolkata"])
def test_zones_without_daylight_saving_have_no_transition(zone: str) -> None:
    timeline = OffsetTimeline(ZoneInfo(zone))
    assert timeline.first_transition(ms("2026-01-01T00:00Z"), ms("2028-01-01T00:00Z")) is None


@pytest.mark.parametrize(
    ("tz", "offset_ms"), [(UTC, 0), (timezone(timedelta(hours=5, minutes=30)), 19_800_000)]
)
def test_fixed_offsets_never_change(tz: tzinfo, offset_ms: int) -> None:
    timeline = OffsetTimeline(tz)
    assert timeline.first_transition(0, 10**13) is None
    assert timeline.last_transition(10**13, 0) is None
    assert timeline.offset_ms(ms("2027-03-28T01:00Z")) == offset_ms


def test_timelines_are_shared_per_zone() -> None:
    assert timeline_for(ZoneInfo("Europe/Paris")) is timeline_for(ZoneInfo("Europe/Paris"))


class _UnhashableParis(tzinfo):
    """Like dateutil's zones: defines equality, so it is not hashable."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _UnhashableParis)

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return timedelta(hours=1) if dt is None else ZoneInfo("Europe/Paris").utcoffset(dt)

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return "Paris"

    def fromutc(self, dt: datetime) -> datetime:
        local = dt.replace(tzinfo=UTC).astimezone(ZoneInfo("Europe/Paris"))
        return local.replace(tzinfo=self)


def test_unhashable_zones_get_their_own_timeline() -> None:
    timeline = timeline_for(_UnhashableParis())
    at_ms = ms("2027-03-28T01:00Z")
    assert timeline.first_transition(at_ms - HOUR_MS, at_ms + HOUR_MS) == Transition(
        at_ms, HOUR_MS, 2 * HOUR_MS
    )


@settings(max_examples=examples(60), deadline=None)
@given(
    zone=st.sampled_from(
        ["Europe/Paris", "America/Santiago", "Pacific/Chatham", "Antarctica/Troll"]
    ),
    start=st.integers(ms("2024-01-01T00:00Z"), ms("2034-01-01T00:00Z")),
)
def test_every_offset_change_in_a_month_is_a_transition(zone: str, start: int) -> None:
    """Sampling the offset every 10 minutes finds exactly the transitions the timeline has."""
    timeline = OffsetTimeline(ZoneInfo(zone))
    tz = ZoneInfo(zone)
    step = 600_000
    end = start + 31 * 24 * HOUR_MS
    sampled = []
    previous = datetime.fromtimestamp(start / 1000, tz).utcoffset()
    for at in range(start + step, end + 1, step):
        offset = datetime.fromtimestamp(at / 1000, tz).utcoffset()
        if offset != previous:
            sampled.append(at)
        previous = offset
    found = []
    cursor = start
    while (transition := timeline.first_transition(cursor, end)) is not None:
        found.append(transition)
        cursor = transition.at_ms
    # Switches happen on whole minutes here, so the 10-minute sample lands on or after them.
    assert sampled == [t.at_ms + (start - t.at_ms) % step for t in found]
    for transition in found:
        assert timeline.offset_ms(transition.at_ms - 1) == transition.offset_before_ms
        assert timeline.offset_ms(transition.at_ms) == transition.offset_after_ms

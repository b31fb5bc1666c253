"""Registration refuses what cannot work, naming the job, option, values and backend."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from brokersched import (
    ConfigurationError,
    JobContext,
    MemoryBackend,
    NATSBackend,
    PostgresBackend,
    RabbitMQBackend,
    Scheduler,
    SQLiteBackend,
    parse_duration,
)
from tests.support.helpers import DictClaimBackend


async def handler(ctx: JobContext) -> None:
    pass


def claim_only(slot_ttl: str = "5m") -> Scheduler[Any]:
    return Scheduler(DictClaimBackend(slot_ttl=parse_duration(slot_ttl)))


def refused(sched: Scheduler[Any], kind: str, *args: Any, **options: Any) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as info:
        getattr(sched, kind)(*args, handler, **options)
    return info.value


@pytest.mark.parametrize(
    ("option", "value", "shown"),
    [("overlap", "allow", "'allow'"), ("max_attempts", 1, "1"), ("catch_up", "1h", "1h")],
)
def test_lease_options_are_refused_on_claim_only_backends(
    option: str, value: Any, shown: str
) -> None:
    error = refused(claim_only(), "every", "sync", "5m", **{option: value})
    assert str(error) == (
        f"job 'sync': option '{option}' ({shown}) needs a lease backend; DictClaimBackend only "
        "claims slots (use SQLiteBackend, PostgresBackend, RedisLeaseBackend or NATSLeaseBackend, "
        "or guard inside the job)"
    )
    assert (error.option, error.backend, error.job) == (option, "DictClaimBackend", "sync")


@pytest.mark.parametrize(
    ("option", "value"), [("overlap", "allow"), ("max_attempts", 1), ("catch_up", "1h")]
)
def test_lease_options_are_accepted_on_lease_backends(option: str, value: Any) -> None:
    job = Scheduler(MemoryBackend()).every("sync", "5m", handler, **{option: value})
    assert job.name == "sync"


def test_at_never_takes_overlap() -> None:
    when = datetime(2027, 1, 1, tzinfo=UTC)
    error = refused(Scheduler(MemoryBackend()), "at", "once", when, overlap="skip")
    assert error.option == "overlap"
    assert "does not apply to at()" in str(error)


def test_history_ttl_is_refused_where_history_is_trimmed_by_count() -> None:
    error = refused(claim_only(), "every", "h", "1m", history_ttl="1d")
    assert (error.option, error.backend) == ("history_ttl", "DictClaimBackend")
    assert "trims history by count only" in str(error)
    with pytest.raises(ConfigurationError, match="history_ttl") as info:
        Scheduler(DictClaimBackend(), history_ttl="1d")
    assert info.value.backend == "DictClaimBackend"


def test_jitter_plus_max_late_must_fit_in_slot_memory() -> None:
    error = refused(claim_only("5m"), "every", "sync", "1h", jitter="30s", max_late="5m")
    assert str(error) == (
        "job 'sync': jitter (30s) + max_late (5m) must be shorter than slot_ttl (5m) of "
        "DictClaimBackend, or a late instance could win the same slot again; raise slot_ttl or "
        "lower max_late"
    )
    assert claim_only("6m").every("sync", "1h", handler, jitter="30s", max_late="5m")
    # the boundary: a sum equal to slot_ttl is refused, one millisecond under it is accepted
    assert "shorter than slot_ttl" in str(
        refused(claim_only("5m"), "every", "edge", "1h", jitter="30s", max_late="4m30s")
    )
    assert claim_only("5m").every("edge", "1h", handler, jitter="30s", max_late="4m29999ms")
    # an unclaimed job never asks the backend, so slot memory does not matter
    assert claim_only("5m").every("local", "1h", handler, max_late="10m", claim=False)


def test_jitter_must_be_under_half_the_period() -> None:
    error = refused(Scheduler(), "every", "j", "10s", jitter="5s")
    assert error.option == "jitter"
    assert str(error) == (
        "job 'j': jitter (5s) must be under half the time between runs (10s), i.e. under 5s"
    )
    assert Scheduler().every("j", "10s", handler, jitter="4999ms")


def test_jitter_rule_uses_the_shortest_cron_gap() -> None:
    error = refused(Scheduler(), "cron", "c", "0,1 8 * * *", jitter="30s")
    assert "between runs (1m)" in str(error)


def test_default_jitter_is_a_quarter_of_short_intervals() -> None:
    sched = Scheduler(jitter="2s")
    assert sched.every("fast", "1s", handler).settings.jitter_ms == 250
    assert sched.every("slow", "1h", handler).settings.jitter_ms == 2000


def test_max_late_must_exceed_jitter() -> None:
    error = refused(Scheduler(), "every", "m", "1h", jitter="30s", max_late="30s")
    assert error.option == "max_late"
    assert str(error) == "job 'm': max_late (30s) must be greater than jitter (30s)"


def test_scheduler_defaults_are_checked_against_each_job() -> None:
    sched = Scheduler(jitter="10s", max_late="5s")
    error = refused(sched, "every", "d", "1h")
    assert error.option == "max_late"


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("timeout", "0s", "timeout (0s) must be greater than 0"),
        ("max_late", 0, "max_late (0s) must be greater than 0"),
        ("jitter", "-1s", "jitter '-1s' is negative; a duration must be >= 0 (write '1s')"),
        ("history_size", 0, "option 'history_size' = 0 is invalid"),
        ("max_attempts", 0, "option 'max_attempts' = 0 is invalid"),
        ("overlap", "queue", "option 'overlap' = 'queue' is invalid"),
        ("claim", "yes", "option 'claim' = 'yes' is invalid"),
        ("data", {1, 2}, "option 'data' must be JSON-serialisable"),
        ("timeout", "soon", "timeout 'soon' is not a duration; use a timedelta"),
    ],
)
def test_bad_values_name_the_option(option: str, value: Any, expected: str) -> None:
    error = refused(Scheduler(), "every", "bad", "1h", **{option: value})
    assert error.option == option
    assert expected in str(error)
    assert str(error).startswith("job 'bad': ")


def test_offset_and_timezone_belong_to_their_trigger() -> None:
    assert refused(Scheduler(), "cron", "c", "0 8 * * *", offset="1s").option == "offset"
    assert refused(Scheduler(), "every", "e", "1h", timezone="UTC").option == "timezone"
    error = refused(Scheduler(), "every", "e", "1m", offset="1m")
    assert error.option == "offset" and "smaller than the interval" in str(error)


def test_unknown_options_suggest_the_closest() -> None:
    error = refused(Scheduler(), "every", "typo", "1m", max_late_ms=5000)
    assert error.option == "max_late_ms"
    assert "unknown option 'max_late_ms'; did you mean 'max_late'?" in str(error)


def test_unclaimed_jobs_refuse_claim_only_lease_features() -> None:
    error = refused(Scheduler(), "every", "u", "1m", claim=False, max_attempts=2)
    assert error.option == "max_attempts" and "needs claim=True" in str(error)


@pytest.mark.parametrize("name", ["", "with space", ".dot-first", "a" * 129, "ünï", "a/b", 42])
def test_bad_names_are_refused(name: Any) -> None:
    error = refused(Scheduler(), "every", name, "1m")
    assert error.option == "name"
    assert repr(name) in str(error)


@pytest.mark.parametrize(
    "name", ["a", "outbox.flush", "tenant:42", "$sys", "A-b_c.d:e$", "x" * 128]
)
def test_good_names_are_accepted(name: str) -> None:
    assert Scheduler().every(name, "1m", handler).name == name


def test_names_are_unique_across_static_and_decorated_jobs() -> None:
    sched = Scheduler()
    sched.every("dup", "1m", handler)
    with pytest.raises(ConfigurationError, match="job name 'dup' is taken"):
        sched.cron("dup", "* * * * *")(handler)


def test_decorator_form_validates_before_decorating() -> None:
    with pytest.raises(ConfigurationError, match="needs a lease backend"):
        claim_only().every("early", "1m", overlap="allow")  # no handler yet: still refused


def test_at_needs_an_aware_datetime() -> None:
    error = refused(Scheduler(), "at", "naive", datetime(2027, 1, 1))
    assert "needs an aware datetime" in str(error)


def test_check_lists_every_error_of_every_job() -> None:
    sched = Scheduler()
    sched.every("fine", "1m", handler)
    assert sched.check() == []


def test_scheduler_options_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="unknown option 'jiter'; did you mean 'jitter'"):
        Scheduler(jiter="1s")  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="not a brokersched backend"):
        Scheduler(object())  # type: ignore[call-overload]


def test_parse_duration_forms() -> None:
    assert parse_duration("250ms") == timedelta(milliseconds=250)
    assert parse_duration("2s") == timedelta(seconds=2)
    assert parse_duration("35m") == timedelta(minutes=35)
    assert parse_duration("1h30m") == timedelta(hours=1, minutes=30)
    assert parse_duration("1d") == timedelta(days=1)
    assert parse_duration(1.5) == timedelta(seconds=1.5)
    assert parse_duration(3) == timedelta(seconds=3)
    assert parse_duration(timedelta(minutes=1)) == timedelta(minutes=1)
    # zero needs no unit
    assert parse_duration("0") == parse_duration("0.0") == parse_duration(" 0 ") == timedelta(0)
    assert Scheduler().every("no-jitter", "1m", handler, jitter="0").settings.jitter_ms == 0


def test_a_bare_number_string_is_told_to_add_a_unit() -> None:
    expected = r"jitter '5' is not a duration; add a unit, e.g. '5s'"
    with pytest.raises(ConfigurationError, match=expected):
        parse_duration("5", name="jitter")


@pytest.mark.parametrize(("value", "positive"), [("-1s", "1s"), (" -1h30m", "1h30m"), (-2, None)])
def test_a_negative_duration_is_told_so(value: Any, positive: str | None) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_duration(value, name="jitter")
    message = str(info.value)
    assert message.startswith(f"jitter {value!r} is negative; a duration must be >= 0")
    assert "not a duration" not in message
    if positive is not None:
        assert message.endswith(f"(write '{positive}')")


@pytest.mark.parametrize("value", ["", "5", "5 parsecs", "1h-30m", True, None, float("nan"), [1]])
def test_parse_duration_errors_show_accepted_forms(value: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_duration(value)
    assert repr(value) in str(info.value)
    assert "'250ms', '2s', '35m', '1h30m', '1d'" in str(info.value)


@pytest.mark.parametrize(
    "value", [1e300, -1e300, 10**20, "99999999999d", "9" * 400 + "ms", timedelta(days=36_501)]
)
def test_a_duration_too_long_is_a_configuration_error(value: Any) -> None:
    """Not an OverflowError (from ``timedelta``) nor a year past 9999 at the first listing."""
    with pytest.raises(ConfigurationError, match=r"interval .* (is too long|is negative)"):
        parse_duration(value, name="interval")
    assert parse_duration("36500d") == timedelta(days=36_500)
    assert Scheduler().after("far", "36500d", handler).next_run is None  # listed, not started


UNREACHABLE = {
    "RabbitMQBackend": lambda ttl: RabbitMQBackend("amqp://app:s3cret@127.0.0.1:1/", slot_ttl=ttl),
    "NATSBackend": lambda ttl: NATSBackend("nats://127.0.0.1:1", slot_ttl=ttl),
}


@pytest.mark.parametrize("backend", sorted(UNREACHABLE))
@pytest.mark.parametrize("option", ["overlap", "max_attempts", "catch_up", "history_ttl"])
def test_real_claim_backends_refuse_without_connecting(backend: str, option: str) -> None:
    """Validation reads capabilities only: an unreachable server gives the same errors."""
    value = {"overlap": "allow", "max_attempts": 1, "catch_up": "1m", "history_ttl": "1d"}[option]
    sched = Scheduler(UNREACHABLE[backend]("5m"))
    error = refused(sched, "every", "sync", "5m", **{option: value})
    assert (error.option, error.backend, error.job) == (option, backend, "sync")
    assert backend in str(error)
    assert "s3cret" not in str(error)


@pytest.mark.parametrize("backend", sorted(UNREACHABLE))
def test_real_claim_backends_check_slot_memory(backend: str) -> None:
    error = refused(Scheduler(UNREACHABLE[backend]("1m")), "every", "s", "1h", max_late="1m")
    assert f"slot_ttl (1m) of {backend}" in str(error)
    assert Scheduler(UNREACHABLE[backend]("2m")).every("s", "1h", handler, max_late="1m")


@pytest.mark.parametrize(
    "backend",
    [
        lambda: SQLiteBackend("/nonexistent/dir/x.db"),
        lambda: PostgresBackend("postgresql://app:s3cret@127.0.0.1:1/none"),
    ],
)
def test_lease_backends_accept_lease_options_without_connecting(backend: Any) -> None:
    sched = Scheduler(backend())
    job = sched.every("j", "1m", handler, overlap="allow", max_attempts=1, history_ttl="1d")
    assert job.settings.policy.overlap == "allow"

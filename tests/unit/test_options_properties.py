"""Property: registration either accepts a job whose settings obey every rule, or raises
``ConfigurationError`` — never another exception."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from brokersched import ConfigurationError, JobContext, MemoryBackend, Scheduler
from tests.support.helpers import DictClaimBackend, examples


async def handler(ctx: JobContext) -> None:
    pass


durations = st.one_of(
    st.integers(-5, 4000).map(lambda ms: f"{ms}ms" if ms >= 0 else ms / 1000),
    st.floats(-1, 600),
    st.just(float("nan")),
    st.sampled_from(["1s", "30s", "1m", "5m", "1h", "1d", "nonsense", "", "0s"]),
    st.integers(0, 7200).map(lambda s: timedelta(seconds=s)),
)
option_values: dict[str, Any] = {
    "jitter": durations,
    "max_late": durations,
    "timeout": durations,
    "overlap": st.sampled_from(["skip", "allow", "queue", None, 1]),
    "max_attempts": st.integers(-1, 5),
    "catch_up": durations,
    "history_size": st.integers(-1, 2000),
    "history_ttl": durations,
    "offset": durations,
    "timezone": st.sampled_from(["UTC", "Europe/Paris", "+05:30", "Mars/Base", 5]),
    "data": st.one_of(st.none(), st.dictionaries(st.text(max_size=3), st.integers()), st.just({1})),
    "claim": st.sampled_from([True, False, "yes"]),
    "max_late_ms": st.integers(0, 10),
}
options = st.fixed_dictionaries({}, optional=option_values)


@st.composite
def schedulers(draw: st.DrawFn) -> Scheduler[Any]:
    if draw(st.booleans()):
        ttl = timedelta(seconds=draw(st.integers(1, 900)))
        return Scheduler(DictClaimBackend(slot_ttl=ttl))
    return Scheduler(MemoryBackend())


@settings(max_examples=examples(400), deadline=None)
@given(
    sched=schedulers(),
    kind=st.sampled_from(["every", "cron", "at"]),
    interval=st.sampled_from(["1s", "10s", "1m", "1h", "0s", "bad"]),
    opts=options,
)
def test_registration_accepts_only_valid_jobs(
    sched: Scheduler[Any], kind: str, interval: str, opts: dict[str, Any]
) -> None:
    from datetime import UTC, datetime

    schedule: Any = {
        "every": interval,
        "cron": "*/10 * * * * *",
        "at": datetime(2030, 1, 1, tzinfo=UTC),
    }[kind]
    try:
        job = getattr(sched, kind)("job", schedule, handler, **opts)
    except ConfigurationError:
        return
    caps = sched.backend.capabilities
    s = job.settings
    gap = job.schedule.min_gap()
    jitter, max_late = timedelta(milliseconds=s.jitter_ms), timedelta(milliseconds=s.max_late_ms)
    if gap is not None:
        assert jitter < gap / 2
    assert max_late > jitter
    if not caps.leases:
        given = {option for option, value in opts.items() if value is not None}  # None: default
        assert not {"overlap", "max_attempts", "catch_up", "history_ttl"} & given
        if s.claim:
            assert caps.slot_memory is not None and jitter + max_late < caps.slot_memory
    if kind == "at":
        assert opts.get("overlap") is None
    assert s.policy.history_size >= 1 and s.policy.max_attempts >= 1
    assert s.timeout is None or s.timeout > timedelta(0)

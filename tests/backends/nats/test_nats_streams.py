"""Stream settings that break the claim guarantee, its bounded size or the history are refused by
``NATSBackend.start()``, against the real NATS server.

Each refused setting is pre-created as an operator would, under a unique prefix; the error must
name the stream, the setting, its value and the fix, and the fix (applied as ``nats stream edit``
would) must let the backend start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import (
    DiscardPolicy,
    PersistMode,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)

from brokersched import BackendError, ConfigurationError, JobContext, Scheduler
from brokersched._clock import SystemClock
from brokersched.abc import JobPolicy, RunRecord, Slot
from brokersched.backends.nats import NATSBackend, _backend, _streams
from brokersched.backends.nats._names import Names
from brokersched.backends.nats._stream_settings import (
    claims_config,
    claims_problems,
    history_config,
    history_problems,
)
from tests.support.names import unique
from tests.support.nats_helpers import (
    SLOT_TTL,
    claims_stream,
    create_stream,
    delete_named_streams,
    delete_streams,
    history_stream,
    nats_server,
    nats_server_denying_stream_updates,
    stream_config,
    update_stream,
    with_settings,
)

# Against both NATS servers, 2.9 and the current one (tests/support/servers.py).
pytestmark = pytest.mark.nats_servers

CLOCK = SystemClock()
MIB = 1024 * 1024


@pytest.fixture
async def prefix(nats_url: str) -> AsyncIterator[str]:
    name = unique()
    yield name
    await delete_streams(nats_url, name)
    await delete_named_streams(nats_url, f"{name}-origin")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def run_record(job: str, slot_ms: int) -> RunRecord:
    at = datetime.now(UTC)
    return RunRecord(job, slot_ms, f"run-{slot_ms}", "i1", "schedule", 1, at, at, "completed")


async def refused(url: str, prefix: str, *, option: str) -> str:
    """The message of the ConfigurationError that ``start()`` raises (the backend stays down)."""
    backend = NATSBackend(url, prefix=prefix, slot_ttl=SLOT_TTL)
    with pytest.raises(ConfigurationError) as info:
        await backend.start(CLOCK)
    assert info.value.option == option
    assert info.value.backend == "NATSBackend"
    return str(info.value)


async def starts(url: str, prefix: str) -> None:
    """The backend starts, claims, records and reads history on the streams as they are."""
    backend = NATSBackend(url, prefix=prefix, slot_ttl=SLOT_TTL)
    await backend.start(CLOCK)
    try:
        job = JobPolicy("check", history_size=100)
        await backend.prepare([job])
        slot = Slot("check", now_ms())
        assert await backend.claim(slot, instance_id="a", run_id="r1", timeout=2)
        assert not await backend.claim(slot, instance_id="b", run_id="r2", timeout=2)
        await backend.record(job, run_record("check", slot.slot_ms))
        assert [r.slot_ms for r in await backend.history(job, 10)] == [slot.slot_ms]
    finally:
        await backend.stop()


FORGETS = "forgotten on a server restart"

# (settings of the pre-created claims stream, fragments of the error, the fix as a stream edit
# or None when the fix is to delete the stream)
CLAIMS_REFUSED = [
    pytest.param(
        {"max_msgs": 1000},
        ["max_msgs is 1000", FORGETS, "--max-msgs=-1"],
        {"max_msgs": -1},
        id="max_msgs",
    ),
    pytest.param(
        {"max_bytes": MIB},
        [f"max_bytes is {MIB}", FORGETS, "--max-bytes=-1"],
        {"max_bytes": -1},
        id="max_bytes",
    ),
    pytest.param(
        {"max_msgs_per_subject": 10},
        ["max_msgs_per_subject is 10", FORGETS, "--max-msgs-per-subject=-1"],
        {"max_msgs_per_subject": -1},
        id="max_msgs_per_subject",
    ),
    pytest.param(
        {"max_bytes": MIB, "discard": DiscardPolicy.NEW},
        [f"max_bytes is {MIB}", "with discard 'new', every claim fails", "--max-bytes=-1"],
        {"max_bytes": -1},  # discard 'new' without a limit is harmless
        id="discard_new_max_bytes",
    ),
    pytest.param(
        {"max_msgs": 1000, "discard": DiscardPolicy.NEW},
        ["max_msgs is 1000", "with discard 'new', every claim fails", "--max-msgs=-1"],
        {"max_msgs": -1},
        id="discard_new_max_msgs",
    ),
    pytest.param(
        {"max_msgs_per_subject": 10, "discard": DiscardPolicy.NEW, "discard_new_per_subject": True},
        [
            "max_msgs_per_subject is 10",
            "every claim fails",
            "--no-discard-per-subject --max-msgs-per-subject=-1",
        ],
        {"max_msgs_per_subject": -1, "discard_new_per_subject": False},
        id="discard_new_per_subject",
    ),
    pytest.param(
        {"max_age": 0},
        ["max_age is 0 (unlimited", "grow for ever", "--max-age 5m"],
        {"max_age": 300},
        id="max_age_0",
    ),
    pytest.param(
        # A short window alone is raised by start(); with a setting it cannot fix, all refused.
        {"max_age": 60, "duplicate_window": 60, "max_msgs": 1000},
        [
            "max_age is 1m, shorter than slot_ttl 5m",
            "duplicate_window is 1m, shorter than slot_ttl 5m",
            "--max-age 5m",
            "max_msgs is 1000",
        ],
        {"max_age": 300, "duplicate_window": 300, "max_msgs": -1},
        id="short_max_age_with_max_msgs",
    ),
    pytest.param(
        {"no_ack": True},
        ["no_ack is true", "every claim fails", "--ack"],
        {"no_ack": False},
        id="no_ack",
    ),
    pytest.param(
        {"max_msg_size": 512},
        ["max_msg_size is 512 bytes", "--max-msg-size=-1"],
        {"max_msg_size": -1},
        id="max_msg_size",
    ),
    pytest.param(
        {"subjects": ["{p}.elsewhere.>"]},
        ["without '{p}.claim.>'", "--subjects '{p}.claim.>'"],
        {"subjects": ["{p}.claim.>"]},
        id="subjects",
    ),
    pytest.param(
        {"storage": StorageType.MEMORY},
        ["storage is 'memory', not 'file'", "nats stream rm {p}-claims"],
        None,
        id="storage_memory",
    ),
    pytest.param(
        {"retention": RetentionPolicy.INTEREST},
        ["retention is 'interest', not 'limits'", "nats stream rm {p}-claims"],
        None,
        id="retention_interest",
    ),
    pytest.param(
        {"retention": RetentionPolicy.WORK_QUEUE},
        ["retention is 'workqueue', not 'limits'", "nats stream rm {p}-claims"],
        None,
        id="retention_workqueue",
    ),
]


def _rendered(settings: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {
        name: getattr(with_settings(StreamConfig(), prefix, settings), name) for name in settings
    }


def _same(stored: object, wanted: object) -> bool:
    """Whether the server's value is the one set (enums by value; None, 0 and False alike)."""
    stored, wanted = getattr(stored, "value", stored), getattr(wanted, "value", wanted)
    return stored == wanted or (not stored and not wanted)


async def assert_refused_then_fixed(
    url: str,
    prefix: str,
    stream: str,
    option: str,
    settings: dict[str, Any],
    fragments: list[str],
    fix: dict[str, Any] | None,
) -> None:
    message = await refused(url, prefix, option=option)
    assert f"stream '{stream}' cannot be used" in message
    for fragment in fragments:
        assert fragment.format(p=prefix) in message, (fragment, message)
    # Refused, never changed behind the operator's back.
    stored = await stream_config(url, stream)
    for name in settings.keys() - {"subjects"}:
        assert _same(getattr(stored, name), settings[name]), name
    if fix is not None:  # the fix the message gives, as `nats stream edit` applies it
        await update_stream(url, stream, **_rendered(fix, prefix))
        await starts(url, prefix)


@pytest.mark.parametrize(("settings", "fragments", "fix"), CLAIMS_REFUSED)
async def test_a_claims_stream_setting_that_breaks_claims_is_refused_with_its_fix(
    nats_url: str,
    prefix: str,
    settings: dict[str, Any],
    fragments: list[str],
    fix: dict[str, Any] | None,
) -> None:
    await create_stream(nats_url, claims_stream(prefix, **settings))
    await assert_refused_then_fixed(
        nats_url, prefix, f"{prefix}-claims", "slot_ttl", settings, fragments, fix
    )


async def test_a_sealed_claims_stream_is_refused(nats_url: str, prefix: str) -> None:
    await create_stream(nats_url, claims_stream(prefix), seal=True)
    message = await refused(nats_url, prefix, option="slot_ttl")
    assert "sealed is true (it takes no more messages): use another prefix" in message


@pytest.mark.parametrize("kind", ["claims", "history"])
@pytest.mark.parametrize("link", ["mirror", "sources"])
async def test_a_mirror_or_a_stream_with_sources_is_refused(
    nats_url: str, prefix: str, kind: str, link: str
) -> None:
    origin = f"{prefix}-origin"
    await create_stream(nats_url, StreamConfig(name=origin, subjects=[f"{prefix}.origin.>"]))
    if link == "mirror":  # a mirror has no subjects of its own
        config = StreamConfig(name=f"{prefix}-{kind}", mirror=StreamSource(name=origin))
        expected = f"mirror is '{origin}' (a mirror takes no publishes"
    else:
        make = claims_stream if kind == "claims" else history_stream
        config = make(prefix, sources=[StreamSource(name=origin)])
        expected = f"sources are ['{origin}'] (messages copied from other streams"
    await create_stream(nats_url, config)
    message = await refused(nats_url, prefix, option="slot_ttl" if kind == "claims" else "prefix")
    assert f"stream '{prefix}-{kind}' cannot be used" in message
    assert expected in message
    assert f"nats stream rm {prefix}-{kind}" in message


HISTORY_REFUSED = [
    pytest.param(
        {"no_ack": True},
        ["no_ack is true", "every run record fails", "--ack"],
        {"no_ack": False},
        id="no_ack",
    ),
    pytest.param(
        {"max_msgs_per_subject": -1},
        ["max_msgs_per_subject is unlimited", "grows for ever", "--max-msgs-per-subject=1000"],
        {"max_msgs_per_subject": 1000},
        id="max_msgs_per_subject_unlimited",
    ),
    pytest.param(
        {"discard": DiscardPolicy.NEW, "max_msgs": 1000},
        ["discard is 'new' with max_msgs=1000", "every run record is refused", "--discard=old`"],
        {"discard": DiscardPolicy.OLD},
        id="discard_new_max_msgs",
    ),
    pytest.param(
        {"discard": DiscardPolicy.NEW, "max_bytes": MIB},
        [f"discard is 'new' with max_bytes={MIB}", "--discard=old`"],
        {"discard": DiscardPolicy.OLD},
        id="discard_new_max_bytes",
    ),
    pytest.param(
        {"discard": DiscardPolicy.NEW, "discard_new_per_subject": True},
        [
            "discard is 'new' with max_msgs_per_subject=100",
            "--discard=old --no-discard-per-subject`",
        ],
        {"discard": DiscardPolicy.OLD, "discard_new_per_subject": False},
        id="discard_new_per_subject",
    ),
    pytest.param(
        {"max_msg_size": 512},
        ["max_msg_size is 512 bytes", "--max-msg-size=-1"],
        {"max_msg_size": -1},
        id="max_msg_size",
    ),
    pytest.param(
        {"storage": StorageType.MEMORY},
        ["storage is 'memory', not 'file'", "nats stream rm {p}-history", "the run history"],
        None,
        id="storage_memory",
    ),
    pytest.param(
        {"retention": RetentionPolicy.INTEREST},
        ["retention is 'interest', not 'limits'"],
        None,
        id="retention_interest",
    ),
]


@pytest.mark.parametrize(("settings", "fragments", "fix"), HISTORY_REFUSED)
async def test_a_history_stream_setting_that_breaks_the_history_is_refused_with_its_fix(
    nats_url: str,
    prefix: str,
    settings: dict[str, Any],
    fragments: list[str],
    fix: dict[str, Any] | None,
) -> None:
    await create_stream(nats_url, history_stream(prefix, **settings))
    await assert_refused_then_fixed(
        nats_url, prefix, f"{prefix}-history", "prefix", settings, fragments, fix
    )


@pytest.mark.parametrize(
    ("claims", "history"),
    [
        pytest.param(
            # What only an operator's deliberate action uses, or only keeps claims longer.
            {
                "deny_delete": True,
                "deny_purge": True,
                "duplicate_window": 600,
                "max_age": 3600,
                "max_msg_size": MIB,
                "discard": DiscardPolicy.NEW,  # harmless without a limit
                "description": "made by hand",
            },
            # Age and global limits with discard 'old' only drop old runs sooner.
            {"max_age": 3600, "max_msgs": 100_000, "max_bytes": 64 * MIB, "deny_purge": True},
            id="harmless",
        ),
        pytest.param(
            {"allow_rollup_hdrs": True},  # the server wants purges allowed with it
            {"allow_rollup_hdrs": True, "max_msgs_per_subject": 1},
            id="rollups",
        ),
    ],
)
async def test_settings_that_keep_the_guarantee_are_accepted(
    nats_url: str, prefix: str, claims: dict[str, Any], history: dict[str, Any]
) -> None:
    await create_stream(nats_url, claims_stream(prefix, **claims))
    await create_stream(nats_url, history_stream(prefix, **history))
    await starts(nats_url, prefix)


# -- the streams brokersched creates pass its own checks ---------------------------------------


def test_the_streams_brokersched_would_create_pass_its_checks() -> None:
    names = Names("p")
    for ttl in (timedelta(seconds=1), SLOT_TTL, timedelta(days=1)):
        assert claims_problems(claims_config(names, ttl, 3), names, ttl) == []
    for size in (1, 1000, 100_000):
        assert history_problems(history_config(names, size, 1), names, size) == []


async def test_the_streams_brokersched_created_pass_its_checks(nats_url: str, prefix: str) -> None:
    """As the server reports them back (it fills in its defaults: -1, 0, 'old', ...)."""
    await starts(nats_url, prefix)
    names = Names(prefix)
    claims = await stream_config(nats_url, names.claims)
    history = await stream_config(nats_url, names.history)
    assert claims_problems(claims, names, SLOT_TTL) == []
    assert history_problems(history, names, 100) == []
    assert history_problems(history, names) == []  # as start() checks it, before prepare()


NEWER_SETTINGS = [
    ({"persist_mode": PersistMode.ASYNC}, "persist_mode is 'async', not 'default'"),
    ({"allow_msg_counter": True}, "allow_msg_counter is true (a counter stream refuses"),
]


@pytest.mark.parametrize(("settings", "fragment"), NEWER_SETTINGS)
def test_settings_of_newer_servers_that_break_claims_are_refused(
    settings: dict[str, Any], fragment: str
) -> None:
    """NATS 2.12 settings: a 2.9 server drops them, so the check is tested on the configuration
    here, and on a stream of the current server below."""
    names = Names("p")
    config = claims_stream("p", **settings)
    problems = claims_problems(config, names, SLOT_TTL)
    assert len(problems) == 1
    assert fragment in problems[0]
    assert "nats stream rm p-claims" in problems[0]
    assert (
        claims_problems(claims_stream("p", persist_mode=PersistMode.DEFAULT), names, SLOT_TTL) == []
    )


@pytest.mark.parametrize(("settings", "fragment"), NEWER_SETTINGS)
async def test_a_current_server_keeps_those_settings_and_start_refuses_the_stream(
    current_nats_url: str, settings: dict[str, Any], fragment: str
) -> None:
    """The same streams on the current nats-server, which keeps the settings (2.9 drops them):
    ``start()`` refuses the stream, naming the setting, and leaves it as it is."""
    prefix = unique()
    await create_stream(current_nats_url, claims_stream(prefix, **settings))
    try:
        kept = await stream_config(current_nats_url, f"{prefix}-claims")
        assert {name: getattr(kept, name) for name in settings} == settings
        backend = NATSBackend(current_nats_url, prefix=prefix)
        with pytest.raises(ConfigurationError) as caught:
            await backend.start(CLOCK)
        assert fragment in str(caught.value)
        kept = await stream_config(current_nats_url, f"{prefix}-claims")
        assert {name: getattr(kept, name) for name in settings} == settings
    finally:
        await delete_streams(current_nats_url, prefix)


# -- a claims stream that forgets claims on a restart, end to end -----------------------------


async def test_a_claims_stream_with_max_msgs_forgets_claims_on_restart_so_start_refuses_it(
    tmp_path: Path, nats_server_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_msgs=1`` JetStream drops a claim as soon as the next one is stored; the
    running server still remembers it, but a restarted one rebuilds its duplicate table from
    the stored messages only, so a late instance wins a slot that already ran. ``start()``
    therefore refuses the stream; once edited as the error says, claims survive a restart."""
    async with nats_server(tmp_path / "store", binary=nats_server_binary) as server:
        prefix = "max-msgs-restart"
        await create_stream(server.url, claims_stream(prefix, max_msgs=1))
        ran = Slot("report", now_ms() - 1000)
        later = Slot("report", now_ms())

        # Why: with the check switched off, a restart lets a late instance win a slot that ran.
        with monkeypatch.context() as patch:
            patch.setattr(_streams, "claims_problems", lambda *_: [])
            early = NATSBackend(server.url, prefix=prefix, slot_ttl=SLOT_TTL)
            await early.start(CLOCK)
            try:
                assert await early.claim(ran, instance_id="early", run_id="r1", timeout=2)
                assert await early.claim(later, instance_id="early", run_id="r2", timeout=2)
                assert not await early.claim(ran, instance_id="other", run_id="r3", timeout=2)
            finally:
                await early.stop()
            await server.restart(signal.SIGTERM)
            late = NATSBackend(server.url, prefix=prefix, slot_ttl=SLOT_TTL)
            await late.start(CLOCK)
            try:
                assert await late.claim(ran, instance_id="late", run_id="r4", timeout=2)  # twice
            finally:
                await late.stop()

        # So start() refuses the stream, naming the setting, its value and the fix.
        message = await refused(server.url, prefix, option="slot_ttl")
        assert f"stream '{prefix}-claims' cannot be used: max_msgs is 1" in message
        assert f"nats stream edit {prefix}-claims --max-msgs=-1" in message

        # Edited as told, the stream keeps every claim through a restart.
        await update_stream(server.url, f"{prefix}-claims", max_msgs=-1)
        backend = NATSBackend(server.url, prefix=prefix, slot_ttl=SLOT_TTL)
        await backend.start(CLOCK)
        first, second = Slot("report", now_ms() + 1), Slot("report", now_ms() + 2)
        try:
            assert await backend.claim(first, instance_id="early", run_id="r5", timeout=2)
            assert await backend.claim(second, instance_id="early", run_id="r6", timeout=2)
        finally:
            await backend.stop()
        await server.restart(signal.SIGTERM)
        late = NATSBackend(server.url, prefix=prefix, slot_ttl=SLOT_TTL)
        await late.start(CLOCK)
        try:
            assert not await late.claim(first, instance_id="late", run_id="r7", timeout=2)
            assert not await late.claim(second, instance_id="late", run_id="r8", timeout=2)
        finally:
            await late.stop()


# -- a rolling deploy that raises slot_ttl raises the claims stream's window ------------------

NATS_LOGGER = "brokersched.backends.nats"


def window_of(config: StreamConfig) -> tuple[float | None, float | None]:
    return config.duplicate_window, config.max_age


def _others(config: StreamConfig) -> dict[str, Any]:
    """Every setting but the two that a raise changes."""
    settings = dataclasses.asdict(config)
    del settings["duplicate_window"], settings["max_age"]
    return settings


async def test_a_longer_slot_ttl_raises_the_claims_window_and_a_shorter_one_keeps_it(
    nats_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    stream = f"{prefix}-claims"
    old = NATSBackend(nats_url, prefix=prefix, slot_ttl="2s")
    await old.start(CLOCK)
    ran = Slot("report", now_ms())
    try:
        assert await old.claim(ran, instance_id="old", run_id="r1", timeout=2)
    finally:
        await old.stop()
    before = await stream_config(nats_url, stream)
    assert window_of(before) == (2, 2)

    new = NATSBackend(nats_url, prefix=prefix, slot_ttl="20s")
    with caplog.at_level(logging.WARNING, logger=NATS_LOGGER):
        await new.start(CLOCK)  # within 2 s of the claim above: its id is still remembered
    try:
        after = await stream_config(nats_url, stream)
        assert window_of(after) == (20, 20)
        assert _others(after) == _others(before)  # only the two fields changed
        [warning] = [r for r in caplog.records if r.name == NATS_LOGGER]
        assert warning.levelno == logging.WARNING
        message = warning.getMessage()
        assert f"duplicate_window of JetStream stream {stream} from 2s to 20s" in message
        assert "max_age from 2s to 20s" in message
        assert "first deploy the shorter slot_ttl on every instance" in message
        assert f"`nats stream edit {stream} --dupe-window 2s --max-age 2s`" in message

        # Claims work; a slot that fell due before the raise is claimed at most the old window
        # late (less the margin): the raise is noted in the stream, so any instance started
        # after it knows (else an at() slot claimed after the old window forgot it runs twice).
        fresh = Slot("report", now_ms() + 1100)  # more than max_clock_skew after the raise
        assert await new.claim(fresh, instance_id="new", run_id="r2", timeout=2)
        assert not await new.claim(fresh, instance_id="new", run_id="r3", timeout=2)
        await asyncio.sleep(max(0.0, (ran.slot_ms + 2000 - now_ms()) / 1000))
        with pytest.raises(BackendError, match="too late to claim safely"):
            await new.claim(ran, instance_id="new", run_id="r5", timeout=2)
    finally:
        await new.stop()

    # An instance with the shorter slot_ttl starts as before and never lowers the window.
    caplog.clear()
    again = NATSBackend(nats_url, prefix=prefix, slot_ttl="2s")
    with caplog.at_level(logging.INFO, logger=NATS_LOGGER):
        await again.start(CLOCK)
    try:
        assert window_of(await stream_config(nats_url, stream)) == (20, 20)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not await again.claim(fresh, instance_id="again", run_id="r5", timeout=2)
    finally:
        await again.stop()


async def test_a_raise_keeps_a_longer_max_age_and_only_raises_what_is_short(
    nats_url: str, prefix: str
) -> None:
    await create_stream(nats_url, claims_stream(prefix, duplicate_window=60, max_age=3600))
    backend = NATSBackend(nats_url, prefix=prefix, slot_ttl="5m")
    await backend.start(CLOCK)
    await backend.stop()
    assert window_of(await stream_config(nats_url, f"{prefix}-claims")) == (300, 3600)


async def test_concurrent_raises_keep_the_longest_window(nats_url: str, prefix: str) -> None:
    """NATS 2.9 has no conditional update: a stale, smaller raise can land after a larger one;
    the instance whose raise was overwritten reads the stream again and raises it again."""
    ttls = [5, 10, 15, 20, 25]
    random.shuffle(ttls)
    backends = [NATSBackend(nats_url, prefix=prefix, slot_ttl=ttl) for ttl in ttls]
    # The stream exists with a short window, as after a fleet of 2 s instances.
    await create_stream(nats_url, claims_config(Names(prefix), timedelta(seconds=2), 1))
    await asyncio.gather(*(backend.start(CLOCK) for backend in backends))
    try:
        assert window_of(await stream_config(nats_url, f"{prefix}-claims")) == (25, 25)
    finally:
        await asyncio.gather(*(backend.stop() for backend in backends))


async def test_a_rolling_deploy_that_raises_slot_ttl_runs_each_slot_once_and_never_stops(
    nats_url: str, prefix: str
) -> None:
    """Two instances at slot_ttl 2 s are replaced one by one by instances at 20 s, a job every
    second: every start succeeds, no slot runs twice, and the fleet keeps running."""
    runs: Counter[int] = Counter()

    async def tick(ctx: JobContext) -> None:
        runs[ctx.slot_ms] += 1

    def instance(name: str, slot_ttl: str, max_late: str) -> Scheduler[NATSBackend]:
        backend = NATSBackend(nats_url, prefix=prefix, slot_ttl=slot_ttl)
        scheduler = Scheduler(backend, instance_id=name, drain_timeout="2s")
        scheduler.every("deploy.tick", "1s", tick, max_late=max_late)
        return scheduler

    old = [instance(f"old{i}", "2s", "1s") for i in range(2)]
    new = [instance(f"new{i}", "20s", "5s") for i in range(2)]
    for scheduler in old:
        await scheduler.start()
    first_ms = now_ms()
    try:
        for replaced, replacement in zip(old, new, strict=True):
            await asyncio.sleep(1.5)
            await replacement.start()  # refused before: the stream's window was 2 s
            await asyncio.sleep(1.5)
            await replaced.stop()
        assert window_of(await stream_config(nats_url, f"{prefix}-claims")) == (20, 20)
        await asyncio.sleep(2)
    finally:
        for scheduler in old + new:
            await scheduler.stop()
    last_ms = now_ms()
    assert [slot for slot, count in runs.items() if count > 1] == []
    # Someone ran (nearly) every slot: the fleet never stopped.
    expected = range((first_ms // 1000 + 1) * 1000, (last_ms // 1000 - 1) * 1000, 1000)
    missing = [slot for slot in expected if slot not in runs]
    assert len(missing) <= 1, missing


async def test_a_sealed_claims_stream_is_refused_and_not_raised(nats_url: str, prefix: str) -> None:
    await create_stream(nats_url, claims_stream(prefix, duplicate_window=2, max_age=2), seal=True)
    sealed = await stream_config(nats_url, f"{prefix}-claims")  # sealing clears max_age
    backend = NATSBackend(nats_url, prefix=prefix, slot_ttl="20s")
    with pytest.raises(ConfigurationError) as info:
        await backend.start(CLOCK)
    message = str(info.value)
    assert info.value.option == "slot_ttl"
    assert "duplicate_window is 2s, shorter than slot_ttl 20s" in message
    assert "sealed is true" in message
    assert await stream_config(nats_url, f"{prefix}-claims") == sealed


async def test_a_raise_that_nats_refuses_keeps_the_refusal(
    nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nats.js.errors import APIError
    from nats.js.manager import JetStreamManager

    async def refuse(self: JetStreamManager, config: StreamConfig, **_: Any) -> None:
        raise APIError.from_error(
            {"code": 503, "err_code": 10023, "description": "insufficient resources"}
        )

    # As created by brokersched with slot_ttl 2s: nothing else to update.
    await create_stream(nats_url, claims_config(Names(prefix), timedelta(seconds=2), 1))
    monkeypatch.setattr(JetStreamManager, "update_stream", refuse)
    backend = NATSBackend(nats_url, prefix=prefix, slot_ttl="20s")
    with pytest.raises(ConfigurationError) as info:
        await backend.start(CLOCK)
    message = str(info.value)
    assert info.value.option == "slot_ttl"
    assert f"stream '{prefix}-claims' cannot be used" in message
    assert "duplicate_window is 2s, shorter than slot_ttl 20s" in message
    assert f"nats stream edit {prefix}-claims --dupe-window 20s --max-age 20s" in message
    assert "could not raise them itself: NATS answered" in message
    assert "insufficient resources" in message


async def test_a_user_who_may_not_update_streams_gets_the_refusal(
    tmp_path: Path, nats_server_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A denied publish gets no reply, only an -ERR: the update times out (shortened here)."""
    monkeypatch.setattr(_backend, "_API_TIMEOUT_S", 0.5)
    async with nats_server_denying_stream_updates(tmp_path / "store", nats_server_binary) as (
        admin,
        app,
    ):
        prefix = "denied"
        created = NATSBackend(admin, prefix=prefix, slot_ttl="2s")
        await created.start(CLOCK)
        await created.stop()
        backend = NATSBackend(app, prefix=prefix, slot_ttl="20s")
        with pytest.raises(ConfigurationError) as info:
            await backend.start(CLOCK)
        message = str(info.value)
        assert "duplicate_window is 2s, shorter than slot_ttl 20s" in message
        assert "permissions violation" in message
        assert "apppw" not in message
        assert window_of(await stream_config(admin, f"{prefix}-claims")) == (2, 2)
        fits = NATSBackend(app, prefix=prefix, slot_ttl="2s")  # needs no update
        await fits.start(CLOCK)
        await fits.stop()

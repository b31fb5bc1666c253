"""NATSBackend against real nats-servers: the shared one on 127.0.0.1:4222 and throwaway ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.api import StorageType, StreamConfig

from brokersched import BackendError, BackendUnavailableError, ConfigurationError
from brokersched._clock import SystemClock
from brokersched.abc import Claim, JobPolicy, RunRecord, Slot
from brokersched.backends.nats import NATSBackend, _history, redact, subject_token
from brokersched.backends.nats._names import Names
from tests.support.fleet import run_fleet
from tests.support.names import unique
from tests.support.nats_helpers import (
    FaultProxy,
    claims_stream,
    create_stream,
    delete_streams,
    fault_proxy,
    history_stream,
    nats_server,
)
from tests.support.paths import REPO_ROOT
from tests.support.wait import free_port, until

# Against both NATS servers, 2.9 and the current one (tests/support/servers.py).
pytestmark = pytest.mark.nats_servers

CLOCK = SystemClock()
REPO_ROOT = REPO_ROOT


@pytest.fixture
async def prefix(nats_url: str) -> AsyncIterator[str]:
    name = unique()
    yield name
    await delete_streams(nats_url, name)


@pytest.fixture
async def backend(nats_url: str, prefix: str) -> AsyncIterator[NATSBackend]:
    b = NATSBackend(nats_url, prefix=prefix, slot_ttl="1m")
    await b.start(CLOCK)
    yield b
    await b.stop()


async def started(*backends: NATSBackend) -> list[NATSBackend]:
    await asyncio.gather(*(b.start(CLOCK) for b in backends))
    return list(backends)


async def stopped(*backends: NATSBackend) -> None:
    await asyncio.gather(*(b.stop() for b in backends))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def run_record(job: str, slot_ms: int) -> RunRecord:
    at = datetime.now(UTC)
    return RunRecord(job, slot_ms, f"run-{slot_ms}", "i1", "schedule", 1, at, at, "completed")


# -- pure helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nats://alice:s3cret@10.0.0.1:4222", "nats://alice:***@10.0.0.1:4222"),
        ("tls://tok3n@host:4222", "tls://***@host:4222"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("a nats://u:p@h:1, b tls://x:y@h2", "a nats://u:***@h:1, b tls://x:***@h2"),
        ("no url at all", "no url at all"),
    ],
)
def test_redact_hides_passwords_and_tokens(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_subject_token_is_one_token_and_tells_job_names_apart() -> None:
    names = ["outbox.flush", "outbox_flush", "outbox-flush", "outbox:flush", "outbox$flush"]
    names += ["Outbox.Flush", "a.b.c", "$x", "a" * 128]
    tokens = [subject_token(name) for name in names]
    assert len(set(tokens)) == len(names)
    for token in tokens:
        assert not set(token) & set(".*> \t"), token
    assert subject_token("outbox.flush") == "outbox%2Eflush"
    for name in ["a b", "a*b", "a>b", "", "x" * 129, ".a", "a%2Eb", "a\r\nb"]:
        with pytest.raises(ConfigurationError, match="subject token"):
            subject_token(name)


JOB_NAMES = st.from_regex(r"[A-Za-z0-9_$][A-Za-z0-9_.:$-]{0,127}", fullmatch=True)
PREFIXES = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)  # dots: NATSBackend refuses them


def _accepted_prefix(prefix: str) -> bool:
    try:
        NATSBackend(prefix=prefix)
    except ConfigurationError:
        return False
    return True


def _decode_subject(subject: str) -> tuple[str, str, str]:
    """``(prefix, kind, job)`` back from a subject: every name is one token of its own."""
    prefix, kind, token = subject.split(".")
    job = re.sub(r"%([0-9A-F]{2})", lambda m: chr(int(m[1], 16)), token)
    return prefix, kind, job


@given(PREFIXES, JOB_NAMES, st.sampled_from(["claim", "history"]))
def test_subjects_and_streams_decode_back_to_prefix_kind_and_job(
    prefix: str, job: str, kind: str
) -> None:
    """Names are injective across (prefix, kind, job): each decodes back to what made it.

    (With dots allowed in a prefix, ``P`` + job ``claim.x`` and ``P.claim`` + ``x`` could meet;
    NATSBackend refuses such prefixes and escapes the job's dots.)
    """
    if not _accepted_prefix(prefix):
        assert "." in prefix
        return
    names = Names(prefix)
    subject = names.claim_subject(job) if kind == "claim" else names.history_subject(job)
    assert _decode_subject(subject) == (prefix, kind, job)
    stream = names.claims if kind == "claim" else names.history
    assert stream.rsplit("-", 1) == [prefix, {"claim": "claims", "history": "history"}[kind]]


def test_the_rabbitmq_collision_cannot_happen_on_nats() -> None:
    with pytest.raises(ConfigurationError, match="prefix"):
        NATSBackend(prefix="P.claim")
    assert Names("P").claim_subject("claim.x") == "P.claim.claim%2Ex"


def test_constructor_validates_and_never_connects() -> None:
    backend = NATSBackend(f"nats://127.0.0.1:{free_port()}", slot_ttl=90, claim_timeout="500ms")
    assert backend.capabilities.slot_memory == timedelta(seconds=90)
    assert not backend.capabilities.leases
    assert not backend.capabilities.history_ttl
    assert not backend.capabilities.history_size_per_job
    bad: list[tuple[dict[str, object], str]] = [
        ({"prefix": "a.b"}, "prefix"),
        ({"prefix": ""}, "prefix"),
        ({"slot_ttl": 0}, "slot_ttl"),
        ({"slot_ttl": "soon"}, "slot_ttl"),
        ({"claim_timeout": "0s"}, "claim_timeout"),
        ({"replicas": 0}, "replicas"),
        ({"replicas": True}, "replicas"),
    ]
    for kwargs, option in bad:
        with pytest.raises(ConfigurationError, match=option) as info:
            NATSBackend(**kwargs)  # type: ignore[arg-type]
        assert (info.value.option, info.value.backend) == (option, "NATSBackend"), kwargs


@pytest.mark.parametrize(
    "server",
    [
        "http://bob:hunter2@127.0.0.1:4222",
        "https://127.0.0.1:4222",
        "amqp://127.0.0.1:5672/",
        "NATS://127.0.0.1:4222",  # nats-py only knows the lower-case schemes
        ["nats://127.0.0.1:4222", "http://127.0.0.1:4223"],
    ],
)
def test_a_url_with_another_scheme_is_refused_at_construction(server: str | list[str]) -> None:
    """nats-py used to take ``http://host:4222`` as the host ``http`` (a DNS error 4 s into
    start())."""
    with pytest.raises(ConfigurationError) as caught:
        NATSBackend(server)
    error = caught.value
    assert (error.option, error.backend) == ("servers", "NATSBackend")
    message = str(error)
    assert "nats://, tls://, ws:// or wss://" in message and "host:4222" in message
    assert "hunter2" not in message
    if server == "http://bob:hunter2@127.0.0.1:4222":
        assert "'http://bob:***@127.0.0.1:4222'" in message


@pytest.mark.parametrize(
    "servers",
    [[], [""], ["nats://a:4222", "ws://b:8080"], ["wss://a:443", "tls://b:4222"], [4222]],
)
def test_empty_mixed_or_non_text_servers_are_refused(servers: list[Any]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        NATSBackend(servers)
    assert caught.value.option == "servers"


@pytest.mark.parametrize(
    "server",
    [
        "nats://127.0.0.1:4222",
        "tls://127.0.0.1:4222",
        "ws://127.0.0.1:8080",
        "wss://127.0.0.1:443",
        "127.0.0.1:4222",
        "alice:pw@127.0.0.1:4222",
        "localhost",
    ],
)
def test_every_url_form_nats_py_takes_is_accepted(server: str) -> None:
    NATSBackend(server)
    NATSBackend([server, server])


async def test_a_scheme_less_server_connects(nats_url: str, prefix: str) -> None:
    """``host:port`` is nats-py's shorthand for ``nats://host:port``: accepted, and it works."""
    parts = urlsplit(nats_url)
    backend = NATSBackend(f"{parts.hostname}:{parts.port or 4222}", prefix=prefix, slot_ttl="1m")
    await backend.start(CLOCK)
    try:
        assert await backend.claim(Slot("job", now_ms()), instance_id="i", run_id="r", timeout=2)
    finally:
        await backend.stop()


def test_repr_redacts_credentials() -> None:
    backend = NATSBackend(["nats://u:hunter2@127.0.0.1:4222", "tls://tok@h:4222"])
    assert "hunter2" not in repr(backend)
    assert "tok@" not in repr(backend)


async def test_missing_extra_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "nats" or m.startswith("nats.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nats", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'brokersched\[nats\]'"):
        await NATSBackend().start(CLOCK)


async def test_start_fails_fast_when_unreachable_without_leaking_secrets() -> None:
    url = f"nats://bob:hunter2@127.0.0.1:{free_port()}"
    backend = NATSBackend(url, connect_timeout=0.3)
    started_at = time.monotonic()
    with pytest.raises(BackendUnavailableError) as info:
        await backend.start(CLOCK)
    assert time.monotonic() - started_at < 3
    assert "bob:***@127.0.0.1" in str(info.value)
    assert "hunter2" not in str(info.value)
    await backend.stop()  # never started: a no-op


async def test_server_without_jetstream_fails_at_start_with_a_hint(
    tmp_path: Path, nats_server_binary: str
) -> None:
    async with nats_server(tmp_path, jetstream=False, binary=nats_server_binary) as server:
        with pytest.raises(BackendUnavailableError, match=r"is it enabled on the server"):
            await NATSBackend(server.url).start(CLOCK)


async def test_claim_before_start_fails_closed(prefix: str) -> None:
    with pytest.raises(BackendUnavailableError, match="not started"):
        await NATSBackend(prefix=prefix).claim(Slot("j", 1), instance_id="i", run_id="r", timeout=1)


# -- claims ------------------------------------------------------------------------------------


async def test_first_claim_wins_every_later_claim_loses(nats_url: str, prefix: str) -> None:
    a, b = await started(NATSBackend(nats_url, prefix=prefix), NATSBackend(nats_url, prefix=prefix))
    try:
        slot = Slot("outbox.flush", now_ms())
        assert await a.claim(slot, instance_id="a", run_id="r1", timeout=1)
        # The same instance and run id again is a second claim, not a retry: it loses.
        assert not await a.claim(slot, instance_id="a", run_id="r1", timeout=1)
        assert not await b.claim(slot, instance_id="b", run_id="r2", timeout=1)
        assert await b.claim(
            Slot("outbox.flush", slot.slot_ms + 1), instance_id="b", run_id="r3", timeout=1
        )
        # Job names that escape to similar tokens stay distinct slots.
        assert await b.claim(
            Slot("outbox_flush", slot.slot_ms), instance_id="b", run_id="r4", timeout=1
        )
    finally:
        await stopped(a, b)


async def test_racing_claimers_on_separate_connections_one_winner_per_slot(
    nats_url: str, prefix: str
) -> None:
    claimers = await started(*(NATSBackend(nats_url, prefix=prefix) for _ in range(6)))
    base = now_ms()
    # 360 claims at once: each is bounded (a claim with no definite answer fails closed), not
    # timed; under CPU stress 2 s was too short for nats-server 2.15 to answer them all
    slots = [Slot(f"race.{i % 3}", base + i) for i in range(60)]
    barrier = asyncio.Barrier(len(claimers))

    async def claim_all(index: int, backend: NATSBackend) -> list[bool]:
        await barrier.wait()
        return list(
            await asyncio.gather(
                *(
                    backend.claim(s, instance_id=f"i{index}", run_id=f"r{index}", timeout=60)
                    for s in slots
                )
            )
        )

    try:
        results = await asyncio.gather(*(claim_all(i, b) for i, b in enumerate(claimers)))
    finally:
        await stopped(*claimers)
    winners = [sum(r[k] for r in results) for k in range(len(slots))]
    assert winners == [1] * len(slots)


async def test_claim_with_no_time_left_fails_closed(backend: NATSBackend) -> None:
    with pytest.raises(BackendError, match="no definite answer"):
        await backend.claim(Slot("j", now_ms()), instance_id="i", run_id="r", timeout=0)


async def test_claims_stream_has_the_promised_settings(
    nats_url: str, prefix: str, backend: NATSBackend
) -> None:
    nc = await nats.connect(nats_url)
    try:
        config = (await nc.jetstream().stream_info(f"{prefix}-claims")).config
    finally:
        await nc.close()
    assert config.storage == StorageType.FILE
    assert config.subjects == [f"{prefix}.claim.>"]
    assert config.duplicate_window == 60
    assert config.max_age == 60
    assert config.allow_direct


# -- ambiguous claims (fault injection through a proxy) ---------------------------------------


async def _stored_claims(nats_url: str, prefix: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(f"{prefix}-claims")
        return int(info.state.messages)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def through_proxy(
    nats_url: str, prefix: str
) -> AsyncIterator[tuple[FaultProxy, NATSBackend, NATSBackend]]:
    """``(proxy, mine, other)``: ``mine`` claims through a fault proxy (3 s claims, quick
    reconnects), ``other`` directly; both started, and stopped afterwards."""
    port = urlsplit(nats_url).port or 4222
    other = NATSBackend(nats_url, prefix=prefix)
    async with fault_proxy(port) as proxy:
        mine = NATSBackend(proxy.url, prefix=prefix, claim_timeout="3s", reconnect_time_wait=0.05)
        await started(mine, other)
        try:
            yield proxy, mine, other
        finally:
            await stopped(mine, other)


async def test_lost_ack_of_a_stored_claim_is_still_a_win(nats_url: str, prefix: str) -> None:
    """The claim is stored but its ack is lost with the connection: the retry must see that the
    stored message is its own (a naive retry would report a loss and the slot would run
    nowhere)."""
    async with through_proxy(nats_url, prefix) as (proxy, mine, other):
        slot = Slot("ambiguous", now_ms())
        proxy.hold_replies()
        claim = asyncio.create_task(mine.claim(slot, instance_id="me", run_id="r", timeout=3))

        async def stored() -> bool:
            return await _stored_claims(nats_url, prefix) == 1

        await until(stored, timeout=5, what="the claim to be stored")
        proxy.cut()  # the ack dies with the connection
        proxy.release_replies()
        assert await claim
        assert not await other.claim(slot, instance_id="other", run_id="r2", timeout=2)


async def test_retry_after_lost_ack_still_loses_to_an_earlier_winner(
    nats_url: str, prefix: str
) -> None:
    async with through_proxy(nats_url, prefix) as (proxy, mine, other):
        slot = Slot("ambiguous", now_ms())
        assert await other.claim(slot, instance_id="other", run_id="r1", timeout=2)
        proxy.hold_replies()
        claim = asyncio.create_task(mine.claim(slot, instance_id="me", run_id="r2", timeout=3))
        # The server has answered "duplicate" (our first attempt); the answer is held.
        await until(lambda: proxy.holding(b'"duplicate"'), timeout=5, what="the held duplicate ack")
        proxy.cut()
        proxy.release_replies()
        assert not await claim


async def test_a_batch_whose_acks_are_lost_resolves_each_claim_like_claim(
    nats_url: str, prefix: str
) -> None:
    """``claim_many`` sends its claims in one write; their acks die with the connection. Each
    claim's retry then finds its own answer: A (stored by this batch) won, B (won earlier by
    another instance) lost; a naive retry would call A lost (run nowhere) or B won (twice)."""
    async with through_proxy(nats_url, prefix) as (proxy, mine, other):
        slot_a, slot_b = Slot("batch.a", now_ms()), Slot("batch.b", now_ms())
        assert await other.claim(slot_b, instance_id="other", run_id="o", timeout=2)
        proxy.hold_replies()
        claims = [Claim(slot, "m", JobPolicy(slot.job)) for slot in (slot_a, slot_b)]
        batch = asyncio.create_task(mine.claim_many(claims, instance_id="me", timeout=3))

        async def answered() -> bool:
            stored = await _stored_claims(nats_url, prefix) == 2
            return stored and await proxy.holding(b'"duplicate"')

        await until(answered, timeout=5, what="A stored and B answered duplicate")
        proxy.cut()  # both acks die with the connection
        proxy.release_replies()
        assert await batch == [True, False]
        assert not await other.claim(slot_a, instance_id="other", run_id="o", timeout=2)


async def test_held_ack_past_the_deadline_is_a_backend_error(nats_url: str, prefix: str) -> None:
    port = urlsplit(nats_url).port or 4222
    async with fault_proxy(port) as proxy:
        mine = NATSBackend(proxy.url, prefix=prefix)
        await mine.start(CLOCK)
        try:
            proxy.hold_replies()
            started_at = time.monotonic()
            with pytest.raises(BackendUnavailableError, match=r"no definite answer within 0\.6s"):
                await mine.claim(Slot("j", now_ms()), instance_id="i", run_id="r", timeout=0.6)
            assert time.monotonic() - started_at < 1.5
        finally:
            proxy.release_replies()
            await mine.stop()


# -- streams -----------------------------------------------------------------------------------


async def test_instances_starting_together_on_a_fresh_server_all_start(
    tmp_path: Path, nats_server_binary: str
) -> None:
    """They race to create the streams; the losers check the winner's instead of failing (a
    fresh NATS 2.9 may answer them "subjects overlap" rather than "name in use")."""
    for round_ in range(8):
        async with nats_server(tmp_path / str(round_), binary=nats_server_binary) as server:
            backends = await started(*(NATSBackend(server.url, prefix="rs") for _ in range(3)))
            await stopped(*backends)


async def test_a_foreign_stream_on_our_subjects_is_named(nats_url: str, prefix: str) -> None:
    await create_stream(
        nats_url, StreamConfig(name=f"{prefix}-other", subjects=[f"{prefix}.claim.>"])
    )
    with pytest.raises(ConfigurationError, match="another JetStream stream already uses"):
        await NATSBackend(nats_url, prefix=prefix).start(CLOCK)


async def test_memory_claims_stream_is_refused_with_a_fix(nats_url: str, prefix: str) -> None:
    await create_stream(nats_url, claims_stream(prefix, storage=StorageType.MEMORY))
    with pytest.raises(ConfigurationError) as info:
        await NATSBackend(nats_url, prefix=prefix).start(CLOCK)
    message = str(info.value)
    assert "storage is 'memory', not 'file'" in message
    assert f"nats stream rm {prefix}-claims" in message


async def test_short_duplicate_window_is_raised_to_slot_ttl(nats_url: str, prefix: str) -> None:
    await create_stream(nats_url, claims_stream(prefix, duplicate_window=60, max_age=60))
    longer = NATSBackend(nats_url, prefix=prefix, slot_ttl="5m")
    await longer.start(CLOCK)
    await longer.stop()
    nc = await nats.connect(nats_url)
    try:
        claims = (await nc.jetstream().stream_info(f"{prefix}-claims")).config
    finally:
        await nc.close()
    assert (claims.duplicate_window, claims.max_age) == (300, 300)
    # A backend whose slot_ttl fits the existing window works with it as it is.
    fits = NATSBackend(nats_url, prefix=prefix, slot_ttl="1m")
    await fits.start(CLOCK)
    await fits.stop()


async def test_memory_history_stream_fails_at_start(nats_url: str, prefix: str) -> None:
    await create_stream(nats_url, history_stream(prefix, storage=StorageType.MEMORY))
    with pytest.raises(ConfigurationError, match=f"'{prefix}-history'.*storage is 'memory'"):
        await NATSBackend(nats_url, prefix=prefix).start(CLOCK)


async def test_streams_grow_but_are_never_recreated(nats_url: str, prefix: str) -> None:
    first = NATSBackend(nats_url, prefix=prefix, slot_ttl="1m")
    await first.start(CLOCK)
    slot = Slot("keep", now_ms())
    await first.prepare([JobPolicy("keep", history_size=3)])
    assert await first.claim(slot, instance_id="a", run_id="r", timeout=1)
    for i in range(3):
        await first.record(JobPolicy("keep", history_size=3), run_record("keep", i))
    await first.stop()

    second = NATSBackend(nats_url, prefix=prefix, slot_ttl="30s")  # shorter: fits the window
    await second.start(CLOCK)
    try:
        await second.prepare([JobPolicy("keep", history_size=3), JobPolicy("big", history_size=50)])
        assert not await second.claim(slot, instance_id="b", run_id="r", timeout=1)
        assert len(await second.history(JobPolicy("keep", history_size=50), 50)) == 3
        # A smaller size later never shrinks the stream (another instance may need more).
        await second.prepare([JobPolicy("small", history_size=2)])
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            history = (await js.stream_info(f"{prefix}-history")).config
            claims = (await js.stream_info(f"{prefix}-claims")).config
        finally:
            await nc.close()
        assert history.max_msgs_per_subject == 50
        assert claims.duplicate_window == 60
    finally:
        await second.stop()


async def test_concurrent_starts_with_different_history_sizes_keep_the_largest(
    nats_url: str, prefix: str
) -> None:
    """JetStream 2.9 has no conditional update: a stale smaller update can land after a larger
    one; the backend that grew the stream checks again and restores the largest size."""
    sizes = [5, 500, 50, 200, 10]
    backends = await started(*(NATSBackend(nats_url, prefix=prefix) for _ in sizes))
    barrier = asyncio.Barrier(len(sizes))

    async def prepare(backend: NATSBackend, size: int) -> None:
        await barrier.wait()
        await backend.prepare([JobPolicy(f"j{size}", history_size=size)])

    async def per_subject() -> int:
        nc = await nats.connect(nats_url)
        try:
            info = await nc.jetstream().stream_info(f"{prefix}-history")
        finally:
            await nc.close()
        return int(info.config.max_msgs_per_subject)

    async def largest() -> bool:
        return await per_subject() == 500

    try:
        await asyncio.gather(*(prepare(b, s) for b, s in zip(backends, sizes, strict=True)))
        await until(largest, timeout=10, what="the largest history size to stay")
    finally:
        await stopped(*backends)
    assert await per_subject() == 500


# -- history -----------------------------------------------------------------------------------


async def test_history_newest_first_trimmed_to_each_jobs_size(backend: NATSBackend) -> None:
    small, large = JobPolicy("h.small", history_size=3), JobPolicy("h.large", history_size=8)
    await backend.prepare([small, large])
    for i in range(10):
        await backend.record(small, run_record(small.name, i))
        await backend.record(large, run_record(large.name, 100 + i))
    assert [r.slot_ms for r in await backend.history(small, 10)] == [9, 8, 7]
    assert [r.slot_ms for r in await backend.history(large, 100)] == list(range(109, 101, -1))
    assert [r.slot_ms for r in await backend.history(large, 2)] == [109, 108]
    assert [r.slot_ms for r in await backend.history(large, 1)] == [109]
    assert await backend.history(large, 0) == []
    newest = await backend.history(small, 1)
    assert newest[0].job == "h.small"
    assert newest[0].run_id == "run-9"
    assert newest[0].outcome == "completed"
    assert await backend.history(JobPolicy("never.ran"), 5) == []
    assert await backend.history(JobPolicy("never.ran"), 1) == []


async def test_history_without_prepare(backend: NATSBackend) -> None:
    job = JobPolicy("unprepared", history_size=4)
    assert await backend.history(job, 10) == []  # no history stream yet
    for i in range(6):
        await backend.record(job, run_record(job.name, i))
    assert [r.slot_ms for r in await backend.history(job, 10)] == [5, 4, 3, 2]


def a_replica(
    monkeypatch: pytest.MonkeyPatch, gives: Callable[[list[_history._Stored]], list[int]]
) -> None:
    """The reading consumer's replica gives ``gives(stored)``: indexes into what the stream
    stores, in the order given. The replica is the one thing faked."""
    drain = _history._drain

    async def replica(*args: Any) -> None:
        stored: deque[_history._Stored] = deque()
        await drain(*args[:-2], stored, set())
        for n in gives(list(stored)):
            _history._keep(stored[n], args[-2], args[-1])

    monkeypatch.setattr(_history, "_drain", replica)


async def test_history_reads_what_a_lagging_replica_lacks_from_the_leader(
    backend: NATSBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cluster the reading consumer can sit on a replica still catching up after a heal,
    which holds the older records only (seen on nats-server 2.9): the newest come from the
    stream leader."""
    job = JobPolicy("h.lag", history_size=10)
    for i in range(5):
        await backend.record(job, run_record(job.name, i))
    a_replica(monkeypatch, lambda stored: [0, 1, 2])  # not yet the last two
    assert [r.slot_ms for r in await backend.history(job, 10)] == [4, 3, 2, 1, 0]
    assert [r.slot_ms for r in await backend.history(job, 3)] == [4, 3, 2]


async def test_history_reads_from_the_leader_what_a_replica_lacks_amid_the_subject(
    backend: NATSBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica of nats-server 2.9 lacked runs amid the subject after a partition (4 of 26,
    under load): the leader says how many the subject holds, and a read that found fewer is
    made from the leader alone."""
    job = JobPolicy("h.holes", history_size=10)
    for i in range(6):
        await backend.record(job, run_record(job.name, i))
    a_replica(monkeypatch, lambda stored: [0, 2, 4, 5])
    assert [r.slot_ms for r in await backend.history(job, 10)] == [5, 4, 3, 2, 1, 0]
    assert [r.slot_ms for r in await backend.history(job, 4)] == [5, 4, 3, 2]


async def test_history_counts_a_run_once_whatever_a_replica_kept(
    backend: NATSBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica of nats-server 2.9 gave a run's record twice after a partition, though the
    leader stored it once (its message id): the history has each run once."""
    job = JobPolicy("h.twice", history_size=10)
    for i in range(4):
        await backend.record(job, run_record(job.name, i))
    a_replica(monkeypatch, lambda stored: [0, 1, 0, 2, 3])  # the first run again
    runs = [r.slot_ms for r in await backend.history(job, 10)]
    assert sorted(runs) == [0, 1, 2, 3], runs  # once each, where the last copy stood
    assert runs[:2] == [3, 2]


# -- connection loss (a throwaway server) -----------------------------------------------------


async def test_connection_loss_fails_closed_then_claiming_resumes(
    tmp_path: Path, nats_server_binary: str
) -> None:
    async with nats_server(tmp_path, binary=nats_server_binary) as server:
        backend = NATSBackend(server.url, prefix="loss", reconnect_time_wait=0.1)
        await backend.start(CLOCK)
        try:
            assert await backend.claim(Slot("j", 1), instance_id="i", run_id="r", timeout=1)
            await server.stop()
            started_at = time.monotonic()
            with pytest.raises(BackendUnavailableError):
                await backend.claim(Slot("j", 2), instance_id="i", run_id="r", timeout=0.5)
            assert time.monotonic() - started_at < 1.5
            await server.start()
            # Nothing to do: the backend reconnects by itself and claims again.
            slot_ms = 3

            async def claims_again() -> bool:
                nonlocal slot_ms
                slot_ms += 1
                try:
                    return await backend.claim(
                        Slot("j", slot_ms), instance_id="i", run_id="r", timeout=0.5
                    )
                except BackendError:
                    return False

            await until(claims_again, timeout=10, what="claiming to resume")
            # The claim made before the outage is still remembered (file store, dedup rebuilt).
            assert not await backend.claim(Slot("j", 1), instance_id="x", run_id="x", timeout=1)
        finally:
            await backend.stop()


class _RestartRun:
    """Claimers on separate connections claim a few jobs' slot every 50 ms; records per slot
    what each claimer was told: won (True), lost (False) or an error (None: a skip)."""

    JOBS = ("tick.a", "tick.b", "tick.c", "tick.d")

    def __init__(self, claimers: list[NATSBackend]) -> None:
        self.claimers = claimers
        self.outcomes: dict[Slot, list[bool | None]] = {}
        self.slow_or_failed = 0  # claims the outage delayed (> 100 ms) or failed
        self.tasks: list[asyncio.Task[None]] = []
        self.answered: list[int] = [0] * len(claimers)  # per claimer: slots answered definitely

    async def claim(self, index: int, slot: Slot) -> None:
        started_at = time.monotonic()
        try:
            won: bool | None = await self.claimers[index].claim(
                slot, instance_id=f"i{index}", run_id=f"r{index}", timeout=1.5
            )
        except BackendError:
            won = None
        if won is None or time.monotonic() - started_at > 0.1:
            self.slow_or_failed += 1
        if won is not None:
            self.answered[index] += 1
        self.outcomes[slot][index] = won

    async def resumed(self) -> None:
        """Until each claimer got a definite answer again (a reconnect takes longer on a loaded
        machine than any fixed pause allows)."""
        before = list(self.answered)

        async def answering() -> bool:
            return all(now > then for now, then in zip(self.answered, before, strict=True))

        await until(answering, timeout=20, what="every claimer to claim again")

    async def tick(self, until: asyncio.Event) -> None:
        slot_ms = 0
        while not until.is_set():
            slot_ms += 50
            for job in self.JOBS:
                slot = Slot(job, slot_ms)
                self.outcomes[slot] = [None] * len(self.claimers)
                self.tasks.extend(
                    asyncio.create_task(self.claim(i, slot)) for i in range(len(self.claimers))
                )
            await asyncio.sleep(0.05)
        await asyncio.gather(*self.tasks)


async def test_restart_while_claiming_never_runs_a_slot_twice_nor_loses_one_unclaimed(
    tmp_path: Path,
    nats_server_binary: str,
) -> None:
    """The server is killed (short outage) and later stopped for longer than a claim's budget,
    while claiming goes on. Per slot: at most one winner; a claimer told it lost only when a
    claim of that slot is stored (its owner may have got no answer in time: a skip, fail
    closed), never when none is. Claiming resumes by itself, and the server still remembers
    every won or lost slot after the restarts."""
    async with nats_server(tmp_path, binary=nats_server_binary) as server:
        claimers = await started(
            *(
                NATSBackend(server.url, prefix="rs", claim_timeout="1s", reconnect_time_wait=0.05)
                for _ in range(3)
            )
        )
        run, done = _RestartRun(claimers), asyncio.Event()
        ticking = asyncio.create_task(run.tick(done))
        try:
            await asyncio.sleep(0.6)
            await server.restart(signal.SIGKILL, downtime=0.3)
            await asyncio.sleep(0.6)
            await server.restart(signal.SIGTERM, downtime=1.5)
            await run.resumed()
            resumed = len(run.outcomes)
            await asyncio.sleep(0.5)
            done.set()
            await ticking
        finally:
            await stopped(*claimers)

        for slot, results in run.outcomes.items():
            assert results.count(True) <= 1, f"{slot.key} ran more than once: {results}"
        assert run.slow_or_failed > 0, "the restarts did not overlap any claim"
        assert any(True not in results for results in run.outcomes.values()), "no outage seen"
        later = list(run.outcomes.values())[resumed:]
        assert later, "no slot after the restarts"
        assert all(results.count(True) == 1 for results in later), "claiming did not resume"

        # Who the server remembers as each slot's claimer, after the restarts:
        owners = await _claim_owners(server.url, "rs-claims")
        for slot, results in run.outcomes.items():
            owner = owners.get(slot.key)
            if True in results:
                assert owner == results.index(True), f"{slot.key}: won {results}, stored {owner}"
            elif owner is not None:  # the owner got no answer in time (its ack lost): a skip
                assert results[owner] is None, f"{slot.key} falsely lost: {results}, {owner}"
            else:
                assert False not in results, f"{slot.key} lost, none stored: {results}"


async def _claim_owners(url: str, stream: str) -> dict[str, int]:
    """Slot key -> index of the claimer (instance ``i<index>``) whose claim is stored."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        last = (await js.stream_info(stream)).state.last_seq
        owners: dict[str, int] = {}
        for seq in range(1, last + 1):
            msg = await js.get_msg(stream, seq)
            key = (msg.headers or {})["Nats-Msg-Id"]
            owners[key] = int(json.loads(msg.data or b"")["instance_id"].removeprefix("i"))
        return owners
    finally:
        await nc.close()


async def test_no_secret_in_logs_or_errors_through_an_outage(
    tmp_path: Path, nats_server_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with nats_server(
        tmp_path, user="svc", password="pa55word", binary=nats_server_binary
    ) as server:
        backend = NATSBackend(server.url, prefix="sec", reconnect_time_wait=0.05)
        await backend.start(CLOCK)
        errors: list[str] = []
        try:
            await server.stop()
            with pytest.raises(BackendError) as info:
                await backend.claim(Slot("j", 1), instance_id="i", run_id="r", timeout=0.3)
            errors.append(str(info.value))
            await server.start()
            await until(lambda: _claims_ok(backend), timeout=10, what="the backend to reconnect")
        finally:
            await backend.stop()
        wrong = NATSBackend(server.url.replace("pa55word", "wrongpass"), connect_timeout=0.3)
        with pytest.raises(BackendUnavailableError) as info:
            await wrong.start(CLOCK)
        errors.append(str(info.value))
    assert "svc:***@" in errors[1]
    text = caplog.text + "\n".join(errors)
    assert "pa55word" not in text
    assert "wrongpass" not in text
    assert "connection lost" in caplog.text


async def _claims_ok(backend: NATSBackend) -> bool:
    try:
        await backend.claim(Slot("j", now_ms()), instance_id="i", run_id="r", timeout=0.3)
    except BackendError:
        return False
    return True


async def test_scheduler_skips_through_an_outage_and_resumes_by_itself(
    tmp_path: Path, nats_server_binary: str
) -> None:
    """End to end with the Scheduler: slots during an outage are skipped (backend-error), the
    timers keep going, and runs resume when the server is back, with nothing run twice."""
    from brokersched import JobContext, RunEvent, Scheduler, SkipEvent, StartEvent

    runs: list[int] = []
    skips: list[str] = []

    async def handler(ctx: JobContext) -> None:
        runs.append(ctx.slot_ms)

    def skipped(event: SkipEvent | StartEvent | RunEvent) -> None:
        assert isinstance(event, SkipEvent)
        skips.append(event.reason)

    async def ran_more(than: int) -> bool:
        return len(runs) >= than

    async with nats_server(tmp_path, binary=nats_server_binary) as server:
        backend = NATSBackend(
            server.url, prefix="sched", claim_timeout="300ms", reconnect_time_wait=0.05
        )
        scheduler = Scheduler(backend, max_late="1s")
        scheduler.every("outage.job", "100ms", handler)
        scheduler.on("skip", skipped)
        async with scheduler:
            await until(lambda: ran_more(3), timeout=10, what="the first runs")
            await server.stop()

            async def skipping() -> bool:
                return "backend-error" in skips

            await until(skipping, timeout=10, what="a backend-error skip")
            await server.start()
            after = len(runs)
            await until(lambda: ran_more(after + 5), timeout=10, what="runs to resume")
    assert len(runs) == len(set(runs))
    assert set(skips) <= {"backend-error", "not-acquired"}


# -- a fleet of scheduler processes ------------------------------------------------------------

FLEET_JOBS = {"fleet.fast": 200, "fleet.slow": 500}  # job name -> interval in ms


async def test_three_scheduler_processes_run_every_slot_exactly_once(
    nats_url: str, prefix: str
) -> None:
    jobs = {job: f"{ms}ms" for job, ms in FLEET_JOBS.items()}
    spec = {"backend": "nats", "url": nats_url, "prefix": prefix, "jobs": jobs}
    spec |= {"options": {"reconnect_time_wait": 0.1}, "scheduler": {}}
    fleet = await run_fleet(spec, run_s=3)
    assert fleet.assert_every_slot_ran_once(FLEET_JOBS) >= 8
    ran = fleet.runs()
    # Each run went into the shared history, readable from any instance.
    reader = NATSBackend(nats_url, prefix=prefix)
    await reader.start(CLOCK)
    try:
        for job in FLEET_JOBS:
            history = await reader.history(JobPolicy(job), 1000)
            assert {r.slot_ms for r in history} == {slot for name, slot in ran if name == job}
            assert len({r.instance_id for r in history}) >= 2, "one instance ran everything"
    finally:
        await reader.stop()

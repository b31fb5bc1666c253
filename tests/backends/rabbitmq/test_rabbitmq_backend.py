"""RabbitMQBackend against the real broker on 127.0.0.1:5672, and through a TCP proxy for faults.

Every test works under its own queue prefix and deletes the queues it touched (AMQP cannot list
queues, so the backends used here note the names). The ``stop_app`` restart test disturbs the
shared broker and only runs with ``BROKERSCHED_RABBITMQ_RESTART_TEST=1``.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import os
import random
import re
import shutil
import ssl
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq.exceptions
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import constants
from pamqp.common import FieldTable

from brokersched._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from brokersched._redact import redact_url
from brokersched.abc import JobPolicy, Slot
from brokersched.backends.rabbitmq import (
    RabbitMQBackend,
    claim_queue_name,
    history_queue_name,
)
from tests.support.fleet import run_fleet
from tests.support.helpers import IN_CI
from tests.support.leftovers import remove_rabbitmq
from tests.support.rabbitmq_helpers import (
    CLAIM_ARGUMENTS,
    CLOCK,
    SLOT,
    AckSpotter,
    claim,
    queue_exists,
    resumed,
    run_record,
    via,
)
from tests.support.servers import rabbitmq_server
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import until

JOB_NAME = re.compile(r"[A-Za-z0-9_$][A-Za-z0-9_.:$-]{0,127}")  # brokersched._options.NAME_PATTERN
QUEUE_NAME = constants.DOMAIN_REGEX["queue-name"]  # what pamqp (and so aio-pika) accepts


# -- helpers -----------------------------------------------------------------------------------


# -- names and configuration (no broker) -------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "segment"),
    [
        ("outbox.flush", "outbox.flush"),
        ("a:b", "a+3Ab"),
        ("$sys", "+24sys"),
        ("x+y", "x+2By"),  # '+' itself is escaped, so escapes cannot collide with names
        ("é", "+C3+A9"),
    ],
)
def test_queue_names_escape_what_amqp_refuses(job: str, segment: str) -> None:
    name = claim_queue_name("bs", Slot(job, SLOT))
    assert name == f"bs.claim.{segment}.{SLOT}"
    assert QUEUE_NAME.fullmatch(name)
    assert history_queue_name("bs", job) == f"bs.history.{segment}"


@pytest.mark.parametrize("prefix", ["b", "p" * 100])
@pytest.mark.parametrize("job", ["$" * 128, ":" * 128, "a" * 128, "$" + "a:" * 63 + "b"])
def test_the_longest_names_fit_in_255_bytes(prefix: str, job: str) -> None:
    for slot_ms in (SLOT, -(2**63), 2**63 - 1):
        name = claim_queue_name(prefix, Slot(job, slot_ms))
        assert len(name.encode()) <= 255, name
        assert QUEUE_NAME.fullmatch(name), name
        assert name.endswith(f".{slot_ms}")
    assert len(history_queue_name(prefix, job).encode()) <= 255


def test_shortened_names_keep_a_readable_head_and_differ() -> None:
    long_a, long_b = "$" * 127 + "a", "$" * 127 + "b"
    name_a = history_queue_name("p" * 100, long_a)
    name_b = history_queue_name("p" * 100, long_b)
    assert name_a != name_b
    assert name_a.startswith("p" * 100 + ".history.+24+24")
    assert "@" in name_a
    assert not name_a.split("@")[0].endswith(("+", "+2"))


@given(st.from_regex(JOB_NAME, fullmatch=True), st.from_regex(JOB_NAME, fullmatch=True))
def test_distinct_jobs_never_share_a_queue(one: str, two: str) -> None:
    for prefix in ("b", "p" * 100):
        names = {claim_queue_name(prefix, Slot(job, SLOT)) for job in (one, two)}
        assert len(names) == len({one, two})
        assert all(QUEUE_NAME.fullmatch(name) and len(name) <= 255 for name in names)


def _accepted_prefix(prefix: str) -> bool:
    try:
        RabbitMQBackend(prefix=prefix)
    except ConfigurationError:
        return False
    return True


def _unescape(segment: str) -> str:
    return re.sub(
        r"(?:\+[0-9A-F]{2})+",
        lambda m: bytes.fromhex(m[0].replace("+", "")).decode(),
        segment,
    )


def _decode(name: str) -> tuple[str, str, str, int | None]:
    """``(prefix, kind, job segment as escaped, slot_ms)`` back from a queue name."""
    prefix, kind, rest = name.split(".", 2)
    slot: int | None = None
    if kind == "claim":
        rest, slot_text = rest.rsplit(".", 1)
        slot = int(slot_text)
    return prefix, kind, rest, slot


PREFIXES = st.one_of(
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,15}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{90,99}", fullmatch=True),  # names get shortened
    st.sampled_from(["P", "P.claim", "P.history", "amq", "a.b.c"]),
)
JOBS = st.one_of(
    st.from_regex(JOB_NAME, fullmatch=True),
    st.sampled_from(["claim.x", "x", "history.x", "x.1", "claim.claim.x.1", "a@b", "#1"]),
    st.just("$" * 128),  # always shortened
)
SLOTS = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(PREFIXES, st.sampled_from(["claim", "history"]), JOBS, SLOTS)
def test_queue_names_decode_back_to_prefix_kind_job_and_slot(
    prefix: str, kind: str, job: str, slot_ms: int
) -> None:
    """Names are injective across (prefix, kind, job, slot): each decodes back to what made it.
    A prefix the backend accepts holds no '.', so it is the first segment and the kind the
    second; the slot is the last. A shortened job segment ends with '@' and a hash of the whole
    name ('@' never survives escaping), which names the job short of a SHA-256 collision."""
    if not _accepted_prefix(prefix):
        assert "." in prefix or prefix == "amq"
        return
    if kind == "claim":
        name = claim_queue_name(prefix, Slot(job, slot_ms))
        expected_slot: int | None = slot_ms
    else:
        name = history_queue_name(prefix, job)
        expected_slot = None
    decoded_prefix, decoded_kind, segment, decoded_slot = _decode(name)
    if "@" in segment:  # shortened
        assert hashlib.sha256(job.encode()).hexdigest().startswith(segment.rsplit("@", 1)[1])
        segment = job
    else:
        segment = _unescape(segment)
    assert (decoded_prefix, decoded_kind, segment, decoded_slot) == (
        prefix,
        kind,
        job,
        expected_slot,
    )
    assert QUEUE_NAME.fullmatch(name) and len(name.encode()) <= 255


def test_prefixes_with_dots_are_refused_so_prefix_and_job_cannot_meet() -> None:
    """``P`` + job ``claim.x`` and ``P.claim`` + job ``x`` used to share one claim queue (and
    ``P`` + history of ``claim.x.1`` the claim queue of ``P.history`` + ``x``, slot 1)."""
    assert claim_queue_name("P", Slot("claim.x", SLOT)) == f"P.claim.claim.x.{SLOT}"
    for prefix in ("P.claim", "P.history", "my.app"):
        with pytest.raises(ConfigurationError, match=re.escape("without '.'")) as caught:
            RabbitMQBackend(prefix=prefix)
        assert caught.value.option == "prefix"
        assert "'my-app' or 'my_app'" in str(caught.value)


@given(st.text(max_size=200), st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_any_text_gives_a_valid_name(job: str, slot_ms: int) -> None:
    name = claim_queue_name("p" * 100, Slot(job, slot_ms))
    assert QUEUE_NAME.fullmatch(name)
    assert len(name.encode()) <= 255


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("amqp://guest:guest@127.0.0.1/", "amqp://guest:***@127.0.0.1/"),
        ("amqps://u:p%40ss@host:5671/vh?x=1", "amqps://u:***@host:5671/vh?x=1"),
        ("amqp://127.0.0.1/", "amqp://127.0.0.1/"),
        ("amqp://user@host/", "amqp://user@host/"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_repr_and_capabilities() -> None:
    backend = RabbitMQBackend("amqp://u:s3cret@127.0.0.1/", slot_ttl="90s", prefix="app")
    assert "s3cret" not in repr(backend)
    assert "app" in repr(backend)
    caps = backend.capabilities
    assert (caps.leases, caps.history_ttl, caps.history_size_per_job) == (False, False, True)
    assert caps.slot_memory is not None
    assert caps.slot_memory.total_seconds() == 90


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"url": "http://u:s3cret@h/"}, "url"),
        ({"slot_ttl": 0}, "slot_ttl"),
        ({"claim_timeout": "0s"}, "claim_timeout"),
        ({"prefix": "amq.mine"}, "prefix"),
        ({"prefix": "amq"}, "prefix"),  # its queues would start with 'amq.'
        ({"prefix": "app.sched"}, "prefix"),
        ({"prefix": "has space"}, "prefix"),
        ({"prefix": "x" * 101}, "prefix"),
        ({"channels": 0}, "channels"),
        ({"channels": True}, "channels"),
    ],
)
def test_bad_options_are_refused_at_construction(options: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RabbitMQBackend(**options)
    assert caught.value.option == option
    assert caught.value.backend == "RabbitMQBackend"
    assert "s3cret" not in str(caught.value)


async def test_constructing_never_connects_and_claims_need_start() -> None:
    backend = RabbitMQBackend("amqp://guest:guest@127.0.0.1:1/")  # nothing listens on port 1
    with pytest.raises(BackendUnavailableError, match="not started"):
        await claim(backend, Slot("job", SLOT))
    await backend.stop()  # safe when not started


async def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aio_pika", None)  # import aio_pika -> ImportError
    with pytest.raises(ConfigurationError, match=re.escape("brokersched[rabbitmq]")):
        await RabbitMQBackend().start(CLOCK)


def test_client_errors_never_carry_the_password() -> None:
    backend = RabbitMQBackend("amqp://u:p%40ss@127.0.0.1/")
    for secret in ("p%40ss", "p@ss"):
        with pytest.raises(BackendUnavailableError) as caught, backend._client_errors("connecting"):
            raise aiormq.exceptions.AMQPConnectionError(f"refused for {secret}")
        printed = "".join(traceback.format_exception(caught.value))
        assert "p@ss" not in printed
        assert "p%40ss" not in printed
        # the client's exception stays chained, scrubbed of the password in place
        assert isinstance(caught.value.__cause__, aiormq.exceptions.AMQPConnectionError)
        assert str(caught.value.__cause__) == "refused for ***"


# -- claims on the broker ----------------------------------------------------------------------


async def test_first_claim_wins_later_ones_lose(fleet: Callable[..., Any]) -> None:
    one, two = await fleet(), await fleet()
    slot = Slot("report", SLOT)
    assert await claim(one, slot) is True
    assert await claim(two, slot) is False
    assert await claim(one, slot) is False
    assert await claim(two, Slot("report", SLOT + 1)) is True


async def test_claim_queue_is_durable_classic_capped_and_persistent(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    backend = await fleet(slot_ttl="1m")
    slot = Slot("job", SLOT)
    assert await claim(backend, slot)
    name = claim_queue_name(backend.prefix, slot)
    arguments: FieldTable = {**CLAIM_ARGUMENTS, "x-expires": 60_000}
    for wrong in ({"durable": False}, {"arguments": {**arguments, "x-queue-type": "quorum"}}):
        channel = await raw.channel()
        declare: dict[str, Any] = {"durable": True, "arguments": arguments, **wrong}
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await channel.declare_queue(name, **declare)
    channel = await raw.channel()
    queue = await channel.declare_queue(name, durable=True, arguments=arguments)
    assert queue.declaration_result.message_count == 1
    # a test slot, so reading its message is harmless; closing the channel puts it back
    message = await queue.get(no_ack=False)
    assert message is not None
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.message_id == slot.key
    await channel.close()


async def test_a_queue_gone_before_the_publish_is_declared_again(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A returned publish (the queue expired between declare and publish) is never a win by
    itself: the claim declares again and publishes again."""
    backend = await fleet()
    slot = Slot("job", SLOT)
    name = claim_queue_name(backend.prefix, slot)
    declare = aio_pika.Channel.declare_queue
    deleter = await raw.channel()
    declares = 0

    async def declare_then_lose_it(self: aio_pika.Channel, *args: Any, **kwargs: Any) -> Any:
        nonlocal declares
        queue = await declare(self, *args, **kwargs)
        declares += 1
        if declares == 1:  # the broker forgets the queue right after the first declare
            await deleter.queue_delete(name)
        return queue

    monkeypatch.setattr(aio_pika.Channel, "declare_queue", declare_then_lose_it)
    assert await claim(backend, slot) is True
    assert declares == 2
    monkeypatch.undo()
    assert await claim(await fleet(), slot) is False


async def test_a_timeout_fails_closed(fleet: Callable[..., Any]) -> None:
    backend = await fleet()
    with pytest.raises(BackendUnavailableError, match="in time"):
        await claim(backend, Slot("job", SLOT), timeout=0)
    assert await claim(backend, Slot("job", SLOT)) is True  # nothing was claimed meanwhile


async def test_a_slot_is_remembered_for_slot_ttl_then_forgotten(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    one, two = await fleet(slot_ttl="500ms"), await fleet(slot_ttl="500ms")
    slot = Slot("job", SLOT)
    assert await claim(one, slot) is True
    assert await claim(two, slot) is False  # declaring again also renews the queue's lease
    name = claim_queue_name(one.prefix, slot)

    async def expired() -> bool:
        return not await queue_exists(raw, name)

    # a declare, even a passive one, renews the queue's lease: look less often than slot_ttl
    await until(expired, timeout=15, what="the claim queue to expire", every=1.5)
    assert await claim(two, slot) is True


async def test_racing_claimers_have_exactly_one_winner_per_slot(
    fleet: Callable[..., Any],
) -> None:
    racers = 8
    # A claim that finds no free channel within a quarter of claim_timeout is shed (tested
    # apart): long enough here that only the race decides, however loaded the machine.
    backends = [await fleet(channels=4, claim_timeout="40s") for _ in range(racers)]
    slots = [Slot(f"race.{n % 3}", SLOT + n * 1000) for n in range(30)]
    barrier = asyncio.Barrier(racers)

    async def racer(backend: RabbitMQBackend) -> dict[Slot, bool]:
        order = random.sample(slots, len(slots))  # every racer fights over slots in its order
        await barrier.wait()
        results = await asyncio.gather(*(claim(backend, slot, timeout=40) for slot in order))
        return dict(zip(order, results, strict=True))

    outcomes = await asyncio.gather(*(racer(backend) for backend in backends))
    for slot in slots:
        winners = sum(outcome[slot] for outcome in outcomes)
        assert winners == 1, f"{slot.key}: {winners} winners"


async def test_a_wrong_password_never_reaches_a_log_or_an_error(
    amqp_url: str, make: Callable[..., RabbitMQBackend], caplog: pytest.LogCaptureFixture
) -> None:
    parts = urlsplit(amqp_url)
    secret = "Wr0ng-pa55word"
    url = urlunsplit(parts._replace(netloc=f"guest:{secret}@{parts.hostname}:{parts.port or 5672}"))
    backend = make(url)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(BackendUnavailableError) as caught:
        await backend.start(CLOCK)
    assert secret not in "".join(traceback.format_exception(caught.value))
    assert secret not in caplog.text
    assert "guest:***@" in str(caught.value)


def _url_with(amqp_url: str, *, password: str | None = None, vhost: str | None = None) -> str:
    parts = urlsplit(amqp_url)
    user = parts.username or "guest"
    secret = password if password is not None else (parts.password or "guest")
    netloc = f"{user}:{secret}@{parts.hostname}:{parts.port or 5672}"
    path = f"/{vhost}" if vhost is not None else parts.path
    return urlunsplit(parts._replace(netloc=netloc, path=path))


async def test_a_missing_vhost_is_named_with_what_to_do(
    amqp_url: str, make: Callable[..., RabbitMQBackend], caplog: pytest.LogCaptureFixture
) -> None:
    """It used to surface aiormq's ``InvalidFrameError: Expected one of ['Connection.OpenOk'],
    got <Connection.Close object at 0x...>``."""
    vhost = f"nosuchvhost-{uuid.uuid4().hex[:6]}"
    backend = make(_url_with(amqp_url, vhost=vhost))
    caplog.set_level(logging.INFO)
    with pytest.raises(BackendError) as caught:
        await backend.start(CLOCK)
    message = str(caught.value)
    assert "\n" not in message
    assert f"refused virtual host {vhost!r}" in message
    assert "does not exist, or user" in message and "has no access to it" in message
    assert f"rabbitmqctl add_vhost {vhost}" in message
    assert ":***@" in message  # the URL is shown redacted
    assert "InvalidFrameError" not in message and "Connection.Close" not in message
    assert not [r for r in caplog.records if r.name.startswith(("aio_pika", "aiormq"))]


async def test_a_refused_login_says_what_to_check(
    amqp_url: str, make: Callable[..., RabbitMQBackend]
) -> None:
    secret = "N0t-the-Passw0rd"
    backend = make(_url_with(amqp_url, password=secret))
    with pytest.raises(BackendError) as caught:
        await backend.start(CLOCK)
    message = str(caught.value)
    assert "refused the login of user" in message and "(ACCESS_REFUSED)" in message
    assert "check the user name and password in the URL" in message
    assert secret not in "".join(traceback.format_exception(caught.value))


async def test_a_failed_start_is_an_error_not_client_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiormq logged ``ERROR error when creating transport`` and aio-pika ``Reconnecting after 1
    seconds`` although start() raises (and does not reconnect): the error says it all."""
    caplog.set_level(logging.INFO)
    backend = RabbitMQBackend("amqp://app:s3cret@127.0.0.1:1/")  # nothing listens on port 1
    with pytest.raises(BackendUnavailableError, match="no connection to the broker"):
        await backend.start(CLOCK)
    clients = [r for r in caplog.records if r.name.startswith(("aio_pika", "aiormq"))]
    assert not clients, [r.getMessage() for r in clients]


# -- history -----------------------------------------------------------------------------------


async def test_history_survives_concurrent_readers_and_writers(
    fleet: Callable[..., Any],
) -> None:
    writer, *readers = [await fleet() for _ in range(4)]
    policy = JobPolicy("hist", history_size=30)
    for n in range(10):
        await writer.record(policy, run_record("hist", SLOT + n, n))

    async def read(reader: RabbitMQBackend) -> list[str]:
        return [record.run_id for record in await reader.history(policy, 10)]

    async def write(first: int) -> None:
        for n in range(first, first + 4):
            await writer.record(policy, run_record("hist", SLOT + n, n))

    for first in (10, 14):
        *reads, _ = await asyncio.gather(*(read(r) for r in readers * 2), write(first))
        # each read is whole: the ten newest records at some moment of the writing
        snapshots = [[f"run-{n}" for n in range(k - 1, k - 11, -1)] for k in range(10, first + 5)]
        assert all(seen in snapshots for seen in reads), reads
    assert await read(readers[0]) == snapshots[-1]  # reading took nothing away


async def test_a_raised_history_size_applies_at_once(
    fleet: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The bound is the reader's (one stream per prefix): records kept beyond the old
    history_size are read under the new one, with nothing to warn about."""
    old, new = await fleet(), await fleet()
    for n in range(4):
        await old.record(JobPolicy("job", history_size=3), run_record("job", SLOT + n, n))
    with caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"):
        await new.record(JobPolicy("job", history_size=5), run_record("job", SLOT + 4, 4))
    assert caplog.text == ""
    records = await new.history(JobPolicy("job", history_size=5), 10)
    assert [record.run_id for record in records] == [f"run-{n}" for n in range(4, -1, -1)]


async def test_history_honours_a_lowered_history_size(
    fleet: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """history() returns at most history_size records, newest first (as NATS does)."""
    old, new = await fleet(), await fleet()
    for n in range(8):
        await old.record(JobPolicy("job", history_size=8), run_record("job", SLOT + n, n))
    lowered = JobPolicy("job", history_size=3)
    with caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"):
        await new.prepare([lowered])
        await new.record(lowered, run_record("job", SLOT + 8, 8))
    records = await new.history(lowered, 100)
    assert [record.run_id for record in records] == ["run-8", "run-7", "run-6"]
    assert len(await new.history(lowered, 2)) == 2
    assert await new.history(JobPolicy("job", history_size=1), 100) == records[:1]


# -- overload -----------------------------------------------------------------------------------


async def test_a_claim_finding_no_free_channel_in_time_is_skipped_as_overloaded(
    fleet: Callable[..., Any],
) -> None:
    """At a load the broker cannot carry, claims must not pile up behind each other
    (and their slots run late): one that finds no free channel within a quarter of
    claim_timeout is skipped at once, saying why."""
    backend = await fleet(channels=1, claim_timeout="4s")
    assert backend._pool is not None
    async with backend._pool.channel():  # the only channel, busy
        started = time.monotonic()
        with pytest.raises(BackendError, match="overloaded") as refused:
            await claim(backend, Slot("job", SLOT), timeout=4.0)
        waited = time.monotonic() - started
    # shed after its quarter of claim_timeout, not at the claim's own deadline: an upper bound
    # a loaded machine cannot reach (the wait is a timer; 3 s of margin for its wake-up)
    assert 1.0 <= waited < 4.0, waited
    message = str(refused.value)
    assert "none of the 1 channels free within 1000 ms" in message and "job:" in message
    assert await claim(backend, Slot("job", SLOT)) is True  # nothing was claimed meanwhile


# -- faults through a proxy --------------------------------------------------------------------


async def test_a_cut_connection_fails_closed_and_claiming_resumes(
    amqp_url: str, fleet: Callable[..., Any], amqp_proxy: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # Its own level too: the CLI's quiet_clients, run in-process by earlier tests, leaves
    # aio-pika's logger at WARNING.
    caplog.set_level(logging.INFO, logger="aio_pika")
    direct, cut_off = await fleet(), await fleet(via(amqp_url, amqp_proxy.port))
    before = Slot("job", SLOT)
    assert await claim(cut_off, before) is True

    await amqp_proxy.cut()
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        await claim(cut_off, Slot("job", SLOT + 1000), timeout=0.5)
    assert time.monotonic() - started < 1.5  # the deadline holds, the claim fails closed
    assert await claim(direct, Slot("job", SLOT + 1000)) is True  # nothing was taken

    amqp_proxy.restore()
    took = await until(resumed(cut_off), timeout=10, what="claims to resume")
    logging.getLogger(__name__).info("claims resumed %.2fs after the link came back", took)
    assert await claim(cut_off, before) is False  # no slot runs twice across the outage
    assert await claim(direct, before) is False
    # only the first connect is quiet: a reconnection is still logged by aio-pika (its line
    # may come a moment after the claims resumed, on a loaded machine)

    async def logged() -> bool:
        return any(r.name == "aio_pika.robust_connection" for r in caplog.records)

    await until(logged, timeout=10, what="aio-pika to log the reconnection")


async def test_link_cuts_let_only_backend_errors_out_of_every_call(
    amqp_url: str, make: Callable[..., RabbitMQBackend], amqp_proxy: TcpProxy
) -> None:
    """aiormq raised a bare ``RuntimeError("<Connection ...> closed")`` out of claim() when the
    link dropped while a channel was being opened. Calls are started on every turn of the event
    loop across each cut, so some of them meet the connection at every stage of its closing."""
    backend = make(via(amqp_url, amqp_proxy.port), channels=16)
    await backend.start(CLOCK)
    job = JobPolicy("cut", history_size=5)
    slots = itertools.count(SLOT)
    escaped: collections.Counter[str] = collections.Counter()
    answered = 0

    async def call(n: int) -> None:
        nonlocal answered
        try:
            match n % 8:
                case 5:
                    await backend.record(job, run_record("cut", next(slots), n))
                case 6:
                    await backend.history(job, 5)
                case 7:
                    await backend.prepare([job])
                case _:
                    await claim(backend, Slot("cut", next(slots)), timeout=1.0)
            answered += 1
        except BackendError:
            pass
        except BaseException as exc:  # CancelledError too: nobody cancels these calls
            escaped[f"{type(exc).__module__}.{type(exc).__name__}: {exc}"] += 1

    try:
        for _ in range(5):
            await until(resumed(backend), timeout=15, what="claims to resume")
            cutting = asyncio.ensure_future(amqp_proxy.cut())
            calls = []
            for n in range(40):
                calls.append(asyncio.ensure_future(call(n)))
                await asyncio.sleep(0)  # one turn of the loop: the cut goes on meanwhile
            await cutting
            amqp_proxy.restore()
            await asyncio.gather(*calls)
    finally:
        await backend.stop()
    assert not escaped, escaped
    assert answered  # some calls went through before each cut


async def test_a_lost_confirm_is_ambiguous_and_the_slot_never_runs(
    amqp_url: str,
    fleet: Callable[..., Any],
    amqp_proxy: TcpProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    direct, cut_off = await fleet(), await fleet(via(amqp_url, amqp_proxy.port), channels=1)
    assert await claim(cut_off, Slot("warm-up", SLOT)) is True  # link idle at a frame boundary
    slot = Slot("job", SLOT)
    # A claim publishes first; the slot's queue does not exist yet, so that publish comes back
    # unrouted (ack 1), and the claim declares the queue and publishes again (ack 2): the
    # broker takes the claim and its ack is lost.
    amqp_proxy.cut_when_downstream(AckSpotter(nth=2))
    with (
        caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"),
        pytest.raises(BackendError, match="ambiguous"),
    ):
        await claim(cut_off, slot)
    assert slot.key in caplog.text
    assert await claim(direct, slot) is False  # the broker holds the lost claim: nobody runs it

    amqp_proxy.restore()
    await until(resumed(cut_off), timeout=10, what="claims to resume")
    assert await claim(cut_off, slot) is False


def _self_signed(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server and a client TLS context for 127.0.0.1, from a throwaway certificate."""
    openssl = shutil.which("openssl")
    if openssl is None:
        if IN_CI:
            pytest.fail("openssl is needed to make a throwaway certificate", pytrace=False)
        pytest.skip("openssl is needed to make a throwaway certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


async def test_amqps_works(amqp_url: str, fleet: Callable[..., Any], tmp_path: Path) -> None:
    server_tls, client_tls = _self_signed(tmp_path)
    parts = urlsplit(amqp_url)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672, ssl=server_tls) as tls:
        backend = await fleet(via(amqp_url, tls.port, "amqps"), ssl_context=client_tls)
        assert await claim(backend, Slot("job", SLOT)) is True
        assert await claim(await fleet(), Slot("job", SLOT)) is False
        await backend.stop()


# -- a real broker restart (opt-in: it disturbs everyone using the shared broker) ---------------


_RABBITMQCTL = rabbitmq_server().rabbitmqctl()  # the run's broker's (RABBITMQ_SERVER)


def _rabbitmqctl(*args: str) -> None:
    assert _RABBITMQCTL is not None
    subprocess.run([*_RABBITMQCTL, *args], check=True, capture_output=True, timeout=120)


@pytest.mark.skipif(
    os.environ.get("BROKERSCHED_RABBITMQ_RESTART_TEST") != "1" or _RABBITMQCTL is None,
    reason="stops the shared broker; set BROKERSCHED_RABBITMQ_RESTART_TEST=1 (needs the "
    "broker's rabbitmqctl on this machine)",
)
async def test_a_broker_restart_forgets_no_claim(fleet: Callable[..., Any]) -> None:
    backend = await fleet(slot_ttl="5m")
    won = Slot("job", SLOT)
    assert await claim(backend, won) is True
    await asyncio.to_thread(_rabbitmqctl, "stop_app")
    try:
        with pytest.raises(BackendError):
            await claim(backend, Slot("job", SLOT + 1000), timeout=1)
    finally:
        await asyncio.to_thread(_rabbitmqctl, "start_app")
    took = await until(resumed(backend), timeout=30, what="claims to resume")
    logging.getLogger(__name__).info("claims resumed %.1fs after start_app", took)
    assert await claim(backend, won) is False  # durable queue, persistent message
    assert await claim(await fleet(slot_ttl="5m"), won) is False


# -- the end-of-run check ----------------------------------------------------------------------


async def test_the_end_of_run_check_cleans_the_broker_the_url_names(
    amqp_url: str, raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """tests/support/leftovers.py lists what carries a prefix on the node that serves the URL's
    port (on this machine: 3.10 on 5672, 4.0 on 5673 and 5674), not on the machine's default
    node, and removes it there."""
    channel = await raw.channel()
    await channel.declare_queue(f"{prefix}.left", durable=True)
    await channel.declare_exchange(f"{prefix}.left", aio_pika.ExchangeType.FANOUT, durable=True)
    found = await remove_rabbitmq(amqp_url, prefix)
    assert sorted(found) == [f"RabbitMQ exchange {prefix}.left", f"RabbitMQ queue {prefix}.left"]
    assert not await queue_exists(raw, f"{prefix}.left")


# -- a fleet of schedulers in separate processes -----------------------------------------------


async def test_three_scheduler_processes_run_every_slot_exactly_once(
    amqp_url: str, prefix: str
) -> None:
    jobs = {"fleet.tick": "500ms", "fleet:tock$": "500ms"}  # the second needs escaping
    spec = {"backend": "rabbitmq", "url": amqp_url, "prefix": prefix, "jobs": jobs}
    spec |= {"options": {"slot_ttl": "2m"}, "scheduler": {"max_late": "10s"}}
    try:
        fleet = await run_fleet(spec)
    finally:
        await remove_rabbitmq(amqp_url, prefix)
    # every slot from when all three were up until shortly before they stopped ran once
    window = fleet.assert_every_slot_ran_once(dict.fromkeys(jobs, 500))
    assert fleet.skips()["not-acquired"] >= 2 * window  # the other two did try

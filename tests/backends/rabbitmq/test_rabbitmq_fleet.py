"""One slot memory per RabbitMQ fleet, against the real broker.

A claim queue takes its ``x-expires`` from the instance that declares it first. Instances of one
prefix with different ``slot_ttl`` (a rolling deploy from 2s to 20s) must never both win a slot:
the short one's queue vanishes while the long one may still claim. Real time is used only where
the broker's expiry of a claim queue is the point.

The first two tests reproduce the bug: they fail on the backend before the fix (they use nothing
but the constructor, ``start`` and ``claim``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest

from brokersched._clock import Clock, SystemClock
from brokersched._exceptions import BackendError
from brokersched.abc import JobPolicy, Slot
from brokersched.backends.rabbitmq import (
    RabbitMQBackend,
    claim_margin_ms,
    claim_queue_name,
    history_queue_name,
)
from brokersched.testing import TestClock
from tests.support.names import unique
from tests.support.rabbitmq_helpers import delete_queues

CLOCK = SystemClock()
SHORT, LONG = "1s", "20s"  # the old and the new slot_ttl of a rolling deploy
SHORT_MS, LONG_MS = 1000, 20_000
SKEW_MS = 100  # the fleet fixture's max_clock_skew
EXPIRED_S = 2.5  # a claim queue made under SHORT is gone by then (the broker's timer)
JOB = JobPolicy("job", history_size=5)

Claimed = bool | BaseException
QUORUM = {"x-queue-type": "quorum"}


# -- helpers -----------------------------------------------------------------------------------


def record_name(prefix: str) -> str:
    return f"{prefix}.slot-memory"


def now_slot(job: str = "job") -> Slot:
    """A slot falling due now: the scheduler claims at or after a slot's instant."""
    return Slot(job, CLOCK.now_ms())


async def claim(backend: RabbitMQBackend, slot: Slot) -> Claimed:
    """``True``/``False``, or the ``BackendError`` of a claim that failed closed."""
    try:
        return await backend.claim(slot, instance_id="i", run_id=uuid.uuid4().hex, timeout=5.0)
    except BackendError as exc:
        return exc


def winners(outcomes: list[Claimed]) -> int:
    unexpected = [o for o in outcomes if not isinstance(o, bool | BackendError)]
    assert not unexpected, unexpected
    return sum(outcome is True for outcome in outcomes)


async def race(backends: list[RabbitMQBackend], slot: Slot) -> list[Claimed]:
    """Every backend claims ``slot`` at the same moment (a barrier, one connection each)."""
    barrier = asyncio.Barrier(len(backends))

    async def one(backend: RabbitMQBackend) -> Claimed:
        await barrier.wait()
        return await claim(backend, slot)

    return list(await asyncio.gather(*(one(backend) for backend in backends)))


async def x_expires(raw: aio_pika.abc.AbstractConnection, queue: str, expires_ms: int) -> bool:
    """Whether ``queue`` was declared with ``x-expires`` = ``expires_ms`` (a 406 says not)."""
    channel = await raw.channel()
    arguments = {
        "x-queue-type": "classic",
        "x-max-length": 1,
        "x-overflow": "reject-publish",
        "x-expires": expires_ms,
    }
    try:
        await channel.declare_queue(queue, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelPreconditionFailed:
        return False
    await channel.close()
    return True


@pytest.fixture
def prefix() -> str:
    return unique("f")


@pytest.fixture
async def fleet(make: Callable[..., RabbitMQBackend]) -> AsyncIterator[Callable[..., Any]]:
    """``await fleet(slot_ttl)``: a started backend of this test's prefix (``make``'s: every
    queue it touched is deleted after the test, the record taking its fences with it)."""
    started: list[RabbitMQBackend] = []

    async def start(
        slot_ttl: str,
        *,
        started_now: bool = True,
        prepared: bool = True,
        clock: Clock = CLOCK,
        **options: Any,
    ) -> Any:
        # One host's clocks: a skew of 100 ms leaves room to claim under a 1 s memory
        options.setdefault("max_clock_skew", f"{SKEW_MS}ms")
        backend = make(slot_ttl=slot_ttl, **options)
        started.append(backend)
        if started_now:
            await backend.start(clock)
            if prepared:  # as a scheduler with jobs does before it arms any
                await backend.prepare([JOB])
        return backend

    yield start
    await asyncio.gather(*(backend.stop() for backend in started))


# -- the bug: a longer slot_ttl wins again what a shorter one forgot ----------------------------


@pytest.mark.parametrize("first", [SHORT, LONG])
async def test_a_slot_won_under_a_short_slot_ttl_is_never_won_again_by_a_longer_one(
    fleet: Callable[..., Any], first: str
) -> None:
    """The old version (short) wins the slot, the new one (long) comes later by
    jitter, within its larger max_late, after the short queue would have expired."""
    second = LONG if first == SHORT else SHORT
    backends = {first: await fleet(first), second: await fleet(second)}
    slot = now_slot()
    assert await claim(backends[SHORT], slot) is True
    await asyncio.sleep(EXPIRED_S)  # the point: the broker's expiry of a SHORT claim queue
    late = await claim(backends[LONG], slot)
    assert late is not True, "the slot was won twice"


async def test_a_slot_claimed_before_the_raise_is_not_won_again_late_after_it(
    fleet: Callable[..., Any],
) -> None:
    """The short instance claims under its own memory; only then does the long one start."""
    short = await fleet(SHORT)
    slot = now_slot()
    assert await claim(short, slot) is True
    long = await fleet(LONG)  # raises the fleet's memory after the slot was claimed
    await asyncio.sleep(EXPIRED_S)
    late = await claim(long, slot)
    assert late is not True, "the slot was won twice"
    assert isinstance(late, BackendError)
    assert "too late to claim safely" in str(late)
    assert "1s when it fell due" in str(late) and "raised to 20s" in str(late)
    fresh = now_slot("other")  # a slot falling due after the raise is claimed normally
    assert [await claim(long, fresh), await claim(short, fresh)] == [True, False]


# -- start(): adopt a longer memory, raise a shorter one, both said with both values -----------


async def test_start_adopts_the_fleets_longer_memory_and_says_so(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    long = await fleet(LONG)
    with caplog.at_level(logging.INFO, logger="brokersched.backends.rabbitmq"):
        short = await fleet(SHORT)
    assert short.fleet_slot_memory == long.fleet_slot_memory == long.slot_ttl
    message = caplog.records[-1].getMessage()
    assert "remembers claimed slots for 20s" in message
    assert "this instance's slot_ttl 1s" in message
    assert f"rabbitmqctl delete_queue {prefix}.slot-memory" in message
    assert short.capabilities.slot_memory == short.slot_ttl  # validation keeps its own
    slot = now_slot()
    assert await claim(short, slot) is True
    assert await x_expires(raw, claim_queue_name(prefix, slot), LONG_MS)
    assert await claim(long, slot) is False


async def test_start_raises_a_shorter_fleet_memory_and_the_others_follow(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    short = await fleet(SHORT)
    with caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"):
        long = await fleet(LONG)
    message = caplog.records[-1].getMessage()
    assert "raised the slot memory of the fleet" in message
    assert "from 1s to 20s" in message
    assert f"rabbitmqctl delete_queue {prefix}.slot-memory" in message
    assert long.fleet_slot_memory == long.slot_ttl
    assert short.fleet_slot_memory == short.slot_ttl  # it has not looked since
    slot = now_slot()
    assert await claim(short, slot) is True  # finds its fence gone, reads the record again
    assert short.fleet_slot_memory == long.slot_ttl
    assert await x_expires(raw, claim_queue_name(prefix, slot), LONG_MS)
    assert await claim(long, slot) is False
    # the record itself says so, for an operator or a later instance
    channel = await raw.channel()
    queue = await channel.declare_queue(record_name(prefix), passive=True)
    body = await queue.get(no_ack=False)
    assert body is not None
    assert json.loads(body.body)["slot_memory_ms"] == LONG_MS
    await channel.close()  # puts the record back


async def test_an_instance_that_only_reads_history_changes_nothing(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A script reading history with the default slot_ttl (5m) must not raise the memory of a
    fleet on 1s: only an instance that claims (or whose scheduler starts with jobs) does."""
    short = await fleet(SHORT)
    with caplog.at_level(logging.INFO, logger="brokersched.backends.rabbitmq"):
        reader = await fleet("5m", prepared=False)
    assert "remembers claimed slots for 1s, shorter than this instance's slot_ttl 5m" in (
        caplog.text
    )
    assert reader.fleet_slot_memory == short.slot_ttl
    assert await reader.history(JOB, 5) == []
    await reader.stop()
    slot = now_slot()
    assert await claim(short, slot) is True
    assert await x_expires(raw, claim_queue_name(prefix, slot), SHORT_MS)


# -- a rolling deploy that raises slot_ttl -----------------------------------------------------


async def test_a_rolling_raise_runs_every_slot_once_without_downtime(
    fleet: Callable[..., Any],
) -> None:
    """Three instances on SHORT are replaced one by one with instances on LONG. Whenever a
    slot falls due, every live instance claims it at once: exactly one wins and no claim fails
    (no downtime). A slot claimed earlier is never won again late, once its SHORT queue would
    have expired."""
    live = [await fleet(SHORT) for _ in range(3)]
    earlier: list[Slot] = []
    for step in range(4):
        slot = now_slot(f"tick.{step}")
        outcomes = await race(live, slot)
        assert winners(outcomes) == 1, outcomes
        assert all(isinstance(outcome, bool) for outcome in outcomes), outcomes
        earlier.append(slot)
        if step < 3:
            await live.pop(0).stop()  # the oldest old instance goes, a new one comes
            live.append(await fleet(LONG))
    assert {backend.fleet_slot_memory for backend in live} == {live[-1].slot_ttl}
    await asyncio.sleep(EXPIRED_S)
    for slot in earlier:
        assert winners(await race(live, slot)) == 0, slot


# -- instances starting together with two slot_ttls --------------------------------------------


async def test_instances_starting_together_with_two_slot_ttls_never_both_win(
    fleet: Callable[..., Any],
) -> None:
    """Six instances (three SHORT, three LONG, shuffled) start at the same moment. Slots fall
    due every 25ms from then on; each instance, as soon as it is up, claims each of them at its
    instant (as a scheduler would), while the others are still starting and raising the record.
    No slot is won twice (a slot may be refused while the record is being made), every slot
    falling due once all are up is won once, and late claims once a SHORT queue would have
    expired win nothing. The slots go on until JUDGED of them fell due after the last start,
    however long the starts take (a loaded machine)."""
    judged = 8
    ttls = [SHORT, LONG] * 3
    random.shuffle(ttls)
    backends = [await fleet(ttl, started_now=False) for ttl in ttls]
    first = CLOCK.now_ms() + 100
    barrier = asyncio.Barrier(len(backends))
    up: list[int] = []
    end: list[int] = []  # the last slot's instant, once every instance is up

    def slot_at(n: int) -> Slot:
        return Slot("start", first + n * 25)

    async def instance(backend: RabbitMQBackend) -> dict[Slot, Claimed]:
        await barrier.wait()
        await backend.start(CLOCK)
        await backend.prepare([JOB])
        up.append(CLOCK.now_ms())
        if len(up) == len(backends):  # no instance has claimed past now + 25ms yet
            end.append(max(up) + judged * 25)
        outcomes: dict[Slot, Claimed] = {}
        for slot in map(slot_at, itertools.count()):
            if end and slot.slot_ms > end[0]:
                return outcomes
            await asyncio.sleep(max(0.0, (slot.slot_ms - CLOCK.now_ms()) / 1000))
            outcomes[slot] = await claim(backend, slot)
        raise AssertionError("unreachable")

    async with asyncio.timeout(60):
        rows = await asyncio.gather(*(instance(backend) for backend in backends))
    slots = list(rows[0])
    assert all(list(row) == slots for row in rows)  # every instance claimed the same slots
    for slot in slots:
        outcomes = [row[slot] for row in rows]
        assert winners(outcomes) <= 1, (slot, outcomes)
        if slot.slot_ms > max(up):
            assert winners(outcomes) == 1, (slot, outcomes)
    assert sum(slot.slot_ms > max(up) for slot in slots) >= judged - 1
    await asyncio.sleep(EXPIRED_S)
    for slot in slots:
        late = await race(backends, slot)
        assert winners(late) == 0, late
    # once every instance has claimed since the last raise (a fresh slot each: on a loaded
    # machine the late claims above may all have been refused before reading the record),
    # they share one memory
    await asyncio.gather(*(claim(backend, now_slot("after")) for backend in backends))
    long_ttl = backends[ttls.index(LONG)].slot_ttl
    assert {backend.fleet_slot_memory for backend in backends} == {long_ttl}


# -- a claim queue declared outside the scheme (a brokersched without the record) ---------------


async def foreign_claim(raw: aio_pika.abc.AbstractConnection, queue: str, *, holding: bool) -> None:
    """What an instance of an older brokersched with slot_ttl 5m does: declare the claim queue
    with its own ``x-expires``, and publish its claim when ``holding``."""
    channel = await raw.channel()
    arguments = {
        "x-queue-type": "classic",
        "x-max-length": 1,
        "x-overflow": "reject-publish",
        "x-expires": 300_000,
    }
    await channel.declare_queue(queue, durable=True, arguments=arguments)
    if holding:
        await channel.default_exchange.publish(aio_pika.Message(b"{}"), queue)
    await channel.close()


async def test_a_claim_queue_with_another_memory_fails_closed_and_the_channel_recovers(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    backend = await fleet(SHORT, channels=1)
    empty, held = now_slot("empty"), now_slot("held")
    await foreign_claim(raw, claim_queue_name(prefix, empty), holding=False)
    await foreign_claim(raw, claim_queue_name(prefix, held), holding=True)
    refused = await claim(backend, empty)
    assert isinstance(refused, BackendError)
    message = str(refused)
    assert "declared with another slot memory" in message
    assert "'300000'" in message and "the fleet's 1s" in message  # both memories named
    assert await claim(backend, held) is False  # it holds a claim: the slot is taken
    # each 406 closed the only channel of the pool; the next claim gets a fresh one
    assert await claim(backend, now_slot("fresh")) is True


async def test_a_claim_queue_with_another_memory_does_not_disturb_other_claims(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    # The point is the foreign queue, not load: a long memory and claim_timeout, so 21 claims
    # on 4 channels of a loaded broker neither outlive a claim's window (under SHORT, about
    # 0.6 s of real time however the clock stands) nor wait past a quarter of claim_timeout
    # for a channel (seen under CPU stress, twice).
    backend = await fleet(LONG, channels=4, claim_timeout="20s")
    bad = now_slot("bad")
    await foreign_claim(raw, claim_queue_name(prefix, bad), holding=False)
    others = [Slot("other", bad.slot_ms + n) for n in range(20)]
    outcomes = await asyncio.gather(claim(backend, bad), *(claim(backend, s) for s in others))
    assert isinstance(outcomes[0], BackendError)
    assert outcomes[1:] == [True] * len(others)


# -- the record lost, lowered, damaged ---------------------------------------------------------


async def delete_record(raw: aio_pika.abc.AbstractConnection, prefix: str) -> None:
    """What an operator's ``rabbitmqctl delete_queue <prefix>.slot-memory`` does (or a broker
    that lost its definitions): the record goes, and every fence with it."""
    channel = await raw.channel()
    await channel.queue_delete(record_name(prefix))
    await channel.close()


async def test_a_record_lost_while_instances_run_is_made_again_and_wins_nothing_twice(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    short, long = await fleet(SHORT), await fleet(LONG)
    before = now_slot("before")
    assert winners(await race([short, long], before)) == 1
    await delete_record(raw, prefix)
    # The short instance reads first: the record is made again from its slot_ttl. What memory
    # applied to a slot that fell due before that is unknown: not claimed late (skipped).
    lost = now_slot("lost")
    refused = await claim(short, lost)
    assert isinstance(refused, BackendError)
    assert "record was made after the slot fell due" in str(refused)
    assert short.fleet_slot_memory == short.slot_ttl
    # then the long one finds the record shorter than its own slot_ttl, and raises it
    after = now_slot("after")
    assert await claim(long, after) is True
    assert long.fleet_slot_memory == long.slot_ttl
    assert await claim(short, after) is False  # taken: a loser needs no view
    assert await claim(short, now_slot("next")) is True  # finds its fence gone, follows
    assert short.fleet_slot_memory == long.slot_ttl
    await asyncio.sleep(EXPIRED_S)
    for slot in (before, after):
        assert winners(await race([short, long], slot)) == 0, slot


async def test_lowering_the_memory_is_deleting_the_record_once_all_use_the_shorter_one(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    long = await fleet(LONG)
    shorts = [await fleet(SHORT) for _ in range(2)]
    assert {b.fleet_slot_memory for b in shorts} == {long.slot_ttl}  # a longer one is kept
    await long.stop()  # the deploy of the shorter slot_ttl is complete
    await delete_record(raw, prefix)
    around = now_slot("around")  # fell due before the record is made again: skipped
    assert winners(await race(shorts, around)) == 0
    slot = now_slot()
    assert winners(await race(shorts, slot)) == 1
    assert {b.fleet_slot_memory for b in shorts} == {shorts[0].slot_ttl}
    assert await x_expires(raw, claim_queue_name(prefix, slot), SHORT_MS)


async def test_a_record_that_is_not_one_is_made_again(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel = await raw.channel()
    await channel.declare_queue(
        record_name(prefix), durable=True, arguments={"x-queue-type": "classic"}
    )
    await channel.default_exchange.publish(aio_pika.Message(b"not json"), record_name(prefix))
    with caplog.at_level(logging.WARNING, logger="brokersched.backends.rabbitmq"):
        backend = await fleet(SHORT)
    assert "is not a slot memory record" in caplog.text
    assert backend.fleet_slot_memory == backend.slot_ttl
    assert await claim(backend, now_slot()) is True


async def test_a_raise_that_died_half_way_leaves_no_fence_a_start_would_trust(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """A raise acks the old record before it writes the new one: dying in between leaves the
    record queue empty, with fences still bound to it. The next reader makes the record again,
    and the old fences go with the queue it deletes first."""
    channel = await raw.channel()
    records = await channel.declare_queue(
        record_name(prefix), durable=True, arguments={"x-queue-type": "classic"}
    )
    for memory in ("1000ms", "20000ms"):
        fence = await channel.declare_exchange(
            f"{record_name(prefix)}.{memory}", "direct", durable=True, auto_delete=True
        )
        await records.bind(fence, routing_key=record_name(prefix))
    backend = await fleet(SHORT)
    assert backend.fleet_slot_memory == backend.slot_ttl
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
        await channel.declare_exchange(f"{record_name(prefix)}.20000ms", passive=True)
    assert await claim(backend, now_slot()) is True


async def test_a_record_of_a_later_version_refuses_the_start(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    channel = await raw.channel()
    await channel.declare_queue(
        record_name(prefix), durable=True, arguments={"x-queue-type": "classic"}
    )
    later = json.dumps({"version": 2, "slot_memory_ms": 5000}).encode()
    await channel.default_exchange.publish(aio_pika.Message(later), record_name(prefix))
    with pytest.raises(BackendError, match="format version 2, written by a later brokersched"):
        await fleet(SHORT)
    queue = await channel.declare_queue(record_name(prefix), passive=True)
    assert queue.declaration_result.message_count == 1  # left as it was


async def test_a_start_waits_for_the_instance_holding_the_lock(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    channel = await raw.channel()
    lock = await channel.declare_queue(
        f"{record_name(prefix)}.lock", durable=True, arguments={"x-queue-type": "classic"}
    )

    async def ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """Nothing comes."""

    await lock.consume(ignore, exclusive=True)  # another instance, in the middle of its start
    backend = await fleet(SHORT, started_now=False)
    starting = asyncio.ensure_future(backend.start(CLOCK))
    await asyncio.sleep(0.3)
    assert not starting.done()
    await channel.close()  # the holder's channel (or connection) goes: so does the lock
    async with asyncio.timeout(5):
        await starting
    assert backend.fleet_slot_memory == backend.slot_ttl  # it made the record


# -- the record's rules, without a broker ------------------------------------------------------


def test_the_record_says_how_late_a_slot_may_still_be_claimed() -> None:
    from brokersched._slotmemory import FleetMemory
    from brokersched.backends.rabbitmq._slotmemory import record_from_json as _record_from_json
    from brokersched.backends.rabbitmq._slotmemory import record_json as _record_json

    skew = 1000
    record = FleetMemory(2000, created_ms=1_000).raised(20_000, at_ms=5_000, skew_ms=skew)
    assert record == FleetMemory(20_000, 1_000, ((5_000, 2000),))
    assert record.limit_ms(500, skew) == 0  # before the record: nothing is known
    assert record.limit_ms(4_999, skew) == 2000  # fell due under 2s
    assert record.limit_ms(6_000, skew) == 2000  # within the clocks' skew of the raise
    assert record.limit_ms(6_001, skew) == 20_000  # fell due under 20s
    again = record.raised(60_000, at_ms=6_000, skew_ms=skew)
    assert again.limit_ms(4_000, skew) == 2000
    assert again.limit_ms(6_500, skew) == 20_000
    assert again.limit_ms(7_001, skew) == 60_000
    assert _record_from_json(_record_json(again)) == again
    # a raise older than the memory it replaced can no longer judge any claim: dropped
    assert again.raised(61_000, at_ms=200_000, skew_ms=skew).raises == ((200_000, 60_000),)


@pytest.mark.parametrize(
    "body",
    [b"[]", b'{"version": 1}', b'{"version": 0, "slot_memory_ms": 1, "created_ms": 1,'
     b' "raises": []}', b'{"version": 1, "slot_memory_ms": -1, "created_ms": 1, "raises": []}',
     b'{"version": 1, "slot_memory_ms": 1, "created_ms": 1, "raises": [[1]]}'],
)  # fmt: skip
def test_what_is_not_a_record_is_refused(body: bytes) -> None:
    from brokersched.backends.rabbitmq._slotmemory import record_from_json as _record_from_json

    with pytest.raises((ValueError, TypeError, KeyError)):
        _record_from_json(body)


# -- end to end: schedulers in a rolling deploy that raises slot_ttl ---------------------------


@pytest.mark.parametrize("declare_ahead", [False, True])
async def test_schedulers_in_a_rolling_raise_run_no_slot_twice_and_skip_none_for_it(
    amqp_url: str, prefix: str, fleet: Callable[..., Any], declare_ahead: bool
) -> None:
    """Two schedulers on the old configuration (slot_ttl 2s, max_late 500ms), then two on the
    new one (slot_ttl 20s, max_late 5s, more jitter), then the old ones stop. A job runs every
    250ms throughout. No slot runs twice, and with ``declare_ahead=False`` none is skipped for a
    backend error: the raise costs no run. With the default ``declare_ahead=True`` a slot whose
    queue was declared ahead under the old memory fails closed (skipped, never twice): those
    are the slots due within half a second of the raise. (A slot missed because every instance
    came too late is a matter of load, not of the raise; it is allowed, as 'late', and so is
    one won by an old instance as it stops.)"""
    from brokersched import Scheduler

    runs: list[int] = []
    skips: list[tuple[int, str]] = []
    details: list[str] = []
    said: dict[int, list[str]] = {}  # by slot: what each instance told of it, and when
    # A stalled loop wakes to past slots: the first is skipped late, the next ones up to
    # max_late before the wake are passed over with it (one skip, not one each: the design).
    passed: list[range] = []

    async def tick(ctx: Any) -> None:
        runs.append(ctx.slot_ms)

    def scheduler(name: str, slot_ttl: str, max_late_ms: int, **options: Any) -> Scheduler[Any]:
        backend = RabbitMQBackend(
            amqp_url, prefix=prefix, slot_ttl=slot_ttl, declare_ahead=declare_ahead
        )
        made = Scheduler(backend, instance_id=name, max_late=f"{max_late_ms}ms", **options)
        made.every("tick", "250ms", tick)
        made.on("skip", lambda event: skips.append((event.slot_ms, event.reason)))

        def stalled(event: Any) -> None:
            if event.reason == "late" and not event.detail:  # the timer's, not a claim's
                passed.append(range(event.slot_ms + 1, CLOCK.now_ms() - max_late_ms + 1))

        made.on("skip", stalled)
        made.on("skip", lambda event: details.append(event.detail or ""))
        for kind in ("claim", "skip", "start"):
            made.on(
                kind,
                lambda event, kind=kind: said.setdefault(event.slot_ms, []).append(
                    f"{name} {kind} {getattr(event, 'reason', '')} at {CLOCK.now_ms()}"
                ),
            )
        return made

    old = [scheduler(f"old-{i}", "2s", 500, jitter="50ms") for i in (1, 2)]
    new = [scheduler(f"new-{i}", "20s", 5000, jitter="100ms") for i in (1, 2)]
    began = CLOCK.now_ms()
    up = 0  # when the first instance was armed: a slot due before is nobody's
    try:
        for member in old:
            await member.start()
            up = up or CLOCK.now_ms()
        await asyncio.sleep(1.0)
        for member in new:
            await member.start()
        await asyncio.sleep(1.0)
        stopping = CLOCK.now_ms()
        for member in old:
            await member.stop()
        stopped = CLOCK.now_ms()
        await asyncio.sleep(1.0)
    finally:
        closing = CLOCK.now_ms()
        for member in old + new:
            await member.stop()
        ended = CLOCK.now_ms()
        await fleet(SHORT, started_now=False)  # so that the fixture deletes the record
        slots = range(began // 250 * 250, ended + 250, 250)
        claims = [claim_queue_name(prefix, Slot("tick", ms)) for ms in slots]
        await delete_queues(amqp_url, [*claims, history_queue_name(prefix, "tick")])
    twice = sorted({ms for ms in runs if runs.count(ms) > 1})
    assert twice == [], f"slots run more than once: {twice}"
    # A claim that timed out on a loaded machine (no answer in time, an answer lost, no
    # channel free or opened in time, a claim held up past its deadline or past the scheduler's
    # bound) fails closed like any other, and is a matter of load, not of the raise.
    load = (
        "no answer from the broker in time",
        "is ambiguous",
        "overloaded",
        "did not open a channel in time",
        "expected 'channel.open'",
        # the connection the broker then closed for that channel error (aiormq reused the
        # number of a channel whose open a timeout cut): the claims on it until it is back
        "no connection to the broker",
        "too late to claim safely",
        "TimeoutError",  # the scheduler's own bound on a claim past the backend's deadline
    )
    errors = [d for (_, reason), d in zip(skips, details, strict=True) if reason == "backend-error"]
    failed = [d for d in errors if not any(sign in d for sign in load)]
    if declare_ahead:
        raised = [d for d in failed if "was declared with another slot memory" in d]
        assert len(failed) == len(raised) <= 4, details  # only around the raise
    else:
        assert failed == [], details
    assert runs, "nothing ran"
    late = {ms for ms, reason in skips if reason in ("late", "backend-error")}
    # a slot won by an instance as it stops is not run (claim-only: lost, at most once)
    handed = range(stopping - 500, stopped + 1)
    # the last second before the final stop: a slot's jittered claim may not have begun
    window = range((up // 250 + 2) * 250, closing - 1000, 250)
    stall = {ms for ms in window if any(ms in over for over in passed)}
    excused = late | stall | set(handed)
    missing = [ms for ms in window if ms not in runs and ms not in excused]
    assert missing == [], (
        f"began {began}, first up {up}, old stopped {stopping}-{stopped}, all stopped "
        f"{closing}-{ended}; what the instances said of each: "
        f"{ {ms: said.get(ms, []) for ms in missing} }"
    )


# -- defence in depth: no claim of a slot older than the slot memory ---------------------------


async def test_a_direct_claim_of_a_slot_the_broker_forgot_is_refused(
    fleet: Callable[..., Any],
) -> None:
    """The runner never claims a slot as old as the slot memory, but ``claim()`` is public: a
    claim made after the claim queue expired must not win the slot a second time."""
    backend = await fleet("500ms")
    slot = now_slot()
    assert await claim(backend, slot) is True
    await asyncio.sleep(1.2)  # the point: the broker's expiry of the claim queue
    again = await claim(backend, slot)
    assert again is not True, "the slot was won twice"
    assert isinstance(again, BackendError)
    message = str(again)
    assert f"slot {slot.key} is " in message and "too late to claim safely" in message
    assert "the fleet's slot memory is 500ms" in message
    assert f"minus a {claim_margin_ms(500, SKEW_MS)}ms margin" in message
    assert await claim(backend, now_slot()) is True  # a fresh slot is claimed as before


async def test_a_claim_is_refused_from_the_slot_memory_minus_the_margin(
    fleet: Callable[..., Any],
) -> None:
    """The limit to the millisecond, on a virtual clock (the queues are fresh on the broker).
    The limit bounds the whole claim: one made 500ms before it has that long to finish."""
    clock = TestClock()
    backend = await fleet("10s", started_now=False, channels=1)
    await backend.start(clock)
    await backend.prepare([JOB])
    await clock.advance("30s")  # the slots below fell due after the record was made
    last_ms = 10_000 - claim_margin_ms(10_000, SKEW_MS)  # the first age refused
    assert await claim(backend, Slot("job", clock.now_ms() - last_ms + 500)) is True
    refused = await claim(backend, Slot("job", clock.now_ms() - last_ms))
    assert isinstance(refused, BackendError)
    assert "is 8s900ms old" in str(refused)  # a margin of 1100 ms: skew 100, flight 250, ahead 750
    assert await claim(backend, Slot("job", clock.now_ms() - 60_000)) is not True


async def test_a_claim_still_waiting_at_the_limit_gives_up(fleet: Callable[..., Any]) -> None:
    """The limit bounds the whole claim, not only its start: a claim that waits for a channel
    (or the broker) until the slot is as old as the memory minus the margin is not made."""
    clock = TestClock()
    backend = await fleet("10s", started_now=False, channels=1)
    await backend.start(clock)
    await backend.prepare([JOB])
    await clock.advance("30s")
    left_ms = 10_000 - claim_margin_ms(10_000, SKEW_MS)
    slot = Slot("job", clock.now_ms() - left_ms + 200)  # 200ms left
    async with backend._pool.channel():  # the only channel, busy
        waiting = asyncio.create_task(claim(backend, slot))
        await asyncio.sleep(0.5)
        assert waiting.done(), "the claim outlived its limit"
    refused = waiting.result()
    assert isinstance(refused, BackendError), refused
    assert "too late to claim safely" in str(refused)
    assert await claim(backend, Slot("job", clock.now_ms())) is True  # the channel still works


# -- queues of the scheme made beforehand with other settings ---------------------------------


@pytest.mark.parametrize("queue", ["slot-memory", "slot-memory.lock"])
async def test_a_record_or_lock_queue_made_with_other_settings_is_refused_with_the_fix(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str, queue: str
) -> None:
    """Made by hand as a quorum queue, say: start() fails closed, naming the queue, the
    argument and how to repair it."""
    channel = await raw.channel()
    await channel.declare_queue(f"{prefix}.{queue}", durable=True, arguments=QUORUM)
    backend = await fleet(SHORT, started_now=False)
    with pytest.raises(BackendError) as refused:
        await backend.start(CLOCK)
    message = str(refused.value)
    assert f"'{prefix}.{queue}'" in message and "x-queue-type" in message
    assert "exists with other arguments" in message and "rabbitmqctl delete_queue" in message


# -- a losing claim costs the broker one publish ------------------------------------------------


async def test_a_losing_claim_is_one_publish_without_the_fence_or_a_declare(
    fleet: Callable[..., Any],
) -> None:
    """A loser need not make what the winner made. Its publish is refused by the winner's
    queue, and that is the whole claim: an instance whose view of the fleet's memory is
    outdated loses without finding its fence gone (which a declare would need first). The
    check of the job's first refused claim (that brokersched made the queue) declares it, but
    reads no fence: a queue of another memory is brokersched's, and the loss stands."""
    short = await fleet(SHORT)
    long = await fleet(LONG)  # raises the fleet's memory: short's fence is gone
    slot = now_slot()
    assert await claim(long, slot) is True
    assert await claim(short, slot) is False
    assert short.fleet_slot_memory == short.slot_ttl  # it never looked at the fence
    assert await claim(short, now_slot("next")) is True  # a first claim does, and follows
    assert short.fleet_slot_memory == long.slot_ttl


# -- declare_ahead: the winner of a slot declares the queue of the next one --------------------


async def test_declared_ahead_the_instants_claims_find_the_queue_and_one_wins(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection, prefix: str
) -> None:
    """``prepare_claims`` declares the queues of slots due within 750 ms (under the fleet's
    memory), not those further ahead, nor with ``declare_ahead=False``; the claims of the
    instant, racing, then have one winner, and the queue stays the fleet's memory."""
    ahead, later, off = await fleet(LONG), await fleet(LONG), await fleet(LONG, declare_ahead=False)
    soon, far = Slot("job", CLOCK.now_ms() + 400), Slot("job", CLOCK.now_ms() + 5000)
    unprepared = Slot("other", CLOCK.now_ms() + 400)
    await ahead.prepare_claims([soon, far])
    await off.prepare_claims([unprepared])
    channel = await raw.channel()
    await channel.declare_queue(claim_queue_name(prefix, soon), passive=True)  # it exists
    assert await x_expires(raw, claim_queue_name(prefix, soon), LONG_MS)
    for missing in (far, unprepared):
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await channel.declare_queue(claim_queue_name(prefix, missing), passive=True)
        channel = await raw.channel()
    await asyncio.sleep(max(0, soon.slot_ms - CLOCK.now_ms()) / 1000)
    assert winners(await race([ahead, later, off], soon)) == 1
    assert await x_expires(raw, claim_queue_name(prefix, soon), LONG_MS)
    assert winners(await race([ahead, later, off], soon)) == 0  # remembered
    await channel.queue_delete(claim_queue_name(prefix, soon))


async def test_a_fleet_record_written_with_a_time_to_live_is_kept_that_long_only(
    fleet: Callable[..., Any],
) -> None:
    """Missed-slot reports are put for a day: gone after it, on the writers' clock, and apart
    from the controls (which a report once landed among)."""
    clock = TestClock("2027-01-15T08:00:00+00:00")
    a = await fleet(LONG, clock=clock, prepared=False)
    assert await a.report_missed(Slot("job", 1_000), instance_id="i-a")
    assert await a.controls() == {}
    assert "job:1000" in await a.fleet_records("missed")
    await clock.advance("25h")
    assert await a.fleet_records("missed") == {}

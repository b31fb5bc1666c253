"""Attacks on RabbitMQBackend's claim protocol (publish first), against the real broker.

Each test races claimers at the same moment, or puts the broker in a state a claim can meet
(a queue made beforehand with other arguments, a queue deleted mid-claim, an instance of the
previous protocol), and asserts the product's promise: a slot has at most one winner, and the
winner is the claim whose message the claim queue holds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aio_pika.abc
import pytest
from pamqp.common import FieldTable

from brokersched._exceptions import BackendError
from brokersched.abc import JobPolicy, Slot
from brokersched.backends.rabbitmq import (
    RabbitMQBackend,
    claim_queue_name,
    history_stream_name,
)
from brokersched.backends.rabbitmq._claims import ClaimAttempt as _ClaimAttempt
from brokersched.backends.rabbitmq._slotmemory import View as _View
from tests.support.rabbitmq_helpers import (
    CLAIM_ARGUMENTS,
    CLOCK,
    SLOT,
    AckSpotter,
    TrackedBackend,
    declare_or_skip,
    resumed,
    run_record,
    via,
)
from tests.support.stall_proxy import StallProxy
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import until

RACERS = 16
_slots = itertools.count()


def fresh_slot(job: str = "race") -> Slot:
    return Slot(job, SLOT + next(_slots) * 1000)


async def claim_as(backend: RabbitMQBackend, slot: Slot, run_id: str) -> bool | BackendError:
    """The claim's outcome; a ``BackendError`` (the slot is skipped) is returned, not raised."""
    try:
        return await backend.claim(slot, instance_id="i", run_id=run_id, timeout=5.0)
    except BackendError as exc:
        return exc


async def race(
    backends: list[RabbitMQBackend], slot: Slot
) -> tuple[list[bool | BackendError], list[str]]:
    """Every backend claims ``slot`` at the same moment: the outcomes and run ids, in order."""
    run_ids = [uuid.uuid4().hex for _ in backends]
    barrier = asyncio.Barrier(len(backends))

    async def one(backend: RabbitMQBackend, run_id: str) -> bool | BackendError:
        await barrier.wait()
        return await claim_as(backend, slot, run_id)

    outcomes = await asyncio.gather(*map(one, backends, run_ids))
    return list(outcomes), run_ids


async def held_run_ids(raw: aio_pika.abc.AbstractConnection, queue: str) -> list[str]:
    """The run ids of the claims in ``queue`` (read without ack; closing puts them back)."""
    channel = await raw.channel()
    try:
        declared = await channel.declare_queue(queue, passive=True)
        found = []
        while (message := await declared.get(no_ack=False, fail=False)) is not None:
            found.append(json.loads(message.body)["run_id"])
        return found
    finally:
        await channel.close()


def claim_arguments(memory_ms: int) -> FieldTable:
    return {**CLAIM_ARGUMENTS, "x-expires": memory_ms}


@pytest.fixture
async def racers(fleet: Callable[..., Any]) -> list[RabbitMQBackend]:
    """RACERS started backends of one fleet (one connection each, 2 channels each)."""
    return list(await asyncio.gather(*(fleet(channels=2) for _ in range(RACERS))))


async def assert_one_rightful_winner(
    raw: aio_pika.abc.AbstractConnection,
    backend: RabbitMQBackend,
    slot: Slot,
    outcomes: list[bool | BackendError],
    run_ids: list[str],
) -> None:
    winners = [run_id for outcome, run_id in zip(outcomes, run_ids, strict=True) if outcome is True]
    errors = [outcome for outcome in outcomes if isinstance(outcome, BackendError)]
    if os.environ.get("RABBITMQ_SERVER") == "4-khepri":
        # Khepri (experimental on 4.0) may answer a racer's declare with the queue "down or
        # inaccessible" while another racer's declare commits: that racer fails closed (it
        # skips the slot), and the queue's message below still shows the one winner.
        errors = [e for e in errors if "down or inaccessible" not in str(e)]
    assert not errors, errors
    assert len(winners) == 1, f"{slot.key}: {len(winners)} winners"
    assert await held_run_ids(raw, claim_queue_name(backend.prefix, slot)) == winners


async def test_sixteen_racers_with_no_queue_yet_have_one_rightful_winner(
    racers: list[RabbitMQBackend], raw: aio_pika.abc.AbstractConnection
) -> None:
    """Every racer's first publish comes back unrouted: all declare, all publish again."""
    for _ in range(10):
        slot = fresh_slot()
        outcomes, run_ids = await race(racers, slot)
        await assert_one_rightful_winner(raw, racers[0], slot, outcomes, run_ids)


async def test_sixteen_racers_on_an_empty_queue_have_one_rightful_winner(
    racers: list[RabbitMQBackend], raw: aio_pika.abc.AbstractConnection
) -> None:
    """The queue exists and is empty (its maker's publish still on the way): the first publish
    to reach it wins, every other is nacked; the maker arriving last loses too."""
    channel = await raw.channel()
    memory_ms = int(racers[0].slot_ttl.total_seconds() * 1000)
    for _ in range(10):
        slot = fresh_slot()
        queue = claim_queue_name(racers[0].prefix, slot)
        racers[0].touched.add(queue)  # type: ignore[attr-defined]
        await channel.declare_queue(queue, durable=True, arguments=claim_arguments(memory_ms))
        outcomes, run_ids = await race(racers, slot)
        await assert_one_rightful_winner(raw, racers[0], slot, outcomes, run_ids)


@pytest.mark.parametrize(
    ("durable", "arguments"),
    [
        pytest.param(True, {"x-queue-type": "classic"}, id="no-cap"),
        pytest.param(True, {**CLAIM_ARGUMENTS, "x-overflow": "drop-head"}, id="drop-head"),
        pytest.param(True, {**CLAIM_ARGUMENTS, "x-max-length": 2}, id="max-length-2"),
        pytest.param(True, CLAIM_ARGUMENTS, id="no-expiry"),
        pytest.param(True, {**claim_arguments(60_000), "x-message-ttl": 1000}, id="message-ttl"),
        pytest.param(False, claim_arguments(60_000), id="transient"),
        pytest.param(True, {**claim_arguments(60_000), "x-queue-type": "quorum"}, id="quorum"),
    ],
)
async def test_a_queue_made_beforehand_with_other_arguments_lets_nobody_win(
    racers: list[RabbitMQBackend],
    raw: aio_pika.abc.AbstractConnection,
    durable: bool,
    arguments: FieldTable,
) -> None:
    """A queue that may not hold exactly one claim, or may forget it: every racer fails closed
    (loses or is skipped), whichever of them reached it first."""
    channel = await raw.channel()
    for _ in range(3):
        slot = fresh_slot()
        queue = claim_queue_name(racers[0].prefix, slot)
        racers[0].touched.add(queue)  # type: ignore[attr-defined]
        await declare_or_skip(channel, queue, durable=durable, arguments=arguments)
        outcomes, _ = await race(racers, slot)
        assert True not in outcomes, f"{slot.key}: {outcomes.count(True)} winners"
        assert any(isinstance(outcome, BackendError) for outcome in outcomes)


async def test_a_queue_deleted_between_the_ack_and_its_check_fails_closed(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An empty queue takes the claim, then is deleted (an operator, a node lost) before the
    claim's check declares it: that declare makes a new, empty queue. Counting that as a win
    would let the next claim win too."""
    one, two = await fleet(), await fleet()
    slot = fresh_slot()
    queue = claim_queue_name(one.prefix, slot)
    channel = await raw.channel()
    await channel.declare_queue(queue, durable=True, arguments=claim_arguments(60_000))
    check = RabbitMQBackend._declare_claim_queue

    async def deleted_first(
        self: RabbitMQBackend, channel: Any, queue: str, slot: Slot, view: _View, *, holds: str
    ) -> None:
        if holds == "in-it" and self is one:
            deleter = await raw.channel()
            await deleter.queue_delete(queue)
            await deleter.close()
        await check(self, channel, queue, slot, view, holds=holds)

    monkeypatch.setattr(RabbitMQBackend, "_declare_claim_queue", deleted_first)
    outcomes = [await claim_as(one, slot, "one"), await claim_as(two, slot, "two")]
    assert outcomes.count(True) <= 1, outcomes
    assert isinstance(outcomes[0], BackendError), outcomes
    assert "gone" in str(outcomes[0])
    assert outcomes[1] is True  # the queue holds no claim: the next claim rightly wins


# -- claim queues made beforehand by something else ------------------------------------------

# A claim queue as someone makes it from the README's table: capped at one message, refusing
# the next, but without brokersched's x-expires (the fleet's slot memory).
AS_THE_TABLE_READS: FieldTable = dict(CLAIM_ARGUMENTS)


async def made_beforehand(
    raw: aio_pika.abc.AbstractConnection,
    backend: RabbitMQBackend,
    slot: Slot,
    arguments: FieldTable,
    *,
    durable: bool = True,
    stray: bytes | None = None,
) -> str:
    """Declare ``slot``'s claim queue as another tool would, holding ``stray`` if given; the
    queue is deleted after the test."""
    queue = claim_queue_name(backend.prefix, slot)
    backend.touched.add(queue)  # type: ignore[attr-defined]
    channel = await raw.channel()
    await declare_or_skip(channel, queue, durable=durable, arguments=arguments)
    if stray is not None:
        await channel.default_exchange.publish(aio_pika.Message(stray), queue)
    await channel.close()
    return queue


async def ready_count(raw: aio_pika.abc.AbstractConnection, queue: str) -> int:
    channel = await raw.channel()
    declared = await channel.declare_queue(queue, passive=True)
    await channel.close()
    return declared.declaration_result.message_count or 0


async def test_a_queue_made_beforehand_holding_a_stray_message_fails_closed_naming_it(
    racers: list[RabbitMQBackend], raw: aio_pika.abc.AbstractConnection
) -> None:
    """It refuses every claim, so before the fix every instance lost (not-acquired, a debug
    line) and nobody ran the slot or said why. Now each instance's refused claim checks the
    queue and fails closed, naming the queue, what differs and the fix; the stray is left."""
    slot = fresh_slot("stray")
    queue = await made_beforehand(raw, racers[0], slot, AS_THE_TABLE_READS, stray=b"hello")
    outcomes, _ = await race(racers[:4], slot)
    assert all(isinstance(outcome, BackendError) for outcome in outcomes), outcomes
    message = str(outcomes[0])
    assert f"claim queue {queue!r} of slot {slot.key}" in message
    assert "made with other settings than brokersched's" in message
    assert "x-expires is not set there, brokersched's is '60000'" in message
    assert "refuses every claim of the slot" in message and "no instance runs" in message
    assert f"rabbitmqctl delete_queue {queue}" in message
    assert f"{racers[0].prefix}.claim.*" in message
    assert "another slot memory" not in message
    assert await ready_count(raw, queue) == 1  # nothing taken out of it


async def test_a_scheduler_skips_a_slot_whose_queue_holds_a_stray_as_a_backend_error(
    make: Callable[..., RabbitMQBackend],
    raw: aio_pika.abc.AbstractConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole way: a scheduler's job every second; the queue of one of its slots was made
    beforehand holding a stray. That slot is skipped as backend-error with a WARNING naming
    the queue and the fix, not as not-acquired; the next one runs."""
    from brokersched import Scheduler

    backend = make()
    stray_ms = (CLOCK.now_ms() // 1000 + 3) * 1000
    queue = await made_beforehand(
        raw, backend, Slot("tick", stray_ms), AS_THE_TABLE_READS, stray=b"hello"
    )
    ran: list[int] = []
    skipped: dict[int, tuple[str, str | None]] = {}
    past = asyncio.Event()

    async def tick(ctx: Any) -> None:
        ran.append(ctx.slot_ms)
        if ctx.slot_ms > stray_ms:
            past.set()

    def on_skip(event: Any) -> None:
        skipped[event.slot_ms] = (event.reason, event.detail)

    scheduler = Scheduler(backend)
    scheduler.every("tick", "1s", tick, jitter="10ms", max_late="5s")
    scheduler.on("skip", on_skip)
    caplog.set_level(logging.WARNING)
    async with scheduler:
        await asyncio.wait_for(past.wait(), timeout=10)
    assert stray_ms not in ran
    reason, detail = skipped[stray_ms]
    assert reason == "backend-error", (reason, detail)
    assert detail is not None and queue in detail and "x-expires is not set there" in detail
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(queue in w and f"rabbitmqctl delete_queue {queue}" in w for w in warnings)
    assert stray_ms + 1000 in ran


@pytest.mark.parametrize(
    ("durable", "arguments", "named"),
    [
        pytest.param(
            True,
            {**claim_arguments(60_000), "x-max-length": 2},
            "x-max-length is '2' there, brokersched's is '1'",
            id="max-length-2",
        ),
        pytest.param(
            True,
            {**claim_arguments(60_000), "x-overflow": "drop-head"},
            "x-overflow is 'drop-head' there, brokersched's is 'reject-publish'",
            id="drop-head",
        ),
        pytest.param(
            True,
            {**claim_arguments(60_000), "x-queue-type": "quorum"},
            "x-queue-type is 'quorum' there, brokersched's is 'classic'",
            id="quorum",
        ),
        pytest.param(
            True,
            CLAIM_ARGUMENTS,
            "x-expires is not set there, brokersched's is '60000'",
            id="no-expiry",
        ),
        pytest.param(
            True,
            {**claim_arguments(60_000), "x-message-ttl": 1000},
            "x-message-ttl is '1000' there, brokersched does not set it",
            id="message-ttl",
        ),
        pytest.param(
            False,
            claim_arguments(60_000),
            "durable is 'false' there, brokersched's is 'true'",
            id="transient",
        ),
    ],
)
@pytest.mark.parametrize("stray", [None, b"hello"], ids=["empty", "holding-a-stray"])
async def test_a_queue_made_with_other_arguments_is_named_by_the_argument_that_differs(
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    durable: bool,
    arguments: FieldTable,
    named: str,
    stray: bytes | None,
) -> None:
    """Before the fix every 406 was reported as "declared with another slot memory ... this
    claim is in it", whatever differed. Now the warning names the argument and both values,
    says brokersched did not make the queue, and how to fix it; the claim still fails closed
    (the queue's cap, if any, decides whether this claim went in or was refused)."""
    one, two = await fleet(), await fleet()
    slot = fresh_slot("other-args")
    queue = await made_beforehand(raw, one, slot, arguments, durable=durable, stray=stray)
    outcomes = [await claim_as(one, slot, "one"), await claim_as(two, slot, "two")]
    assert True not in outcomes, outcomes
    refused = [outcome for outcome in outcomes if isinstance(outcome, BackendError)]
    assert refused, outcomes
    for outcome in refused:
        message = str(outcome)
        assert named in message, message
        assert "made with other settings than brokersched's" in message
        assert "not run" in message or "no instance runs" in message
        assert f"rabbitmqctl delete_queue {queue}" in message
        assert "another slot memory" not in message


async def test_racers_whose_every_refused_claim_is_checked_still_have_one_rightful_winner(
    racers: list[RabbitMQBackend],
    raw: aio_pika.abc.AbstractConnection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check of a refused claim is a declare with brokersched's arguments: it takes nothing
    out of the queue, so it lets no other claim in. Checked at every loss, on queues made by
    the racers and on queues declared ahead, a slot still has exactly its one winner."""
    monkeypatch.setattr("brokersched.backends.rabbitmq._claims._REFUSAL_CHECK_EVERY_MS", 0)
    channel = await raw.channel()
    for round_ in range(10):
        slot = fresh_slot()
        queue = claim_queue_name(racers[0].prefix, slot)
        racers[0].touched.add(queue)  # type: ignore[attr-defined]
        if round_ % 2:
            await channel.declare_queue(queue, durable=True, arguments=claim_arguments(60_000))
        outcomes, run_ids = await race(racers, slot)
        await assert_one_rightful_winner(raw, racers[0], slot, outcomes, run_ids)


async def test_a_refused_claim_is_checked_once_a_minute_per_job(
    fleet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss stays one refused publish: only the first loss of a job, then one a minute, adds
    the declare that checks the queue (a job running less often has each loss checked)."""
    from datetime import UTC, datetime

    from brokersched.testing import TestClock

    winner, loser = await fleet(), await fleet()
    clock = TestClock(datetime.now(UTC))  # the slots fall due after the fleet's record was made
    for backend in (winner, loser):  # restarted on the virtual clock, to move a minute on
        await backend.stop()
        await backend.start(clock)
    checked: list[str] = []
    declare = RabbitMQBackend._declare_claim_queue

    async def counted(
        self: RabbitMQBackend, channel: Any, queue: str, slot: Slot, view: _View, *, holds: str
    ) -> None:
        if holds == "refused":
            checked.append(slot.job)
        await declare(self, channel, queue, slot, view, holds=holds)

    monkeypatch.setattr(RabbitMQBackend, "_declare_claim_queue", counted)

    async def lose(job: str) -> None:
        slot = Slot(job, clock.now_ms() + next(_slots))
        assert await claim_as(winner, slot, "w") is True
        assert await claim_as(loser, slot, "l") is False

    for _ in range(3):
        await lose("often")
    await lose("seldom")
    assert checked == ["often", "seldom"]
    await clock.advance("59s")
    await lose("often")
    assert checked == ["often", "seldom"]
    await clock.advance("1s")
    await lose("often")
    await lose("often")
    assert checked == ["often", "seldom", "often"]


async def test_a_stray_in_a_queue_made_with_brokersched_s_own_arguments_passes_for_a_claim(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    """The limit the README states: a queue made beforehand with exactly brokersched's
    arguments, the fleet's slot memory included, cannot be told from one a claim made, and the
    message in it is taken for another instance's claim. Reading the message to tell would
    take it out of the queue for a moment, and a claim arriving then would win a second time."""
    backend = await fleet()
    slot = fresh_slot("mimic")
    await made_beforehand(raw, backend, slot, claim_arguments(60_000), stray=b"hello")
    assert await claim_as(backend, slot, "one") is False


class PreviousProtocol(RabbitMQBackend):
    """The claim step of brokersched before publish-first (25b8610): check the fence, declare
    the claim queue, then publish. A rolling deploy runs it beside the new one."""

    async def _claim_on(
        self,
        channel: aio_pika.abc.AbstractChannel,
        queue: str,
        slot: Slot,
        body: bytes,
        attempt: _ClaimAttempt,
        view: _View,
        *,
        acked: bool,
    ) -> bool:
        assert not acked  # only the new protocol's claims come back acked and stale
        from aio_pika.exceptions import (
            ChannelNotFoundEntity,
            ChannelPreconditionFailed,
            DeliveryError,
            PublishError,
        )

        from brokersched.backends.rabbitmq._claims import OtherMemory as _OtherMemory
        from brokersched.backends.rabbitmq._claims import StaleView as _StaleView

        message = aio_pika.Message(
            body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=slot.key
        )
        try:
            await channel.declare_exchange(view.fence, passive=True)
        except ChannelNotFoundEntity as exc:
            raise _StaleView from exc
        for _ in range(3):
            try:
                await channel.declare_queue(queue, durable=True, arguments=view.claim_arguments)
            except ChannelPreconditionFailed as exc:
                raise _OtherMemory(str(exc)) from exc
            attempt.unconfirmed = True
            try:
                await channel.default_exchange.publish(message, queue, mandatory=True)
            except PublishError:
                attempt.unconfirmed = False
                continue
            except DeliveryError:
                attempt.unconfirmed = False
                return False
            attempt.unconfirmed = False
            return True
        raise BackendError("vanished")


class TrackedPrevious(PreviousProtocol, TrackedBackend):
    pass


@pytest.fixture
async def mixed(
    make: Callable[..., RabbitMQBackend], amqp_url: str, prefix: str, touched: set[str]
) -> AsyncIterator[list[RabbitMQBackend]]:
    """Half the racers on the previous protocol, half on the new one, one fleet."""
    backends = [
        TrackedPrevious(amqp_url, touched=touched, prefix=prefix, slot_ttl="1m", channels=2)
        if n % 2
        else make(channels=2)
        for n in range(RACERS)
    ]
    await asyncio.gather(*(backend.start(CLOCK) for backend in backends))
    yield backends
    await asyncio.gather(*(backend.stop() for backend in backends))


async def test_a_rolling_deploy_from_declare_first_has_one_rightful_winner(
    mixed: list[RabbitMQBackend], raw: aio_pika.abc.AbstractConnection
) -> None:
    """Both protocols declare the same queue with the same arguments: they interoperate."""
    assert any(isinstance(backend, PreviousProtocol) for backend in mixed)
    for _ in range(10):
        slot = fresh_slot()
        mixed[0].touched.add(claim_queue_name(mixed[0].prefix, slot))  # type: ignore[attr-defined]
        outcomes, run_ids = await race(mixed, slot)
        await assert_one_rightful_winner(raw, mixed[0], slot, outcomes, run_ids)


async def test_a_burst_past_the_pool_skips_claims_that_never_reached_the_broker(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    """An overloaded claim is skipped before it publishes: the slot stays free for another
    instance, never won by a claim that was reported as skipped."""
    busy = await fleet(channels=1, claim_timeout="200ms")
    other = await fleet()
    slots = [fresh_slot("burst") for _ in range(60)]
    outcomes = await asyncio.gather(*(claim_as(busy, slot, "busy") for slot in slots))
    skipped = [
        slot
        for slot, outcome in zip(slots, outcomes, strict=True)
        if isinstance(outcome, BackendError) and "overloaded" in str(outcome)
    ]
    assert skipped, "the burst never overloaded one channel"
    for slot in skipped:
        assert await claim_as(other, slot, "other") is True


async def test_racers_raising_the_fleets_memory_mid_race_never_both_win(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    """Each round a new instance with a longer slot_ttl raises the fleet's memory (new fence,
    old one deleted) while the others claim, spread over the raise, under the old one. Claims
    may be skipped across the raise; a slot never has two winners, nor a winner not in it."""
    racers = list(await asyncio.gather(*(fleet(channels=2, slot_ttl="1m") for _ in range(8))))
    for minutes in range(2, 12):
        raiser = await fleet(slot_ttl=f"{minutes}m")
        slot = fresh_slot()
        run_ids = [uuid.uuid4().hex for _ in racers]

        async def spread(
            backend: RabbitMQBackend, run_id: str, slot: Slot = slot
        ) -> bool | BackendError:
            await asyncio.sleep(random.uniform(0, 0.03))
            return await claim_as(backend, slot, run_id)

        found = await asyncio.gather(raiser._memory.refresh(None), *map(spread, racers, run_ids))
        won = [run for outcome, run in zip(found[1:], run_ids, strict=True) if outcome is True]
        assert len(won) <= 1, f"{slot.key}: {len(won)} winners"
        held = await held_run_ids(raw, claim_queue_name(racers[0].prefix, slot))
        assert won == held or not won, (won, held)
        racers.append(raiser)
    assert racers[-1].fleet_slot_memory == timedelta(minutes=11)


async def test_an_outdated_instance_first_into_a_queue_of_the_new_memory_wins_it(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    """A rolling deploy raised the memory; an instance still on the old view publishes first
    into the empty queue a new-view claimer just made. Its claim is in a queue of the fleet's
    memory, as a claim under the new view would be: it wins (the raise costs no run) rather
    than leaving the slot to nobody."""
    outdated = await fleet(slot_ttl="1m")
    raiser = await fleet(slot_ttl="2m")
    await raiser._memory.refresh(None)  # the raise: the fence of 1m is gone
    slot = fresh_slot()
    queue = claim_queue_name(outdated.prefix, slot)
    channel = await raw.channel()
    await channel.declare_queue(queue, durable=True, arguments=claim_arguments(120_000))
    assert await claim_as(outdated, slot, "outdated") is True
    assert outdated.fleet_slot_memory == timedelta(minutes=2)
    assert await claim_as(raiser, slot, "raiser") is False
    assert await held_run_ids(raw, queue) == ["outdated"]


async def test_an_outdated_instance_first_into_a_queue_of_the_old_memory_fails_closed(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    """The same, into a queue made under the old memory: that claim cannot stand, and the
    queue holds it, so nobody wins."""
    outdated = await fleet(slot_ttl="1m")
    raiser = await fleet(slot_ttl="2m")
    await raiser._memory.refresh(None)
    slot = fresh_slot()
    queue = claim_queue_name(outdated.prefix, slot)
    channel = await raw.channel()
    await channel.declare_queue(queue, durable=True, arguments=claim_arguments(60_000))
    assert isinstance(await claim_as(outdated, slot, "outdated"), BackendError)
    assert await claim_as(raiser, slot, "raiser") is False
    assert await held_run_ids(raw, queue) == ["outdated"]


# -- history -------------------------------------------------------------------------------------


async def test_a_record_written_while_a_reader_holds_a_full_history_is_kept(
    fleet: Callable[..., Any],
) -> None:
    """A reader holds every record of a full history (unacked) while a run is recorded: the
    new record is not the one dropped, and readers racing around it each see a whole history."""
    writer, *readers = [await fleet() for _ in range(5)]
    policy = JobPolicy("hist", history_size=5)
    for n in range(5):
        await writer.record(policy, run_record("hist", SLOT + n, n))
    for n in range(5, 15):
        reads = await asyncio.gather(
            *(reader.history(policy, 10) for reader in readers),
            writer.record(policy, run_record("hist", SLOT + n, n)),
        )
        for read in reads[:-1]:
            assert read is not None
            newest = int(read[0].run_id.removeprefix("run-"))
            assert newest in (n - 1, n)
            assert [r.run_id for r in read] == [f"run-{k}" for k in range(newest, newest - 5, -1)]
    final = await readers[0].history(policy, 10)
    assert [r.run_id for r in final] == [f"run-{k}" for k in range(14, 9, -1)]


async def test_a_record_written_while_a_reader_holds_every_record_survives(
    fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    backend = await fleet()
    policy = JobPolicy("held", history_size=5)
    for n in range(5):
        await backend.record(policy, run_record("held", SLOT + n, n))
    channel = await raw.channel()
    await channel.set_qos(prefetch_count=5)
    queue = await channel.declare_queue(history_stream_name(backend.prefix), passive=True)
    taken: list[bytes] = []
    all_taken = asyncio.Event()

    async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        taken.append(message.body)
        if len(taken) == 5:
            all_taken.set()

    # a reader holding every record, unacked
    await queue.consume(take, arguments={"x-stream-offset": "first"})
    await asyncio.wait_for(all_taken.wait(), 5)
    await backend.record(policy, run_record("held", SLOT + 5, 5))
    await channel.close()  # the reader's records go back
    read = [r.run_id for r in await backend.history(policy, 10)]
    assert read == [f"run-{k}" for k in range(5, 0, -1)], read


# -- lost confirms --------------------------------------------------------------------------------


@pytest.mark.parametrize("queue_exists", [True, False], ids=["empty-queue", "no-queue"])
async def test_a_confirm_lost_on_either_path_never_makes_two_winners(
    amqp_url: str,
    fleet: Callable[..., Any],
    raw: aio_pika.abc.AbstractConnection,
    queue_exists: bool,
) -> None:
    """The link is cut at the claim's first confirm: into an empty queue (the claim is in it)
    or for a publish returned unrouted (nothing is). Either way the claim is ambiguous, and
    the slot is won once at most: by nobody, or by the next claimer when nothing was taken."""
    parts = urlsplit(amqp_url)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as proxy:
        direct = await fleet()
        cut_off = await fleet(via(amqp_url, proxy.port), channels=1)
        assert await claim_as(cut_off, fresh_slot("warm-up"), "warm") is True
        slot = fresh_slot()
        queue = claim_queue_name(direct.prefix, slot)
        if queue_exists:
            channel = await raw.channel()
            await channel.declare_queue(queue, durable=True, arguments=claim_arguments(60_000))
        proxy.cut_when_downstream(AckSpotter(nth=1))
        outcome = await claim_as(cut_off, slot, "cut")
        assert isinstance(outcome, BackendError)
        assert "ambiguous" in str(outcome)
        assert await claim_as(direct, slot, "direct") is (not queue_exists)
        assert await held_run_ids(raw, queue) == (["cut"] if queue_exists else ["direct"])


async def test_a_claim_stalled_in_the_network_is_skipped_and_arrives_as_a_loss(
    amqp_url: str, fleet: Callable[..., Any], raw: aio_pika.abc.AbstractConnection
) -> None:
    """A partition (no reset) holds a claim's publish: the claim gives up at claim_timeout
    (ambiguous, skipped), another instance wins, and the held publish, delivered later, is
    refused by the queue: one winner."""
    async with StallProxy(urlsplit(amqp_url).port or 5672) as proxy:
        direct = await fleet()
        stalled = await fleet(via(amqp_url, proxy.port), channels=1, claim_timeout="300ms")
        assert await claim_as(stalled, fresh_slot("warm-up"), "warm") is True
        slot = fresh_slot()
        queue = claim_queue_name(direct.prefix, slot)
        channel = await raw.channel()
        await channel.declare_queue(queue, durable=True, arguments=claim_arguments(60_000))
        proxy.stall()
        outcome = await claim_as(stalled, slot, "stalled")
        assert isinstance(outcome, BackendError)
        assert "ambiguous" in str(outcome)
        assert await claim_as(direct, slot, "direct") is True
        proxy.resume()
        # a later claim through the same link comes after the held publish
        await until(resumed(stalled), timeout=5, what="claims through the link to resume")
        assert await held_run_ids(raw, queue) == ["direct"]

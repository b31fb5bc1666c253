"""One slot memory per Redis fleet: instances of one prefix with different ``slot_ttl`` (a
rolling deploy from 1s to 20s) never both win a slot, although each claim key lives as long as
its winner said. Real time is used only where Redis's expiry of a claim key is the point."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio

from brokersched import BackendError
from brokersched._clock import SystemClock
from brokersched.abc import Claim, JobPolicy, Slot
from brokersched.backends.redis import RedisBackend, claim_key
from brokersched.backends.redis._claims import slot_memory_key
from tests.support.names import unique
from tests.support.redis_helpers import delete_keys, redis_fleet
from tests.support.wait import until

CLOCK = SystemClock()
SHORT, LONG = "1s", "20s"
SKEW = "100ms"
EXPIRED_S = 2.5  # a key made under SHORT is gone by then (Redis's timer)
LOGGER = "brokersched.backends.redis"


@pytest.fixture
def prefix() -> str:
    return unique("f")


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Any]:
    connection = redis.asyncio.Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


@pytest.fixture
async def fleet(redis_url: str, prefix: str) -> AsyncIterator[Callable[..., Any]]:
    """``await fleet(slot_ttl)``: a started RedisBackend of this test's prefix."""
    # One host's clocks: a skew of 100 ms leaves room to claim under a 1 s memory
    async with redis_fleet(redis_url, prefix, max_clock_skew=SKEW) as start:
        yield lambda slot_ttl: start(slot_ttl=slot_ttl)


def now_slot(job: str = "job") -> Slot:
    return Slot(job, CLOCK.now_ms())


async def claim(backend: RedisBackend, slot: Slot) -> bool | BackendError:
    try:
        return await backend.claim(slot, instance_id="i", run_id="r", timeout=5.0)
    except BackendError as exc:
        return exc


@pytest.mark.parametrize("first", [SHORT, LONG])
async def test_a_slot_won_under_a_short_slot_ttl_is_never_won_again_by_a_longer_one(
    fleet: Callable[..., Any], first: str
) -> None:
    second = LONG if first == SHORT else SHORT
    backends = {first: await fleet(first), second: await fleet(second)}
    slot = now_slot()
    assert await claim(backends[SHORT], slot) is True
    await asyncio.sleep(EXPIRED_S)
    late = await claim(backends[LONG], slot)
    assert late is not True, "the slot was won twice"
    if first == LONG:  # the short instance claimed under the fleet's 20s from the start
        assert late is False


async def test_a_slot_claimed_before_the_raise_is_refused_late_not_won_again(
    fleet: Callable[..., Any],
) -> None:
    short = await fleet(SHORT)
    slot = now_slot()
    assert await claim(short, slot) is True  # under 1s: nobody knew better
    long = await fleet(LONG)  # raises the fleet's memory after the slot was claimed
    await asyncio.sleep(EXPIRED_S)
    late = await claim(long, slot)
    assert isinstance(late, BackendError), late
    assert "too late to claim safely" in str(late)
    assert "was 1s when it fell due (raised to 20s since)" in str(late)
    fresh = now_slot("other")  # a slot falling due after the raise is claimed normally
    assert [await claim(long, fresh), await claim(short, fresh)] == [True, False]


async def test_start_adopts_the_fleets_longer_memory_and_says_so(
    fleet: Callable[..., Any], client: Any, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    long = await fleet(LONG)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        short = await fleet(SHORT)
    assert short.fleet_slot_memory == long.fleet_slot_memory == long.slot_ttl
    assert short.capabilities.slot_memory == short.slot_ttl  # validation keeps its own
    message = caplog.records[-1].getMessage()
    assert "remembers claimed slots for 20s" in message and "slot_ttl 1s" in message
    assert f"DEL {prefix}:slot-memory" in message
    slot = now_slot()
    assert await claim(short, slot) is True
    assert 19_000 < await client.pttl(claim_key(prefix, slot)) <= 20_000


async def test_a_raise_is_seen_by_the_next_claim_which_extends_its_key(
    fleet: Callable[..., Any], client: Any, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    short = await fleet(SHORT)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        long = await fleet(LONG)
    message = caplog.records[-1].getMessage()
    assert "raised the slot memory of the fleet" in message and "from 1s to 20s" in message
    assert short.fleet_slot_memory == short.slot_ttl  # it has not looked since
    slot = now_slot()
    assert await claim(short, slot) is True  # made under 1s, then extended
    assert 19_000 < await client.pttl(claim_key(prefix, slot)) <= 20_000
    assert short.fleet_slot_memory == long.slot_ttl
    assert await claim(long, slot) is False


async def test_a_batch_claims_its_new_slot_under_a_raise_its_earlier_slot_predates(
    redis_url: str, prefix: str
) -> None:
    """One batch holds a slot this instance's last read of the record covers (it fell due
    before the instance started) and one falling due after another instance raised the
    fleet's memory: the batch reads the record for the new slot, whose claim then lives the
    raised memory, so a late claim once the old memory is over does not win it again. On one
    host (``max_clock_skew`` 0) the start's read covers every slot due before it."""
    async with redis_fleet(redis_url, prefix, max_clock_skew="0s") as start:
        await start(slot_ttl=SHORT)  # an older instance: the record is made
        earlier = now_slot("earlier")
        short = await start(slot_ttl=SHORT)  # its read covers ``earlier``
        long = await start(slot_ttl=LONG)  # raises the fleet's memory; short has not looked
        raised_by_ms = CLOCK.now_ms()
        await until(lambda: CLOCK.now_ms() > raised_by_ms, what="the next millisecond")
        fresh = now_slot("fresh")  # falls due after the raise
        claims = [Claim(slot, "r", JobPolicy(slot.job)) for slot in (earlier, fresh)]
        outcomes = await short.claim_many(claims, instance_id="i", timeout=5.0)
        assert outcomes[1] is True, outcomes
        await asyncio.sleep(EXPIRED_S)  # the point: Redis would expire a key made under SHORT
        assert await claim(long, fresh) is False, "the slot was won twice"


async def test_a_lost_record_is_made_again_by_the_next_claim(
    fleet: Callable[..., Any], client: Any, prefix: str
) -> None:
    long = await fleet(LONG)
    await client.delete(slot_memory_key(prefix))
    # A slot that fell due before the record was made again is not claimed: what memory its
    # first claim had is unknown, so it may have been forgotten already. A later one is.
    due = now_slot()
    refused = await claim(long, Slot(due.job, due.slot_ms - 100))
    assert isinstance(refused, BackendError)
    # Refused on the record read now, or on the one read at the start when this slot is no
    # later than that read on Redis's clock (which may run ahead of this host's under load).
    assert "record was made after the slot fell due" in str(refused)
    later = now_slot()
    assert await claim(long, Slot(later.job, later.slot_ms + 1000)) is True
    assert await client.hget(slot_memory_key(prefix), "memory_ms") == b"20000"


async def test_instances_starting_together_with_two_slot_ttls_never_both_win(
    redis_url: str, prefix: str
) -> None:
    """Six instances (three SHORT, three LONG, shuffled) start at the same moment and claim
    slots falling due every 25ms at their instant, while the others are still starting and
    raising the record. No slot is won twice; every slot falling due once all are up is won
    once; late claims once a SHORT key would have expired win nothing."""
    ttls = [SHORT, LONG] * 3
    random.shuffle(ttls)
    backends = [
        RedisBackend(redis_url, prefix=prefix, slot_ttl=ttl, max_clock_skew=SKEW) for ttl in ttls
    ]
    first = CLOCK.now_ms() + 100
    slots = [Slot("start", first + n * 25) for n in range(24)]
    barrier = asyncio.Barrier(len(backends))
    up: list[int] = []

    async def instance(backend: RedisBackend) -> dict[Slot, bool | BackendError]:
        await barrier.wait()
        await backend.start(CLOCK)
        outcomes: dict[Slot, bool | BackendError] = {}
        for slot in slots:
            await asyncio.sleep(max(0.0, (slot.slot_ms - CLOCK.now_ms()) / 1000))
            outcomes[slot] = await claim(backend, slot)
            if len(outcomes) == 1:  # up: started, and its slot_ttl is in the record
                up.append(CLOCK.now_ms())
        return outcomes

    try:
        rows = await asyncio.gather(*(instance(backend) for backend in backends))
        for slot in slots:
            outcomes = [row[slot] for row in rows]
            assert sum(outcome is True for outcome in outcomes) <= 1, (slot, outcomes)
            if slot.slot_ms > max(up) + 250:
                assert sum(outcome is True for outcome in outcomes) == 1, (slot, outcomes)
        await asyncio.sleep(EXPIRED_S)  # the point: Redis expires a SHORT claim key by itself
        for slot, *outcomes in zip(slots, *(row.values() for row in rows), strict=True):
            late = await asyncio.gather(*(claim(backend, slot) for backend in backends))
            # a slot won before is never won again; one that every claim failed closed on (a
            # loaded machine's claims can all come too late) may be won once, still within
            # the raised memory
            won_before = sum(outcome is True for outcome in outcomes)
            assert won_before + sum(outcome is True for outcome in late) <= 1, (outcomes, late)
            if won_before:
                assert sum(outcome is True for outcome in late) == 0, late
        assert {backend.fleet_slot_memory for backend in backends} == {
            backends[ttls.index(LONG)].slot_ttl
        }
    finally:
        for backend in backends:
            await backend.stop()
        await delete_keys(redis_url, prefix)

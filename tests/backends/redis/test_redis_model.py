"""The fleet simulator's model of a Redis server (``RedisModel``, under the real
``RedisBackend``) answers as the real server does: one seeded scenario of claims, boot claims,
batches, claims too late to make, records, history reads, the fleet's records and restarts
that raise the fleet's slot memory, run on both and compared call by call
(``tests/support/model_reality.py``)."""

from __future__ import annotations

from datetime import timedelta
from typing import cast

import pytest
import redis.asyncio

from brokersched.abc import Backend
from brokersched.backends.redis import RedisBackend
from brokersched.backends.redis._connection import RedisConnection
from brokersched.testing._sim_redis import RedisData, sim_redis
from tests.support.model_reality import (
    SEEDS,
    ModelClocks,
    RealClocks,
    Side,
    Transcript,
    assert_same,
    claim_program,
    run_claims,
)
from tests.support.names import unique
from tests.support.redis_helpers import delete_keys

MEMORIES = (60_000, 120_000, 60_000)  # the instances' slot_ttl: the second raises the first's
RECORD = "slot-memory"  # the fleet's slot memory record: <prefix>:slot-memory


async def evicted_keys(url: str) -> int:
    """The server's count of evicted keys (the eviction guard reads it with each claim)."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        return int((await client.info("stats"))["evicted_keys"])
    finally:
        await client.aclose()


async def on_server(url: str, prefix: str, program: list[tuple[object, ...]]) -> Transcript:
    clocks = RealClocks()

    def make(memory_ms: int) -> Backend:
        backend = RedisBackend(
            url, prefix=prefix, slot_ttl=timedelta(milliseconds=memory_ms), budget_interval=None
        )
        store(backend).store_time = clocks.now_ms()
        return backend

    def store(backend: Backend) -> RedisConnection:
        return cast(RedisConnection, cast(RedisBackend, backend)._redis)

    async def follow(now_ms: int) -> None:  # the scripts judge time on the store's clock
        for backend in side.backends:
            store(backend).store_time = now_ms

    async def forget() -> None:
        client = redis.asyncio.Redis.from_url(url)
        try:
            await client.delete(f"{prefix}:{RECORD}")
        finally:
            await client.aclose()

    clocks.on_advance = follow
    side = Side(clocks, make, forget)
    try:
        return await run_claims(side, program, MEMORIES)
    finally:
        await side.stop()
        await delete_keys(url, prefix)


async def on_model(prefix: str, program: list[tuple[object, ...]], evicted: int) -> Transcript:
    clocks = ModelClocks()
    data = RedisData(clocks.store)
    data.evicted = evicted

    def make(memory_ms: int) -> Backend:
        memory = timedelta(milliseconds=memory_ms)
        return sim_redis(clocks.store, data, slot_ttl=memory, prefix=prefix)[0]

    async def forget() -> None:
        data.keys.pop(f"{prefix}:{RECORD}", None)

    side = Side(clocks, make, forget)
    try:
        return await run_claims(side, program, MEMORIES)
    finally:
        await side.stop()


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_redis_model_answers_as_redis_does(redis_url: str, seed: int) -> None:
    prefix = unique("model")
    program = claim_program(seed, len(MEMORIES), MEMORIES, forget=True)
    real = await on_server(redis_url, prefix, program)
    model = await on_model(prefix, program, await evicted_keys(redis_url))
    assert_same(real, model, seed=seed, server="Redis")
    assert any(answer is True for _, answer in real.steps)  # slots were won
    assert any(answer is False for _, answer in real.steps)  # and lost

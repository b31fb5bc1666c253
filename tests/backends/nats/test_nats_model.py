"""The fleet simulator's models of NATS answer as the real server does: the KV bucket under
the real ``NATSLeaseBackend`` (made over ``BucketModel``: its rows over ``_SimTable``, its
history stream, the fleet's records) and the claims stream (``SimNATS``). One seeded scenario,
run on the server and on the model, compared call by call (``tests/support/model_reality.py``)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from brokersched.abc import Backend
from brokersched.backends.nats import NATSBackend, NATSLeaseBackend
from brokersched.testing._sim_nats import SimNATS, nats_bucket, sim_nats_lease
from tests.support.conformance import in_run
from tests.support.model_reality import (
    SEEDS,
    ModelClocks,
    RealClocks,
    Side,
    Transcript,
    assert_same,
    claim_program,
    lease_program,
    run_claims,
    run_leases,
)
from tests.support.names import unique
from tests.support.nats_helpers import delete_named_streams, delete_streams, lease_streams

# Against both NATS servers, 2.9 and the current one (tests/support/servers.py).
pytestmark = pytest.mark.nats_servers

INSTANCES = 2
TTL_MS = 10_000
MEMORIES = (60_000, 120_000, 60_000)  # the instances' slot_ttl: the second raises the window


async def leases_on_server(url: str, program: list[tuple[object, ...]]) -> Transcript:
    bucket = in_run(unique("model"))
    clocks = RealClocks()
    side: Side

    def make(ttl_ms: int) -> Backend:
        backend = NATSLeaseBackend(
            url, bucket=bucket, lease_ttl=timedelta(milliseconds=ttl_ms), budget_interval=None
        )
        backend.store_time = clocks.now_ms()  # the rows judge time on the store's clock
        return backend

    async def follow(now_ms: int) -> None:
        for backend in side.backends:
            assert isinstance(backend, NATSLeaseBackend)
            backend.store_time = now_ms

    clocks.on_advance = follow
    side = Side(clocks, make)
    try:
        return await run_leases(side, program, INSTANCES, TTL_MS)
    finally:
        await side.stop()
        await delete_named_streams(url, *lease_streams(bucket))


async def leases_on_model(program: list[tuple[object, ...]]) -> Transcript:
    clocks = ModelClocks()
    bucket = nats_bucket(clocks.store)
    names = iter(range(INSTANCES))

    def make(ttl_ms: int) -> Backend:
        ttl = timedelta(milliseconds=ttl_ms)
        backend, _ = sim_nats_lease(clocks.store, bucket, lease_ttl=ttl, instance=f"i{next(names)}")
        return backend

    side = Side(clocks, make)
    try:
        return await run_leases(side, program, INSTANCES, TTL_MS)
    finally:
        await side.stop()


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_kv_model_answers_as_nats_does(nats_url: str, seed: int) -> None:
    program = lease_program(seed, INSTANCES, TTL_MS)
    real = await leases_on_server(nats_url, program)
    model = await leases_on_model(program)
    assert_same(real, model, seed=seed, server="a NATS KV bucket")


async def claims_on_server(url: str, program: list[tuple[object, ...]]) -> Transcript:
    prefix = in_run(unique("model"))

    def make(memory_ms: int) -> Backend:
        memory = timedelta(milliseconds=memory_ms)
        return NATSBackend(url, prefix=prefix, slot_ttl=memory, budget_interval=None)

    side = Side(RealClocks(), make)
    try:
        return await run_claims(side, program, MEMORIES)
    finally:
        await side.stop()
        await delete_streams(url, prefix)


async def claims_on_model(program: list[tuple[object, ...]]) -> Transcript:
    clocks = ModelClocks()
    stream = SimNATS.stream(clocks.store)

    def make(memory_ms: int) -> Backend:
        return SimNATS(clocks.store, stream, slot_ttl=timedelta(milliseconds=memory_ms))

    side = Side(clocks, make)
    try:
        return await run_claims(side, program, MEMORIES)
    finally:
        await side.stop()


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_claims_model_answers_as_nats_does(nats_url: str, seed: int) -> None:
    program = claim_program(seed, len(MEMORIES), MEMORIES)
    real = await claims_on_server(nats_url, program)
    model = await claims_on_model(program)
    assert_same(real, model, seed=seed, server="the NATS claims stream")

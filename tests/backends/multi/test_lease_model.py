"""The fleet simulator's model of a lease store (``SimLeaseBackend``: the lease protocol on
the store's clock, behind its faults) answers as SQLite, PostgreSQL and Redis do: one seeded
scenario of claims, renewals, releases with their records, hand-overs, take-overs, lease
states, history reads and the fleet's records, the store's clock moved past leases, run on
each server and on the model and compared call by call (``tests/support/model_reality.py``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from brokersched.abc import Backend
from brokersched.backends.memory import MemoryStore
from brokersched.backends.redis import RedisLeaseBackend
from brokersched.testing._sim_lease import SimLeaseBackend
from tests.support.leases import VirtualClockSQLite, fleet_of
from tests.support.model_reality import (
    SEEDS,
    ModelClocks,
    RealClocks,
    Side,
    Transcript,
    assert_same,
    lease_program,
    run_leases,
)

INSTANCES = 2
TTL_MS = 10_000
KINDS = ("sqlite", "postgres", "redis")


async def on_model(program: list[tuple[object, ...]]) -> Transcript:
    clocks = ModelClocks()
    rows = MemoryStore()
    names = iter(range(INSTANCES))

    def make(ttl_ms: int) -> Backend:
        ttl = timedelta(milliseconds=ttl_ms)
        return SimLeaseBackend(clocks.store, rows, lease_ttl=ttl, instance=f"i{next(names)}")

    side = Side(clocks, make)
    try:
        return await run_leases(side, program, INSTANCES, TTL_MS)
    finally:
        await side.stop()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
async def test_the_lease_model_answers_as_the_store_does(
    kind: str, seed: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    program = lease_program(seed, INSTANCES, TTL_MS)
    async with fleet_of(kind, request, tmp_path) as fleet:
        clocks = RealClocks(fleet.set_store_time)

        def make(ttl_ms: int) -> Backend:
            backend = fleet.build(lease_ttl=timedelta(milliseconds=ttl_ms))
            if isinstance(backend, VirtualClockSQLite | RedisLeaseBackend):
                backend.store_time = clocks.now_ms()
            fleet.started.append(backend)  # stopped, and its store removed, by fleet_of
            return backend

        async def started() -> None:  # PostgreSQL's clock is its schema's, made at start
            await fleet.set_store_time(clocks.now_ms())

        side = Side(clocks, make, started=started)
        real = await run_leases(side, program, INSTANCES, TTL_MS)
    model = await on_model(program)
    assert_same(real, model, seed=seed, server=kind)

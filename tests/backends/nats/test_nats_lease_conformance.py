"""NATSLeaseBackend passes the public lease-backend conformance suite on the real NATS
servers (2.9 and the current one), and racing claimers on separate connections have exactly
one winner."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import pytest_asyncio

from brokersched import SystemClock
from brokersched.abc import JobPolicy, Lease, Slot
from brokersched.backends.nats import NATSLeaseBackend
from brokersched.testing.conformance import LeaseBackendSuite
from tests.support.conformance import StoreClockElapse, in_run
from tests.support.names import unique
from tests.support.nats_helpers import delete_named_streams, lease_streams

# Against both NATS servers, 2.9 and the current one (tests/support/servers.py).
pytestmark = pytest.mark.nats_servers


class TestNATSLeases(StoreClockElapse, LeaseBackendSuite[NATSLeaseBackend]):
    url = ""
    buckets: set[str]

    @pytest_asyncio.fixture(autouse=True)
    async def _server(self, nats_url: str) -> AsyncIterator[None]:
        """Remember the server for make_backend; remove the test's buckets afterwards."""
        self.url, self.buckets = nats_url, set()
        yield
        for bucket in self.buckets:
            await delete_named_streams(nats_url, *lease_streams(bucket))

    def make_backend(self, namespace: str, **options: Any) -> NATSLeaseBackend:
        bucket = in_run(namespace)
        self.buckets.add(bucket)
        return self.built(NATSLeaseBackend(self.url, bucket=bucket, **options))  # type: ignore[no-any-return]

    async def set_store_time(self, backends: Sequence[NATSLeaseBackend], now_ms: int) -> None:
        for backend in backends:
            backend.store_time = now_ms


@pytest.mark.asyncio
async def test_racing_claimers_on_their_own_connections_have_one_winner(nats_url: str) -> None:
    """Eight instances claim the same slots at the same moment, on the server's own clock:
    every slot has exactly one lease, and the others are refused."""
    bucket = unique("lease")
    backends = [NATSLeaseBackend(nats_url, bucket=bucket, lease_ttl="10s") for _ in range(8)]
    try:
        for backend in backends:
            await backend.start(SystemClock())
        now = time.time_ns() // 1_000_000
        for round_ in range(5):
            slot = Slot("race", now - 5000 + round_ * 1000)
            barrier = asyncio.Barrier(len(backends))

            async def claim(
                index: int, slot: Slot = slot, barrier: asyncio.Barrier = barrier
            ) -> Any:
                await barrier.wait()
                return await backends[index].acquire(
                    slot,
                    policy=JobPolicy("race", overlap="allow"),
                    instance_id=f"i{index}",
                    run_id=secrets.token_hex(4),
                    reason="schedule",
                    timeout=10.0,
                )

            answers = await asyncio.gather(*(claim(n) for n in range(len(backends))))
            leases = [answer for answer in answers if isinstance(answer, Lease)]
            assert len(leases) == 1, answers
            assert answers.count("not-acquired") == len(backends) - 1
        # The fence holds against every instance after the race.
        late = await backends[0].acquire(
            Slot("race", now - 5000),
            policy=JobPolicy("race"),
            instance_id="late",
            run_id="late",
            reason="schedule",
            timeout=5.0,
        )
        assert late == "not-acquired"
    finally:
        for backend in backends:
            await backend.stop()
        await delete_named_streams(nats_url, *lease_streams(bucket))

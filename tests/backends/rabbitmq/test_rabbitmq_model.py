"""The fleet simulator's model of RabbitMQ's claims (``SimRabbitMQ``: a queue per slot, the
fleet's slot memory record, the claim deadlines) answers as the real broker does: one seeded
scenario, run on the broker and on the model, compared call by call
(``tests/support/model_reality.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from brokersched.abc import Backend, Claim, Slot
from brokersched.backends.rabbitmq._names import claim_queue_name
from brokersched.testing._sim_rabbitmq import SimRabbitMQ
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
from tests.support.rabbitmq_helpers import TrackedBackend, delete_queues

MEMORIES = (60_000, 120_000, 60_000)  # the instances' slot_ttl: the second raises the first's


class _Tracked(TrackedBackend):
    """Notes the queues of batched and boot claims too."""

    async def claim_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[bool | Exception]:
        self.touched.update(claim_queue_name(self.prefix, claim.slot) for claim in claims)
        return await super().claim_many(claims, instance_id=instance_id, timeout=timeout)

    async def claim_boot(self, slot: Slot, **options: Any) -> bool:
        self.touched.add(claim_queue_name(self.prefix, slot))
        return await super().claim_boot(slot, **options)


async def on_broker(url: str, prefix: str, program: list[tuple[object, ...]]) -> Transcript:
    touched: set[str] = set()

    def make(memory_ms: int) -> Backend:
        memory = timedelta(milliseconds=memory_ms)
        return _Tracked(
            url, prefix=prefix, slot_ttl=memory, declare_ahead=False, budget_interval=None,
            touched=touched,
        )  # fmt: skip

    side = Side(RealClocks(), make)
    try:
        return await run_claims(side, program, MEMORIES)
    finally:
        await side.stop()
        await delete_queues(url, touched)


async def on_model(program: list[tuple[object, ...]]) -> Transcript:
    clocks = ModelClocks()
    broker = SimRabbitMQ.broker(clocks.store)

    def make(memory_ms: int) -> Backend:
        memory = timedelta(milliseconds=memory_ms)
        return SimRabbitMQ(clocks.store, broker, slot_ttl=memory, declare_ahead=False)

    side = Side(clocks, make)
    try:
        return await run_claims(side, program, MEMORIES)
    finally:
        await side.stop()


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_rabbitmq_model_answers_as_rabbitmq_does(
    amqp_url: str, prefix: str, seed: int
) -> None:
    program = claim_program(seed, len(MEMORIES), MEMORIES)
    real = await on_broker(amqp_url, prefix, program)
    model = await on_model(program)
    assert_same(real, model, seed=seed, server="RabbitMQ")

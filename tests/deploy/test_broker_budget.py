"""A broker near its file-handle budget: on the tests' own RabbitMQ node
(soft open-files limit 1024, so (1024 - 97) / 3 = 309 quorum queues hang it), quorum queues
made by someone else bring it to 80 % of that; the backend, reading the budget through the
management API, sheds (declares no new claim queue: its slots are skipped, never run twice)
while the broker keeps answering, and claims again once the queues are gone. Between 60 % and
80 % it only stops declaring claim queues ahead. Real time: about half a minute, the node's
boot aside."""

from __future__ import annotations

import asyncio
import math

import aio_pika
import pytest

from brokersched import RabbitMQBackend, Scheduler
from brokersched._clock import SystemClock
from brokersched._events import Event, SkipEvent, StartEvent
from brokersched.abc import Slot
from brokersched.backends.rabbitmq import claim_queue_name
from brokersched.backends.rabbitmq._budget import SHED, WARN
from brokersched.backends.rabbitmq._ops import Management, quorum_budget
from tests.support.names import unique
from tests.support.private_rabbitmq import PrivateRabbitMQ
from tests.support.rabbitmq_helpers import delete_queues, queue_exists
from tests.support.wait import until

QUORUM = {"x-queue-type": "quorum"}


@pytest.mark.timeout(360)  # the node boots in the first test that asks for it
async def test_a_broker_near_its_budget_is_shed_and_claims_resume_below_it(
    private_rabbitmq: PrivateRabbitMQ,
) -> None:
    node = private_rabbitmq
    management = Management(node.management_url, "/")
    [info] = await management.get("nodes")
    quorum = [q for q in await management.get("queues?columns=type") if q["type"] == "quorum"]
    fillers = [unique("fill") for _ in range(math.ceil(SHED * quorum_budget(info["fd_total"])))]
    fillers = fillers[len(quorum) :]
    backend = RabbitMQBackend(
        node.amqp_url,
        prefix=unique("budget"),
        slot_ttl="1m",
        management_url=node.management_url,
        budget_interval="300ms",
    )
    scheduler = Scheduler(backend, jitter=0, max_late="5s")
    starts: list[int] = []
    shed: list[str] = []

    def started(event: Event) -> None:
        assert isinstance(event, StartEvent)
        starts.append(event.slot_ms)

    def skipped(event: Event) -> None:
        assert isinstance(event, SkipEvent)
        if event.reason == "backend-error" and "shedding" in (event.detail or ""):
            shed.append(event.detail or "")

    scheduler.every("tick", "1s", lambda ctx: None)
    scheduler.on("start", started)
    scheduler.on("skip", skipped)
    other = await aio_pika.connect(node.amqp_url)  # another application of the broker
    try:
        channel = await other.channel()
        async with scheduler:
            await until(lambda: starts, timeout=15, what="a first run")
            assert backend.budget is not None and backend.budget.state == "ok"
            for name in fillers:
                await channel.declare_queue(
                    name, durable=True, arguments={"x-queue-type": "quorum"}
                )
            await until(lambda: backend.budget and backend.budget.state == "shed", what="shedding")
            await until(lambda: len(shed) >= 2, what="two slots shed")
            assert "claim queue" in shed[0] and "quorum queues" in shed[0]
            # the broker answers every client meanwhile
            probe = await asyncio.wait_for(aio_pika.connect(node.amqp_url), 5)
            await probe.close()
            for name in fillers:
                await channel.queue_delete(name)
            await until(lambda: backend.budget and backend.budget.state == "ok", what="ok again")
            runs = len(starts)
            await until(lambda: len(starts) > runs, timeout=10, what="claims again")
        assert len(starts) == len(set(starts))  # no slot twice
    finally:
        async with asyncio.timeout(60):
            channel = await other.channel()
            for name in fillers:
                await channel.queue_delete(name)
            await other.close()


@pytest.mark.timeout(360)  # the node boots in the first test that asks for it
async def test_a_broker_at_its_warning_level_gets_no_claim_queue_ahead_and_claims_go_on(
    private_rabbitmq: PrivateRabbitMQ,
) -> None:
    """Quorum queues made by someone else bring the broker to 70 % of its budget: the winner of
    a slot no longer declares the claim queue of the next one ahead (each queue is made by its
    own claim), and the claims go on. Under 60 % again, queues are declared ahead again."""
    node = private_rabbitmq
    management = Management(node.management_url, "/")
    [info] = await management.get("nodes")
    quorum = [q for q in await management.get("queues?columns=type") if q["type"] == "quorum"]
    level = (WARN + SHED) / 2
    fillers = [unique("fill") for _ in range(math.ceil(level * quorum_budget(info["fd_total"])))]
    fillers = fillers[len(quorum) :]
    prefix, clock = unique("ahead"), SystemClock()
    backend = RabbitMQBackend(
        node.amqp_url,
        prefix=prefix,
        slot_ttl="1m",
        management_url=node.management_url,
        budget_interval="300ms",
    )

    def next_slot() -> Slot:  # due within the 750 ms that claim queues are declared ahead
        return Slot("tick", clock.now_ms() + 500)

    slots: list[Slot] = []
    raw = await aio_pika.connect(node.amqp_url)
    await backend.start(clock)
    try:
        assert backend.budget is not None and backend.budget.state == "ok"
        slots.append(at_ease := next_slot())
        await backend.prepare_claims([at_ease])
        assert await queue_exists(raw, claim_queue_name(prefix, at_ease))
        channel = await raw.channel()
        for name in fillers:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        await until(lambda: backend.budget and backend.budget.state == "warn", what="warning")
        slots.append(warned := next_slot())
        await backend.prepare_claims([warned])
        assert not await queue_exists(raw, claim_queue_name(prefix, warned)), (
            "a claim queue was declared ahead at the warning level"
        )
        await asyncio.sleep(max(0, warned.slot_ms - clock.now_ms()) / 1000)
        assert await backend.claim(warned, instance_id="i", run_id="r", timeout=5) is True
        for name in fillers:
            await channel.queue_delete(name)
        await until(lambda: backend.budget and backend.budget.state == "ok", what="ok again")
        slots.append(again := next_slot())
        await backend.prepare_claims([again])
        assert await queue_exists(raw, claim_queue_name(prefix, again))
    finally:
        await backend.stop()
        await raw.close()
        async with asyncio.timeout(60):
            names = [claim_queue_name(prefix, slot) for slot in slots]
            await delete_queues(node.amqp_url, [*fillers, *names])

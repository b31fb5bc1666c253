"""The broker's budget and ``doctor`` by the node's version, on a real node of the run's line
(``RABBITMQ_SERVER``: a private 3.10 node, or a private RabbitMQ 4.0 node from
scripts/rabbitmq4.sh's root), each with a soft open-files limit of 1024 and the management
plugin, so that neither the shared broker nor its limit is touched:

- idle quorum queues: on 3.x they hold the file-handle budget ((1024 - 97) / 3 = 309), so 260
  shed; on 4.x they hold no file, so the same 260 read ``ok``;
- live claim queues, made by the claims of an instance of the fleet: on 4.x each holds an open
  file (the count read is checked against the node process's own, in /proc), so 780 of them
  shed, and the watching instance skips the next new slot while its claims into existing
  queues go on; on 3.x the handle cache closes them, so they read ``ok``;
- ``doctor`` names the open-files limit that 40 one-second jobs with a 5-minute ``slot_ttl``
  need on that version: an error at 1024 on 4.x, none on 3.x.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import AsyncIterator

import aio_pika
import pytest

from brokersched import RabbitMQBackend
from brokersched._clock import SystemClock
from brokersched._exceptions import BackendError
from brokersched.abc import Slot
from brokersched.backends.rabbitmq import claim_queue_name
from brokersched.backends.rabbitmq._budget import SHED
from brokersched.backends.rabbitmq._files import NODE_FILES_4, major_version, quorum_budget
from brokersched.backends.rabbitmq._ops import Management
from tests.support.names import unique
from tests.support.private_rabbitmq import PrivateRabbitMQ
from tests.support.rabbitmq_helpers import SLOT, claim, delete_queues, fleet_queues
from tests.support.wait import until

# a private node boots in the first test that asks for it: up to 120 s on a loaded machine
pytestmark = pytest.mark.timeout(420)

QUORUM_QUEUES = 260  # 84 % of what 1024 files hold on 3.x, nothing on 4.x
CLAIM_QUEUES = 780  # 80 % of 1024 files on 4.x with the node's own and a few connections


async def version_of(node: PrivateRabbitMQ) -> int:
    [info] = await Management(node.management_url, "/").get("nodes")
    assert info["fd_total"] == 1024
    [rabbit] = [app for app in info["applications"] if app["name"] == "rabbit"]
    major = major_version(rabbit["version"])
    assert major is not None
    return major


@pytest.fixture
async def node(private_rabbitmq_of_run: PrivateRabbitMQ) -> PrivateRabbitMQ:
    return private_rabbitmq_of_run


@pytest.fixture
async def backend(node: PrivateRabbitMQ) -> AsyncIterator[RabbitMQBackend]:
    made = RabbitMQBackend(
        node.amqp_url,
        prefix=unique("budget"),
        slot_ttl="1m",
        management_url=node.management_url,
        budget_interval="300ms",
        channels=16,
    )
    await made.start(SystemClock())
    try:
        yield made
    finally:
        await made.stop()
        await delete_queues(node.amqp_url, fleet_queues(made.prefix))


async def test_idle_quorum_queues_shed_on_3x_and_cost_nothing_on_4x(
    node: PrivateRabbitMQ, backend: RabbitMQBackend
) -> None:
    major = await version_of(node)
    assert QUORUM_QUEUES / quorum_budget(1024) >= SHED  # what the 3.x rule sheds
    fillers = [unique("quorum") for _ in range(QUORUM_QUEUES)]
    connection = await aio_pika.connect(node.amqp_url)
    try:
        channel = await connection.channel()
        for name in fillers:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        await asyncio.sleep(1)  # a few readings (budget_interval 300 ms)
        await until(lambda: backend.budget is not None, what="a reading")
        budget = backend.budget
        assert budget is not None
        if major >= 4:
            assert budget.state == "ok", budget.detail
            assert budget.used < 0.2, budget.detail
            assert "RabbitMQ 4." in budget.detail and "quorum" not in budget.detail
            assert await claim(backend, Slot("after", SLOT)) is True  # nothing is shed
            await delete_queues(
                node.amqp_url, [claim_queue_name(backend.prefix, Slot("after", SLOT))]
            )
        else:
            await until(lambda: backend.budget and backend.budget.state == "shed", what="shed")
            assert f"{QUORUM_QUEUES} quorum queues of the 309" in backend.budget.detail  # type: ignore[union-attr]
    finally:
        async with asyncio.timeout(120):
            channel = await connection.channel()
            for name in fillers:
                await channel.queue_delete(name)
            await connection.close()


def holding(backend: RabbitMQBackend) -> int:
    """How many classic queues holding a persistent message the budget's last reading saw."""
    detail = backend.budget.detail if backend.budget is not None else ""
    found = re.search(r"(\d+) classic queues holding a persistent message", detail or "")
    return int(found[1]) if found else 0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_live_claim_queues_count_against_the_open_files_limit_on_4x_only(
    node: PrivateRabbitMQ, backend: RabbitMQBackend
) -> None:
    major = await version_of(node)
    slots = [Slot("live", SLOT + 1000 * n) for n in range(CLAIM_QUEUES)]
    queues = [claim_queue_name(backend.prefix, slot) for slot in slots]
    before = open_files(node.beam_pid)
    # another instance of the fleet makes them, one that does not watch the budget (the
    # watched one would shed its own last claims of the batch)
    maker = RabbitMQBackend(node.amqp_url, prefix=backend.prefix, slot_ttl="1m", channels=16)
    await maker.start(SystemClock())
    try:
        for start in range(0, len(slots), 16):
            won = await asyncio.gather(*(claim(maker, slot) for slot in slots[start : start + 16]))
            assert all(won)
        await maker.stop()
        held = open_files(node.beam_pid) - before
        if major >= 4:
            # each live claim queue holds a file of the node process
            assert held >= CLAIM_QUEUES * 0.95, held
            # Shed once the share reaches its threshold, maybe before management's statistics
            # (refreshed every few seconds) show every queue: wait for a reading that does.
            await until(
                lambda: holding(backend) >= CLAIM_QUEUES, timeout=30, what="every queue counted"
            )
            assert backend.budget is not None and backend.budget.state == "shed"
            detail = backend.budget.detail
            # the claim queues, and the backend's record and presence queues
            assert CLAIM_QUEUES <= holding(backend) <= CLAIM_QUEUES + 5, detail
            counted = int(detail.split(": ", 1)[1].split(" of its")[0])
            # what the watch counts is at least what the process holds (a little margin over)
            real = open_files(node.beam_pid)
            assert real <= counted <= real + NODE_FILES_4, (real, detail)
            with pytest.raises(BackendError, match="shedding"):
                await claim(backend, Slot("live", SLOT + 1000 * CLAIM_QUEUES))
            assert await claim(backend, slots[0]) is False  # a queue that exists: claims go on
        else:
            # the handle cache closes them: no file held for long, nothing shed
            await asyncio.sleep(1)
            assert backend.budget is not None and backend.budget.state == "ok", backend.budget
            assert await claim(backend, Slot("live", SLOT + 1000 * CLAIM_QUEUES)) is True
            queues.append(
                claim_queue_name(backend.prefix, Slot("live", SLOT + 1000 * CLAIM_QUEUES))
            )
    finally:
        await maker.stop()
        async with asyncio.timeout(120):
            await delete_queues(node.amqp_url, queues)
    if major >= 4:  # the files are given back, and so is the budget
        await until(lambda: backend.budget and backend.budget.state == "ok", timeout=30, what="ok")


async def test_doctor_names_the_open_files_limit_the_jobs_need(
    node: PrivateRabbitMQ, backend: RabbitMQBackend
) -> None:
    """40 one-second jobs, slot_ttl 5 minutes: 40 x 300 + 40 claim queues live at once."""
    major = await version_of(node)
    doctor = RabbitMQBackend(
        node.amqp_url,
        prefix=backend.prefix,
        slot_ttl="5m",
        management_url=node.management_url,
    )
    slots = [Slot(f"job.{j}", SLOT + 1000 * n) for j in range(40) for n in range(300)]
    findings = {finding.check: finding for finding in await doctor.doctor(slots=slots)}
    need = findings["open-files limit needed"]
    assert "40 claimed job(s) keep up to 12040 claim queues alive" in need.found
    if major >= 4:
        assert need.severity == "error", need
        files = int(need.found.split("holds about ")[1].split()[0])
        assert files >= 12_040 + NODE_FILES_4
        assert f"at least {math.ceil(files / 0.8 / 1024) * 1024} is needed" in need.found
        assert "lowest limit of the cluster is 1024" in need.consequence
    else:
        assert need.severity == "ok", need
        assert "claim queues hold no file the node cannot close" in need.found

"""A cancelled ``start()`` stays cancelled and leaves nothing running (RabbitMQ, NATS JetStream).

Against the real servers, ``start()`` is cancelled at every turn of the event loop from its first
until the turn at which it would have finished by itself, then after small real delays (points
that depend on the network). After each cancellation:

(a) ``CancelledError`` comes out of ``start()``: on Python 3.11 nats-py's ``asyncio.wait_for``
    could swallow it and ``start()`` carried on connected (CPython gh-86296);
(b) no task started since is left pending once the loop has turned a few times: aio-pika's
    reconnection loop, aiormq's reader, writer and heartbeat, nats-py's reader, pinger and
    flusher (a cancelled ``aio_pika.connect_robust`` used to leave all of the former running,
    reconnecting for ever);
(c) a fresh backend of the same fleet starts and wins a claim (nothing half-made on the server
    blocks it, e.g. RabbitMQ's slot-memory lock held by a connection nobody closed).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from brokersched._clock import SystemClock
from brokersched.abc import ClaimBackend, Slot
from brokersched.backends.nats import NATSBackend
from brokersched.backends.rabbitmq import RabbitMQBackend, claim_queue_name
from tests.support.names import unique
from tests.support.nats_helpers import delete_streams
from tests.support.rabbitmq_helpers import delete_queues, fleet_queues

CLOCK = SystemClock()
SLOT = 4_102_444_800_000  # 2100-01-01T00:00:00Z: never older than a slot memory
MAX_TURNS = 3000  # a start takes a few hundred turns; a bound, in case it never finishes
EVERY_TURN_UNTIL = 200  # cancel at each of the first turns, then at every STRIDE-th one
STRIDE = 8
DELAYS_S = [i * 0.0004 for i in range(40)]  # 0 to 16 ms: connect and preparation on localhost
SETTLE_TURNS = 20  # turns given to tasks that end by themselves after a close


@dataclass
class Fleet:
    """Backends of one prefix on one server, and what the test left there to delete."""

    kind: str
    url: str
    prefix: str = field(default_factory=lambda: unique("t"))
    slots: list[Slot] = field(default_factory=list)

    def make(self) -> ClaimBackend:
        if self.kind == "rabbitmq":
            return RabbitMQBackend(self.url, prefix=self.prefix, slot_ttl="1m")
        return NATSBackend(self.url, prefix=self.prefix, slot_ttl="1m")

    def next_slot(self) -> Slot:
        self.slots.append(Slot("cancel-probe", SLOT + len(self.slots)))
        return self.slots[-1]

    async def clean_up(self) -> None:
        if self.kind == "nats":
            await delete_streams(self.url, self.prefix)
            return
        claims = [claim_queue_name(self.prefix, slot) for slot in self.slots]
        await delete_queues(self.url, [*fleet_queues(self.prefix), *claims])


@pytest.fixture(params=["rabbitmq", "nats"])
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    url = request.getfixturevalue("amqp_url" if request.param == "rabbitmq" else "nats_url")
    made = Fleet(request.param, url)
    yield made
    await made.clean_up()


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the loop's exception handler ("Task was destroyed but it is pending",
    "exception was never retrieved"...), checked by each test after a garbage collection."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    loop.set_exception_handler(previous)


def _started_since(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t not in before and t is not current]


async def _left_pending(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """The tasks started since ``before`` still pending after at most SETTLE_TURNS turns."""
    for _ in range(SETTLE_TURNS):
        if not _started_since(before):
            break
        await asyncio.sleep(0)
    return _started_since(before)


def _describe(tasks: Iterable[asyncio.Task[Any]]) -> list[str]:
    return sorted(getattr(t.get_coro(), "__qualname__", repr(t)) for t in tasks)


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _cancel_start(fleet: Fleet, wait: Callable[[], Awaitable[None]]) -> bool:
    """Start a backend, ``wait``, cancel the start and check (a) and (b); then (c).

    False when the start finished during ``wait`` (the backend is stopped again).
    """
    backend = fleet.make()
    before = set(asyncio.all_tasks())
    starting = asyncio.create_task(backend.start(CLOCK))
    await wait()
    if starting.done():
        await starting  # a failed start is the test's failure, not a finished sweep
        await backend.stop()
        return False
    starting.cancel()
    try:
        await starting
    except asyncio.CancelledError:
        pass
    else:
        await backend.stop()
        pytest.fail(f"{fleet.kind}: start() swallowed its cancellation and connected")
    left = await _left_pending(before)
    assert not left, f"{fleet.kind}: a cancelled start() left tasks running: {_describe(left)}"
    await _fresh_backend_claims(fleet)
    return True


async def _fresh_backend_claims(fleet: Fleet) -> None:
    backend = fleet.make()
    async with asyncio.timeout(10):
        await backend.start(CLOCK)
        try:
            won = await backend.claim(
                fleet.next_slot(), instance_id="fresh", run_id=uuid.uuid4().hex, timeout=5.0
            )
        finally:
            await backend.stop()
    assert won, f"{fleet.kind}: a fresh backend lost a slot nobody had claimed"


def _no_loop_errors(seen: list[dict[str, Any]]) -> None:
    gc.collect()  # a task dropped while pending is reported when it is collected
    assert not seen, [context.get("message") for context in seen]


async def test_a_start_cancelled_at_any_turn_of_the_loop_leaves_nothing(
    fleet: Fleet, loop_errors: list[dict[str, Any]]
) -> None:
    turns = itertools.chain(range(EVERY_TURN_UNTIL), range(EVERY_TURN_UNTIL, MAX_TURNS, STRIDE))
    cancelled = 0
    for n in turns:
        if not await _cancel_start(fleet, functools.partial(_turns, n)):
            break
        cancelled += 1
    else:
        pytest.fail(f"{fleet.kind}: start() still running after {MAX_TURNS} turns of the loop")
    assert cancelled >= 10, f"{fleet.kind}: start() finished after {cancelled} turns"
    _no_loop_errors(loop_errors)


async def test_a_start_cancelled_after_a_short_delay_leaves_nothing(
    fleet: Fleet, loop_errors: list[dict[str, Any]]
) -> None:
    for delay in DELAYS_S:
        await _cancel_start(fleet, functools.partial(asyncio.sleep, delay))
    _no_loop_errors(loop_errors)


async def test_a_start_under_an_outer_timeout_times_out_and_leaves_nothing(fleet: Fleet) -> None:
    """What ``asyncio.wait_for(scheduler.start(), 0.01)`` does to the backend's start."""
    for seconds in (0.001, 0.003, 0.006):
        backend = fleet.make()
        before = set(asyncio.all_tasks())
        try:
            async with asyncio.timeout(seconds):
                await backend.start(CLOCK)
        except TimeoutError:
            pass
        else:
            await backend.stop()  # fast enough to start within the timeout: nothing to check
            continue
        assert not await _left_pending(before), fleet.kind
    await _fresh_backend_claims(fleet)

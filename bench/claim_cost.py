"""What one claim costs the RabbitMQ broker, by the shape of the claim: broker CPU per claim.

    .venv/bin/python bench/claim_cost.py [--node 3.10,4.0] [--url URL] [--claims 2000]
                                         [--channels 8] [--repeat 2]

Each variant makes ``--claims`` claims of fresh slots at the protocol level (no
``RabbitMQBackend``: the operations themselves), ``--channels`` in flight on one connection,
and reads the broker's CPU (its Erlang VM's utime + stime in ``/proc/<pid>/stat``) before and
after; the broker's idle CPU over the same time (management's statistics, measured first) is
taken off. The queues are deleted outside the measured window (but for ``expiry``, which
measures it). Variants:

* ``durable+persistent``: the claim as made today: declare a durable classic queue
  (``x-max-length=1``, ``x-overflow=reject-publish``, ``x-expires``), publish one persistent
  message with ``mandatory=True``, wait for the publisher confirm;
* ``durable+transient msg``: the same with a transient message (``delivery_mode=1``);
* ``transient queue``: a transient (non-durable, non-exclusive) queue and message: a deprecated
  feature that RabbitMQ 4.3 denies by default (said when the broker denies it);
* ``no x-expires``: the queue without ``x-expires`` (deleted by hand: what expiry saves);
* ``x-queue-version=2``: the queue as CQv2 (3.x's default is v1; 4.x has only v2);
* ``lost (publish, nack)``: a second claim of each slot of the first variant: one publish
  refused by the full queue (``reject-publish``), nothing declared;
* ``ahead x50, nowait``: the queues declared ahead 50 at a time with ``nowait`` (no reply
  awaited, as a batch declared ahead would be), then the claims published into them;
* ``expiry``: the CPU of the broker expiring the queues of the first variant, made again with
  ``x-expires`` 15 s, over the window in which they expire (the cost a claim leaves for later;
  it includes management's statistics of the live queues until they are gone).

``--node 3.10`` starts a private node from this machine's rabbitmq-server package, ``--node 4.0``
one from scripts/rabbitmq4.sh's Debian 13 root (as root), each with 16,384 open files, the
management plugin and nothing else on it, and stops it at the end; ``--url`` measures a node
already running here instead (its process found by the URL's port; other clients of it add to
its CPU). Prints a table; asserts nothing. Needs Linux and, for a private node, root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection
from pamqp.common import FieldTable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.beam import cpu_seconds, serving_pid, url_port  # noqa: E402

RUN = f"cost{uuid.uuid4().hex[:6]}"
CLAIM: FieldTable = {
    "x-queue-type": "classic",
    "x-max-length": 1,
    "x-overflow": "reject-publish",
    "x-expires": 600_000,
}
EXPIRES_S = 15.0  # longer than the claims take: none expires before the window
NOFILE = 16_384
IDLE_S = 5.0


class Denied(Exception):
    """The broker denies what the variant needs (a deprecated feature)."""


class Broker:
    """One connection and its confirm channels to the measured node."""

    def __init__(self, url: str, pid: int, channels: int) -> None:
        self.url, self.pid, self.width = url, pid, channels
        self.connection: AbstractConnection | None = None
        self.channels: list[AbstractChannel] = []
        self.idle_per_s = 0.0

    async def open(self) -> None:
        self.connection = await aio_pika.connect(self.url)
        self.channels = [
            await self.connection.channel(publisher_confirms=True) for _ in range(self.width)
        ]

    async def reopen(self) -> None:
        """After the broker closed the connection (a denied feature closes all of it)."""
        with contextlib.suppress(Exception):
            if self.connection is not None:
                await self.connection.close()
        await self.open()

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()

    async def striped(
        self, names: list[str], op: Callable[[AbstractChannel, str], Awaitable[None]]
    ) -> None:
        """``op(channel, name)`` for every name, one channel per stripe, stripes at once."""

        async def stripe(channel: AbstractChannel, part: list[str]) -> None:
            for name in part:
                await op(channel, name)

        width = len(self.channels)
        await asyncio.gather(*(stripe(ch, names[i::width]) for i, ch in enumerate(self.channels)))

    async def measure(self, run: Callable[[], Awaitable[None]]) -> tuple[float, float]:
        """(broker CPU seconds over ``run`` less the idle rate, wall seconds)."""
        cpu, wall = cpu_seconds(self.pid), time.monotonic()
        await run()
        wall = time.monotonic() - wall
        return max(0.0, cpu_seconds(self.pid) - cpu - self.idle_per_s * wall), wall

    async def measure_idle(self) -> None:
        cpu, wall = cpu_seconds(self.pid), time.monotonic()
        await asyncio.sleep(IDLE_S)
        self.idle_per_s = (cpu_seconds(self.pid) - cpu) / (time.monotonic() - wall)

    async def delete(self, names: list[str]) -> None:
        async def drop(channel: AbstractChannel, name: str) -> None:
            await channel.queue_delete(name)

        await self.striped(names, drop)


def message(persistent: bool) -> aio_pika.Message:
    return aio_pika.Message(b"{}", delivery_mode=2 if persistent else 1)


async def publish(channel: AbstractChannel, name: str, persistent: bool = True) -> bool:
    """A claim's publish: acked (won) or nacked (lost)."""
    try:
        await channel.default_exchange.publish(
            message(persistent), routing_key=name, mandatory=True
        )
    except aio_pika.exceptions.DeliveryError:
        return False
    return True


def claim(
    *, durable: bool = True, persistent: bool = True, arguments: FieldTable = CLAIM
) -> Callable[[AbstractChannel, str], Awaitable[None]]:
    async def op(channel: AbstractChannel, name: str) -> None:
        await channel.declare_queue(name, durable=durable, arguments=arguments)
        assert await publish(channel, name, persistent), f"{name}: a fresh claim lost"

    return op


async def lose(channel: AbstractChannel, name: str) -> None:
    assert not await publish(channel, name), f"{name}: a second claim won"


def names(variant: str, count: int) -> list[str]:
    tag = variant.split()[0].replace("+", "-").replace("=", "")
    return [f"{RUN}.claim.{tag}.{n}" for n in range(count)]


async def variant_rows(broker: Broker, count: int) -> list[tuple[str, float, float]]:
    """Each variant: (name, broker ms per claim, claims per second)."""
    rows: list[tuple[str, float, float]] = []

    async def row(label: str, made: list[str], run: Callable[[], Awaitable[None]]) -> None:
        try:
            cpu, wall = await broker.measure(run)
        except Denied as exc:
            rows.append((f"{label}: denied ({exc})", float("nan"), float("nan")))
            await broker.reopen()
            return
        rows.append((label, cpu * 1000 / count, count / wall))

    won = names("durable+persistent", count)
    await row("durable+persistent", won, lambda: broker.striped(won, claim()))
    await row("lost (publish, nack)", won, lambda: broker.striped(won, lose))
    await broker.delete(won)

    transient_msg = names("durable+transient", count)
    await row(
        "durable+transient msg",
        transient_msg,
        lambda: broker.striped(transient_msg, claim(persistent=False)),
    )
    await broker.delete(transient_msg)

    transient = names("transient", count)

    async def transient_claims() -> None:
        try:
            await broker.striped(transient, claim(durable=False, persistent=False))
        except (aiormq.exceptions.AMQPError, aio_pika.exceptions.AMQPException) as exc:
            if "deprecated" in str(exc):
                raise Denied(str(exc).splitlines()[0]) from None
            raise

    await row("transient queue", transient, transient_claims)
    with contextlib.suppress(Exception):
        await broker.delete(transient)

    plain = names("no-expires", count)
    no_expires = {key: value for key, value in CLAIM.items() if key != "x-expires"}
    await row("no x-expires", plain, lambda: broker.striped(plain, claim(arguments=no_expires)))
    await broker.delete(plain)

    v2 = names("v2", count)
    await row(
        "x-queue-version=2",
        v2,
        lambda: broker.striped(v2, claim(arguments={**CLAIM, "x-queue-version": 2})),
    )
    await broker.delete(v2)

    ahead = names("ahead", count)

    async def declared_ahead() -> None:
        for start in range(0, count, 50):
            batch = ahead[start : start + 50]

            async def declare(channel: AbstractChannel, name: str) -> None:
                underlay = await channel.get_underlay_channel()
                await underlay.queue_declare(name, durable=True, arguments=CLAIM, nowait=True)

            await broker.striped(batch, declare)
            await broker.striped(batch, lambda channel, name: _won(channel, name))

    await row("ahead x50, nowait", ahead, declared_ahead)
    await broker.delete(ahead)

    expiring = names("expiry", count)
    short = {**CLAIM, "x-expires": int(EXPIRES_S * 1000)}
    began = time.monotonic()
    await broker.striped(expiring, claim(arguments=short))

    async def expiry() -> None:  # until every queue has had its expiry, and some more
        await asyncio.sleep(max(0.0, began + EXPIRES_S * 2 - time.monotonic()))

    cpu, _ = await broker.measure(expiry)
    rows.append(("expiry (later)", cpu * 1000 / count, float("nan")))
    await broker.delete(expiring)
    return rows


async def _won(channel: AbstractChannel, name: str) -> None:
    assert await publish(channel, name), f"{name}: a claim into a queue declared ahead lost"


@contextlib.contextmanager
def private_node(line: str) -> Iterator[tuple[str, int, str]]:
    """(URL, beam pid, version) of a private node of ``line`` (3.10 or 4.0), stopped after."""
    import shutil
    import tempfile

    from tests.support.private_rabbitmq import PrivateRabbitMQ, rabbitmq4_node
    from tests.support.wait import free_port

    if line == "4.0":
        with rabbitmq4_node(nofile=NOFILE) as node:
            yield node.amqp_url, node.beam_pid, "4.0.5"
        return
    base = Path(tempfile.mkdtemp(prefix=f"{RUN}-"))
    node = PrivateRabbitMQ(base, f"{RUN}@localhost", free_port(), free_port(), nofile=NOFILE)
    try:
        node.start()
        yield node.amqp_url, node.beam_pid, "3.10"
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


async def measure(url: str, pid: int, label: str, args: argparse.Namespace) -> None:
    broker = Broker(url, pid, args.channels)
    await broker.open()
    try:
        await broker.measure_idle()
        print(f"\n{label}: idle {broker.idle_per_s * 1000:.1f} ms CPU/s, {args.claims} claims "
              f"per variant, {args.channels} in flight, best of {args.repeat}")  # fmt: skip
        best: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.repeat):
            for name, ms, rate in await variant_rows(broker, args.claims):
                best.setdefault(name, []).append((ms, rate))
        print(f"{'variant':<34} {'broker ms/claim':>15} {'claims/s':>9}")
        for name, figures in best.items():
            ms = min(figure[0] for figure in figures)
            rate = statistics.median(figure[1] for figure in figures)
            print(f"{name:<34} {ms:>15.2f} {rate:>9.0f}")
    finally:
        await broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--node", default="3.10,4.0", help="private nodes: 3.10, 4.0")
    parser.add_argument("--url", help="a node running here instead of private ones")
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.url:
        pid = serving_pid(url_port(args.url))
        if pid is None:
            sys.exit(f"no process here serves port {url_port(args.url)}")
        asyncio.run(measure(args.url, pid, f"the node at port {url_port(args.url)}", args))
        return
    for line in args.node.split(","):
        with private_node(line) as (url, pid, version):
            asyncio.run(measure(url, pid, f"a private RabbitMQ {version} node", args))


if __name__ == "__main__":
    main()

"""A claim log on RabbitMQ: one stream per prefix, every instance reading every claim, measured
side by side with today's claim queue per slot.

    sudo .venv/bin/python bench/claim_log.py [--node 3.10,4.0] [--slots 2000] [--in-flight 8]
                                             [--repeat 3] [--latency 300] [--no-expiry]
                                             [--no-restart] [--no-syncs] [--batch 20]

The protocol measured (nothing in ``RabbitMQBackend`` changes): one stream queue per prefix
(``x-queue-type=stream``, ``x-max-age`` the slot memory, small segments); every instance keeps
ONE consumer on it (``basic.qos`` prefetch, ``x-stream-offset`` a timestamp of now - memory at
attach) and remembers the first claim of each slot key it reads. A claim publishes
``<slot key> <nonce>`` (persistent, ``mandatory``, publisher confirms) and waits until its own
consumer reads it back: it won when no claim of the same key came before it in the stream.
Every reader sees one order, so all of them name the same winner; a losing claim costs one
append, and every reader reads every claim.

Three instances (a connection each: 8 confirm channels and one consuming channel) claim every
slot, 1 winner and 2 losers, ``--in-flight`` slots at a time. Variants, each round in this
order:

* ``claim log``: one claim a message, all three instances claiming every slot;
* ``its 3 appends alone``: the same appends into a second stream that nobody reads;
* ``1 claimer``: only one instance appends (the others would have read its claim before
  theirs fell due, and skip it); all three read;
* ``batches``: every instance claims ``--batch`` slots of one instant in one message, a line
  a slot (the first line of a key in the log wins it);
* ``queue per slot``: today's path at the protocol level: publish first (``mandatory``) to
  ``<run>.claim.<slot>``; returned unrouted (no queue yet): declare the durable classic queue
  (``x-max-length=1``, ``reject-publish``, ``x-expires``) and publish again; acked = won,
  nacked = lost. Queues deleted outside the measured window; ``expiry`` (once per node, the
  broker expiring 2,000 such queues declared with ``x-expires`` 15 s) is their later cost.

Figures, per node: broker CPU per slot (its Erlang VM's utime + stime in ``/proc/<pid>/stat``
over the run, less the node's idle rate before anything was declared; best of ``--repeat``);
slots per second; the claim decision latency p50/p99 of one claimer alone on an idle node
(publish -> own message read; the queue: publish -> ack, declare included); the node's open
files (``/proc/<pid>/fd``) at rest and the most seen during the runs; the stream directory's
bytes per claim. Then a restart: claims in flight when the node is killed (``kill -9``) or
stopped, a reader re-attached by the offset it read last and one from the first message,
compared with what was read before (same order? every confirmed claim read back?). Last, where
strace is installed (``--no-syncs`` skips it), the node's fsync and fdatasync calls while 300
confirmed messages go one at a time into a stream, then into a durable classic queue.

Asserted in every run: exactly one winner per slot (a queue claim whose declare finds the
queue "down or inaccessible", as 4.0 may answer a racer, fails closed and is counted), and all
three readers name the same first claimer for every key (the same order). ``--node 3.10``
starts a private node from this machine's rabbitmq-server package, ``--node 4.0`` one from
scripts/rabbitmq4.sh's Debian 13 root (as root), as bench/claim_cost.py does; each is removed
at the end, with all it holds. Linux and root only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from aio_pika.exceptions import ChannelNotFoundEntity, DeliveryError, PublishError
from pamqp.common import FieldTable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.claim_cost import CLAIM, EXPIRES_S, IDLE_S, NOFILE  # noqa: E402
from tests.support.beam import cpu_seconds  # noqa: E402
from tests.support.private_rabbitmq import PrivateRabbitMQ, rabbitmq4_node  # noqa: E402
from tests.support.wait import free_port  # noqa: E402

RUN = f"clog{uuid.uuid4().hex[:6]}"
MEMORY_S = 300  # the slot memory: the default slot_ttl of 5 minutes
SEGMENT_BYTES = 1_000_000
PREFETCH = 1000
ACK_EVERY = 200  # streams deliver no more than the prefetch unacked: acks go in batches
INSTANCES = 3
DECIDE_S = 30.0
SETTLE_S = 3.0
SYNC_MESSAGES = 300


def stream_arguments() -> FieldTable:
    return {
        "x-queue-type": "stream",
        "x-max-age": f"{MEMORY_S}s",
        "x-stream-max-segment-size-bytes": SEGMENT_BYTES,
    }


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- the claim log ---------------------------------------------------------------------------


@dataclass
class Reader:
    """One instance's view of the claim log: the first claim of each key, in the log's order."""

    first: dict[str, str] = field(default_factory=dict)  # key -> nonce of its first claim
    order: list[tuple[int, str, str]] = field(default_factory=list)  # (offset, key, nonce)
    # own nonce -> the keys it won (a message is one claim, or one per line of a batch)
    waiting: dict[str, asyncio.Future[set[str]]] = field(default_factory=dict)
    last_offset: int = -1
    unacked: int = 0
    marks: dict[str, asyncio.Future[None]] = field(default_factory=dict)

    async def deliver(self, message: AbstractIncomingMessage) -> None:
        # Everything before the first await: aio-pika starts one task per delivery, in order.
        offset = (message.headers or {}).get("x-stream-offset")
        assert isinstance(offset, int), f"a stream delivery without its offset: {offset!r}"
        if offset > self.last_offset:  # a re-delivered offset says nothing new
            self.last_offset = offset
            won: set[str] = set()
            nonce = ""
            for line in message.body.decode().splitlines():  # one claim, or a batch's
                key, _, nonce = line.partition(" ")
                self.order.append((offset, key, nonce))
                if self.first.setdefault(key, nonce) == nonce:
                    won.add(key)
            decided = self.waiting.pop(nonce, None)
            if decided is not None and not decided.done():
                decided.set_result(won)
            mark = self.marks.pop(key, None)
            if mark is not None and not mark.done():
                mark.set_result(None)
        self.unacked += 1
        if self.unacked >= ACK_EVERY:
            self.unacked = 0
            await message.ack(multiple=True)


class Instance:
    """One instance of the fleet: a connection, its confirm channels, one consumer on the log."""

    def __init__(self, url: str, width: int) -> None:
        self.url, self.width = url, width
        self.connection: AbstractConnection | None = None
        self.channels: list[AbstractChannel] = []
        self.reader = Reader()
        self.stream = ""
        self.failed_closed = 0  # queue claims whose declare found the queue down (4.0)

    async def open(self) -> None:
        self.connection = await aio_pika.connect(self.url)
        self.channels = [
            await self.connection.channel(publisher_confirms=True, on_return_raises=True)
            for _ in range(self.width)
        ]

    async def attach(self, stream: str, offset: datetime.datetime | int | str) -> None:
        """ONE consumer on the log from ``offset`` (a datetime, an int offset, "first"...)."""
        assert self.connection is not None
        self.stream = stream
        channel = await self.connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.declare_queue(stream, passive=True)
        await queue.consume(self.reader.deliver, arguments={"x-stream-offset": offset})

    async def close(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                await self.connection.close()

    async def append(self, channel: AbstractChannel, key: str, nonce: str) -> None:
        message = aio_pika.Message(f"{key} {nonce}".encode(), delivery_mode=2)
        await channel.default_exchange.publish(message, routing_key=self.stream, mandatory=True)

    async def claim(self, channel: AbstractChannel, key: str) -> tuple[bool, float, float]:
        """(won, seconds to the decision, seconds to the publisher confirm)."""
        won, decided, confirmed = await self.claim_many(channel, [key])
        return key in won, decided, confirmed

    async def claim_many(
        self, channel: AbstractChannel, keys: list[str]
    ) -> tuple[set[str], float, float]:
        """Claims of several slots in one append, a line each: (the keys won, seconds to the
        decision, seconds to the publisher confirm)."""
        nonce = uuid.uuid4().hex[:16]
        decided: asyncio.Future[set[str]] = asyncio.get_running_loop().create_future()
        self.reader.waiting[nonce] = decided
        body = "\n".join(f"{key} {nonce}" for key in keys)
        began = time.perf_counter()
        message = aio_pika.Message(body.encode(), delivery_mode=2)
        await channel.default_exchange.publish(message, routing_key=self.stream, mandatory=True)
        confirmed = time.perf_counter() - began
        won = await asyncio.wait_for(decided, DECIDE_S)
        return won, time.perf_counter() - began, confirmed

    async def mark(self, channel: AbstractChannel, key: str) -> None:
        """Append ``key`` and wait until this instance has read up to it."""
        seen = asyncio.get_running_loop().create_future()
        self.reader.marks[key] = seen
        await self.append(channel, key, "mark")
        await asyncio.wait_for(seen, DECIDE_S)

    # --- today's claim queue per slot ---

    async def queue_claim(self, w: int, name: str, args: FieldTable) -> bool:
        """On channel ``w``: publish first; no queue yet (returned unrouted): declare it and
        publish again. A declare racing the queue's creation on 4.0 may find it "down or
        inaccessible" (404, the channel closed): that claim fails closed, as the backend's does
        (counted in ``failed_closed``), on a new channel."""
        channel = self.channels[w]
        won = await _publish(channel, name)
        if won is None:
            try:
                await channel.declare_queue(name, durable=True, arguments=args)
            except ChannelNotFoundEntity:
                assert self.connection is not None
                self.channels[w] = await self.connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self.failed_closed += 1
                return False
            won = await _publish(channel, name)
            assert won is not None, f"{name}: unrouted right after its declare"
        return won


async def _publish(channel: AbstractChannel, name: str) -> bool | None:
    """Acked (won), nacked (lost, the queue holds a claim) or returned unrouted (no queue)."""
    message = aio_pika.Message(b"{}", delivery_mode=2)
    try:
        await channel.default_exchange.publish(message, routing_key=name, mandatory=True)
    except PublishError:
        return None
    except DeliveryError:
        return False
    return True


class Fleet:
    def __init__(self, url: str, pid: int, width: int) -> None:
        self.url, self.pid, self.width = url, pid, width
        self.instances = [Instance(url, width) for _ in range(INSTANCES)]
        self.idle_per_s = 0.0
        self.max_files = 0
        self.unrun = 0  # slots nobody won (queue claims that failed closed)

    def failed_closed(self) -> int:
        return sum(instance.failed_closed for instance in self.instances)

    async def open(self) -> None:
        for instance in self.instances:
            await instance.open()

    async def close(self) -> None:
        for instance in self.instances:
            await instance.close()

    async def measure_idle(self) -> float:
        cpu, wall = cpu_seconds(self.pid), time.monotonic()
        await asyncio.sleep(IDLE_S)
        return (cpu_seconds(self.pid) - cpu) / (time.monotonic() - wall)

    async def measure(self, run: Callable[[], Awaitable[None]]) -> tuple[float, float]:
        """(broker CPU seconds over ``run`` less the idle rate, wall seconds); the most open
        files seen meanwhile go to ``max_files``."""

        async def sample() -> None:
            while True:
                self.max_files = max(self.max_files, open_files(self.pid))
                await asyncio.sleep(0.05)

        self.max_files = 0
        sampler = asyncio.create_task(sample())
        cpu, wall = cpu_seconds(self.pid), time.monotonic()
        try:
            await run()
        finally:
            wall = time.monotonic() - wall
            cpu = cpu_seconds(self.pid) - cpu
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        return max(0.0, cpu - self.idle_per_s * wall), wall

    async def slots(
        self, count: int, in_flight: int, claim: Callable[[Instance, int, int], Awaitable[bool]]
    ) -> None:
        """Every slot claimed by every instance at once, ``in_flight`` slots at a time; one
        winner each (none only where a queue claim failed closed: counted in ``unrun``)."""

        async def worker(w: int) -> None:
            for slot in range(w, count, in_flight):
                won = await asyncio.gather(*(claim(i, w, slot) for i in self.instances))
                assert sum(won) <= 1, f"slot {slot}: {sum(won)} winners"
                if not any(won):
                    assert self.failed_closed(), f"slot {slot}: no winner"
                    self.unrun += 1

        await asyncio.gather(*(worker(w) for w in range(in_flight)))

    async def batches(self, count: int, in_flight: int, size: int) -> list[str]:
        """Every instance claims ``size`` slots of one instant in one append, ``in_flight``
        batches at a time; one winner per slot. Returns the keys."""
        tag = uuid.uuid4().hex[:8]  # once: fresh keys, none claimed before
        keys = [f"{RUN}.claim.b{tag}.job{n % 50}.{n:06d}" for n in range(count)]

        async def worker(w: int) -> None:
            for start in range(w * size, count, in_flight * size):
                part = keys[start : start + size]
                won = await asyncio.gather(
                    *(i.claim_many(i.channels[w], part) for i in self.instances)
                )
                for key in part:
                    winners = sum(key in keys_won for keys_won, _, _ in won)
                    assert winners == 1, f"{key}: {winners} winners"

        await asyncio.gather(*(worker(w) for w in range(in_flight)))
        return keys

    def check_one_order(self, keys: set[str] | None = None) -> int:
        """All readers name the same first claimer of every key (and read the same log);
        returns the keys compared."""
        firsts = [instance.reader.first for instance in self.instances]
        wanted = keys if keys is not None else set(firsts[0])
        for first in firsts[1:]:
            assert {k: first.get(k) for k in wanted} == {k: firsts[0].get(k) for k in wanted}, (
                "two readers name different first claimers"
            )
        orders = [instance.reader.order for instance in self.instances]
        shortest = min(len(order) for order in orders)
        assert all(order[:shortest] == orders[0][:shortest] for order in orders), (
            "two readers read the log in different orders"
        )
        return len(wanted)


# --- what is measured ------------------------------------------------------------------------


@dataclass
class Node:
    """The measured node: its URL, its VM's pid, its version, its data directory; restartable
    when private."""

    url: str
    version: str
    private: PrivateRabbitMQ

    @property
    def pid(self) -> int:
        return self.private.beam_pid

    def stream_bytes(self, stream: str) -> tuple[int, int]:
        """(bytes, segment files) of the stream's directory."""
        total = segments = 0
        name = stream.replace(".", "_")  # the directory: <vhost>_<queue>_<id>, dots as _
        for path in (self.private.base / "mnesia").rglob("*"):
            if path.parent.parent.name == "stream" and name in path.parent.name:
                total += path.stat().st_size
                segments += path.suffix == ".segment"
        return total, segments

    def restart(self, crash: bool) -> None:
        """Stop the node (``kill -9``, or ``rabbitmqctl stop``) and start it on its data."""
        node = self.private
        if crash:
            os.kill(node.beam_pid, signal.SIGKILL)
        else:
            subprocess.run(
                node.rabbitmqctl("stop"),
                env={**os.environ, **node.env},
                check=True,
                capture_output=True,
                timeout=120,
            )
        if node.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()
            node.process = None
        # start() writes a new cookie and waits for "Server startup complete" in a new log
        shutil.rmtree(node.base / "home")
        log = node.base / "log"
        log.rename(node.base / f"log.{time.monotonic_ns()}")
        node.start()


@contextlib.contextmanager
def private_node(line: str) -> Iterator[Node]:
    """A private node of ``line`` (3.10 or 4.0), as bench/claim_cost.py starts it, removed
    after."""
    if line == "4.0":
        with rabbitmq4_node(nofile=NOFILE) as node:
            yield Node(node.amqp_url, "4.0.5", node)
        return
    base = Path(tempfile.mkdtemp(prefix=f"{RUN}-"))
    node = PrivateRabbitMQ(base, f"{RUN}@localhost", free_port(), free_port(), nofile=NOFILE)
    try:
        node.start()
        yield Node(node.amqp_url, "3.10", node)
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Figures:
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    rate: dict[str, list[float]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    latency: dict[str, tuple[float, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, cpu_s: float, wall: float, slots: int) -> None:
        self.cpu_ms.setdefault(name, []).append(cpu_s * 1000 / slots)
        self.rate.setdefault(name, []).append(slots / wall)


async def measure_node(node: Node, args: argparse.Namespace) -> None:
    fleet = Fleet(node.url, node.pid, args.in_flight)
    figures = Figures()
    stream = f"{RUN}.claims"
    await fleet.open()
    a = fleet.instances[0]
    queues: list[str] = []
    try:
        fleet.idle_per_s = await fleet.measure_idle()
        figures.files["node at rest, nothing declared"] = open_files(node.pid)
        channel = a.channels[0]
        await channel.declare_queue(stream, durable=True, arguments=stream_arguments())
        attach_at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=MEMORY_S)
        for instance in fleet.instances:
            await instance.attach(stream, attach_at)
        await asyncio.sleep(1.0)
        figures.files["the stream declared, 3 consumers on it, at rest"] = open_files(node.pid)
        idle_log = await fleet.measure_idle()
        figures.notes.append(
            f"idle CPU: node {fleet.idle_per_s * 1000:.1f} ms/s; with the stream and its 3"
            f" consumers {idle_log * 1000:.1f} ms/s"
        )
        bare = f"{RUN}.bare"  # a stream nobody reads: what the appends cost alone
        await channel.declare_queue(bare, durable=True, arguments=stream_arguments())

        log_files = 0
        stored: dict[str, list[float]] = {}  # stream bytes per slot claimed, by variant

        async def timed(label: str, run: Callable[[], Awaitable[None]]) -> None:
            nonlocal log_files
            before, _ = node.stream_bytes(stream)
            cpu, wall = await fleet.measure(run)
            figures.add(label, cpu, wall, args.slots)
            after, _ = node.stream_bytes(stream)
            stored.setdefault(label, []).append((after - before) / (INSTANCES * args.slots))
            if label.startswith("claim log"):
                log_files = max(log_files, fleet.max_files)
            await asyncio.sleep(SETTLE_S)  # what the broker does after it, out of the next

        for round_ in range(args.repeat):
            keys = [f"{RUN}.claim.job{n % 50}.{round_}{n:06d}" for n in range(args.slots)]

            async def log_slot(
                instance: Instance, w: int, slot: int, keys: list[str] = keys
            ) -> bool:
                won, _, _ = await instance.claim(instance.channels[w], keys[slot])
                return won

            await timed("claim log", lambda: fleet.slots(args.slots, args.in_flight, log_slot))

            async def append_only(
                instance: Instance, w: int, slot: int, keys: list[str] = keys
            ) -> bool:
                await instance.channels[w].default_exchange.publish(
                    aio_pika.Message(
                        f"{keys[slot]} {uuid.uuid4().hex[:16]}".encode(), delivery_mode=2
                    ),
                    routing_key=bare,
                    mandatory=True,
                )
                return instance is a

            await timed(
                "claim log: its 3 appends alone (no reader)",
                lambda: fleet.slots(args.slots, args.in_flight, append_only),
            )

            async def alone(instance: Instance, w: int, slot: int, keys: list[str] = keys) -> bool:
                if instance is not a:  # it read the claim before its own fell due: no append
                    return False
                won, _, _ = await a.claim(a.channels[w], f"{keys[slot]}.alone")
                return won

            await timed(
                "claim log: 1 claimer (2 read the win first)",
                lambda: fleet.slots(args.slots, args.in_flight, alone),
            )
            batched: list[str] = []

            async def batch_run(batched: list[str] = batched) -> None:
                batched.extend(await fleet.batches(args.slots, args.in_flight, args.batch))

            await timed(f"claim log: batches of {args.batch} slots", batch_run)
            for instance in fleet.instances:  # every reader has read every claim
                await instance.mark(instance.channels[0], f"{RUN}.mark.{round_}")
            checked = fleet.check_one_order(set(keys) | set(batched))

            names = [f"{RUN}.claim.q{round_}.{n}" for n in range(args.slots)]
            queues = names

            async def queue_slot(
                instance: Instance, w: int, slot: int, names: list[str] = names
            ) -> bool:
                return await instance.queue_claim(w, names[slot], CLAIM)

            await timed(
                "queue per slot (today)",
                lambda: fleet.slots(args.slots, args.in_flight, queue_slot),
            )
            figures.files["queue per slot: most during a run"] = fleet.max_files
            await delete_queues(a, names)
            queues = []
            await asyncio.sleep(SETTLE_S)
        figures.files["claim log: most during a run"] = log_files
        figures.notes.append(
            f"queue per slot: {fleet.failed_closed()} claims failed closed (their declare found"
            f" the queue down or inaccessible), {fleet.unrun} slots won by nobody"
        )
        await asyncio.sleep(1.0)
        figures.files["claim log: at rest after the runs"] = open_files(node.pid)
        total, segments = node.stream_bytes(stream)
        single = statistics.median(stored["claim log"])
        batch = statistics.median(stored[f"claim log: batches of {args.batch} slots"])
        figures.notes.append(
            f"stream directory: {single:.0f} bytes per claim, {batch:.0f} per slot claimed in"
            f" a batch of {args.batch} ({total} bytes in all, {segments} segment files of at"
            f" most {SEGMENT_BYTES} bytes); in every round all {INSTANCES} readers named the"
            f" same first claimer of all {checked} keys claimed"
        )

        # the decision latency: one claimer alone on an idle node (the others only read)
        decide, confirm = [], []
        for n in range(args.latency):
            _, decided, confirmed = await a.claim(a.channels[0], f"{RUN}.claim.lat.{n}")
            decide.append(decided)
            confirm.append(confirmed)
        queue_won, queue_lost = [], []
        names = [f"{RUN}.claim.lat.{n}" for n in range(args.latency)]
        queues = names
        for name in names:
            began = time.perf_counter()
            assert await a.queue_claim(0, name, CLAIM)
            queue_won.append(time.perf_counter() - began)
        for name in names:
            began = time.perf_counter()
            assert not await a.queue_claim(0, name, CLAIM)
            queue_lost.append(time.perf_counter() - began)
        await delete_queues(a, names)
        queues = []
        for label, values in (
            ("claim log: publish -> own claim read (won or lost)", decide),
            ("claim log: publish -> confirm only", confirm),
            ("queue per slot: winning (publish, declare, publish)", queue_won),
            ("queue per slot: losing (publish, nacked)", queue_lost),
        ):
            figures.latency[label] = (percentile(values, 0.5), percentile(values, 0.99))

        if args.expiry:
            names = [f"{RUN}.claim.exp.{n}" for n in range(args.slots)]
            short = {**CLAIM, "x-expires": int(EXPIRES_S * 1000)}
            began = time.monotonic()

            async def declare(instance: Instance, w: int, slot: int) -> bool:
                if instance is not a:
                    return False
                return await a.queue_claim(w, names[slot], short)

            await fleet.slots(args.slots, args.in_flight, declare)

            async def expiry() -> None:
                await asyncio.sleep(max(0.0, began + EXPIRES_S * 2 - time.monotonic()))

            cpu, wall = await fleet.measure(expiry)
            figures.add("queue per slot: its expiry (later, once)", cpu, wall, args.slots)
            queues = names  # expired; deleted again in case
    finally:
        with contextlib.suppress(Exception):
            await a.channels[0].queue_delete(f"{RUN}.bare")
        if queues:
            with contextlib.suppress(Exception):
                await delete_queues(a, queues)
        await fleet.close()
    report(node, figures, args)
    if args.restart:
        for crash in (True, False):
            await restart_check(node, stream, crash)
    await drop_stream(node.url, stream)
    if args.syncs and shutil.which("strace"):
        print(
            f"\nsyncs (fsync + fdatasync) of the node, {SYNC_MESSAGES} confirmed publishes one"
            " at a time:"
        )
        targets: list[tuple[str, FieldTable]] = [
            ("into a stream", stream_arguments()),
            ("persistent, into a durable classic queue", {"x-queue-type": "classic"}),
        ]
        for label, arguments in targets:
            print(f"  {label}: {await count_syncs(node, arguments)}")


async def delete_queues(instance: Instance, names: list[str]) -> None:
    async def drop(w: int) -> None:
        for name in names[w :: instance.width]:
            await instance.channels[w].queue_delete(name)

    await asyncio.gather(*(drop(w) for w in range(instance.width)))


async def drop_stream(url: str, stream: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.queue_delete(stream)
    finally:
        await connection.close()


def report(node: Node, figures: Figures, args: argparse.Namespace) -> None:
    print(
        f"\na private RabbitMQ {node.version} node: {args.slots} slots, {INSTANCES} claimers"
        f" each, {args.in_flight} slots in flight, best of {args.repeat}"
    )
    print(f"{'':<44} {'broker ms/slot':>14} {'slots/s':>8}")
    for name, values in figures.cpu_ms.items():
        rate = statistics.median(figures.rate[name])
        print(f"{name:<44} {min(values):>14.2f} {rate:>8.0f}")
    print(f"\ndecision latency, one claimer alone ({args.latency} claims)    p50 ms   p99 ms")
    for name, (p50, p99) in figures.latency.items():
        print(f"{name:<56} {p50 * 1000:>6.2f} {p99 * 1000:>8.2f}")
    print("\nthe node's open files")
    for name, count in figures.files.items():
        print(f"  {name:<54} {count:>6}")
    for note in figures.notes:
        print(note)


# --- a restart -------------------------------------------------------------------------------


async def restart_check(node: Node, stream: str, crash: bool) -> None:
    """Claims in flight when the node goes down; afterwards, a reader re-attached by the last
    offset it read, and one from the start, against what was read before."""
    how = "kill -9" if crash else "rabbitmqctl stop"
    fleet = Fleet(node.url, node.pid, 4)
    await fleet.open()
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=MEMORY_S)
    for instance in fleet.instances:
        await instance.attach(stream, start)
    a = fleet.instances[0]
    tag = f"{RUN}.claim.r{int(crash)}"
    keys = [f"{tag}.before.{n}" for n in range(100)]

    async def decided(instance: Instance, w: int, slot: int) -> bool:
        won, _, _ = await instance.claim(instance.channels[w], keys[slot])
        return won

    await fleet.slots(len(keys), 4, decided)
    for instance in fleet.instances:
        await instance.mark(instance.channels[0], f"{tag}.mark.before")
    fleet.check_one_order()
    before = list(a.reader.order)
    resume_from = a.reader.last_offset + 1

    # claims in flight: every instance claims 400 more slots at once, unawaited
    confirmed: set[str] = set()
    unknown: set[str] = set()
    some_confirmed = asyncio.Event()

    async def in_flight(instance: Instance, w: int, key: str) -> None:
        nonce = uuid.uuid4().hex[:16]
        try:
            await instance.append(instance.channels[w], key, nonce)
        except BaseException:
            unknown.add(nonce)
            raise
        confirmed.add(nonce)
        if len(confirmed) >= 100:
            some_confirmed.set()

    tasks = [
        asyncio.create_task(in_flight(instance, n % 4, f"{tag}.flight.{n}"))
        for n in range(400)
        for instance in fleet.instances
    ]
    await some_confirmed.wait()
    await asyncio.to_thread(node.restart, crash)  # start() runs an event loop of its own
    await asyncio.wait(tasks, timeout=60)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # lost with the connection: counted in ``unknown``
    await fleet.close()
    unknown -= confirmed
    in_flight_total = len(tasks)

    # after the restart: one reader by the offset read last, one from the first message
    fleet = Fleet(node.url, node.pid, 1)
    await fleet.open()
    resumed, whole, late = fleet.instances
    for attempt in range(100):  # the stream comes back a little after the node
        try:
            await resumed.attach(stream, resume_from)
            await whole.attach(stream, "first")
            break
        except Exception:
            if attempt == 99:
                raise
            await fleet.close()
            await asyncio.sleep(0.2)
            fleet = Fleet(node.url, node.pid, 1)
            await fleet.open()
            resumed, whole, late = fleet.instances
    await late.attach(stream, start)
    for instance in fleet.instances:
        await instance.mark(instance.channels[0], f"{tag}.mark.after")
    await fleet.close()
    read = {nonce for _, _, nonce in whole.reader.order}
    first_read, last_read = before[0][0], before[-1][0]
    same_prefix = [e for e in whole.reader.order if first_read <= e[0] <= last_read] == before
    suffix = [entry for entry in whole.reader.order if entry[0] >= resume_from]
    print(
        f"\nrestart ({how}) with {in_flight_total} claims in flight, {len(confirmed)} of them"
        f" confirmed before the node went down:\n"
        f"  every confirmed claim read back after it: {confirmed <= read}"
        f" ({len(confirmed & read)} of {len(confirmed)})\n"
        f"  unconfirmed claims (connection lost) found in the log: {len(unknown & read)} of"
        f" {len(unknown)}\n"
        f"  the claims read before it, in the same order at the same offsets after it:"
        f" {same_prefix} ({len(before)} claims)\n"
        f"  a reader re-attached at the offset after the last it read sees exactly what the"
        f" reader from the first sees from there: {resumed.reader.order == suffix}"
        f" ({len(suffix)} messages)\n"
        f"  the three readers (by offset, from the first, by timestamp) name the same first"
        f" claimers: {check_firsts(fleet)}"
    )


async def count_syncs(node: Node, arguments: FieldTable) -> int:
    """The node's fsync and fdatasync calls (strace) while ``SYNC_MESSAGES`` confirmed
    persistent messages go, one at a time, to a new queue of ``arguments``."""
    name = f"{RUN}.syncs"
    connection = await aio_pika.connect(node.url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(name, durable=True, arguments=arguments)
        await asyncio.sleep(1.0)
        trace = await asyncio.create_subprocess_exec(
            *("strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-p", str(node.pid)),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        await asyncio.sleep(1.5)  # attached to every thread
        for n in range(SYNC_MESSAGES):
            message = aio_pika.Message(f"sync {n}".encode(), delivery_mode=2)
            await channel.default_exchange.publish(message, routing_key=name, mandatory=True)
        await asyncio.sleep(0.5)
        trace.send_signal(signal.SIGINT)
        out, _ = await trace.communicate()
        await channel.queue_delete(name)
    finally:
        await connection.close()
    calls = 0
    for line in out.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[-1] in ("fsync", "fdatasync"):
            calls += int(fields[3])  # % time, seconds, usecs/call, calls, [errors,] syscall
    return calls


def check_firsts(fleet: Fleet) -> bool:
    """Over the keys all three read (the ones the reader by offset read)."""
    resumed = fleet.instances[0].reader
    keys = set(resumed.first)
    return all(
        {k: instance.reader.first.get(k) for k in keys} == {k: resumed.first[k] for k in keys}
        for instance in fleet.instances[1:]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--node", default="3.10,4.0", help="private nodes: 3.10, 4.0")
    parser.add_argument("--slots", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=20, help="slots per batched append")
    parser.add_argument("--latency", type=int, default=300, help="claims timed one at a time")
    parser.add_argument("--no-expiry", dest="expiry", action="store_false")
    parser.add_argument("--no-restart", dest="restart", action="store_false")
    parser.add_argument(
        "--no-syncs", dest="syncs", action="store_false", help="skip the strace of syncs"
    )
    args = parser.parse_args()
    # the restart closes connections under the client on purpose: its complaints are expected
    for logger in ("aio_pika", "aiormq"):
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    if os.geteuid() != 0:
        sys.exit("needs root: the private nodes (and the 4.0 root's chroot)")
    for line in args.node.split(","):
        with private_node(line) as node:
            asyncio.run(measure_node(node, args))


if __name__ == "__main__":
    main()

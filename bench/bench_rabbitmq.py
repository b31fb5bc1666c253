"""RabbitMQBackend.claim() next to the raw AMQP round trip it is made of, in the same run.

    .venv/bin/python bench/bench_rabbitmq.py [--url URL] [--claims 300] [--rounds 4]
                                             [--channels 8] [--memory 2000]
                                             [--cpu 2000] [--beam-pid PID]
                                             [--burst 600 --instances 3 --claim-timeout 2s]

"raw" is what a claim costs at the protocol level: declare a durable classic queue
(x-max-length=1, reject-publish, x-expires), publish one persistent message to it with
mandatory=True and wait for the publisher confirm, on a pool of confirm channels of one
connection. "backend" is ``RabbitMQBackend.claim()`` doing the same through its own pool. The
two take turns (and turns at going first) over the rounds, one claim at a time (latency, pooled
over the rounds) and with ``--channels`` claims in flight (throughput, the median round).
``--memory N`` also measures the broker memory of N live claim queues (needs ``rabbitmqctl``,
i.e. root on the broker host). ``--cpu N`` measures the broker's own CPU (its Erlang VM's
utime + stime in /proc/<pid>/stat, before and after) for N winning claims (fresh slots) and
then N losing claims (the same slots, from a second instance), ``--channels`` in flight: the
broker must run on this host (``--beam-pid``, else the process serving the URL's port, found in
/proc, else ``rabbitmqctl eval 'os:getpid().'``). ``--memory`` asks ``rabbitmqctl``'s default node
(the 3.10 service here), whatever the URL.
``--burst N``: ``--instances`` backends (one connection each, as processes of a fleet) each
claim N slots falling due at the same instant, all at once (jitter 0): how many are won, lost
and skipped as overloaded (no free channel within a quarter of ``--claim-timeout``), and when
the won claims were answered, after the slots' instant (what a run would start late by).
Every queue made here is deleted before the script ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection
from pamqp.common import FieldTable

from brokersched import BackendError, SystemClock
from brokersched._redact import redact_url
from brokersched.abc import Slot
from brokersched.backends.rabbitmq import RabbitMQBackend, claim_queue_name

# The prefix of everything this run makes: removed at its end, whatever happened.
RUN = f"bench{uuid.uuid4().hex[:6]}"
ROOT = str(Path(__file__).resolve().parent.parent)
DEFAULT_URL = os.environ.get("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
ARGUMENTS: FieldTable = {
    "x-queue-type": "classic",
    "x-max-length": 1,
    "x-overflow": "reject-publish",
    "x-expires": 120_000,
}
Claim = Callable[[int], Awaitable[bool]]


class Raw:
    """declare + publish + confirm on a pool of plain confirm channels: the floor."""

    def __init__(self, connection: AbstractConnection, channels: int, prefix: str) -> None:
        self.connection = connection
        self.size = channels
        self.prefix = prefix
        self.pool: asyncio.Queue[AbstractChannel] = asyncio.Queue()

    async def open(self) -> None:
        for _ in range(self.size):
            channel = aio_pika.Channel(
                self.connection, publisher_confirms=True, on_return_raises=True
            )
            await channel
            self.pool.put_nowait(channel)

    async def claim(self, n: int) -> bool:
        name = f"{self.prefix}.claim.raw.{n}"
        channel = await self.pool.get()
        try:
            await channel.declare_queue(name, durable=True, arguments=ARGUMENTS)
            message = aio_pika.Message(
                b"{}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=f"raw:{n}"
            )
            try:
                await channel.default_exchange.publish(message, name, mandatory=True)
            except aio_pika.exceptions.DeliveryError:
                return False
            return True
        finally:
            self.pool.put_nowait(channel)


async def sequential(claim: Claim, first: int, count: int) -> list[float]:
    """Latency in ms of ``count`` claims made one after another."""
    latencies = []
    for n in range(first, first + count):
        started = time.perf_counter()
        assert await claim(n)
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


async def parallel(claim: Claim, first: int, count: int, in_flight: int) -> float:
    """Claims per second with ``in_flight`` claims outstanding at any time."""
    numbers = iter(range(first, first + count))

    async def worker() -> None:
        for n in numbers:
            assert await claim(n)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return count / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def delete_all(connection: AbstractConnection, names: list[str], channels: int) -> None:
    pool = [await connection.channel() for _ in range(channels)]

    async def delete(channel: AbstractChannel, chunk: list[str]) -> None:
        for name in chunk:
            await channel.queue_delete(name)

    await asyncio.gather(*(delete(ch, names[i :: len(pool)]) for i, ch in enumerate(pool)))
    for channel in pool:
        await channel.close()


def broker_memory_bytes() -> int:
    """Memory the broker's Erlang VM uses, as ``rabbitmqctl status`` reports it."""
    output = subprocess.run(
        ["rabbitmqctl", "status", "--formatter", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(json.loads(output)["memory"]["total"]["erlang"])


async def memory_per_queue(url: str, count: int) -> float:
    """Broker memory per live claim queue (holding its one persistent message), in KB."""
    backend = RabbitMQBackend(url, prefix=f"{RUN}{uuid.uuid4().hex[:6]}", channels=16)
    await backend.start(SystemClock())
    first = SystemClock().now_ms()  # fresh slots: an old one is refused
    slots = [Slot("memory", first + n) for n in range(count)]
    try:
        await asyncio.to_thread(
            subprocess.run, ["rabbitmqctl", "eval", "garbage_collect()."], capture_output=True
        )
        before = await asyncio.to_thread(broker_memory_bytes)
        await parallel(
            lambda n: backend.claim(slots[n], instance_id="b", run_id="r", timeout=30), 0, count, 16
        )
        await asyncio.sleep(2)  # let the queue processes settle
        after = await asyncio.to_thread(broker_memory_bytes)
    finally:
        connection = await aio_pika.connect(url)
        async with connection:
            await delete_all(connection, [claim_queue_name(backend.prefix, s) for s in slots], 16)
        await backend.stop()
    return (after - before) / count / 1024


class Figures:
    """Latencies and rates of one contender, pooled over the rounds."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.rates: list[float] = []

    async def measure(self, claim: Claim, first: int, count: int, in_flight: int) -> None:
        self.latencies += await sequential(claim, first, count)
        self.rates.append(await parallel(claim, first + count, count, in_flight))

    def row(self, label: str) -> str:
        p50, p95, p99 = (percentile(self.latencies, q) for q in (50, 95, 99))
        rate = statistics.median(self.rates)
        return f"{label:10}{p50:9.2f}{p95:9.2f}{p99:9.2f}{rate:11.0f}"


async def compare(url: str, claims: int, channels: int, rounds: int) -> tuple[Figures, Figures]:
    """Raw and backend measured alternately, so that both see the same broker weather."""
    prefix = f"{RUN}{uuid.uuid4().hex[:6]}"
    connection = await aio_pika.connect(url)
    raw = Raw(connection, channels, prefix)
    await raw.open()
    backend = RabbitMQBackend(url, prefix=prefix, channels=channels, slot_ttl="2m")
    await backend.start(SystemClock())

    base = SystemClock().now_ms()  # fresh slots: an old one is refused

    async def backend_claim(n: int) -> bool:
        slot = Slot("bench", base + n)
        return await backend.claim(slot, instance_id="b", run_id="r", timeout=30)

    raw_figures, backend_figures = Figures(), Figures()
    numbers = range(2 * claims * rounds)
    try:
        contenders = [(raw_figures, raw.claim), (backend_figures, backend_claim)]
        for round_ in range(rounds):
            first = 2 * claims * round_
            for figures, claim in contenders[:: 1 if round_ % 2 else -1]:  # who goes first
                await figures.measure(claim, first, claims, channels)
    finally:
        await backend.stop()
        names = [f"{prefix}.claim.raw.{n}" for n in numbers]
        names += [claim_queue_name(prefix, Slot("bench", base + n)) for n in numbers]
        await delete_all(connection, names, 16)
        await connection.close()
    return raw_figures, backend_figures


def beam_pid(given: int | None, url: str) -> int:
    """``--beam-pid``, else the process serving ``url``'s port here (several nodes may run on
    this machine: rabbitmqctl's default node need not be the one named), else rabbitmqctl's."""
    if given is not None:
        return given
    sys.path.insert(0, ROOT)
    from tests.support.beam import serving_pid, url_port

    if (pid := serving_pid(url_port(url))) is not None:
        return pid
    output = subprocess.run(
        ["rabbitmqctl", "eval", "os:getpid()."], check=True, capture_output=True, text=True
    ).stdout
    return int(output.strip().strip('"'))


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def broker_cpu(url: str, count: int, channels: int, pid: int) -> tuple[float, float]:
    """Broker CPU in ms per winning and per losing claim, and the claims/s of each."""
    prefix = f"{RUN}{uuid.uuid4().hex[:6]}"
    clock = SystemClock()
    winner = RabbitMQBackend(url, prefix=prefix, channels=channels, slot_ttl="2m")
    loser = RabbitMQBackend(url, prefix=prefix, channels=channels, slot_ttl="2m")
    await winner.start(clock)
    await loser.start(clock)
    first = clock.now_ms()
    slots = [Slot("cpu", first + n) for n in range(count)]
    figures = []
    try:
        for backend, expected in ((winner, True), (loser, False)):

            async def claim(
                n: int, backend: RabbitMQBackend = backend, expected: bool = expected
            ) -> bool:
                won = await backend.claim(slots[n], instance_id="b", run_id="r", timeout=30)
                return won is expected  # parallel() asserts it

            before, started = cpu_seconds(pid), time.perf_counter()
            await parallel(claim, 0, count, channels)
            elapsed, used = time.perf_counter() - started, cpu_seconds(pid) - before
            figures.append((used * 1000 / count, count / elapsed))
    finally:
        await winner.stop()
        await loser.stop()
        connection = await aio_pika.connect(url)
        async with connection:
            before = cpu_seconds(pid)
            await delete_all(connection, [claim_queue_name(prefix, s) for s in slots], channels)
            expiry_ms = (cpu_seconds(pid) - before) * 1000 / count
    (win_ms, win_rate), (lose_ms, lose_rate) = figures
    print(
        f"broker CPU per claim ({count} each, {channels} in flight): winning {win_ms:.2f} ms"
        f" ({win_rate:.0f}/s), losing {lose_ms:.2f} ms ({lose_rate:.0f}/s); the claim queue's"
        f" expiry later (measured as a delete): {expiry_ms:.2f} ms"
    )
    for instances in (1, 3, 5):
        per_slot = win_ms + expiry_ms + (instances - 1) * lose_ms
        print(
            f"  {instances} instances claiming each slot: {per_slot:.2f} ms of broker CPU per"
            f" slot, a ceiling of {1000 / per_slot:.0f} slots/s"
            f" ({instances * 1000 / per_slot:.0f} claims/s) per broker core"
        )
    return win_ms, lose_ms


async def burst(url: str, count: int, instances: int, channels: int, claim_timeout: str) -> None:
    prefix = f"{RUN}{uuid.uuid4().hex[:6]}"
    clock = SystemClock()
    backends = [
        RabbitMQBackend(url, prefix=prefix, channels=channels, claim_timeout=claim_timeout)
        for _ in range(instances)
    ]
    for backend in backends:
        await backend.start(clock)
    due = clock.now_ms() + 500
    slots = [Slot(f"burst.{n}", due) for n in range(count)]
    answered: list[float] = []
    outcomes: dict[str, int] = {"won": 0, "lost": 0, "overloaded": 0, "other errors": 0}

    async def claim(backend: RabbitMQBackend, slot: Slot) -> None:
        try:
            won = await backend.claim(slot, instance_id="b", run_id="r", timeout=30)
        except BackendError as exc:
            outcomes["overloaded" if "overloaded" in str(exc) else "other errors"] += 1
            return
        outcomes["won" if won else "lost"] += 1
        if won:
            answered.append(clock.now_ms() - due)

    try:
        await asyncio.sleep((due - clock.now_ms()) / 1000)
        await asyncio.gather(*(claim(b, slot) for slot in slots for b in backends))
    finally:
        for backend in backends:
            await backend.stop()
        connection = await aio_pika.connect(url)
        async with connection:
            await delete_all(connection, [claim_queue_name(prefix, s) for s in slots], 16)
    shown = ", ".join(f"{key} {value}" for key, value in outcomes.items())
    print(
        f"burst: {instances} instances x {count} slots due at once, {channels} channels each,"
        f" claim_timeout {claim_timeout}: {shown}"
    )
    if answered:
        p50, p99 = (percentile(answered, q) for q in (50, 99))
        print(
            f"  won claims answered after the slots' instant: p50 {p50:.0f} ms, p99 {p99:.0f}"
            f" ms, max {max(answered):.0f} ms"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--claims", type=int, default=300, help="claims per round and mode")
    parser.add_argument("--rounds", type=int, default=4, help="alternate raw/backend rounds")
    parser.add_argument("--channels", type=int, default=8, help="channels = claims in flight")
    parser.add_argument("--memory", type=int, default=0, help="also measure N live queues")
    parser.add_argument("--cpu", type=int, default=0, help="broker CPU of N claims won/lost")
    parser.add_argument("--beam-pid", type=int, help="the broker's Erlang VM (for --cpu)")
    parser.add_argument("--burst", type=int, default=0, help="N slots due at once per instance")
    parser.add_argument("--instances", type=int, default=3, help="instances in --burst")
    parser.add_argument("--claim-timeout", default="2s", help="claim_timeout in --burst")
    args = parser.parse_args()
    if args.burst:
        await burst(args.url, args.burst, args.instances, args.channels, args.claim_timeout)
        if not args.claims:
            return
    if args.cpu:
        await broker_cpu(args.url, args.cpu, args.channels, beam_pid(args.beam_pid, args.url))
        if not args.claims:
            return

    raw, backend = await compare(args.url, args.claims, args.channels, args.rounds)
    print(
        f"broker {redact_url(args.url)}: {args.rounds} rounds of {args.claims} sequential +"
        f" {args.claims} parallel claims, {args.channels} channels/in flight"
    )
    print(f"{'':10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'claims/s':>11}")
    print(raw.row("raw"))
    print(backend.row("backend"))
    latency = percentile(backend.latencies, 50) / percentile(raw.latencies, 50)
    rate = statistics.median(backend.rates) / statistics.median(raw.rates)
    print(f"backend/raw: p50 latency x{latency:.2f}, claims/s x{rate:.2f}")
    if args.memory:
        per_queue = await memory_per_queue(args.url, args.memory)
        print(f"broker memory: {per_queue:.1f} KB per live claim queue ({args.memory} queues)")


async def remove_what_this_run_made(url: str) -> None:
    """Every queue, stream and exchange of this run's prefixes (the claim queues the measures
    delete, and the backends' slot memory, its lock and fences, the history stream): by
    prefix, through tests/support/leftovers.py (the management API of the node serving the URL's
    port, else its rabbitmqctl), also after Ctrl-C."""
    sys.path.insert(0, ROOT)
    from tests.support.leftovers import remove_rabbitmq

    await remove_rabbitmq(url, RUN)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        url = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--url=")), None)
        if "--url" in sys.argv:
            url = sys.argv[sys.argv.index("--url") + 1]
        asyncio.run(remove_what_this_run_made(url or DEFAULT_URL))

"""NATSBackend claim latency and throughput next to a raw JetStream publish-with-ack.

    .venv/bin/python bench/bench_nats.py [--url nats://127.0.0.1:4222] [--count 5000]

Both sides run in the same process on the same server, interleaved, each on its own connection.
"raw" is ``js.publish`` with a unique ``Nats-Msg-Id`` and a body the size of a claim's to a
stream configured like the claims stream; "claim" is ``NATSBackend.claim`` on a fresh slot (a
win, the common case on the instance that runs it) and on a slot already won (a loss, the case
on every other instance). With 1 in flight the figures are round trips; with 100, throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import nats
from nats.js.api import StorageType, StreamConfig

from brokersched import SystemClock
from brokersched.abc import Slot
from brokersched.backends.nats import NATSBackend

Op = Callable[[int], Awaitable[object]]
CLAIM_BODY_BYTES = 110
ROUNDS = 5  # each line is the median of this many interleaved rounds (the host may be shared)


async def measure(op: Op, count: int, inflight: int) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, ops/s) of ``count`` calls of ``op(i)`` with ``inflight`` at a time."""
    latencies: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            index, next_index = next_index, next_index + 1
            started = time.perf_counter()
            await op(index)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    elapsed = time.perf_counter() - started
    quantiles = statistics.quantiles(latencies, n=100)
    return quantiles[49] * 1000, quantiles[98] * 1000, count / elapsed


async def raw_publisher(url: str, prefix: str) -> tuple[Op, Callable[[], Awaitable[None]]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=f"{prefix}-raw",
            subjects=[f"{prefix}.raw.>"],
            storage=StorageType.FILE,
            duplicate_window=300,
            max_age=300,
            allow_direct=True,  # as the claims stream (5m slot_ttl)
        )
    )
    run = uuid.uuid4().hex[:6]

    body = b"x" * CLAIM_BODY_BYTES  # the size of a claim's body: only the backend differs

    async def publish(index: int) -> object:
        headers = {"Nats-Msg-Id": f"bench:{run}:{index}"}
        return await js.publish(f"{prefix}.raw.bench", body, headers=headers)

    async def close() -> None:
        await js.delete_stream(f"{prefix}-raw")
        await nc.close()

    return publish, close


LABELS = {"raw": "raw publish-with-ack", "won": "claim (won)", "lost": "claim (lost)"}


async def main(url: str, count: int) -> None:
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    publish, close_raw = await raw_publisher(url, prefix)
    backend = NATSBackend(url, prefix=prefix)
    await backend.start(SystemClock())
    base = time.time_ns() // 1_000_000
    rounds = 0

    async def claim_new(index: int) -> object:
        slot = Slot("bench.job", base + rounds * count + index)
        return await backend.claim(slot, instance_id="i", run_id="r", timeout=2)

    async def claim_won(index: int) -> object:  # the slots claim_new just won: all lost
        slot = Slot("bench.job", base + rounds * count + index)
        return await backend.claim(slot, instance_id="j", run_id="r", timeout=2)

    try:
        await measure(publish, 500, 10)  # warm-up
        print(f"NATS at {url}: {count} operations per round, median of {ROUNDS} rounds")
        print(f"{'':26}{'p50 ms':>9}{'p99 ms':>9}{'ops/s':>10}")
        for inflight in (1, 100):
            rows: dict[str, list[tuple[float, float, float]]] = {}
            for _ in range(ROUNDS):  # interleaved, so that load from elsewhere hits all alike
                for name, op in (("raw", publish), ("won", claim_new), ("lost", claim_won)):
                    rows.setdefault(name, []).append(await measure(op, count, inflight))
                rounds += 1
            raw_rate = statistics.median(rate for _, _, rate in rows["raw"])
            for name, label in LABELS.items():
                p50, p99, rate = (statistics.median(col) for col in zip(*rows[name], strict=True))
                ratio = "" if name == "raw" else f"  {raw_rate / rate:.2f}x raw time"
                print(f"{label:20} x{inflight:<4}{p50:9.3f}{p99:9.3f}{rate:10.0f}{ratio}")
    finally:
        await backend.stop()
        await close_raw()
        cleanup = await nats.connect(url)
        for suffix in ("claims", "history"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await cleanup.jetstream().delete_stream(f"{prefix}-{suffix}")
        await cleanup.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="nats://127.0.0.1:4222")
    parser.add_argument("--count", type=int, default=5000)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.count))

"""RedisBackend.claim() next to the raw ``SET NX PX`` it is made of, in the same run; and the
lease backend's acquire + release (two Lua scripts) for scale.

    .venv/bin/python bench/bench_redis.py [--url URL] [--claims 2000] [--rounds 4]
                                          [--concurrency 32] [--cluster]

"raw" is one ``SET key value NX PX 300000`` on a redis-py client of its own (the floor);
"claim" is ``RedisBackend.claim()`` (key naming, the deadline, error translation around the
same command, run in a script behind the eviction guard, which reads ``INFO memory`` and
``INFO stats``); "claim + record read" the same for a slot later than the instance's last read
of the fleet's slot memory, which it reads first (HMGET, one more round trip);
"lease" is ``RedisLeaseBackend.acquire()`` then ``release()`` (a job of its own per call, so
that concurrent calls are not refused by fencing).
They take turns (and turns at going first) over the rounds: one call at a time (latency, p50
and p99 pooled over the rounds) and ``--concurrency`` calls in flight (throughput, the median
round). Every key made here is deleted before the script ends. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio

from brokersched import SystemClock
from brokersched.abc import JobPolicy, Lease, Slot
from brokersched.backends.redis import RedisBackend, RedisLeaseBackend

DEFAULT_URL = os.environ.get("BROKERSCHED_REDIS_URL", "redis://127.0.0.1:6379/0")
Call = Callable[[int], Awaitable[Any]]


async def latency(call: Call, count: int, start: int) -> list[float]:
    samples = []
    for n in range(start, start + count):
        began = time.perf_counter()
        await call(n)
        samples.append(time.perf_counter() - began)
    return samples


async def throughput(call: Call, count: int, start: int, concurrency: int) -> float:
    numbers = iter(range(start, start + count))

    async def worker() -> None:
        for n in numbers:
            await call(n)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - began)


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cluster", action="store_true")
    args = parser.parse_args()
    prefix = "bench" + uuid.uuid4().hex[:8]
    clock = SystemClock()
    raw_client: Any = (
        redis.asyncio.RedisCluster.from_url(args.url)
        if args.cluster
        else redis.asyncio.Redis.from_url(args.url)
    )
    claims = RedisBackend(args.url, prefix=prefix, cluster=args.cluster, max_connections=64)
    leases = RedisLeaseBackend(args.url, prefix=prefix, cluster=args.cluster, max_connections=64)
    await claims.start(clock)
    await leases.start(clock)
    policy = JobPolicy("bench.lease", overlap="allow")  # a job per call: fencing orders slots

    async def raw(n: int) -> Any:
        return await raw_client.set(f"{prefix}:raw:{n}", "x", nx=True, px=300_000)

    async def claim(n: int) -> bool:
        slot = Slot("bench.claim", 1_700_000_000_000 + n)
        return await claims.claim(slot, instance_id="bench", run_id="r", timeout=5.0)

    base = clock.now_ms() - 3_600_000  # slots in the past: always within the clock-skew bound
    ahead = clock.now_ms() + 3_600_000

    async def claim_read(n: int) -> bool:
        # a slot later than this instance's last read of the fleet's slot memory record: the
        # claim reads it first (HMGET, then the claim's script)
        slot = Slot("bench.claim.read", ahead + n)
        return await claims.claim(slot, instance_id="bench", run_id="r", timeout=5.0)

    async def lease(n: int) -> None:
        granted = await leases.acquire(
            Slot(f"bench.lease.{n}", base), policy=policy, instance_id="bench", run_id="r",
            reason="schedule", timeout=5.0,
        )  # fmt: skip
        assert isinstance(granted, Lease)
        await leases.release(granted)

    calls: dict[str, Call] = {
        "raw SET NX PX": raw,
        "claim()": claim,
        "claim() + record read": claim_read,
        "lease acquire+release": lease,
    }
    samples: dict[str, list[float]] = {name: [] for name in calls}
    rates: dict[str, list[float]] = {name: [] for name in calls}
    offset = 0
    try:
        for round_ in range(args.rounds):
            order = list(calls)
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            for name in order:
                samples[name] += await latency(calls[name], args.claims // 4, offset)
                offset += args.claims
                rates[name].append(
                    await throughput(calls[name], args.claims, offset, args.concurrency)
                )
                offset += args.claims
        where = "cluster" if args.cluster else "server"
        print(f"Redis {where} {claims._redis.redacted}, {args.rounds} rounds")
        print(f"{'':24} {'p50 ms':>8} {'p99 ms':>8} {'per s (x' + str(args.concurrency) + ')':>14}")
        for name in calls:
            p50, p99 = percentile(samples[name], 0.5), percentile(samples[name], 0.99)
            rate = statistics.median(rates[name])
            print(f"{name:24} {p50 * 1000:8.3f} {p99 * 1000:8.3f} {rate:14.0f}")
    finally:
        await claims.stop()
        await leases.stop()
        keys = [key async for key in raw_client.scan_iter(match=f"{prefix}:*", count=1000)]
        for start in range(0, len(keys), 500):
            if args.cluster:
                for key in keys[start : start + 500]:
                    await raw_client.delete(key)
            else:
                await raw_client.delete(*keys[start : start + 500])
        await raw_client.aclose()


if __name__ == "__main__":
    asyncio.run(main())

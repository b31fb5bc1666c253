"""Soak: a fleet of 3 schedulers on a 3-node NATS cluster (R3), the claims stream's leader
killed (kill -9) and restarted again and again; prints slots run twice, lost, and how late
runs started after each kill.

    .venv/bin/python bench/chaos_nats.py [KILLS]     # default 10; ~15 s per kill

Starts its own cluster (scripts/cluster-nats.sh, in a temporary directory) and stops it.
Exit status 1 when a slot ran twice.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.cluster_nats import Fleet, NatsCluster, figures, now_ms


async def _until_runs_after(fleet: Fleet, after_ms: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(slot > after_ms for _, slot in fleet.runs()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no run of a slot after {after_ms} within {timeout}s")
        await asyncio.sleep(0.1)


async def soak(cluster: NatsCluster, kills: int) -> bool:
    prefix = f"soak{uuid.uuid4().hex[:8]}"
    stream = f"{prefix}-claims"
    await cluster.wait_whole()  # a fresh cluster places R3 streams only once every node counts
    fleet = await Fleet.start(cluster.servers, prefix)
    faults: list[tuple[int, int]] = []
    try:
        await cluster.wait_current(stream)
        await _until_runs_after(fleet, now_ms() + 1000)
        for _ in range(kills):
            node = await cluster.leader(stream)
            fault = now_ms()
            await cluster.run("kill", str(node))
            await _until_runs_after(fleet, fault + 1000)
            await asyncio.sleep(3)  # the node stays down a while
            await cluster.run("start", str(node))
            await cluster.wait_current(stream)
            await cluster.wait_whole()  # the next kill finds every node counted and current
            await _until_runs_after(fleet, now_ms() + 1000)
            faults.append((node, fault))
        await asyncio.sleep(3)
        await fleet.stop()
    finally:
        await fleet.kill()
    whole = figures(fleet, faults[0][1] if faults else now_ms())
    for i, (node, fault) in enumerate(faults, 1):
        upto = faults[i][1] if i < len(faults) else fleet.stopped_ms
        late = [
            (line["at"] - line["slot_ms"]) / 1000
            for line in fleet.run_lines()
            if fault <= line["slot_ms"] < upto
        ]
        lost = [slot for _, slot in whole.lost if fault - 1000 <= slot < upto]
        print(
            f"kill {i:2d}: leader n{node}, {len(lost)} slots lost, runs at most "
            f"{max(late, default=0):.1f}s late"
        )
    print(f"total: {whole}")
    return not whole.twice


async def main(kills: int) -> int:
    with tempfile.TemporaryDirectory(prefix="brokersched-chaos-") as directory:
        cluster = NatsCluster(Path(directory) / "cluster")
        cluster.up_sync()
        try:
            print(f"cluster ({cluster.mode}): {', '.join(cluster.servers)}")
            return 0 if await soak(cluster, kills) else 1
        finally:
            cluster.down_sync()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kills", nargs="?", type=int, default=10, help="leader kills (10)")
    sys.exit(asyncio.run(main(parser.parse_args().kills)))

"""Chaos soak on a 3-node RabbitMQ cluster: slots run twice, lost, time to resume.

    .venv/bin/python bench/chaos_rabbitmq.py [--kills 10] [--partitions 2] [--ticktimes 60,10]

For each ``net_ticktime`` given, starts a cluster with scripts/cluster.sh rabbitmq, runs the
fleet of tests/support/cluster_rabbitmq.py (3 processes, one per node, every node's URL, 20 jobs
@1 s), then ``--kills`` rounds of: kill -9 a node (in turn), wait until every process claims
again, start the node again; then ``--partitions`` rounds of: cut a node off for
``--cut-seconds``, heal, wait until every process claims again. Prints one line per round and a
summary per ticktime. Stops the cluster at the end. Prints figures; asserts nothing, but exits 1
when a slot ran twice.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.cluster_rabbitmq import (
    PROCESSES,
    Fleet,
    RabbitCluster,
    cluster_name_and_subnet,
    figures,
    members_running,
    running_fleet,
)
from tests.support.wait import until_sync

EVERYONE = set(range(PROCESSES))


def claiming_again(fleet: Fleet, since: float, timeout: float = 120) -> float:
    return until_sync(
        lambda: members_running(fleet, since + 1) == EVERYONE, timeout=timeout, what="resume"
    )


def soak(cluster: RabbitCluster, kills: int, partitions: int, cut_s: float) -> int:
    rounds: list[tuple[str, float, int, float]] = []  # label, resume, lost, stall
    with running_fleet(cluster.urls) as fleet:
        began = time.time()
        claiming_again(fleet, began)
        for n in range(kills):
            node = n % 3 + 1
            killed = time.time()
            cluster.kill(node)
            resumed = claiming_again(fleet, killed)
            time.sleep(1)
            restarted = time.time()
            cluster.start(node)
            claiming_again(fleet, time.time())
            lost = figures(fleet, (killed, time.time() - 1.5), killed)
            rounds.append((f"kill -9 node {node}", resumed, len(lost.lost), lost.resume_s))
            took = time.time() - restarted
            print(f"  {lost.line(f'kill node {node}')} (restart took {took:.1f} s)")
        if partitions and cluster.partition_unavailable:
            print(f"  partition unavailable: {cluster.partition_unavailable}")
            partitions = 0
        for n in range(partitions):
            node = n % 3 + 1
            cut = time.time()
            cluster.partition(node)
            try:
                resumed = claiming_again(fleet, cut)
                time.sleep(max(0.0, cut + cut_s - time.time()))
            finally:
                healed = time.time()
                cluster.heal()
            back = claiming_again(fleet, healed)
            lost = figures(fleet, (cut, time.time() - 1.5), cut)
            rounds.append((f"cut node {node}", resumed, len(lost.lost), lost.resume_s))
            print(
                f"  {lost.line(f'cut node {node} for {healed - cut:.0f} s')}; every process"
                f" claiming again {resumed:.1f} s after the cut, {back:.1f} s after the heal"
            )
        ended = time.time()
    whole = figures(fleet, (began, ended - 1.5))
    print(f"  whole run: {whole.line('all rounds')}")
    for label in ("kill", "cut"):
        mine = [r for r in rounds if r[0].startswith(label)]
        if mine:
            print(
                f"  {label}: {len(mine)} rounds; every process claiming again after"
                f" {min(r[1] for r in mine):.1f}-{max(r[1] for r in mine):.1f} s; slots lost per"
                f" round {min(r[2] for r in mine)}-{max(r[2] for r in mine)} of 20/s; last lost"
                f" slot {max(r[3] for r in mine):.1f} s after the fault at worst"
            )
    return len(whole.twice)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--cut-seconds", type=float, default=22)
    parser.add_argument("--ticktimes", default="60,10", help="net_ticktime values, comma-separated")
    args = parser.parse_args()
    twice = 0
    for ticktime in [int(t) for t in args.ticktimes.split(",")]:
        print(f"== net_ticktime {ticktime} s")
        with tempfile.TemporaryDirectory(prefix="chaos-rabbitmq-") as directory:
            name, subnet = cluster_name_and_subnet("c")
            cluster = RabbitCluster(name, Path(directory) / "c", subnet, ticktime)
            try:
                cluster.up()
                twice += soak(cluster, args.kills, args.partitions, args.cut_seconds)
            finally:
                cluster.down()
    print(f"slots run twice over every run: {twice}")
    return 1 if twice else 0


if __name__ == "__main__":
    sys.exit(main())

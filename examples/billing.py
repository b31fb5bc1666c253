"""Monthly invoices: a job that must never run twice for one slot, and must not be lost to an
outage either. SQLite holds the claims (no server), so separate processes share them.

    python examples/billing.py     # the demo below, every 3 s instead of monthly (~12 s)

1. Instances a and b run; the one that takes the first slot dies after the first invoice (like
   ``kill -9`` or the OOM killer). With ``max_attempts=1`` the other one does not restart that
   slot (the default, 3, would: and invoice the first customer again); it records the slot
   ``interrupted``, and someone checks which invoices went out before sending the rest.
2. Every instance is down for the next slot. Instance c starts later and runs it at once
   (``ctx.reason == "catch-up"``): ``catch_up="12h"`` keeps a missed billing run for hours.

One instance by hand: ``python examples/billing.py --instance-id a --db /tmp/billing.db``
(monthly, on the 1st at 09:00 UTC).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from brokersched import JobContext, Scheduler, SQLiteBackend

JOB = "billing.invoices"
CUSTOMERS = ["ada", "grace", "linus"]


def send_invoices(ctx: JobContext) -> None:  # sync, like many payment clients: a worker thread
    for n, customer in enumerate(CUSTOMERS):
        if ctx.abort_reason == "timeout":  # stop between two invoices (a shutdown lets it
            return  # finish: the drain waits); the run is recorded timed-out
        print(
            f"{ctx.instance_id}: invoice for {customer}, slot {ctx.scheduled_at:%H:%M:%S}"
            f" ({ctx.reason})",
            flush=True,
        )
        if n == 0 and ctx.data and not os.path.exists(marker := ctx.data["crash_once"]):
            Path(marker).touch()  # the demo's first run, whichever instance has it, dies:
            os._exit(1)  # no cleanup, its lease is left to expire
        time.sleep(0.1)


async def instance(args: argparse.Namespace) -> None:
    scheduler = Scheduler(SQLiteBackend(args.db, lease_ttl=args.lease_ttl), instance_id=args.id)
    scheduler.cron(
        JOB,
        args.schedule,
        send_invoices,
        max_attempts=1,  # a run cut short by a dead process is never started again
        catch_up="12h",  # a run missed during an outage or a deploy still happens, hours late
        timeout="30m",  # a run stuck on the payment provider is told to stop (abort_reason)
        data={"crash_once": args.crash_once} if args.crash_once else None,
    )
    async with scheduler:
        await asyncio.sleep(args.seconds)
        job = scheduler.get(JOB)
        assert job is not None
        for r in await job.history():
            slot = datetime.fromtimestamp(r.slot_ms / 1000, UTC)
            print(
                f"{args.id}: history: slot {slot:%H:%M:%S} {r.reason} on {r.instance_id}, "
                f"attempt {r.attempt}: {r.outcome} {r.error or ''}",
                flush=True,
            )


def demo(directory: str) -> int:
    db = str(Path(directory) / "billing.db")

    def start(name: str, seconds: float) -> subprocess.Popen[str]:
        argv = [sys.argv[0], "--instance-id", name, "--db", db, "--seconds", str(seconds)]
        argv += ["--schedule", "*/3 * * * * *", "--lease-ttl", "1s"]  # fast, for a demo
        argv += ["--crash-once", f"{db}.crashed"]
        return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True)

    print("instances a and b start; the first run dies half-way")
    fleet = [start("a", 6), start("b", 6)]
    output = "".join(process.communicate()[0] for process in fleet)
    print(output, end="")
    time.sleep(3.2)  # every instance is down: a slot passes
    print("instance c starts after a slot that nobody ran")
    late = start("c", 1.5).communicate()[0]
    print(late, end="")

    lines = [line.split(": ", 1)[1] for line in (output + late).splitlines()]
    sent = Counter(line.split(" (")[0] for line in lines if line.startswith("invoice for"))
    twice = [invoice for invoice, n in sent.items() if n > 1]
    print(f"\ninvoices sent twice for one slot: {len(twice)}")
    return 1 if twice else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--instance-id", dest="id", help="run one instance (default: the demo)")
    parser.add_argument("--db", default="/tmp/billing.db", help="the SQLite file of claims")
    parser.add_argument("--schedule", default="0 9 1 * *", help="cron (default: monthly)")
    parser.add_argument("--lease-ttl", default="30s", help="how soon a dead runner is noticed")
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long to run")
    parser.add_argument("--crash-once", help="the first run to create this file dies")
    args = parser.parse_args()
    if args.id is not None:
        raise SystemExit(asyncio.run(instance(args)))
    with tempfile.TemporaryDirectory() as directory:
        raise SystemExit(demo(directory))

"""A one-off data migration with ``at()``, run once by a fleet: every instance registers it, one
runs it. SQLite holds the claims (no server), so separate processes share them.

    python examples/migration.py        # starts two instances at once, then a third one late

or one instance by hand (start it twice, in two terminals, with the same --at and --db)::

    python examples/migration.py --instance-id a --db /tmp/migration.db --at 2027-01-01T02:00Z

Every instance must get the *same* time: it names the slot that the instances claim. Computed
at start (``now() + 1h``) it would differ per process, and each would run its own migration.
An instance that starts less than ``max_late`` after that time still claims it and runs it
late, once for the fleet; a time further back is not run.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from brokersched import JobContext, Scheduler, SQLiteBackend

JOB = "orders.v2-migration"


async def migrate(ctx: JobContext) -> None:
    print(f"{ctx.instance_id}: migrating the orders to v2 (reason {ctx.reason})", flush=True)
    await asyncio.sleep(1.0)  # pretend to rewrite the rows
    print(f"{ctx.instance_id}: migration done", flush=True)


async def instance(instance_id: str, db: str, when: datetime, seconds: float) -> None:
    scheduler = Scheduler(SQLiteBackend(db), instance_id=instance_id)
    scheduler.at(
        JOB,
        when,
        migrate,
        jitter=0,  # one run: nothing to spread
        max_late="1h",  # an instance slow to reach it (a busy loop, a frozen VM) still runs it
        timeout="30m",  # a migration stuck on a lock ends, and says so in the history
        max_attempts=1,  # a runner that dies half-way is not restarted blindly: look first
    )
    async with scheduler:
        await asyncio.sleep(seconds)
        job = scheduler.get(JOB)
        assert job is not None
        runs = [f"{r.outcome} on {r.instance_id}" for r in await job.history()]
    print(f"{instance_id}: the history of {JOB}: {', '.join(runs) or 'no run'}", flush=True)


def demo(directory: str) -> int:
    """Two instances started at the same moment, and a third started after the migration's time
    (the next deploy): the migration runs once."""
    when = datetime.now(UTC) + timedelta(seconds=4)  # time enough for both to start
    db = str(Path(directory) / "migration.db")
    print(f"the migration is due at {when:%H:%M:%S.%f}; instances a and b start now")

    def start(name: str, seconds: float) -> subprocess.Popen[str]:
        argv = [sys.argv[0], "--instance-id", name, "--db", db, "--at", when.isoformat()]
        argv += ["--seconds", str(seconds)]
        return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True)

    first = [start("a", 6.5), start("b", 6.5)]
    time.sleep(5)
    print("instance c starts after the migration's time")
    late = start("c", 1.5)
    output = "".join(process.communicate()[0] for process in [*first, late])
    print(output, end="")
    ran = output.count("migrating the orders")
    print(f"\nthe migration ran {ran} time(s) on three instances")
    return 0 if ran == 1 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--instance-id", help="run one instance (default: the demo)")
    parser.add_argument("--db", default="/tmp/migration.db", help="the SQLite file of claims")
    parser.add_argument("--at", type=datetime.fromisoformat, help="when to migrate (ISO 8601)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long an instance runs")
    args = parser.parse_args()
    if args.instance_id is None:
        with tempfile.TemporaryDirectory() as directory:
            raise SystemExit(demo(directory))
    if args.at is None or args.at.tzinfo is None:
        parser.error("--at needs a time with its zone, e.g. 2027-01-01T02:00Z")
    asyncio.run(instance(args.instance_id, args.db, args.at, args.seconds))

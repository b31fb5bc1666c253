"""A fleet of scheduler processes: how late, how many slots run twice or never, at what CPU.

    .venv/bin/python bench/fleet.py [--backend postgres,nats] [--procs 3] [--jobs 20]
                                    [--seconds 10] [--jitter 0,default] [--apscheduler]

For each backend (``sqlite``, ``postgres``, ``nats``, ``rabbitmq``, ``redis``,
``natslease``; the memory backend is one process, so not a fleet) and each jitter (``0``,
``default`` = a quarter of the interval, 250 ms, or any duration), ``--procs`` OS processes each
run a ``Scheduler`` on that backend (a unique schema, prefix or file) with the same ``--jobs``
jobs ``every("job.N", "1s")`` whose handler sleeps 50 ms. Once all are started, each is given
the same window of ``--seconds`` on the wall clock; what happens inside it is measured:

* ``twice``: slots run more than once (must be 0); ``missed``: slots of the window (but its
  last second) run nowhere (or more than 3 s after the window's end);
* ``p50``/``p99``: lateness, handler start minus the slot's time, on the true (wall) clock of
  the one machine all processes share; it includes the jitter (the earliest claimer wins);
* ``cpu/run``: CPU time (user + system) of all scheduler processes over the window divided by
  the runs in it (``inst``), and the same for the server (``srv``): PostgreSQL's connection
  processes of this fleet (found by ``application_name`` in ``pg_stat_activity``), or the
  whole ``nats-server``, RabbitMQ ``beam.smp`` (the one serving the URL's port) or
  ``redis-server`` process (which other clients of a shared server add to). Read from
  ``/proc/<pid>/stat`` (Linux).

``--apscheduler PYTHON``: the same shape with APScheduler 4 on PostgreSQL (SQLAlchemy data store
+ asyncpg event broker), run by ``PYTHON`` from a venv of its own (it is not a dependency):
``python -m venv /tmp/aps && /tmp/aps/bin/pip install 'apscheduler>=4.0.0a5' asyncpg
'sqlalchemy[asyncio]' sniffio 'anyio<4.9'`` (4.0.0a6 fails on anyio 4.9 and later); only its
jitter 0 row is run (it has no jitter), and its event broker's LISTEN connection is not
counted. Everything made on a server is deleted afterwards. Prints; asserts nothing.

``--claims INSTANTS``: only the claims, in this process, on ``sqlite``, ``postgres`` and
``natslease``:
``--procs`` backend objects claim the same ``--jobs`` slots at each of INSTANTS instants, one
``acquire()`` per slot, then one ``acquire_many()`` per instant; prints the time per instant and
the CPU per slot of this process (``cli``) and of the server's connections (``srv``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brokersched import ConfigurationError, parse_duration

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("sqlite", "postgres", "nats", "rabbitmq", "redis", "natslease")
PG_DSN = os.environ.get("BROKERSCHED_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
NATS_URL = os.environ.get("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222")
AMQP_URL = os.environ.get("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("BROKERSCHED_REDIS_URL", "redis://127.0.0.1:6379/0")
# The server process whose CPU is read, by name (pgrep -x) and, optionally, command line.
SERVER_PROCESS = {"nats": ("nats-server", ""), "rabbitmq": ("beam.smp", ""),
                  "redis": ("redis-server", ":6379"), "natslease": ("nats-server", "")}  # fmt: skip
TICK = os.sysconf("SC_CLK_TCK")

# One scheduler process. argv: a JSON spec. Runs are kept in memory (printing each one would
# cost CPU the measure counts) and printed once, with the CPU over the window, at its end.
MEMBER = """
import asyncio, json, sys, time
import brokersched
from brokersched import Scheduler

LATE_S = 3

spec = json.loads(sys.argv[1])
runs = []


async def handler(ctx):
    runs.append((ctx.job, ctx.slot_ms, time.time() * 1000))
    await asyncio.sleep(0.05)


def backend():
    kind, where = spec["backend"], spec["where"]
    if kind == "sqlite":
        return brokersched.SQLiteBackend(where)
    if kind == "postgres":
        return brokersched.PostgresBackend(where, schema=spec["name"])
    if kind == "nats":
        return brokersched.NATSBackend(where, prefix=spec["name"])
    if kind == "natslease":
        return brokersched.NATSLeaseBackend(where, bucket=spec["name"])
    if kind == "rabbitmq":
        return brokersched.RabbitMQBackend(where, prefix=spec["name"])
    return brokersched.RedisBackend(where, prefix=spec["name"])


async def main():
    options = {} if spec["jitter"] == "default" else {"jitter": spec["jitter"]}
    scheduler = Scheduler(backend())
    for n in range(spec["jobs"]):
        scheduler.every(f"job.{n}", "1s", handler, **options)
    async with scheduler:
        print(json.dumps({"ready": scheduler.instance_id}), flush=True)
        start, stop = map(float, (await asyncio.to_thread(sys.stdin.readline)).split())
        await asyncio.sleep(max(0.0, start - time.time()))
        cpu = time.process_time()
        await asyncio.sleep(max(0.0, stop - time.time()))
        cpu = time.process_time() - cpu
        await asyncio.sleep(LATE_S)  # the window's last slots may start after its end
        print(json.dumps({"cpu": cpu, "runs": runs}), flush=True)


asyncio.run(main())
"""

# The same with APScheduler 4 on PostgreSQL; the handler must be importable by reference.
APS_MEMBER = """
import asyncio, json, sys, time
from datetime import UTC, datetime

from apscheduler import AsyncScheduler, current_job
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.asyncpg import AsyncpgEventBroker
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy.ext.asyncio import create_async_engine

LATE_S = 3

runs = []


async def handler():
    job = current_job.get()
    runs.append((job.schedule_id, job.scheduled_fire_time.timestamp() * 1000, time.time() * 1000))
    await asyncio.sleep(0.05)


async def main(spec):
    settings = {"application_name": spec["tag"]}
    engine = create_async_engine(spec["where"], connect_args={"server_settings": settings})
    store = SQLAlchemyDataStore(engine, schema=spec["name"])
    broker = AsyncpgEventBroker.from_async_sqla_engine(engine)
    async with AsyncScheduler(store, broker, max_concurrent_jobs=1000) as scheduler:
        if spec["first"]:
            epoch = datetime.fromtimestamp(spec["epoch"], UTC)
            for n in range(spec["jobs"]):
                await scheduler.add_schedule(
                    handler, IntervalTrigger(seconds=1, start_time=epoch), id=f"job.{n}",
                    misfire_grace_time=60,
                )
        await scheduler.start_in_background()
        print(json.dumps({"ready": spec["name"]}), flush=True)
        start, stop = map(float, (await asyncio.to_thread(sys.stdin.readline)).split())
        await asyncio.sleep(max(0.0, start - time.time()))
        cpu = time.process_time()
        await asyncio.sleep(max(0.0, stop - time.time()))
        cpu = time.process_time() - cpu
        await asyncio.sleep(LATE_S)  # the window's last slots may start after its end
        print(json.dumps({"cpu": cpu, "runs": runs}), flush=True)
        await scheduler.stop()
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def server_pids(name: str, pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-a", "-x", name], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in found.splitlines() if pattern in line]


def rabbitmq_pids(url: str) -> list[int]:
    """The Erlang VM serving ``url``'s port (several RabbitMQ nodes may run here: the 3.10
    service, scripts/rabbitmq4.sh's 4.0 nodes), else every ``beam.smp``."""
    sys.path.insert(0, str(ROOT))
    from tests.support.beam import serving_pid, url_port

    pid = serving_pid(url_port(url))
    return [pid] if pid is not None else server_pids("beam.smp", "")


@dataclass
class Result:
    label: str
    runs: int = 0
    twice: int = 0
    missed: int = 0
    p50: float = 0.0
    p99: float = 0.0
    inst_ms: float = 0.0
    server_ms: float | None = None

    def line(self) -> str:
        server = "-" if self.server_ms is None else f"{self.server_ms:.2f}"
        return (
            f"{self.label:<34} {self.runs:>6} {self.twice:>5} {self.missed:>6} "
            f"{self.p50:>7.1f} {self.p99:>7.1f} {self.inst_ms:>9.2f} {server:>8}"
        )


HEADER = (
    f"{'fleet':<34} {'runs':>6} {'twice':>5} {'missed':>6} {'p50 ms':>7} {'p99 ms':>7} "
    f"{'inst ms/run':>9} {'srv ms/run':>8}"
)


class ServerCPU:
    """The CPU the server spends for this fleet, sampled at the window's two ends."""

    def __init__(self, pids: Callable[[], Awaitable[list[int]]]) -> None:
        self._pids = pids
        self._start: dict[int, float] = {}
        self._end: dict[int, float] = {}

    async def sample(self, end: bool) -> None:
        readings = {pid: cpu_seconds(pid) for pid in await self._pids()}
        if end:
            self._end = readings
        else:
            self._start = readings

    def seconds(self) -> float:
        return sum(cpu - self._start.get(pid, 0.0) for pid, cpu in self._end.items())


async def postgres_pids(tag: str) -> list[int]:
    import asyncpg

    conn = await asyncpg.connect(PG_DSN)
    try:
        rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE application_name = $1", tag)
    finally:
        await conn.close()
    return [row["pid"] for row in rows]


async def cleanup(backend: str, name: str, where: str) -> None:
    """Delete everything the fleet made on the server, by its prefix (``brokersched purge``'s
    ``Backend.inventory()``/``purge()``, then by name: tests/support/leftovers.py); also after
    Ctrl-C, from ``fleet``'s ``finally``. RabbitMQ's claim queues would expire by themselves,
    but not the history stream, the slot memory and its fences."""
    if backend == "sqlite":
        shutil.rmtree(Path(where).parent, ignore_errors=True)
        return
    sys.path.insert(0, str(ROOT))
    from tests.support.leftovers import REMOVE

    kind, url = {
        "postgres": ("postgres", PG_DSN),
        "apscheduler": ("postgres", PG_DSN),
        "nats": ("nats", NATS_URL),
        "natslease": ("nats", NATS_URL),
        "redis": ("redis", REDIS_URL),
        "rabbitmq": ("amqp", AMQP_URL),
    }[backend]
    await REMOVE[kind](url, name)


async def fleet(backend: str, procs: int, jobs: int, seconds: int, jitter: str, python: str = "",
                aps_dir: str = "") -> Result:  # fmt: skip
    name = f"fleet{uuid.uuid4().hex[:8]}"
    tag = f"brokersched-{name}"
    server: ServerCPU | None = None
    if backend == "sqlite":
        where = str(Path(tempfile.mkdtemp(prefix="fleet-")) / "fleet.db")
    elif backend in ("postgres", "apscheduler"):
        joiner = "&" if "?" in PG_DSN else "?"
        where = f"{PG_DSN}{joiner}application_name={tag}"
        if backend == "apscheduler":  # SQLAlchemy takes the name in connect_args
            where = PG_DSN.replace("postgresql://", "postgresql+asyncpg://", 1)
        server = ServerCPU(lambda: postgres_pids(tag))
    else:
        urls = {"nats": NATS_URL, "natslease": NATS_URL, "rabbitmq": AMQP_URL}
        where = urls.get(backend, REDIS_URL)
        process, pattern = SERVER_PROCESS[backend]

        async def pids() -> list[int]:
            if backend == "rabbitmq":  # the node serving the URL's port, of those running here
                return rabbitmq_pids(where)
            return server_pids(process, pattern)

        server = ServerCPU(pids)
    spec: dict[str, Any] = {
        "backend": backend, "where": where, "name": name, "tag": tag, "jobs": jobs,
        "jitter": jitter, "epoch": time.time() // 1 + 1,
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    members: list[asyncio.subprocess.Process] = []
    try:
        for n in range(procs):
            if backend == "apscheduler":  # python: APScheduler's; aps_dir: its member module
                code = "import json, sys, asyncio, aps_member as m; asyncio.run(m.main(json.loads(sys.argv[1])))"  # noqa: E501
                argv = [python, "-c", code, json.dumps({**spec, "first": n == 0})]
                member_env = {**env, "PYTHONPATH": aps_dir}
            else:
                argv, member_env = [sys.executable, "-c", MEMBER, json.dumps(spec)], env
            member = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env=member_env, limit=1 << 26,  # the runs come back in one line
            )  # fmt: skip
            members.append(member)
            if n == 0:  # the first creates the schema or the streams; the others find them
                await _ready(member)
        for member in members[1:]:
            await _ready(member)
        start = time.time() // 1 + 2.0  # a whole second, after every process armed its jobs
        stop = start + seconds
        for member in members:
            assert member.stdin is not None
            member.stdin.write(f"{start} {stop}\n".encode())
            await member.stdin.drain()
        if server is not None:
            await asyncio.sleep(start - time.time())
            await server.sample(end=False)
            await asyncio.sleep(stop - time.time() - 0.05)
            await server.sample(end=True)
        reports = [json.loads(await _line(member, seconds + 30)) for member in members]
    finally:
        for member in members:
            if member.stdin is not None:
                member.stdin.close()
        for member in members:
            try:
                await asyncio.wait_for(member.wait(), 30)
            except TimeoutError:
                member.kill()
        await cleanup(backend, name, where)
    return _result(backend, procs, jobs, jitter, start, stop, reports, server)


async def _line(member: asyncio.subprocess.Process, timeout: float) -> bytes:
    assert member.stdout is not None
    line = await asyncio.wait_for(member.stdout.readline(), timeout)
    if not line:
        raise RuntimeError(f"a fleet process exited with {await member.wait()}")
    return line


async def _ready(member: asyncio.subprocess.Process) -> None:
    assert "ready" in json.loads(await _line(member, 60))


def _result(backend: str, procs: int, jobs: int, jitter: str, start: float,
            stop: float, reports: list[dict[str, Any]], server: ServerCPU | None,
            ) -> Result:  # fmt: skip
    start_ms, stop_ms = start * 1000, stop * 1000
    counts: dict[tuple[str, int], int] = {}
    late: list[float] = []
    runs = 0
    for report in reports:
        for job, slot_ms, began_ms in report["runs"]:
            if not start_ms <= slot_ms < stop_ms:
                continue
            runs += 1
            key = (job, round(slot_ms))
            counts[key] = counts.get(key, 0) + 1
            late.append(began_ms - slot_ms)
    slots = [round(start_ms) + 1000 * s for s in range(round((stop_ms - start_ms) / 1000) - 1)]
    missed = sum((f"job.{n}", slot) not in counts for n in range(jobs) for slot in slots)
    twice = sum(n > 1 for n in counts.values())
    quantiles = statistics.quantiles(late, n=100) if len(late) > 1 else [0.0] * 99
    cpu = sum(report["cpu"] for report in reports)
    name = "APScheduler 4 postgres" if backend == "apscheduler" else backend
    label = f"{name} {procs}x{jobs} jitter {jitter}"
    return Result(
        label, runs, twice, missed, quantiles[49], quantiles[98],
        1000 * cpu / max(runs, 1),
        None if server is None else 1000 * server.seconds() / max(runs, 1),
    )  # fmt: skip


async def claims_only(backend: str, procs: int, jobs: int, rounds: int, batched: bool) -> str:
    """``procs`` backend objects (one process) claim the same ``jobs`` slots per instant, one
    ``acquire`` per slot or one ``acquire_many``, ``rounds`` instants: the claim's own cost."""
    from brokersched import NATSLeaseBackend, PostgresBackend, SQLiteBackend, SystemClock
    from brokersched.abc import Claim, JobPolicy, LeaseBackend, Slot

    name = f"fleet{uuid.uuid4().hex[:8]}"
    tag = f"brokersched-{name}"
    directory = tempfile.mkdtemp(prefix="fleet-")
    where = str(Path(directory) / "fleet.db")
    backends: list[LeaseBackend] = []
    for _ in range(procs):
        if backend == "postgres":
            joiner = "&" if "?" in PG_DSN else "?"
            dsn = f"{PG_DSN}{joiner}application_name={tag}"
            backends.append(PostgresBackend(dsn, schema=name))
        elif backend == "natslease":
            backends.append(NATSLeaseBackend(NATS_URL, bucket=name))
        else:
            backends.append(SQLiteBackend(where))
    for each in backends:
        await each.start(SystemClock())
    policies = [JobPolicy(f"job.{n}", overlap="allow") for n in range(jobs)]
    base = time.time_ns() // 1_000_000 - 10_000_000
    server = ServerCPU(lambda: postgres_pids(tag)) if backend == "postgres" else None
    if backend == "natslease":

        async def nats_pids() -> list[int]:
            return server_pids(*SERVER_PROCESS["natslease"])

        server = ServerCPU(nats_pids)

    async def instant(each: LeaseBackend, slot_ms: int) -> None:
        claims = [Claim(Slot(p.name, slot_ms), "run", p) for p in policies]
        if batched:
            await each.acquire_many(claims, instance_id="bench", timeout=10)
            return
        await asyncio.gather(*(
            each.acquire(c.slot, policy=c.policy, instance_id="bench", run_id="run",
                         reason="schedule", timeout=10)
            for c in claims
        ))  # fmt: skip

    try:
        await asyncio.gather(*(instant(each, base - 1000) for each in backends))  # warm up
        if server is not None:
            await server.sample(end=False)
        cpu, began = time.process_time(), time.perf_counter()
        for n in range(rounds):
            await asyncio.gather(*(instant(each, base + n * 1000) for each in backends))
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        if server is not None:
            await server.sample(end=True)
    finally:
        for each in backends:
            await each.stop()
        await cleanup(backend, name, where)
        shutil.rmtree(directory, ignore_errors=True)
    slots = jobs * rounds
    srv = "-" if server is None else f"{1000 * server.seconds() / slots:.3f}"
    how = "acquire_many" if batched else "acquire each"
    return (
        f"{backend:<8} {procs}x{jobs:<4} {how:<13} {1000 * wall / rounds:>10.1f} "
        f"{1000 * cpu / slots:>11.3f} {srv:>10}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=",".join(BACKENDS),
                        help=f"comma-separated, of {', '.join(BACKENDS)}")  # fmt: skip
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--jitter", default="0,default", help="comma-separated: 0, default, 1s")
    parser.add_argument("--apscheduler", metavar="PYTHON", help="APScheduler 4's python")
    parser.add_argument("--claims", type=int, metavar="INSTANTS",
                        help="only the claims: one at a time, then batched")  # fmt: skip
    args = parser.parse_args()
    backends = [b for b in args.backend.split(",") if b]
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
    for jitter in args.jitter.split(","):
        if jitter != "default":
            try:
                parse_duration(jitter, name="--jitter")
            except ConfigurationError as exc:
                parser.error(f"{exc}, or 'default'")
    if args.claims:
        print("backend  shape  claims        ms/instant  cli ms/slot srv ms/slot", flush=True)
        for backend in (b for b in backends if b in ("sqlite", "postgres", "natslease")):
            for batched in (False, True):
                shape = (backend, args.procs, args.jobs, args.claims, batched)
                print(asyncio.run(claims_only(*shape)), flush=True)
        return
    print(HEADER, flush=True)
    for backend in backends:
        for jitter in args.jitter.split(","):
            shape = (args.procs, args.jobs, args.seconds, jitter)
            result = asyncio.run(fleet(backend, *shape))
            print(result.line(), flush=True)
    if args.apscheduler:
        with tempfile.TemporaryDirectory(prefix="fleet-aps-") as aps_dir:
            Path(aps_dir, "aps_member.py").write_text(APS_MEMBER)
            shape = (args.procs, args.jobs, args.seconds, "0", args.apscheduler, aps_dir)
            result = asyncio.run(fleet("apscheduler", *shape))
        print(result.line(), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

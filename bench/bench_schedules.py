"""Stored schedules at scale: writing N schedules, a fresh instance loading them, and a change
reaching a running fleet, per backend, side by side with APScheduler 4's data store.

    .venv/bin/python bench/bench_schedules.py [--backend postgres,redis,nats,rabbitmq]
                                              [--n 100] [--instances 3] [--changes 20]
                                              [--concurrency 8] [--concurrent-puts 200]
                                              [--no-apscheduler] [--profile DIR]

The schedules, as a SaaS team with a schedule per tenant would write them: ``--n`` crons
``f"{i % 60} * * * *"`` in Europe/Paris (``tenant.NNNNN``, ``data={"tenant": i}``: each minute
of the hour has its tenants) and ``--n``/10 ``every="10s"`` (``poll.NNNNN``), one task
``bench.run`` whose handler does nothing. On each backend (a unique prefix or schema per run,
everything removed at the end, also after Ctrl-C: ``tests/support/leftovers.py``'s removal):

* ``put``: one writer ``Scheduler`` (started, no task registered, so it follows nothing) writes
  them one after the other (``seq``: wall time, per put p50/p99), then ``--concurrent-puts`` of
  them again (a change of ``data``) ``--concurrency`` at a time (``c8``: the wall time scaled
  to all of them, per put p50/p99, and the puts that failed: ``BackendError``, the log's
  compare-and-set losing 20 times);
* ``load``: ``--instances`` fresh processes, started one after the other, each a ``Scheduler``
  with the task registered: ``start()`` until ``len(scheduler.jobs())`` is the total (the
  figure is the median over the instances, the slowest in brackets), and the resident memory
  it grew by (``/proc/self/statm`` after ``gc.collect()``, before ``start()`` and once loaded)
  per schedule. Each process first starts and stops the same scheduler on an empty prefix
  (imports, connections: ``the same start with no schedule``), so neither figure counts them;
* ``change``: with all of them running, ``--changes`` new schedules (a cron each) written by
  the writer one at a time; the time from ``put()`` returning to every instance answering
  ``scheduler.get(id)`` (each polls every 5 ms, wall clock of this machine), p50/p99;
* ``runs``: while they ran, the slots run twice (must be 0) and the ``every="10s"`` slots run
  against those due in the window (from 5 s after the last instance loaded to 3 s before they
  stop; brokersched's interval slots fall on multiples of 10 s since the epoch, APScheduler's
  on 10 s steps from the write, which may move its count by one per schedule).

APScheduler 4 (``apscheduler==4.0.0a6``, its SQLAlchemy data store on PostgreSQL with the
asyncpg event broker, a schema of its own; installed beside brokersched, with ``anyio==4.13.0``
and ``sniffio``, see docs/benchmarks.md) does the same: ``add_schedule`` with a
``CronTrigger.from_crontab(..., timezone="Europe/Paris", start_time=<now in Paris>)`` (without
``start_time`` 4.0.0a6 gives every first fire an hour early, in the past, and its instances
spend the measured window running those) or an ``IntervalTrigger``; its
instances keep no schedule in memory (each acquires the due ones from the database), so its
``load`` is ``start_in_background()`` returning and its ``change`` the time until every
instance receives the ``ScheduleAdded`` event. Skipped, said so, when it is not importable.

``--profile DIR``: cProfile of the writer's sequential puts and of the first instance's load,
written to DIR as ``<backend>-put.prof`` and ``<backend>-load.prof``, their top functions
printed. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BACKENDS = ("postgres", "redis", "nats", "rabbitmq")
PG_DSN = os.environ.get("BROKERSCHED_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
NATS_URL = os.environ.get("BROKERSCHED_NATS_URL", "nats://127.0.0.1:4222")
AMQP_URL = os.environ.get("BROKERSCHED_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("BROKERSCHED_REDIS_URL", "redis://127.0.0.1:6379/0")
TASK = "bench.run"
TZ = "Europe/Paris"
EVERY_S = 10
PAGE = os.sysconf("SC_PAGE_SIZE")
# What the instance processes share with this one: the schedules, by index.
SHARED = """
import gc, os, time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss():
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def cron_id(i):
    return f"tenant.{i:05d}"


def every_id(i):
    return f"poll.{i:05d}"


def change_id(k):
    return f"change.{k:03d}"


def cron_of(i):
    return f"{i % 60} * * * *"
"""

# One brokersched instance. argv: a JSON spec. Reports its load, then the changes it sees, then
# (on "stop" read from stdin) the slots it ran.
MEMBER = """
import asyncio, cProfile, json, sys, time
import brokersched
from brokersched import Scheduler
from shared import change_id, rss

spec = json.loads(sys.argv[1])
runs = []


def backend(name):
    kind, where = spec["backend"], spec["where"]
    if kind == "postgres":
        return brokersched.PostgresBackend(where, schema=name)
    if kind == "nats":
        return brokersched.NATSBackend(where, prefix=name)
    if kind == "rabbitmq":
        return brokersched.RabbitMQBackend(where, prefix=name)
    return brokersched.RedisBackend(where, prefix=name)


def scheduler_of(name):
    scheduler = Scheduler(backend(name))

    @scheduler.task("bench.run")
    async def run(ctx):
        runs.append((ctx.job, ctx.slot_ms))

    return scheduler


async def main():
    # The same start on an empty prefix first: its imports, connections and caches are not
    # the schedules' (the baseline of the time and the memory).
    empty = scheduler_of(spec["name"] + "empty")
    began = time.perf_counter()
    await empty.start()
    empty_s = time.perf_counter() - began
    await empty.stop()
    scheduler = scheduler_of(spec["name"])
    before = rss()
    profile = cProfile.Profile() if spec["profile"] else None
    began = time.perf_counter()
    if profile:
        profile.enable()
    await scheduler.start()
    while len(scheduler.jobs()) < spec["total"]:
        await asyncio.sleep(0.005)
    loaded = time.perf_counter() - began
    if profile:
        profile.disable()
        profile.dump_stats(spec["profile"])
    grew = rss() - before
    report = {"load_s": loaded, "empty_s": empty_s, "rss": grew, "at": time.time()}
    print(json.dumps(report), flush=True)
    stopping = asyncio.ensure_future(asyncio.to_thread(sys.stdin.readline))
    for k in range(spec["changes"]):
        while scheduler.get(change_id(k)) is None:
            if stopping.done():
                break
            await asyncio.sleep(0.005)
        else:
            print(json.dumps({"seen": k, "at": time.time()}), flush=True)
            continue
        break
    await stopping
    stopped = time.time()
    await scheduler.stop()
    print(json.dumps({"runs": runs, "stopped": stopped}), flush=True)


asyncio.run(main())
"""

# One APScheduler 4 instance, the same reports (its handler must be importable by reference).
APS_MEMBER = """
import asyncio, json, sys, time

from apscheduler import AsyncScheduler, ScheduleAdded, current_job
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.asyncpg import AsyncpgEventBroker
from sqlalchemy.ext.asyncio import create_async_engine
from shared import change_id, rss

runs = []


async def handler():
    job = current_job.get()
    runs.append((job.schedule_id, job.scheduled_fire_time.timestamp() * 1000))


def scheduler_of(spec):
    engine = create_async_engine(spec["where"])
    store = SQLAlchemyDataStore(engine, schema=spec["name"])
    broker = AsyncpgEventBroker.from_async_sqla_engine(engine)
    return AsyncScheduler(store, broker, max_concurrent_jobs=1000)


async def main(spec):
    seen = {}
    wanted = {change_id(k): k for k in range(spec["changes"])}

    def added(event):
        if event.schedule_id in wanted and event.schedule_id not in seen:
            seen[event.schedule_id] = time.time()
            print(json.dumps({"seen": wanted[event.schedule_id], "at": seen[event.schedule_id]}),
                  flush=True)

    # The same start with no schedule first (a schema of its own): imports, connections.
    began = time.perf_counter()
    async with scheduler_of({**spec, "name": spec["name"] + "empty"}) as empty:
        await empty.start_in_background()
        empty_s = time.perf_counter() - began
        await empty.stop()
    before = rss()
    began = time.perf_counter()
    async with scheduler_of(spec) as scheduler:
        scheduler.subscribe(added, {ScheduleAdded}, is_async=False)
        await scheduler.start_in_background()
        loaded = time.perf_counter() - began
        report = {"load_s": loaded, "empty_s": empty_s, "rss": rss() - before, "at": time.time()}
        print(json.dumps(report), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        stopped = time.time()
        await scheduler.stop()
    print(json.dumps({"runs": runs, "stopped": stopped}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
"""


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Result:
    label: str
    total: int = 0
    seq_s: float = 0.0
    seq: list[float] = field(default_factory=list)
    c8_s: float = 0.0  # scaled to the total
    c8: list[float] = field(default_factory=list)
    c8_failed: int = 0
    loads: list[float] = field(default_factory=list)
    empty: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    changes: list[float] = field(default_factory=list)
    changes_lost: int = 0
    twice: int = 0
    every_run: int = 0
    every_due: int = 0
    note: str = ""

    def cells(self) -> list[str]:
        ms = lambda values, q: f"{pct(values, q) * 1000:.1f}"  # noqa: E731
        load = f"{statistics.median(self.loads):.2f} ({max(self.loads):.2f})" if self.loads else "-"
        empty = f"{statistics.median(self.empty):.2f}" if self.empty else "-"
        per = f"{statistics.median(self.rss) / max(self.total, 1) / 1024:.1f}" if self.rss else "-"
        changed = (
            f"{ms(self.changes, 0.5)} / {ms(self.changes, 0.99)}"
            + (f" ({self.changes_lost} not seen)" if self.changes_lost else "")
            if self.changes or self.changes_lost
            else "-"
        )
        return [
            f"{self.seq_s:.1f}",
            f"{ms(self.seq, 0.5)} / {ms(self.seq, 0.99)}",
            f"{self.c8_s:.1f}" + (f" ({self.c8_failed} failed)" if self.c8_failed else ""),
            f"{ms(self.c8, 0.5)} / {ms(self.c8, 0.99)}" if self.c8 else "-",
            load,
            empty,
            per,
            changed,
            str(self.twice),
            f"{self.every_run} / {self.every_due}",
        ]


ROWS = [
    "put all, sequential (s)",
    "per put p50 / p99 (ms)",
    "put all, 8 at a time (s)",
    "per put p50 / p99 (ms), 8 at a time",
    "load at start, median (slowest) (s)",
    "the same start with no schedule (s)",
    "memory per schedule per instance (KB, RSS)",
    "change seen by all instances p50 / p99 (ms)",
    "slots run twice",
    "every-10s slots run / due",
]


def print_table(results: list[Result], n: int) -> None:
    print()
    print(f"Stored schedules: {n} crons + {n // 10} every 10 s")
    header = ["", *(r.label for r in results)]
    lines = [header, ["---"] * len(header)]
    columns = [r.cells() for r in results]
    for i, row in enumerate(ROWS):
        lines.append([row, *(c[i] for c in columns)])
    for line in lines:
        print("| " + " | ".join(line) + " |")
    for r in results:
        if r.note:
            print(f"{r.label}: {r.note}")


def make_backend(kind: str, name: str) -> Any:
    import brokersched

    if kind == "postgres":
        return brokersched.PostgresBackend(PG_DSN, schema=name)
    if kind == "nats":
        return brokersched.NATSBackend(NATS_URL, prefix=name)
    if kind == "rabbitmq":
        return brokersched.RabbitMQBackend(AMQP_URL, prefix=name)
    return brokersched.RedisBackend(REDIS_URL, prefix=name)


def where_of(kind: str) -> str:
    return {
        "postgres": PG_DSN,
        "nats": NATS_URL,
        "rabbitmq": AMQP_URL,
        "redis": REDIS_URL,
        "apscheduler": PG_DSN.replace("postgresql://", "postgresql+asyncpg://", 1),
    }[kind]


async def cleanup(kind: str, name: str) -> None:
    from tests.support.leftovers import REMOVE

    server, url = {
        "postgres": ("postgres", PG_DSN),
        "apscheduler": ("postgres", PG_DSN),
        "nats": ("nats", NATS_URL),
        "redis": ("redis", REDIS_URL),
        "rabbitmq": ("amqp", AMQP_URL),
    }[kind]
    await REMOVE[server](url, name)


async def timed_puts(
    calls: list[Callable[[], Awaitable[Any]]], concurrency: int
) -> tuple[float, list[float], int]:
    """Run ``calls``, ``concurrency`` at a time: the wall time, each call's time, failures."""
    times: list[float] = []
    failed = 0
    queue = list(reversed(calls))

    async def worker() -> None:
        nonlocal failed
        while queue:
            call = queue.pop()
            began = time.perf_counter()
            try:
                await call()
            except Exception as exc:  # a lost compare-and-set race, said as a failure
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # Ctrl-C, whatever the call made of its cancellation
                failed += 1
                if failed == 1:
                    print(f"    a put failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            times.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - began, times, failed


class Member:
    """One instance process: its reports, line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def spawn(cls, code: str, spec: dict[str, Any], path: str) -> Member:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(ROOT)])}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 26,
        )
        return cls(process)

    async def report(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"an instance ended (exit {await self.process.wait()})")
        return json.loads(line)

    def stop(self) -> None:
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.write(b"stop\n")

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()


def show_profile(path: str, label: str) -> None:
    out = io.StringIO()
    pstats.Stats(path, stream=out).sort_stats("cumulative").print_stats(18)
    print(f"--- profile: {label} ({path}), by cumulative time")
    print("\n".join(out.getvalue().splitlines()[:45]))


async def fleet_phase(
    result: Result,
    spec: dict[str, Any],
    code: str,
    path: str,
    instances: int,
    changes: int,
    put_change: Callable[[int], Awaitable[Any]],
    load_timeout: float,
) -> None:
    """Start the instances one after the other, then the changes, then the runs."""
    members: list[Member] = []
    try:
        for k in range(instances):
            profile = spec["profile_dir"] and k == 0
            own = {**spec, "profile": f"{spec['profile_dir']}/{spec['label']}-load.prof"}
            if not profile:
                own["profile"] = ""
            member = await Member.spawn(code, own, path)
            members.append(member)
            loaded = await member.report(load_timeout)
            result.loads.append(loaded["load_s"])
            result.empty.append(loaded["empty_s"])
            result.rss.append(loaded["rss"])
            print(
                f"    instance {k}: loaded in {loaded['load_s']:.2f} s (an empty start: "
                f"{loaded['empty_s']:.2f} s; +{loaded['rss'] / 1e6:.1f} MB)",
                flush=True,
            )
        window_from = time.time() + 5
        for k in range(changes):
            await put_change(k)
            returned = time.time()
            latest = 0.0
            try:
                for member in members:
                    seen = await member.report(10)
                    assert seen["seen"] == k, seen
                    latest = max(latest, seen["at"])
                result.changes.append(max(0.0, latest - returned))
            except TimeoutError:
                result.changes_lost = changes - k
                print(f"    change {k}: not seen by every instance within 10 s", flush=True)
                break
        await asyncio.sleep(max(0.0, window_from + EVERY_S * 3 + 3 - time.time()))
        for member in members:
            member.stop()
        reports = []
        for member in members:
            while "runs" not in (found := await member.report(60)):
                pass
            reports.append(found)
        window_to = min(r["stopped"] for r in reports) - 3
        counted: dict[tuple[str, float], int] = {}
        for report in reports:
            for job, slot_ms in report["runs"]:
                counted[(job, slot_ms)] = counted.get((job, slot_ms), 0) + 1
        result.twice = sum(1 for c in counted.values() if c > 1)
        every = [
            key
            for key in counted
            if key[0].startswith("poll.") and window_from * 1000 <= key[1] < window_to * 1000
        ]
        result.every_run = len(every)
        # An interval's slots fall on multiples of it since the epoch.
        step_ms = EVERY_S * 1000
        first, last = -(-int(window_from * 1000) // step_ms), -(-int(window_to * 1000) // step_ms)
        result.every_due = spec["every"] * max(0, last - first)
    finally:
        for member in members:
            await member.kill()


def schedule_args(n: int) -> list[tuple[str, dict[str, Any]]]:
    from shared import cron_id, cron_of, every_id  # type: ignore[import-not-found]

    args = [
        (cron_id(i), {"cron": cron_of(i), "timezone": TZ, "data": {"tenant": i}}) for i in range(n)
    ]
    args += [(every_id(i), {"every": f"{EVERY_S}s", "data": {"tenant": i}}) for i in range(n // 10)]
    return args


async def bench_brokersched(kind: str, args: argparse.Namespace, path: str) -> Result:
    from shared import change_id  # type: ignore[import-not-found]

    from brokersched import Scheduler

    result = Result(kind)
    name = f"bsbench{uuid.uuid4().hex[:8]}"
    writer = Scheduler(make_backend(kind, name))
    schedules = schedule_args(args.n)
    result.total = len(schedules)
    try:
        await writer.start()
        put = writer.schedules.put
        calls = [
            (lambda i=i, o=o: put(i, task=TASK, **o))  # type: ignore[misc]
            for i, o in schedules
        ]
        profile = cProfile.Profile() if args.profile else None
        if profile:
            profile.enable()
        result.seq_s, result.seq, failed = await timed_puts(calls, 1)
        if profile:
            profile.disable()
            profile.dump_stats(f"{args.profile}/{kind}-put.prof")
        print(f"  {kind}: {result.total} puts in {result.seq_s:.1f} s ({failed} failed)")
        sample = schedules[:: max(1, len(schedules) // args.concurrent_puts)]
        sample = sample[: args.concurrent_puts]
        again = [
            (lambda i=i, o=o: put(i, task=TASK, **{**o, "data": {"again": True}}))  # type: ignore[misc]
            for i, o in sample
        ]
        wall, result.c8, result.c8_failed = await timed_puts(again, args.concurrency)
        result.c8_s = wall / max(len(sample), 1) * result.total
        print(f"  {kind}: {len(sample)} puts 8 at a time in {wall:.1f} s", flush=True)
        spec = {
            "backend": kind,
            "where": where_of(kind),
            "name": name,
            "total": result.total,
            "every": args.n // 10,
            "changes": args.changes,
            "profile_dir": args.profile or "",
            "label": kind,
        }

        async def put_change(k: int) -> None:
            await put(change_id(k), task=TASK, cron="0 3 * * *", timezone=TZ)

        await fleet_phase(
            result, spec, MEMBER, path, args.instances, args.changes, put_change, args.load_timeout
        )
    finally:
        with contextlib.suppress(Exception):
            await writer.stop()
        await cleanup(kind, name)
    if args.profile:
        show_profile(f"{args.profile}/{kind}-put.prof", f"{kind}: the sequential puts")
        show_profile(f"{args.profile}/{kind}-load.prof", f"{kind}: an instance's load")
    return result


async def bench_apscheduler(args: argparse.Namespace, path: str) -> Result:
    result = Result("APScheduler 4 (postgres)")
    try:
        import aps_member  # type: ignore[import-not-found]
        from apscheduler.triggers.cron import CronTrigger
        from apscheduler.triggers.interval import IntervalTrigger
    except ImportError as exc:
        result.note = f"skipped: APScheduler 4 is not importable here ({exc})"
        return result
    from shared import change_id  # type: ignore[import-not-found]

    name = f"bsbench{uuid.uuid4().hex[:8]}"
    spec = {
        "where": where_of("apscheduler"),
        "name": name,
        "changes": args.changes,
        "total": 0,
        "every": args.n // 10,
        "profile_dir": "",
        "label": "apscheduler",
    }
    schedules = schedule_args(args.n)
    result.total = len(schedules)

    def cron(expression: str) -> Any:
        # Its start time given in the zone: 4.0.0a6 reads the default (now, in UTC) as a wall
        # time of the zone, so in Paris every first fire came an hour early (in the past).
        now = datetime.datetime.now(ZoneInfo(TZ))
        return CronTrigger.from_crontab(expression, timezone=TZ, start_time=now)

    def trigger(options: dict[str, Any]) -> Any:
        return cron(options["cron"]) if "cron" in options else IntervalTrigger(seconds=EVERY_S)

    try:
        async with aps_member.scheduler_of(spec) as writer:
            add = writer.add_schedule
            handler = aps_member.handler
            calls = [
                (lambda i=i, o=o: add(handler, trigger(o), id=i, kwargs={}))  # type: ignore[misc]
                for i, o in schedules
            ]
            result.seq_s, result.seq, failed = await timed_puts(calls, 1)
            print(f"  apscheduler: {result.total} puts in {result.seq_s:.1f} s ({failed} failed)")
            sample = schedules[:: max(1, len(schedules) // args.concurrent_puts)]
            sample = sample[: args.concurrent_puts]
            again = [
                (lambda i=i, o=o: add(handler, trigger(o), id=i, conflict_policy="replace"))  # type: ignore[misc]
                for i, o in sample
            ]
            wall, result.c8, result.c8_failed = await timed_puts(again, args.concurrency)
            result.c8_s = wall / max(len(sample), 1) * result.total

            async def put_change(k: int) -> None:
                await add(handler, cron("0 3 * * *"), id=change_id(k))

            spec["total"] = result.total
            code = "import asyncio, json, sys, aps_member as m; asyncio.run(m.main(json.loads(sys.argv[1])))"  # noqa: E501
            await fleet_phase(
                result,
                spec,
                code,
                path,
                args.instances,
                args.changes,
                put_change,
                args.load_timeout,
            )
        result.note = (
            "instances keep no schedule in memory: load = start_in_background(), memory = what "
            "a started instance grew by; a change = the ScheduleAdded event at every instance"
        )
    finally:
        await cleanup("apscheduler", name)
    return result


async def main(args: argparse.Namespace, path: str) -> None:
    results: list[Result] = []
    if args.apscheduler:  # first: the quickest
        print("APScheduler 4 on postgres", flush=True)
        aps = await bench_apscheduler(args, path)
    for kind in args.backend:
        print(f"{kind}: {args.n} crons + {args.n // 10} every 10 s", flush=True)
        began = time.perf_counter()
        results.append(await bench_brokersched(kind, args, path))
        print(f"  {kind}: done in {time.perf_counter() - began:.0f} s", flush=True)
        print_table(results, args.n)  # so far
    if args.apscheduler:
        results.append(aps)
    print_table(results, args.n)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", default=",".join(BACKENDS), type=lambda s: [b for b in s.split(",") if b]
    )
    parser.add_argument("--n", type=int, default=100, help="cron schedules (and n/10 every 10s)")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--concurrent-puts", type=int, default=200)
    parser.add_argument("--load-timeout", type=float, default=300)
    parser.add_argument("--no-apscheduler", dest="apscheduler", action="store_false")
    parser.add_argument("--profile", metavar="DIR", help="cProfile the puts and a load")
    args = parser.parse_args()
    unknown = set(args.backend) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    return args


if __name__ == "__main__":
    options = parse()
    with tempfile.TemporaryDirectory(prefix="bench-schedules-") as where:
        Path(where, "shared.py").write_text(SHARED)
        Path(where, "aps_member.py").write_text(APS_MEMBER)
        sys.path.insert(0, where)
        asyncio.run(main(options, where))

"""The store's clock.

* Which clock moved: when the database's clock steps back 10 s every claim is refused as clock
  skew, and the warning must name the store's clock, not tell the operator to fix the
  *instance's*. ``skew_diagnosis`` tells which clock moved (checked here on virtual readings,
  then through a scheduler whose SQLite store clock is moved by its one hook,
  ``_store_now_ms``; tests/backends/multi/test_lease_rules.py checks each lease backend,
  PostgreSQL's and Redis's real servers included).
* SQLite's store clock is the host's kernel clock, read by a direct system call, which
  libfaketime does not fake. ``julianday('now')`` is the calling process's own time: a process
  run under libfaketime +40 s judged its claims on its own fast clock, fenced 40 s of slots
  and the fleet ran nothing. A real second process under ``faketime -f +40s`` is refused its
  slots ahead, and the honest process keeps running every slot.

A faked worker runs ``python -m tests.support.store_clock_worker '<spec>'`` under ``faketime``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from brokersched import Scheduler, SQLiteBackend
from brokersched._events import SkipEvent
from brokersched.backends._lease import ClockName, ClockReading, skew_diagnosis
from tests.support.helpers import faketime
from tests.support.paths import REPO_ROOT
from tests.support.store_clock_worker import TICK_MS
from tests.support.wait import until

ROOT = REPO_ROOT
STORE = ClockName("PostgreSQL's clock_timestamp()", "the PostgreSQL server")
FAST_S = 40  # the libfaketime offset: ahead by far more than max_clock_skew


# -- 4: which clock moved, on virtual readings ----------------------------------------------


def reading(store_ms: int, wall_ms: int, mono_ms: int) -> ClockReading:
    return ClockReading(store_ms=store_ms, wall_ms=wall_ms, mono_ms=mono_ms)


T0 = 1_800_000_000_000  # wall and store agree here; the monotonic clock starts at 0
AGREED = reading(T0 + 20, T0, 0)


def test_a_store_clock_stepped_back_while_the_instance_kept_time() -> None:
    # 60 s later the instance's wall and monotonic clocks moved 60 s; the store's only 50 s.
    moved, why = skew_diagnosis(AGREED, reading(T0 + 50_020, T0 + 60_000, 60_000), STORE)
    assert moved == "store"
    assert why.startswith("PostgreSQL's clock_timestamp() appears to have stepped back by ~10s")
    assert "since its last accepted claim 1m ago" in why
    assert "fix the time sync (NTP) of the PostgreSQL server" in why


def test_an_instance_clock_stepped_forward_while_the_store_kept_time() -> None:
    moved, why = skew_diagnosis(AGREED, reading(T0 + 60_020, T0 + 70_000, 60_000), STORE)
    assert moved == "instance"
    assert why.startswith("this instance's clock stepped forward by ~10s")
    assert "fix this instance's time sync (NTP)" in why


def test_without_an_accepted_claim_both_clocks_are_named() -> None:
    moved, why = skew_diagnosis(None, reading(T0, T0 + 120_000, 5), STORE)
    assert moved is None
    assert "this instance's clock is fast, or PostgreSQL's clock_timestamp() is slow" in why


def test_both_clocks_moved_names_both_with_their_moves() -> None:
    moved, why = skew_diagnosis(AGREED, reading(T0 + 55_020, T0 + 63_000, 60_000), STORE)
    assert moved is None
    assert "this instance's clock moved +3s" in why and "clock_timestamp() -5s" in why


def test_a_slow_drift_is_not_taken_for_a_step() -> None:
    """10 s apart after 10 hours: either clock's rate (up to 500 ppm) explains it, so the
    instance does not blame the store."""
    hours = 10 * 3_600_000
    moved, _ = skew_diagnosis(AGREED, reading(T0 + hours - 9_980, T0 + hours, hours), STORE)
    assert moved is None


def test_round_trip_noise_is_not_a_step() -> None:
    moved, _ = skew_diagnosis(AGREED, reading(T0 + 59_400, T0 + 60_000, 60_000), STORE)
    assert moved is None


# -- 4: through a scheduler, the store's clock moved by its one hook --------------------------


class SteppingSQLite(SQLiteBackend):
    """SQLite whose store clock is ``back_ms`` behind the host's (``_store_now_ms``)."""

    back_ms = 0

    def _store_now_ms(self) -> int:
        return super()._store_now_ms() - self.back_ms


async def test_the_skip_names_the_store_clock_that_stepped_back(tmp_path: Path) -> None:
    backend = SteppingSQLite(tmp_path / "leases.db", lease_ttl="3s")
    scheduler = Scheduler(backend, instance_id="a", jitter=0)
    ran: list[int] = []
    skips: list[SkipEvent] = []
    scheduler.every("tick", f"{TICK_MS}ms", lambda ctx: ran.append(ctx.slot_ms), catch_up=0)
    scheduler.on("skip", skips.append)
    async with scheduler:
        await until(lambda: len(ran) >= 2)
        backend.back_ms = 10_000
        await until(lambda: any(skip.reason == "clock-skew" for skip in skips))
    skip = next(skip for skip in skips if skip.reason == "clock-skew")
    assert skip.detail is not None
    assert "SQLite's clock (the host's CLOCK_REALTIME) appears to have stepped back by ~10s" in (
        skip.detail
    )
    assert "this instance's clock is fast" not in skip.detail


# -- 5: a process faked 40 s fast shares the host's clock ------------------------------------


def test_the_host_clock_is_not_faked_by_libfaketime() -> None:
    code = (
        "import time; from brokersched._clock import host_time_ms; "
        "print(time.time_ns() // 10**6, host_time_ms())"
    )
    out = subprocess.run(
        [faketime(), "-f", f"+{FAST_S}s", sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    faked, host = map(int, out.split())
    assert faked - host > (FAST_S - 5) * 1000, out  # its C library is 40 s fast...
    assert abs(host - _now_ms()) < 5_000, out  # ... and the host's clock is the host's


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture
async def fast_worker(tmp_path: Path) -> AsyncIterator[Any]:
    """Start ``fast_worker(spec)``: a worker process under ``faketime -f +40s``, stopped after.

    The faketime wrapper runs the worker as its child and does not pass signals on: each worker
    gets a process group of its own, and the stop goes to the group."""
    started: list[asyncio.subprocess.Process] = []

    async def start(spec: dict[str, Any]) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            faketime(), "-f", f"+{FAST_S}s",
            sys.executable, "-m", "tests.support.store_clock_worker",
            json.dumps(spec), cwd=ROOT, stdout=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        started.append(process)
        assert process.stdout is not None
        async with asyncio.timeout(30):
            assert await process.stdout.readline() == b"ready\n"
        return process

    try:
        yield start
    finally:
        for process in started:
            await stop_group(process)


async def stop_group(process: asyncio.subprocess.Process) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            async with asyncio.timeout(15):
                await process.communicate()  # to the pipe's end: every process of it exited
            return
        except TimeoutError:
            continue


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def test_a_process_faked_fast_is_refused_and_the_fleet_keeps_running(
    tmp_path: Path, fast_worker: Any
) -> None:
    """One process under libfaketime +40 s, judged on its own clock, claimed every slot 40 s
    ahead: 16 slots nobody ran, the fleet silent 40 s. Its claims are refused (clock-skew) and
    the honest process runs every slot."""
    db, log = tmp_path / "leases.db", tmp_path / "fast.log"
    ran: list[int] = []
    skips: list[SkipEvent] = []
    honest = Scheduler(SQLiteBackend(db, lease_ttl="3s"), instance_id="honest", jitter=0)
    honest.every("tick", f"{TICK_MS}ms", lambda ctx: ran.append(ctx.slot_ms), catch_up=0)
    honest.on("skip", skips.append)
    async with honest:
        await until(lambda: len(ran) >= 2)
        await fast_worker({"db": str(db), "log": str(log)})
        joined = _now_ms()
        await until(
            lambda: (
                sum(line.startswith("skip clock-skew") for line in read_lines(log)) >= 3
                and sum(slot > joined for slot in ran) >= 6
            ),
            timeout=20,
        )
    fast = read_lines(log)
    assert not [line for line in fast if line.startswith("ran")], fast
    assert any("this instance's clock is fast" in line for line in fast), fast
    after = [slot for slot in ran if slot > joined]
    assert all(b - a == TICK_MS for a, b in itertools.pairwise(after)), after
    assert len(ran) == len(set(ran))
    assert [skip for skip in skips if skip.slot_ms > joined] == []

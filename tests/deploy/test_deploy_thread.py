"""``scheduler.start_in_thread()``: a scheduler for code without an event loop. These tests are
plain sync functions, as such applications are (real time, bounded waits: about 2 s)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from brokersched import BackendUnavailableError, JobContext, MemoryBackend, Scheduler
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT


def test_a_scheduler_runs_in_its_own_thread_until_stopped() -> None:
    sched = Scheduler(jitter=0)
    ran = threading.Event()
    threads: list[str] = []

    @sched.every("tick", "100ms", claim=False)
    def tick(ctx: JobContext) -> None:
        threads.append(threading.current_thread().name)
        ran.set()

    handle = sched.start_in_thread()
    try:
        assert handle.running and handle.thread.is_alive() and not handle.thread.daemon
        assert ran.wait(5), "the job did not run within 5 s"
    finally:
        handle.stop()
    assert not handle.thread.is_alive()
    assert not sched.running
    assert threads[0].startswith("brokersched-handler")  # sync handlers: a worker thread


def test_the_handle_is_a_context_manager_and_runs_coroutines_from_sync_code() -> None:
    sched = Scheduler(jitter=0)
    loops: list[int] = []

    @sched.every("report", "1h")
    async def report(ctx: JobContext) -> None:
        loops.append(threading.get_ident())

    job = sched.get("report")
    assert job is not None
    with sched.start_in_thread() as handle:
        record = handle.run(job.trigger(), timeout=5)
        history = handle.run(job.history(5), timeout=5)
    assert record is not None and record.outcome == "completed"
    assert [entry.run_id for entry in history] == [record.run_id]
    assert loops == [handle.thread.ident]  # async handlers: the thread's event loop
    assert not handle.thread.is_alive()


def test_the_start_error_is_raised_to_the_caller_and_the_lifespan_runs_in_the_thread() -> None:
    class Unreachable(MemoryBackend):
        async def start(self, clock: Any) -> None:
            raise BackendUnavailableError("cannot connect to the broker")

    where: list[str] = []

    @asynccontextmanager
    async def lifespan(scheduler: Scheduler[Any]) -> AsyncIterator[None]:
        where.append(threading.current_thread().name)
        yield

    sched = Scheduler(Unreachable(), lifespan=lifespan)
    with pytest.raises(BackendUnavailableError, match="cannot connect"):
        sched.start_in_thread(name="sched")
    assert where == ["sched"]
    assert [t for t in threading.enumerate() if t.name == "sched"] == []


def program_output(script: str) -> list[str]:
    """The lines a Python program printed; it must exit with 0 within 10 s."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 10
    return done.stdout.splitlines()


def test_a_program_that_forgets_stop_still_exits_after_a_drain() -> None:
    script = textwrap.dedent(
        """
        import threading, time
        from brokersched import Scheduler

        scheduler = Scheduler(jitter=0, drain_timeout="5s")
        started = threading.Event()

        @scheduler.every("slow", "100ms", claim=False)
        def slow(ctx):
            started.set()
            while ctx.abort_reason is None:
                time.sleep(0.01)
            print("told", ctx.abort_reason, flush=True)

        scheduler.start_in_thread()
        started.wait(5)
        print("main ends", flush=True)
        """
    )
    assert program_output(script) == ["main ends", "told shutdown"]


def test_a_sync_handler_abandoned_by_the_drain_does_not_keep_the_program_alive() -> None:
    """It ignores ``ctx.abort_reason``: recorded ``interrupted`` after ``drain_timeout``, its
    thread ends with the process (it was joined at exit: the program waited for it)."""
    script = textwrap.dedent(
        """
        import threading, time
        from brokersched import Scheduler

        scheduler = Scheduler(jitter=0, drain_timeout="200ms")
        started = threading.Event()

        @scheduler.after("stuck", 0, claim=False)
        def stuck(ctx):
            started.set()
            time.sleep(60)

        scheduler.on("fail", lambda event: print(event.outcome, flush=True))
        with scheduler.start_in_thread():
            started.wait(5)
        print("main ends", flush=True)
        """
    )
    assert program_output(script) == ["interrupted", "main ends"]


def test_handler_threads_are_reused_and_never_wait_for_one_another() -> None:
    """A Django connection lives per thread: runs one after another share a thread (a thread
    per run opened a connection per run); runs at once each have one."""
    scheduler = Scheduler(jitter=0)
    both = threading.Barrier(2, timeout=5)
    threads: list[str] = []

    def together(ctx: JobContext) -> None:
        both.wait()  # broken (an error) if one run waited for the other

    def alone(ctx: JobContext) -> None:
        threads.append(threading.current_thread().name)

    a = scheduler.every("a", "1h", together, claim=False)
    b = scheduler.every("b", "1h", together, claim=False)
    job = scheduler.every("alone", "1h", alone, claim=False)

    async def at_once() -> list[str]:
        records = await asyncio.gather(a.trigger(), b.trigger())
        return [record.outcome if record else "skipped" for record in records]

    with scheduler.start_in_thread() as handle:
        for _ in range(3):
            handle.run(job.trigger())
        assert handle.run(at_once()) == ["completed", "completed"]
    assert len(threads) == 3 and len(set(threads)) == 1

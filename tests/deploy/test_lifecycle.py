"""Misuse of the life cycle is loud: start twice, wait before start, leave without stop; serve()."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from brokersched import MemoryBackend, Scheduler
from brokersched.testing import TestClock
from tests.support.helpers import read_until
from tests.support.paths import REPO_ROOT


async def test_start_twice_is_refused() -> None:
    sched = Scheduler(MemoryBackend(), clock=TestClock())
    await sched.start()
    try:
        with pytest.raises(RuntimeError, match="started already"):
            await sched.start()
        with pytest.raises(RuntimeError, match="started already"):
            async with sched:
                pass
    finally:
        await sched.stop()
    await sched.start()  # a stopped scheduler starts again
    await sched.stop()


async def test_wait_stopped_before_start_is_refused() -> None:
    sched = Scheduler(MemoryBackend(), clock=TestClock())
    with pytest.raises(RuntimeError, match=r"before start\(\) would wait for ever"):
        await sched.wait_stopped()
    async with sched:
        pass
    await sched.wait_stopped()  # stopped: returns at once


def run_script(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
    )


def test_leaving_the_loop_without_stop_says_so(tmp_path: Path) -> None:
    process = run_script(
        tmp_path,
        """
        import asyncio
        from brokersched import Scheduler

        async def main() -> None:
            scheduler = Scheduler()
            scheduler.every("tick", "1s", lambda ctx: None)
            await scheduler.start()  # and never stopped

        asyncio.run(main())
        """,
    )
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert "the scheduler was never stopped" in output
    assert "await scheduler.stop()" in output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_cleanly_on_a_signal(tmp_path: Path, signum: signal.Signals) -> None:
    process = run_script(
        tmp_path,
        """
        import asyncio
        import logging
        from brokersched import JobContext, Scheduler

        scheduler = Scheduler(jitter="0s")

        @scheduler.every("tick", "1s")
        async def tick(ctx: JobContext) -> None:
            ctx.logger.info("tick")

        logging.basicConfig(level=logging.INFO)
        asyncio.run(scheduler.serve())
        print("returned")
        """,
    )
    assert process.stdout is not None
    seen = read_until(process.stdout, "run job=tick", timeout=30)
    process.send_signal(signum)
    rest, _ = process.communicate(timeout=30)
    output = seen + rest
    assert process.returncode == 0, output
    assert f"{signum.name}: stopping" in output
    assert "returned" in output
    assert "Traceback" not in output


def test_a_signal_during_the_start_stops_once_started(tmp_path: Path) -> None:
    process = run_script(
        tmp_path,
        """
        import asyncio
        import logging
        from brokersched import MemoryBackend, Scheduler

        class SlowToConnect(MemoryBackend):
            async def _open(self, clock):
                print("connecting", flush=True)
                await asyncio.sleep(1)  # a broker far away
                await super()._open(clock)

        scheduler = Scheduler(SlowToConnect())
        scheduler.every("tick", "1s", lambda ctx: None)
        logging.basicConfig(level=logging.INFO)
        asyncio.run(scheduler.serve())
        print("returned")
        """,
    )
    assert process.stdout is not None
    seen = read_until(process.stdout, "connecting", timeout=30)
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=30)
    output = seen + rest
    assert process.returncode == 0, output
    assert "SIGINT: stopping" in output
    assert "returned" in output
    assert "Traceback" not in output


def test_serve_on_an_unreachable_backend_is_one_line_and_status_3(tmp_path: Path) -> None:
    process = run_script(
        tmp_path,
        """
        import asyncio
        from brokersched import RabbitMQBackend, Scheduler

        scheduler = Scheduler(RabbitMQBackend("amqp://guest:s3cret@127.0.0.1:1/"))
        scheduler.every("tick", "1s", lambda ctx: None)
        asyncio.run(scheduler.serve())
        """,
    )
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 3, output
    assert "cannot start:" in output
    assert "Traceback" not in output
    assert "s3cret" not in output

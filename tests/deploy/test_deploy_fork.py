"""Pre-forked workers: a scheduler made before the fork gets an identity and a jitter of its own
in each process when it starts (``gunicorn --preload``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.wait import free_port

ROOT = REPO_ROOT

FORKING = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from brokersched import Scheduler
    from brokersched.testing import TestClock

    explicit = sys.argv[1] if len(sys.argv) > 1 else None
    clock = TestClock("2027-01-15T08:00:00+00:00")
    scheduler = Scheduler(clock=clock, jitter="20s", instance_id=explicit)
    scheduler.every("refresh", "1m", lambda ctx: None, claim=False)
    late = []
    scheduler.on("start", lambda event: late.append(clock.now_ms() - event.slot_ms))

    async def main():
        async with scheduler:
            await clock.advance("3m30s")
        return {"pid": os.getpid(), "instance_id": scheduler.instance_id, "late_ms": late}

    children = []
    for _ in range(3):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, json.dumps(asyncio.run(main())).encode())
            os._exit(0)
        os.close(write)
        children.append((pid, read))
    for pid, read in children:
        with os.fdopen(read) as pipe:
            print(pipe.read())
        os.waitpid(pid, 0)
    """
)


def forked_workers(*args: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", FORKING, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_forked_processes_get_their_own_instance_id_and_jitter() -> None:
    workers = forked_workers()
    assert len(workers) == 3
    ids = [str(worker["instance_id"]) for worker in workers]
    assert len(set(ids)) == 3, ids
    for worker in workers:
        assert f":{worker['pid']}:" in str(worker["instance_id"])  # its own pid, not the parent's
    lateness = [tuple(worker["late_ms"]) for worker in workers]  # type: ignore[arg-type]
    assert all(len(late) == 3 for late in lateness)
    assert len(set(lateness)) == 3, lateness  # 3 draws in 0-20 s each: equal only by accident


def test_an_explicit_instance_id_survives_the_fork() -> None:
    workers = forked_workers("worker-a")
    assert [worker["instance_id"] for worker in workers] == ["worker-a"] * 3


RUN_LINE = re.compile(
    r" (?P<pid>\d+) brokersched INFO run job=cache\.refresh .*late_ms=(?P<late>\d+) "
    r"instance_id=(?P<id>\S+)"
)


def test_gunicorn_preload_workers_differ(tmp_path: Path) -> None:
    """examples/fastapi under examples/gunicorn's config: 3 workers forked from a master that
    imported the app (and made its Scheduler). Each one runs the per-process job under its own
    id, with its own jitter. Real time: about 6 s."""
    log = tmp_path / "gunicorn.log"
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    env = {
        **os.environ,
        "BIND": f"127.0.0.1:{free_port()}",
        "WORKERS": "3",
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
    }
    env.pop("BROKERSCHED_URL", None)
    with log.open("w") as sink:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "-c",
                "examples/gunicorn/gunicorn.conf.py",
                "examples.fastapi.app:app",
            ],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        runs: dict[str, list[tuple[str, int]]] = defaultdict(list)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs.clear()
            for match in RUN_LINE.finditer(log.read_text()):
                runs[match["pid"]].append((match["id"], int(match["late"])))
            if len(runs) >= 3 and all(len(each) >= 2 for each in runs.values()):
                break
            assert server.poll() is None, log.read_text()
            time.sleep(0.2)
        else:
            pytest.fail(f"3 workers did not run cache.refresh twice each:\n{log.read_text()}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    # the config's child_exit hook forgot each exited worker's live gauges; counts stay
    assert sorted(path.name for path in multiproc.glob("gauge_livesum_*")) == []
    assert len(list(multiproc.glob("counter_*.db"))) >= 3
    ids = {pid: {run_id for run_id, _ in each} for pid, each in runs.items()}
    assert all(len(each) == 1 for each in ids.values()), ids
    assert len({next(iter(each)) for each in ids.values()}) == len(ids), ids  # distinct ids
    for pid, each in ids.items():
        assert f":{pid}:" in next(iter(each))
    # Jitter of 0-900 ms drawn by each worker: with one shared RNG the first two runs of every
    # worker were late by the same few milliseconds (393/394/394 ms).
    firsts = sorted(tuple(late for _, late in each[:2]) for each in runs.values())
    spread = [max(run[i] for run in firsts) - min(run[i] for run in firsts) for i in range(2)]
    assert max(spread) > 20, firsts

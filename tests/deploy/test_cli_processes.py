"""The CLI as a process of its own, for what tests/unit checks in process: a lifespan entered
by ``trigger`` and failing at ``run``, metrics served over HTTP, ``--no-schedule`` and
``BROKERSCHED_ENABLED``, and an import of the package that needs no extra."""

from __future__ import annotations

import signal
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.cli_apps.process import RunningCLI, brokersched

LIFESPAN_APP = textwrap.dedent(
    """
    from contextlib import asynccontextmanager
    from brokersched import JobContext, Scheduler

    pool = None

    @asynccontextmanager
    async def lifespan(scheduler):
        global pool
        pool = {"rows": 3}
        yield
        pool = None
        print("pool closed", flush=True)

    scheduler = Scheduler(lifespan=lifespan, jitter=0)

    @scheduler.every("report", "1h")
    async def report(ctx: JobContext) -> None:
        assert pool is not None, "the pool is None"
        print("rows", pool["rows"], flush=True)
    """
)


def test_brokersched_trigger_enters_the_lifespan(tmp_path: Path) -> None:
    app = tmp_path / "lifespan_app.py"
    app.write_text(LIFESPAN_APP)
    result = brokersched("trigger", f"{app}:scheduler", "report")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["rows 3", "pool closed"]
    assert "job 'report' completed" in result.stdout


FAILING_LIFESPAN_APP = textwrap.dedent(
    """
    import os
    from contextlib import asynccontextmanager
    from brokersched import Scheduler

    @asynccontextmanager
    async def lifespan(scheduler):
        if os.environ["FAIL"] == "enter":
            raise RuntimeError("pool: cannot reach postgresql://app:s3cret@db/app")
        yield
        raise RuntimeError("pool: closing failed")

    scheduler = Scheduler(lifespan=lifespan, jitter=0)
    scheduler.every("report", "1h", lambda ctx: print("report ran", flush=True))
    """
)


def test_a_failing_lifespan_is_one_error_line_and_exit_code_1(tmp_path: Path) -> None:
    """The application's code: its traceback (redacted), then one line, not an uncaught
    exception."""
    app = tmp_path / "failing_lifespan_app.py"
    app.write_text(FAILING_LIFESPAN_APP)
    run = brokersched("run", f"{app}:scheduler", env={"FAIL": "enter"})
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (
        "Error: the application failed: RuntimeError: pool: cannot reach "
        "postgresql://app:***@db/app"
    )
    assert "Traceback" in run.stderr and "s3cret" not in run.stderr
    trigger = brokersched("trigger", f"{app}:scheduler", "report", env={"FAIL": "exit"})
    assert trigger.returncode == 1
    assert trigger.stdout.startswith("report ran")
    assert trigger.stderr.splitlines()[-1] == (
        "Error: the application failed: RuntimeError: pool: closing failed"
    )


def test_brokersched_run_serves_metrics_over_http(tmp_path: Path) -> None:
    import json
    import time

    env = {"BROKERSCHED_TEST_DB": str(tmp_path / "metrics.db")}
    app = "tests.support.cli_apps.sqlite_app:scheduler"
    cli = RunningCLI("run", app, "--metrics-port", "0", "--log-format", "json", env=env)
    try:
        line = cli.wait_for_line(lambda line: "metrics_port" in line)
        port = int(json.loads(line)["metrics_port"])
        assert json.loads(line)["message"] == f"serving metrics on http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 15
        while True:  # tick and flaky run every 200 ms on SQLite
            samples: dict[str, Any] = scrape(port)
            completed = samples.get('brokersched_runs_total{job="tick",outcome="completed"}', 0)
            failed = samples.get('brokersched_runs_total{job="flaky",outcome="failed"}', 0)
            if (completed >= 2 and failed >= 2) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert completed >= 2 and failed >= 2, samples
        assert samples['brokersched_claim_duration_seconds_count{backend="sqlite"}'] >= 4
        assert samples['brokersched_runs_total{job="report",outcome="completed"}'] == 0
        assert samples['brokersched_last_success_timestamp_seconds{job="tick"}'] > 1.7e9
        assert "python_info" in " ".join(samples)  # the process-wide registry is served
        assert cli.stop() == 0, cli.output()
    finally:
        cli.kill()


def test_run_no_schedule_and_the_environment(tmp_path: Path) -> None:
    env = {"BROKERSCHED_TEST_DB": str(tmp_path / "off.db")}
    app = "tests.support.cli_apps.draining:scheduler"
    cli = RunningCLI("run", app, "--no-schedule", "--log-format", "json", env=env)
    try:
        cli.wait_for_line(lambda line: "started" in line)
        assert cli.stop(signal.SIGTERM) == 0, cli.output()
    finally:
        cli.kill()
    started = next(e for e in cli.json_lines() if e["message"].startswith("started"))
    assert started["enabled"] is False
    assert "with scheduling disabled (jobs run on trigger only)" in started["message"]
    result = brokersched("jobs", app, env={**env, "BROKERSCHED_ENABLED": "maybe"})
    assert result.returncode == 2
    assert "BROKERSCHED_ENABLED='maybe' is not a boolean" in result.stderr


def test_importing_needs_no_extras() -> None:
    import subprocess
    import sys

    code = (
        "import sys, brokersched\n"
        "extras = {'aio_pika', 'nats', 'asyncpg', 'aiosqlite', 'redis'}\n"
        "assert not extras & set(sys.modules), sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, number = line.rpartition(" ")
            samples[name] = float(number)
    return samples


def test_a_killed_instance_shows_as_dead_with_its_lease_held_within_a_second(
    tmp_path: Path,
) -> None:
    """Two processes beating every 200 ms; the one holding a leased run is killed with -9: the
    other's view of the fleet says dead, its run held, within 3 heartbeats."""
    import asyncio
    import time

    from brokersched._clock import SystemClock
    from brokersched.backends.sqlite import SQLiteBackend

    db = str(tmp_path / "fleet.db")
    app = "tests.support.cli_apps.fleet_app:scheduler"
    members = {
        name: RunningCLI(
            "run", app, env={"BROKERSCHED_TEST_DB": db, "BROKERSCHED_TEST_INSTANCE": name}
        )
        for name in ("fleet-a", "fleet-b")
    }

    async def fleet() -> dict[str, tuple[str, list[Any]]]:
        backend = SQLiteBackend(db)
        await backend.start(SystemClock())
        try:
            now = SystemClock().now()
            return {i.id: (i.liveness(now), list(i.running)) for i in await backend.instances()}
        finally:
            await backend.stop()

    def seen(check: Any, timeout: float = 20) -> dict[str, tuple[str, list[Any]]]:
        deadline = time.monotonic() + timeout
        while True:
            found = asyncio.run(fleet()) if Path(db).exists() else {}
            if check(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    try:
        found = seen(lambda f: len(f) == 2 and any(running for _, running in f.values()))
        holder = next(name for name, (_, running) in found.items() if running)
        assert {name: liveness for name, (liveness, _) in found.items()} == {
            "fleet-a": "alive",
            "fleet-b": "alive",
        }
        members[holder].process.kill()  # SIGKILL: no last record
        killed_at = time.monotonic()
        found = seen(lambda f: f[holder][0] == "dead", timeout=10)
        assert found[holder][0] == "dead", found
        assert time.monotonic() - killed_at < 5  # 3 heartbeats of 200 ms, and a read or two
        [run] = found[holder][1]
        assert (run.job, run.leased) == ("hold", True)
        other = "fleet-b" if holder == "fleet-a" else "fleet-a"
        assert found[other][0] == "alive"
        assert members[other].stop() == 0, members[other].output()
        assert seen(lambda f: f[other][0] == "stopped")[other][0] == "stopped"
    finally:
        for member in members.values():
            member.kill()

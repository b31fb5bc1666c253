"""The ``brokersched`` command, run as a subprocess against real backends (SQLite, RabbitMQ).

The applications it loads are in ``tests/support/cli_apps``; each reads where its backend lives from
the environment this module sets.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from click.testing import CliRunner

from brokersched._clock import SystemClock
from brokersched._logging import configure_logging
from brokersched._redact import redact_text
from brokersched.abc import JobPolicy
from brokersched.backends.rabbitmq import RabbitMQBackend, history_queue_name
from brokersched.cli import cli
from tests.support.cli_apps.process import RunningCLI, brokersched, cli_env
from tests.support.helpers import missing
from tests.support.names import unique
from tests.support.rabbitmq_helpers import delete_queues, fleet_queues

SQLITE_APP = "tests.support.cli_apps.sqlite_app:scheduler"
RABBITMQ_APP = "tests.support.cli_apps.rabbitmq_app:scheduler"
UNREACHABLE = {"BROKERSCHED_AMQP_URL": "amqp://app:s3cret@127.0.0.1:1/"}


@pytest.fixture
def sqlite_env(tmp_path: Path) -> dict[str, str]:
    return {"BROKERSCHED_TEST_DB": str(tmp_path / "brokersched.db")}


def one_error_line(stderr: str) -> str:
    """The single line a user mistake prints: no traceback, no log noise."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# -- help, python -m, console script -------------------------------------------------------


def test_help_documents_the_exit_codes() -> None:
    result = brokersched("--help")
    assert result.returncode == 0
    for command in ("run", "jobs", "next", "history", "trigger", "check"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), command
    codes = result.stdout[result.stdout.index("Exit codes:") :]
    for line in ("0  success", "1  trigger: the job failed", "2  usage", "3  the backend"):
        assert line in codes


def test_the_console_script_is_the_same_command() -> None:
    script = Path(sys.executable).with_name("brokersched")
    if not script.exists():
        # CI installs the project: there a missing script is a packaging bug
        missing("the package is not installed with its console script in this environment")
    result = subprocess.run([script, "next", "--every", "1h", "-n", "1"], capture_output=True)
    assert result.returncode == 0, result.stderr


# -- next ------------------------------------------------------------------------------------


def test_next_previews_cron_with_the_dst_rules() -> None:
    """Paris springs forward on 2027-03-28 at 02:00: 02:30 does not exist that day."""
    result = brokersched(
        "next", "30 2 * * *", "--timezone", "Europe/Paris", "-n", "3", "--after", "2027-03-27"
    )
    assert result.returncode == 0, result.stderr
    rows = [re.split(r"\s*│\s*", line.strip("│ ")) for line in result.stdout.splitlines()]
    rows = [row for row in rows if row[0].isdigit()]
    assert rows == [
        ["1", "Sat 2027-03-27 02:30:00", "+01:00", "2027-03-27 01:30:00Z"],
        ["2", "Sun 2027-03-28 03:00:00", "+02:00", "2027-03-28 01:00:00Z"],  # after the gap
        ["3", "Mon 2027-03-29 02:30:00", "+02:00", "2027-03-29 00:30:00Z"],
    ]
    assert "cron '30 2 * * *' (Europe/Paris)" in result.stdout


def test_next_previews_an_interval_with_an_offset() -> None:
    result = brokersched(
        "next", "--every", "6h", "--offset", "1m", "-n", "2", "--after", "2027-01-15T00:00:00Z"
    )
    assert result.returncode == 0, result.stderr
    assert "every 6h + 1m" in result.stdout
    assert "2027-01-15 00:01:00Z" in result.stdout and "2027-01-15 06:01:00Z" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["0 25 * * *"], "hour '25' is out of range 0-23 in '0 25 * * *'"),
        (["0 8 * * *", "--timezone", "Mars/Olympus"], "Mars/Olympus"),
        (["0 8 * * *", "--every", "1h"], "not both"),
        (["--every", "soon"], "--every 'soon' is not a duration"),
        (["0 8 * * *", "--after", "yesterday"], "--after 'yesterday' is not an ISO 8601 time"),
    ],
)
def test_next_refuses_bad_input_in_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["next", *args])  # in process: the same code, faster
    assert result.exit_code == 2
    assert message in one_error_line(result.stderr)


# -- jobs and check: no connection -----------------------------------------------------------


def test_jobs_lists_schedules_and_options_without_connecting() -> None:
    # The broker address is unreachable and holds a password: neither may matter nor show.
    result = brokersched("jobs", RABBITMQ_APP, "-n", "2", env=UNREACHABLE)
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    greet = next(line for line in lines if "│ greet" in line)
    assert "every 1h" in greet and "UTC" in greet
    nightly = [line for line in lines[lines.index(greet) :] if "nightly" in line or "CE" in line]
    assert "cron '30 2 * * *' (Europe/Paris)" in nightly[0]
    assert re.search(r"02:30:00 CES?T", nightly[0])  # next runs in the job's own zone


def test_jobs_shows_only_the_options_given(sqlite_env: dict[str, str]) -> None:
    result = brokersched("jobs", SQLITE_APP, env=sqlite_env)
    assert result.returncode == 0, result.stderr
    assert 'data={"to":"ops"}' in result.stdout and "timeout=10m" in result.stdout
    assert "catch_up=0s" in result.stdout
    assert "jitter=" not in result.stdout  # the scheduler's default, not a job option
    assert not Path(sqlite_env["BROKERSCHED_TEST_DB"]).exists()  # nothing was opened


def test_check_counts_the_jobs(sqlite_env: dict[str, str]) -> None:
    result = brokersched("check", SQLITE_APP, env=sqlite_env)
    assert (result.returncode, result.stdout.strip()) == (0, "4 jobs OK")


def test_check_reports_every_job_refused_at_registration() -> None:
    result = brokersched("check", "tests.support.cli_apps.refused:scheduler")
    assert result.returncode == 1
    first, second, summary = result.stderr.strip().splitlines()
    assert first.startswith("error: job 'exclusive': option 'overlap' ('skip') needs a lease")
    assert "RabbitMQBackend" in first
    assert second.startswith("error: job 'also-bad': jitter (6s) must be under half")
    assert "2 configuration errors" in summary
    assert "s3cret" not in result.stderr and "Traceback" not in result.stderr


def test_check_stopped_by_a_direct_form_error_still_reports_what_it_collected() -> None:
    result = brokersched("check", "tests.support.cli_apps.refused_direct:scheduler")
    assert result.returncode == 1
    first, second, summary = result.stderr.strip().splitlines()
    assert first.startswith("error: job 'also-bad': jitter (6s) must be under half")
    assert second.startswith("error: job 'purge': jitter (7s) must be under half")
    assert "registration stopped at this job" in summary


def test_check_reports_every_error_at_once() -> None:
    result = brokersched("check", "tests.support.cli_apps.late_backend:create")
    assert result.returncode == 1
    errors = result.stderr.strip().splitlines()
    assert errors == [
        "error: job 'exclusive': option 'overlap' ('skip') needs a lease backend; "
        "RabbitMQBackend only claims slots (use SQLiteBackend, PostgresBackend, "
        "RedisLeaseBackend or NATSLeaseBackend, or guard inside the job)",
        "error: job 'persistent': option 'max_attempts' (5) needs a lease backend; "
        "RabbitMQBackend only claims slots (use SQLiteBackend, PostgresBackend, "
        "RedisLeaseBackend or NATSLeaseBackend, or guard inside the job)",
        "error: job 'persistent': option 'catch_up' (10m) needs a lease backend; "
        "RabbitMQBackend only claims slots (use SQLiteBackend, PostgresBackend, "
        "RedisLeaseBackend or NATSLeaseBackend, or guard inside the job)",
        "3 configuration errors",
    ]


def test_a_factory_is_called() -> None:
    result = brokersched("check", "tests.support.cli_apps.odd:make_scheduler")
    assert result.returncode == 0
    assert result.stdout.strip() == "0 jobs OK"
    assert "registers no jobs" in result.stderr


HOW = "write MODULE:ATTR (app:scheduler) or path/to/file.py:ATTR (./app.py:scheduler)"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("app", f"'app' is not MODULE:ATTR nor FILE.py:ATTR; {HOW}"),
        ("no_such_module:scheduler", HOW),
        ("./no_such_file.py:scheduler", "no Python file './no_such_file.py'"),
        ("no_such_dir/app.py:scheduler", HOW),
        (
            "tests/support/cli_apps/odd.py:nothing",
            "'tests/support/cli_apps/odd.py' has no attribute 'nothing'",
        ),
        ("no_such_module:scheduler", "no module named 'no_such_module'"),
        (
            "tests.support.cli_apps.missing:scheduler",
            "no module named 'tests.support.cli_apps.missing'",
        ),
        (
            "tests.support.cli_apps.odd:nothing",
            "module 'tests.support.cli_apps.odd' has no attribute 'nothing'",
        ),
        ("tests.support.cli_apps.odd:answer", "is of type int, not a brokersched.Scheduler"),
        ("tests.support.cli_apps.odd:needs_settings", "odd:needs_settings' needs arguments"),
        ("tests.support.cli_apps.odd:broken_factory", "jitter 'soon' is not a duration"),
        (
            "tests.support.cli_apps.odd:Scheduler",
            "is the class Scheduler, not the Scheduler object",
        ),
    ],
)
def test_loading_mistakes_are_one_line(spec: str, message: str) -> None:
    result = CliRunner().invoke(cli, ["jobs", spec])
    assert result.exit_code == 2
    assert message in one_error_line(result.stderr)


APP_FILE = """
from brokersched import MemoryBackend, Scheduler
from helper import PERIOD  # a neighbour, imported as `python app.py` would find it

scheduler = Scheduler(MemoryBackend())


@scheduler.every("tick", PERIOD)
async def tick(ctx):
    pass
"""


def run_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "brokersched", *args],
        cwd=directory,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_file_path_names_the_application(tmp_path: Path) -> None:
    """``brokersched jobs ./app.py:scheduler`` used to end in a ModuleNotFoundError traceback."""
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "app.py").write_text(APP_FILE)
    (project / "helper.py").write_text('PERIOD = "6h"\n')
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "helper.py").write_text('PERIOD = "2h"\n')
    (project / "pkg" / "jobs.py").write_text(APP_FILE.replace("from helper", "from .helper"))
    for directory, spec, period in [
        (project, "./app.py:scheduler", "6h"),
        (project, "app.py:scheduler", "6h"),
        (tmp_path, "project/app.py:scheduler", "6h"),
        (tmp_path, str(project / "app.py") + ":scheduler", "6h"),
        (tmp_path, "project/pkg/jobs.py:scheduler", "2h"),  # imported as pkg.jobs
        (project, "pkg/jobs.py:scheduler", "2h"),
        (project, "pkg.jobs:scheduler", "2h"),  # the same module, named as a module
    ]:
        result = run_in(directory, "jobs", spec, "-n", "1")
        assert result.returncode == 0, (spec, result.stderr)
        assert f"every {period}" in result.stdout, spec
    checked = run_in(project, "check", "./app.py:scheduler")
    assert (checked.returncode, checked.stdout.strip()) == (0, "1 job OK")
    typo = run_in(project, "check", "./app.py:sched")
    assert typo.returncode == 2
    assert one_error_line(typo.stderr) == (
        "Error: './app.py' has no attribute 'sched' (its Scheduler objects: scheduler)"
    )


def test_a_file_shadowed_by_an_imported_module_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "json.py").write_text("scheduler = None\n")
    result = run_in(tmp_path, "jobs", "lib/json.py:scheduler")
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "'lib/json.py' would be imported as 'json', a name already taken by" in line
    assert HOW in line


def test_a_configuration_error_at_import_is_a_usage_error_outside_check() -> None:
    result = brokersched("jobs", "tests.support.cli_apps.refused:scheduler")
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "tests.support.cli_apps.refused:scheduler: job 'exclusive': option 'overlap'" in line


def test_a_bug_in_the_application_shows_its_traceback() -> None:
    result = brokersched("jobs", "tests.support.cli_apps.crashing:scheduler")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and 'settings["database"]' in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: importing 'tests.support.cli_apps.crashing' failed: KeyError: 'database'"
    )


# -- trigger and history on SQLite -----------------------------------------------------------


def test_trigger_and_history_on_sqlite(sqlite_env: dict[str, str]) -> None:
    ok = brokersched("trigger", SQLITE_APP, "tick", env=sqlite_env)
    assert ok.returncode == 0, ok.stderr
    assert re.fullmatch(r"job 'tick' completed in \d+ms \(run [0-9a-f]{16} on \S+\)\n", ok.stdout)
    assert "outcome=completed" in ok.stderr  # the scheduler's run line, in the log

    failed = brokersched("trigger", SQLITE_APP, "boom", env=sqlite_env)
    assert failed.returncode == 1
    assert "job 'boom' failed in" in failed.stderr
    assert failed.stderr.strip().endswith("ValueError: boom: the handler failed")

    records = brokersched("history", SQLITE_APP, "boom", "--json", env=sqlite_env)
    assert records.returncode == 0, records.stderr
    (record,) = [json.loads(line) for line in records.stdout.splitlines()]
    assert (record["job"], record["outcome"], record["reason"]) == ("boom", "failed", "manual")
    assert record["error"] == "ValueError: boom: the handler failed"

    table = brokersched("history", SQLITE_APP, "tick", env=sqlite_env)
    assert table.returncode == 0, table.stderr
    (row,) = [line for line in table.stdout.splitlines() if "manual" in line]
    assert "completed" in row and "manual #" not in row  # the first attempt

    # Only the triggered job ran: the others stayed paused while the scheduler was up.
    none = brokersched("history", SQLITE_APP, "flaky", env=sqlite_env)
    assert none.stdout.strip() == "no runs recorded for job 'flaky'"


def test_history_shows_a_failed_runs_traceback(sqlite_env: dict[str, str]) -> None:
    assert brokersched("trigger", SQLITE_APP, "boom", env=sqlite_env).returncode == 1
    shown = brokersched("history", SQLITE_APP, "boom", "--traceback", env=sqlite_env)
    assert shown.returncode == 0, shown.stderr
    table, _, tracebacks = shown.stdout.partition("failed run ")
    assert "ValueError: boom: the handler failed" in table
    assert "Traceback (most recent call last):" in tracebacks
    assert 'raise ValueError("boom: the handler failed")' in tracebacks
    assert tracebacks.rstrip().endswith("ValueError: boom: the handler failed")
    (record,) = [
        json.loads(line)
        for line in brokersched(
            "history", SQLITE_APP, "boom", "--json", env=sqlite_env
        ).stdout.splitlines()
    ]
    assert record["traceback"].startswith("Traceback (most recent call last):")
    plain = brokersched("history", SQLITE_APP, "boom", env=sqlite_env).stdout
    assert "Traceback" not in plain  # only with --traceback


def test_unknown_job_is_a_usage_error(sqlite_env: dict[str, str]) -> None:
    result = brokersched("trigger", SQLITE_APP, "nope", env=sqlite_env)
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "no job named 'nope' in tests.support.cli_apps.sqlite_app:scheduler" in line
    assert "(jobs: boom, flaky, report, tick)" in line


# -- run on SQLite: logs and the drain ------------------------------------------------------


def test_run_logs_json_and_drains_on_sigterm(tmp_path: Path) -> None:
    env = {"BROKERSCHED_TEST_DB": str(tmp_path / "drain.db")}
    cli = RunningCLI(
        "run", "tests.support.cli_apps.draining:scheduler", "--log-format", "json", env=env
    )
    try:
        cli.wait_for_line(lambda line: "long run started" in line)
        assert cli.stop(signal.SIGTERM) == 0, cli.output()
    finally:
        cli.kill()
    entries = cli.json_lines()
    assert len(entries) == len(cli.lines), cli.output()  # every line is one JSON object
    started = next(e for e in entries if e["message"].startswith("started"))
    assert started["jobs"] == ["long"] and started["backend"].startswith("SQLiteBackend(")
    (run,) = [e for e in entries if e.get("outcome")]
    assert run["job"] == "long" and run["level"] == "warning"
    assert (run["outcome"], run["reason"], run["attempt"]) == ("interrupted", "schedule", 1)
    for field in ("run_id", "slot", "duration_ms", "late_ms", "instance_id"):
        assert field in run
    messages = [e["message"] for e in entries]
    assert messages[-4:] == [
        "SIGTERM: stopping",
        "draining running jobs (up to 5s)",
        run["message"],  # the run ends during the drain
        "stopped",
    ]
    assert "error='aborted: shutdown'" in run["message"]


def test_run_exits_when_a_sync_handler_outlives_the_drain(tmp_path: Path) -> None:
    env = {"BROKERSCHED_TEST_DB": str(tmp_path / "stubborn.db"), "BROKERSCHED_TEST_DRAIN": "300ms"}
    cli = RunningCLI("run", "tests.support.cli_apps.stubborn:scheduler", env=env)
    try:
        cli.wait_for_line(lambda line: "stubborn run started" in line)
        began = time.monotonic()
        assert cli.stop(signal.SIGTERM) == 0, cli.output()
        assert time.monotonic() - began < 10  # not the handler's 30 s
    finally:
        cli.kill()
    output = cli.output()
    assert "abandoned: still running after drain_timeout (0.3s)" in output
    assert "its lease expires and the slot is taken over" in output
    assert "runs of 1 job(s) outlived drain_timeout: exiting without waiting for them" in output


def test_a_second_signal_cuts_the_drain_short(tmp_path: Path) -> None:
    env = {"BROKERSCHED_TEST_DB": str(tmp_path / "stubborn.db"), "BROKERSCHED_TEST_DRAIN": "1m"}
    cli = RunningCLI("run", "tests.support.cli_apps.stubborn:scheduler", env=env)
    try:
        cli.wait_for_line(lambda line: "stubborn run started" in line)
        cli.process.send_signal(signal.SIGINT)
        cli.wait_for_line(lambda line: "draining running jobs (up to 1m)" in line)
        assert cli.stop(signal.SIGINT) == 1, cli.output()
    finally:
        cli.kill()
    assert "second SIGINT: exiting now, without waiting for running jobs" in cli.output()


def test_run_refuses_a_taken_metrics_port(sqlite_env: dict[str, str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = brokersched("run", SQLITE_APP, "--metrics-port", str(port), env=sqlite_env)
    assert result.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in one_error_line(result.stderr)


# -- RabbitMQ: a real broker, and one that is not there -------------------------------------


@pytest.fixture
def rabbitmq_env(amqp_url: str) -> Iterator[dict[str, str]]:
    prefix = unique("brokersched_cli")
    yield {"BROKERSCHED_AMQP_URL": amqp_url, "BROKERSCHED_TEST_PREFIX": prefix}
    # trigger starts the scheduler, which declares the history queue of every job; the claim
    # queues expire by themselves (slot_ttl=20s in the app)
    histories = [history_queue_name(prefix, job) for job in ("greet", "nightly")]
    asyncio.run(delete_queues(amqp_url, [*histories, *fleet_queues(prefix)]))


def test_trigger_and_history_on_rabbitmq(rabbitmq_env: dict[str, str]) -> None:
    for _ in range(2):
        result = brokersched("trigger", RABBITMQ_APP, "greet", env=rabbitmq_env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("job 'greet' completed in")
    listed = brokersched("history", RABBITMQ_APP, "greet", "--json", env=rabbitmq_env)
    assert listed.returncode == 0, listed.stderr
    records = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["outcome"], r["reason"]) for r in records] == [("completed", "manual")] * 2
    assert records[0]["slot_ms"] > records[1]["slot_ms"]  # newest first
    # the same records as the backend reads them itself
    backend = RabbitMQBackend(
        rabbitmq_env["BROKERSCHED_AMQP_URL"], prefix=rabbitmq_env["BROKERSCHED_TEST_PREFIX"]
    )

    async def read() -> list[str]:
        await backend.start(SystemClock())
        try:
            return [r.run_id for r in await backend.history(JobPolicy("greet"), 10)]
        finally:
            await backend.stop()

    assert asyncio.run(read()) == [r["run_id"] for r in records]


def test_trigger_names_the_application_by_its_file(rabbitmq_env: dict[str, str]) -> None:
    result = brokersched(
        "trigger", "tests/support/cli_apps/rabbitmq_app.py:scheduler", "greet", env=rabbitmq_env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("job 'greet' completed in")


def test_run_on_an_unreachable_broker_prints_only_its_error() -> None:
    """aiormq's ``ERROR error when creating transport`` and aio-pika's ``Reconnecting after 1
    seconds`` came before the CLI's own line."""
    result = brokersched("run", RABBITMQ_APP, env=UNREACHABLE)
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert line.startswith("Error: backend unavailable: RabbitMQBackend: connecting to")
    assert "amqp://app:***@127.0.0.1:1/" in line and "s3cret" not in line


def test_a_missing_vhost_is_one_line_naming_it(amqp_url: str) -> None:
    parts = urlsplit(amqp_url)
    url = urlunsplit(parts._replace(path="/no-such-vhost"))
    result = brokersched("run", RABBITMQ_APP, env={"BROKERSCHED_AMQP_URL": url})
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert "refused virtual host 'no-such-vhost'" in line
    assert "rabbitmqctl add_vhost no-such-vhost" in line


@pytest.mark.parametrize("command", ["trigger", "history"])
def test_an_unreachable_backend_exits_3_without_secrets(command: str) -> None:
    result = brokersched(command, RABBITMQ_APP, "greet", env=UNREACHABLE)
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert line.startswith("Error: backend unavailable: RabbitMQBackend")
    assert "amqp://app:***@127.0.0.1:1/" in line and "s3cret" not in line


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.fixture
def postgres_env(postgres_dsn: str) -> Iterator[dict[str, str]]:
    schema = unique("brokersched_cli")
    yield {"BROKERSCHED_POSTGRES_DSN": postgres_dsn, "BROKERSCHED_TEST_SCHEMA": schema}

    async def drop() -> None:
        import asyncpg

        connection = await asyncpg.connect(postgres_dsn)
        try:
            await connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await connection.close()

    asyncio.run(drop())


def test_trigger_and_history_on_postgres(postgres_env: dict[str, str]) -> None:
    app = "tests.support.cli_apps.postgres_app:scheduler"
    result = brokersched("trigger", app, "vacuum", env=postgres_env)
    assert result.returncode == 0, result.stderr
    listed = brokersched("history", app, "vacuum", "--json", env=postgres_env)
    assert listed.returncode == 0, listed.stderr
    (record,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (record["outcome"], record["reason"], record["attempt"]) == ("completed", "manual", 1)


def test_jobs_says_a_job_paused_for_the_fleet_is_paused(postgres_env: dict[str, str]) -> None:
    """``Job.pause()`` on a running instance pauses the job for the whole fleet: ``jobs``
    reads the fleet's controls and says so, in the table (no "enabled" beside it) and in
    ``--json`` (``state``; ``enabled`` keeps meaning the application's)."""
    from brokersched import PostgresBackend, Scheduler

    app = "tests.support.cli_apps.postgres_app:scheduler"
    dsn, schema = postgres_env["BROKERSCHED_POSTGRES_DSN"], postgres_env["BROKERSCHED_TEST_SCHEMA"]

    async def pause() -> None:
        instance = Scheduler(PostgresBackend(dsn, schema=schema, lease_ttl="5s"), jitter=0)
        job = instance.every("vacuum", "1d", lambda ctx: None, overlap="skip", max_attempts=2)
        async with instance:
            await job.pause(by="ops")

    asyncio.run(pause())
    table = brokersched("jobs", app, env={**postgres_env, "COLUMNS": "160"})
    assert table.returncode == 0, table.stderr
    (row,) = [line for line in table.stdout.splitlines() if "vacuum" in line]
    assert "paused" in row and "enabled" not in row and " yes " not in row, table.stdout
    narrow = brokersched("jobs", app, env={**postgres_env, "COLUMNS": "80"})
    assert "paused" in narrow.stdout and "enabled" not in narrow.stdout, narrow.stdout
    listed = brokersched("jobs", app, "--json", env=postgres_env)
    (job,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (job["state"], job["controls_read"], job["enabled"]) == ("paused", True, True)


def test_jobs_shows_until_when_a_pause_lasts_and_the_slots_a_skip_passes_over(
    postgres_env: dict[str, str],
) -> None:
    from brokersched import PostgresBackend, Scheduler

    app = "tests.support.cli_apps.postgres_app:scheduler"
    dsn, schema = postgres_env["BROKERSCHED_POSTGRES_DSN"], postgres_env["BROKERSCHED_TEST_SCHEMA"]
    env = {**postgres_env, "COLUMNS": "160"}
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    days = [midnight + timedelta(days=n) for n in range(1, 6)]

    async def change(action: str) -> None:
        instance = Scheduler(PostgresBackend(dsn, schema=schema, lease_ttl="5s"), jitter=0)
        job = instance.every("vacuum", "1d", lambda ctx: None, overlap="skip", max_attempts=2)
        async with instance:
            if action == "pause":
                await job.pause(until=days[1] + timedelta(hours=1), by="ops")
            else:
                await job.resume(by="ops")
                await job.skip(2, by="ops")

    def listed() -> tuple[str, dict[str, Any]]:
        table = brokersched("jobs", app, env=env)
        assert table.returncode == 0, table.stderr
        rows = brokersched("jobs", app, "--json", "-n", "2", env=env).stdout.splitlines()
        return table.stdout, json.loads(rows[0])

    asyncio.run(change("pause"))
    table, row = listed()
    assert f"paused until {days[1]:%Y-%m-%d} 01:00" in table, table
    assert f"{days[2]:%Y-%m-%d}" in table and f"{days[1]:%Y-%m-%d} 00:00" not in table
    assert row["state"] == "paused" and row["control"]["until"].startswith(f"{days[1]:%F}")
    asyncio.run(change("skip"))
    table, row = listed()
    assert "enabled, skips 2 slots" in table, table
    assert f"{days[2]:%Y-%m-%d}" in table and f"{days[0]:%Y-%m-%d} 00:00" not in table
    assert row["control"]["skip"]["count"] == 2


def test_jobs_says_when_it_cannot_read_the_fleets_controls() -> None:
    env = {"BROKERSCHED_POSTGRES_DSN": "postgresql://app:s3cret@127.0.0.1:1/test", "COLUMNS": "160"}
    result = brokersched("jobs", "tests.support.cli_apps.postgres_app:scheduler", env=env)
    assert result.returncode == 0, result.stderr
    assert "fleet-wide pauses not read" in result.stdout and "s3cret" not in result.stdout
    (row,) = [line for line in result.stdout.splitlines() if "vacuum" in line]
    assert "enabled?" in row


def test_an_unreachable_database_exits_3_without_secrets() -> None:
    env = {"BROKERSCHED_POSTGRES_DSN": "postgresql://app:s3cret@127.0.0.1:1/test"}
    result = brokersched(
        "history", "tests.support.cli_apps.postgres_app:scheduler", "vacuum", env=env
    )
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert line.startswith("Error: backend unavailable: PostgresBackend")
    assert "s3cret" not in result.stderr


# -- log formatting (in process) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
        ("connect postgresql://app:p%40ss@db/x failed", "connect postgresql://app:***@db/x failed"),
        ("nats://:token@n1:4222,nats://u:p@n2", "nats://:***@n1:4222,nats://u:***@n2"),
        ("host=db user=app password=hunter2 dbname=x", "host=db user=app password=*** dbname=x"),
        ("password='two words' sslmode=require", "password=*** sslmode=require"),
        ("http://host:8080/path and amqp://host/", "http://host:8080/path and amqp://host/"),
    ],
)
def test_redact_text(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted


def test_json_formatter_keeps_extra_fields_and_redacts(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("json", "DEBUG", stream)
    log = logging.getLogger("brokersched.test")
    log.info(
        "run %s via %s",
        "job=a",
        "amqp://u:pw@h/",
        extra={"job": "a", "duration_ms": 12, "tags": ["x"], "url": "amqp://u:pw@h/"},
    )
    try:
        raise RuntimeError("down: amqp://u:pw@h/")
    except RuntimeError:
        log.exception("failed")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "run job=a via amqp://u:***@h/"
    assert (first["level"], first["logger"]) == ("info", "brokersched.test")
    assert (first["job"], first["duration_ms"], first["tags"]) == ("a", 12, ["x"])
    assert first["url"] == "amqp://u:***@h/"
    assert "RuntimeError: down: amqp://u:***@h/" in second["exc_info"]
    assert "pw@" not in stream.getvalue()


def test_the_text_formatter_redacts_too(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("text", "INFO", stream)
    logging.getLogger("brokersched.test").warning("lost amqp://u:pw@h/")
    assert stream.getvalue().rstrip().endswith("WARNING brokersched.test: lost amqp://u:***@h/")


# -- listings: --json, every job's history, 80 columns ---------------------------------------

LISTED_APP = """
from brokersched import Scheduler, SQLiteBackend

scheduler = Scheduler(SQLiteBackend({path!r}), jitter=0)
scheduler.every("sync.orders", "1h", lambda ctx: None, timeout="10m")
scheduler.every("sync.invoices-for-the-accounting-department", "1h", lambda ctx: None)
scheduler.cron("report", "0 8 * * MON-FRI", lambda ctx: None, timezone="Europe/Paris",
               data={{"dsn": "postgresql://report:s3cret@db/reports"}}, key="report-v2")
"""


def listed_app(tmp_path: Path) -> str:
    """An application on SQLite whose history holds runs of three jobs, interleaved."""
    from datetime import UTC, datetime, timedelta

    from brokersched.abc import RunRecord
    from brokersched.backends.sqlite import SQLiteBackend

    db = tmp_path / "listed.db"
    app = tmp_path / f"listed_{uuid.uuid4().hex[:8]}.py"
    app.write_text(LISTED_APP.format(path=str(db)))
    start = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)

    def run(job: str, minute: int, outcome: str = "completed") -> RunRecord:
        at = start + timedelta(minutes=minute)
        error = "RuntimeError: cannot reach postgresql://report:s3cret@db/reports"
        # What a handler returned (written unredacted, as a third-party backend might).
        result = {"orders": minute, "via": "postgresql://sync:s3cret@db/o", "ids": [*range(40)]}
        return RunRecord(
            job, int(at.timestamp() * 1000), f"run-{job[:6]}-{minute}", "host-1:42", "schedule",
            1 if outcome == "completed" else 2, at, at + timedelta(seconds=2), outcome,  # type: ignore[arg-type]
            error if outcome == "failed" else None,
            result=result if job == "sync.orders" else None,
        )  # fmt: skip

    async def write() -> None:
        backend = SQLiteBackend(db)
        await backend.start(SystemClock())
        try:
            for minute, job in enumerate(["sync.orders", "report-v2", "sync.orders"] * 3):
                outcome = "failed" if job == "report-v2" else "completed"
                await backend.record(JobPolicy(job), run(job, minute, outcome))
        finally:
            await backend.stop()

    asyncio.run(write())
    return f"{app}:scheduler"


def invoke(*args: str, columns: int | None = None) -> str:
    env = {"COLUMNS": str(columns)} if columns else {}
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_history_without_a_job_merges_every_jobs_latest_runs(tmp_path: Path) -> None:
    app = listed_app(tmp_path)
    lines = invoke("history", app, "--json", "--limit", "4").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["run_id"] for r in records] == [
        "run-sync.o-8", "run-report-7", "run-sync.o-6", "run-sync.o-5",
    ]  # fmt: skip
    assert all(list(r) == list(records[0]) for r in records)  # the same keys, always
    assert list(records[0]) == [
        "job", "slot_ms", "slot", "run_id", "instance_id", "reason", "attempt", "started_at",
        "finished_at", "duration_ms", "late_ms", "outcome", "error", "traceback", "result",
    ]  # fmt: skip
    failed = records[1]
    assert failed["started_at"] == "2027-01-15T08:07:00.000Z" and failed["duration_ms"] == 2000
    assert failed["error"] == "RuntimeError: cannot reach postgresql://report:***@db/reports"
    assert records[0]["error"] is None and records[0]["traceback"] is None
    assert records[0]["result"] == {
        "orders": 8, "via": "postgresql://sync:***@db/o", "ids": [*range(40)],
    }  # fmt: skip
    assert failed["result"] is None
    table = invoke("history", app, "-n", "3")
    assert "last 3 runs of 3 jobs" in table and "report" in table
    empty = invoke("history", app, "sync.invoices-for-the-accounting-department")
    assert empty.strip() == "no runs recorded for job 'sync.invoices-for-the-accounting-department'"
    assert invoke("history", app, "sync.invoices-for-the-accounting-department", "--json") == ""


def test_jobs_and_next_print_json(tmp_path: Path) -> None:
    app = listed_app(tmp_path)
    jobs = [json.loads(line) for line in invoke("jobs", app, "--json", "-n", "2").splitlines()]
    report = jobs[2]
    assert report == {
        "name": "report",
        "key": "report-v2",
        "kind": "cron",
        "schedule": "cron '0 8 * * MON-FRI' (Europe/Paris)",
        "zone": "Europe/Paris",
        "options": {"data": "***"},
        "overrides": {},
        "enabled": True,
        "next_runs": report["next_runs"],
        "state": "enabled",
        "controls_read": True,
        "control": None,
        "trigger": {"kind": "cron", "expression": "0 8 * * MON-FRI", "timezone": "Europe/Paris",
                    "dst": None},
        "claim": True,
    }  # fmt: skip
    assert len(report["next_runs"]) == 2
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT0[67]:00:00\.000Z", t) for t in report["next_runs"])
    assert jobs[0]["options"] == {"timeout": "10m"}
    rows = invoke("next", "0 8 * * *", "-z", "Europe/Paris", "--after", "2027-03-27T12:00",
                  "-n", "2", "--json")  # fmt: skip
    assert [json.loads(line) for line in rows.splitlines()] == [
        {"n": 1, "local": "2027-03-28T08:00:00.000+02:00", "zone": "Europe/Paris",
         "utc_offset": "+02:00", "utc": "2027-03-28T06:00:00.000Z", "dst": "run-once"},
        {"n": 2, "local": "2027-03-29T08:00:00.000+02:00", "zone": "Europe/Paris",
         "utc_offset": "+02:00", "utc": "2027-03-29T06:00:00.000Z", "dst": "run-once"},
    ]  # fmt: skip


@pytest.mark.parametrize("columns", [120, 160, 200])
@pytest.mark.parametrize("job", [None, "report", "sync.orders"])
def test_history_shows_a_run_a_line_from_120_columns(
    tmp_path: Path, columns: int, job: str | None
) -> None:
    """From 120 columns (the wide table) each run is one line whatever the width: times,
    outcome, reason and run id whole, the error cut with an ellipsis rather than wrapped."""
    app = listed_app(tmp_path)
    output = invoke("history", app, *([job] if job else []), columns=columns)
    lines = output.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= columns, output
    rows = [line for line in lines if re.match(r"2027-01-15 08:0\d:00Z ", line)]
    expected = {None: 9, "report": 3, "sync.orders": 6}[job]
    assert len(rows) == expected, output
    for row in rows:
        assert re.search(r" run-(sync\.o|report)-\d ", row), row  # the run id whole
        assert re.search(r" (completed|failed) ", row) and " schedule" in row, row
    failed = [row for row in rows if " failed " in row]
    assert len(failed) == (0 if job == "sync.orders" else 3), output
    assert all("RuntimeError" in row and "s3cret" not in row for row in failed)
    returned = [row for row in rows if " completed " in row]
    assert all('{"orders":' in row and "s3cret" not in row for row in returned), output
    assert all(row.rstrip().endswith("…") for row in returned), output  # cut, not wrapped


@pytest.mark.parametrize(
    "args",
    [
        ("jobs", "{app}"),
        ("history", "{app}"),
        ("history", "{app}", "report"),
        ("next", "0 8 * * MON-FRI", "-z", "Europe/Paris"),
    ],
)
def test_listings_fit_80_columns(tmp_path: Path, args: tuple[str, ...]) -> None:
    app = listed_app(tmp_path)
    output = invoke(*(arg.format(app=app) for arg in args), columns=80)
    assert max(len(line.rstrip()) for line in output.splitlines()) <= 80, output
    words = {"jobs": ("report", "sync.orders"), "next": ("08:00:00",)}.get(args[0], ("failed",))
    if args == ("history", "{app}"):
        words = ("report", "sync.orders")
    for word in words:
        assert word in output
    if args[0] == "history":
        assert "failed" in output and "RuntimeError" in output and "s3cret" not in output


# -- the newcomer's messages ------------------------------------------------------------------


def test_check_blames_no_job_for_a_backends_error() -> None:
    result = brokersched("check", "tests.support.cli_apps.backend_typo:scheduler")
    assert result.returncode == 1
    first, last = result.stderr.strip().splitlines()
    assert first.startswith("error: RabbitMQBackend: unknown keyword 'slot_tll'; did you mean")
    assert "registration stopped" not in result.stderr and "s3cret" not in result.stderr
    assert last == (
        "tests.support.cli_apps.backend_typo:scheduler could not be loaded, so its jobs were not "
        "checked; fix it and check again"
    )


def test_check_warns_of_an_at_job_in_the_past() -> None:
    result = brokersched("check", "tests.support.cli_apps.past_at:scheduler")
    assert (result.returncode, result.stdout.strip()) == (0, "1 job OK")
    assert result.stderr.strip() == (
        "warning: job 'migrate': at 2020-01-01T00:00:00+00:00 passed "
        + result.stderr.split("passed ")[1].split(" ago")[0]
        + " ago, more than its max_late (1m): it will never run (give a later time, or "
        "trigger it by hand)"
    )
    assert re.search(r"passed \d+d ago", result.stderr)


def test_run_warns_when_the_application_has_no_jobs() -> None:
    cli = RunningCLI("run", "tests.support.cli_apps.odd:make_scheduler")
    try:
        line = cli.wait_for_line(lambda line: "registers no jobs" in line)
        assert "WARNING" in line and "nothing will run" in line
        assert cli.stop(signal.SIGINT) == 0, cli.output()
    finally:
        cli.kill()


def test_instances_lists_the_fleet_with_liveness_in_80_columns_and_json(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from brokersched.abc import Instance, Lease, RunInProgress, Slot
    from brokersched.backends.sqlite import SQLiteBackend

    app = listed_app(tmp_path)
    now = datetime.now(UTC)
    beat = timedelta(seconds=5)
    started = now - timedelta(minutes=1)
    slot = Slot("sync.orders", int(started.timestamp() * 1000))
    run = RunInProgress(
        "sync.orders", "0123456789abcdef", slot.slot_ms, started, "schedule", leased=True
    )
    alive = Instance("web-1:4242:ab12", "web-1", 4242, "1.0", now - timedelta(hours=2), now, beat)
    dead = Instance(
        "worker-7:99:cd34", "worker-7", 99, "1.0", now - timedelta(hours=1),
        now - timedelta(seconds=30), beat, (run,),
    )  # fmt: skip

    async def publish() -> Lease:
        backend = SQLiteBackend(tmp_path / "listed.db")
        await backend.start(SystemClock())
        try:  # the dead instance's run still holds its lease: it is shown in progress
            policy = JobPolicy(slot.job)
            lease = await backend.acquire(
                slot,
                policy=policy,
                instance_id=dead.id,
                run_id=run.run_id,
                reason="schedule",
                timeout=5.0,
            )
            assert not isinstance(lease, str), lease
            for instance in (alive, dead):
                await backend.publish_instance(instance)
            return lease
        finally:
            await backend.stop()

    async def end(lease: Lease) -> None:
        backend = SQLiteBackend(tmp_path / "listed.db")
        await backend.start(SystemClock())
        try:
            await backend.release(lease, handover=False)
        finally:
            await backend.stop()

    lease = asyncio.run(publish())
    rows = [json.loads(line) for line in invoke("instances", app, "--json").splitlines()]
    assert [(r["id"], r["liveness"]) for r in rows] == [
        ("web-1:4242:ab12", "alive"),
        ("worker-7:99:cd34", "dead"),
    ]
    assert rows[1]["running"][0]["run_id"] == "0123456789abcdef"
    table = invoke("instances", app, columns=80)
    assert all(len(line) <= 80 for line in table.splitlines()), table
    assert "dead" in table and "alive" in table and "(lease held)" in table
    asyncio.run(end(lease))  # over (here ended; taken over alike): no longer running there
    rows = [json.loads(line) for line in invoke("instances", app, "--json").splitlines()]
    assert [(r["id"], r["running"]) for r in rows] == [
        ("web-1:4242:ab12", []),
        ("worker-7:99:cd34", []),
    ]
    assert "(lease held)" not in invoke("instances", app, columns=80)

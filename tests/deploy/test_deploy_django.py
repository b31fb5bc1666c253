"""examples/django on PostgreSQL: ``manage.py brokersched check|jobs|trigger|run`` (the real
management command, in its own process), a sync ORM job that keeps running after the database
terminated its connections (``around_run=db_connections``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.support.names import unique
from tests.support.paths import REPO_ROOT

PROJECT = REPO_ROOT / "examples" / "django"
APPLICATION_NAME = "brokersched-django-example"  # examples/django/exampleproject/settings.py


@pytest.fixture
def database(postgres_dsn: str) -> Iterator[str]:
    """A database of its own (Django's tables, and the scheduler's schema): its URL."""
    name = unique("bs_django")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield urlunsplit(urlsplit(postgres_dsn)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def project_env(database: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database, "TICK_EVERY": "1s", "COLUMNS": "200"}


def manage(database: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env=project_env(database),
        capture_output=True,
        text=True,
        timeout=60,
    )


def ticks(database: str, reason: str = "schedule") -> int:
    with psycopg.connect(database) as conn:
        query = "SELECT count(*) FROM reports_tick WHERE reason = %s"
        row = conn.execute(query, [reason]).fetchone()
    assert row is not None
    return int(row[0])


def terminate_django_connections(database: str) -> int:
    """What a database restart or failover does to the ORM's persistent connections."""
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [APPLICATION_NAME],
        ).fetchall()
    return len(rows)


def wait_for_ticks(database: str, count: int, log: Path, timeout: float = 20) -> int:
    """Wait until the job has run ``count`` times on schedule; the number of runs then."""
    deadline = time.monotonic() + timeout
    while (done := ticks(database)) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{done} runs of {count} within {timeout}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return done


def test_the_management_command_reads_the_project(database: str) -> None:
    """About 4 s: five Django processes."""
    migrate = manage(database, "migrate", "--no-input")
    assert migrate.returncode == 0, migrate.stderr
    check = manage(database, "brokersched", "check")
    assert (check.returncode, check.stdout.strip()) == (0, "1 job OK"), check.stderr
    jobs = manage(database, "brokersched", "jobs")
    assert jobs.returncode == 0 and "reports.tick" in jobs.stdout, jobs.stderr
    trigger = manage(database, "brokersched", "trigger", "reports.tick")
    assert trigger.returncode == 0, trigger.stderr
    assert "job 'reports.tick' completed" in trigger.stdout
    assert ticks(database, reason="manual") == 1  # the ORM wrote it, in the trigger's process
    unknown = manage(database, "brokersched", "trigger", "nope")
    assert unknown.returncode == 2 and "nope" in unknown.stderr


def test_runs_survive_the_database_closing_connections(database: str, tmp_path: Path) -> None:
    """About 8 s of real time: a run every second, the connections killed twice between runs."""
    assert manage(database, "migrate", "--no-input").returncode == 0
    log = tmp_path / "run.log"
    with log.open("w") as sink:
        run = subprocess.Popen(
            [sys.executable, "manage.py", "brokersched", "run", "--log-format", "json"],
            cwd=PROJECT,
            env=project_env(database),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        done = wait_for_ticks(database, 2, log)
        for _ in range(2):
            done = wait_for_ticks(database, done + 1, log)  # just run: ~1 s to the next slot
            assert terminate_django_connections(database) >= 1  # the ORM held one
            done = wait_for_ticks(database, done + 2, log)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=20) == 0, log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    runs = [
        entry
        for line in log.read_text().splitlines()
        if line.startswith("{") and (entry := json.loads(line)).get("event") == "run"
    ]
    assert len(runs) >= 6
    assert {entry["outcome"] for entry in runs} == {"completed"}, [
        entry.get("error") for entry in runs
    ]


def test_a_project_without_the_setting_is_told_what_to_write() -> None:
    code = (
        "import django, sys\n"
        "from django.conf import settings\n"
        "settings.configure(INSTALLED_APPS=['brokersched.contrib.django'])\n"
        "django.setup()\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(['manage.py', 'brokersched', 'check'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert (
        "settings.BROKERSCHED_SCHEDULER is None; name the scheduler as 'module:attribute', "
        "e.g. BROKERSCHED_SCHEDULER = 'reports.jobs:scheduler'"
    ) in done.stderr

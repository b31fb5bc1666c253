"""The examples of the option table and the dashboard example, run as a user runs them: one
command each, on the embedded backends (memory, SQLite), no server.

They sleep in real time (the point is the real thing), so they all start at once, when the
first test asks; each test then waits for its own and reads what it printed.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"
TOKEN = "examples-admin-token-0123456789"
COMMANDS = {  # what follows `python`
    "billing": [EXAMPLES / "billing.py"],
    "nightly_export": [EXAMPLES / "nightly_export.py", "--seconds", "5"],
    "cache_refresh": [EXAMPLES / "cache_refresh.py", "--seconds", "5"],
    "migration": [EXAMPLES / "migration.py"],
    "dashboard": [  # until SIGTERM
        *("-m", "brokersched", "run", f"{EXAMPLES / 'dashboard' / 'app.py'}:scheduler"),
        *("--http", "127.0.0.1:0"),
    ],
}
# no BROKERSCHED_* server URLs: nothing to connect to
ENV = {"PATH": "/usr/bin:/bin", "BROKERSCHED_ADMIN_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    cwd = tmp_path_factory.mktemp("examples")  # the default /tmp/*.db files are not used
    processes = {
        name: subprocess.Popen(
            [sys.executable, *map(str, argv)],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, argv in COMMANDS.items()
    }
    yield processes
    for process in processes.values():
        process.kill()
        process.communicate()


def output_of(started: dict[str, subprocess.Popen[str]], name: str) -> str:
    process = started[name]
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    return out


def test_billing_is_never_retried_and_catches_up(
    started: dict[str, subprocess.Popen[str]],
) -> None:
    out = output_of(started, "billing")
    assert "invoices sent twice for one slot: 0" in out
    # the first run died after one invoice: recorded, not restarted (max_attempts=1)
    died = re.search(r"slot (\S+) schedule on \w, attempt 1: interrupted .*max_attempts \(1\)", out)
    assert died is not None, out
    slot = died[1]
    assert re.findall(rf"invoice for \w+, slot {slot}", out) == [f"invoice for ada, slot {slot}"]
    assert "(retry)" not in out
    # instance c started after a slot nobody ran, and ran it (catch_up="12h")
    assert re.search(r"c: invoice for linus, slot \S+ \(catch-up\)", out), out


def test_an_export_longer_than_its_interval_skips_the_next_slot(
    started: dict[str, subprocess.Popen[str]],
) -> None:
    out = output_of(started, "nightly_export")
    assert "skipped: export still running" in out
    assert re.search(r"slots skipped while one ran: [1-9]", out), out
    assert "exports running at the same time: 0" in out


def test_the_cache_refresh_runs_each_slot_once_and_never_catches_up(
    started: dict[str, subprocess.Popen[str]],
) -> None:
    out = output_of(started, "cache_refresh")
    assert re.search(r"[1-9]\d* refreshes, slots refreshed twice: 0", out), out
    assert "catch-up runs after the deploy: 0" in out
    assert "(catch-up)" not in out


def test_the_migration_runs_once_on_three_processes(
    started: dict[str, subprocess.Popen[str]],
) -> None:
    out = output_of(started, "migration")
    assert out.count("migrating the orders") == 1, out
    assert "the migration ran 1 time(s) on three instances" in out
    # every instance, the late one too, reads the same single run from the shared store
    histories = re.findall(r"(\w): the history of orders.v2-migration: (.*)", out)
    assert sorted(name for name, _ in histories) == ["a", "b", "c"]
    assert len({runs for _, runs in histories}) == 1 and "completed" in histories[0][1]


def test_the_dashboard_example_serves_the_page_the_jobs_and_a_trigger(
    started: dict[str, subprocess.Popen[str]],
) -> None:
    process = started["dashboard"]
    assert process.stdout is not None
    while "serving the admin API and dashboard on" not in (line := process.stdout.readline()):
        assert line, "the example ended before serving"
    url = line.rsplit(" ", 1)[1].strip()
    with httpx.Client(base_url=url, timeout=10) as http:
        page = http.get("")
        jobs = http.get("jobs").json()
        trigger = http.post(
            "jobs/report.daily/trigger", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        deadline = time.monotonic() + 10
        while not (records := http.get("jobs/report.daily/history").json()["records"]):
            assert time.monotonic() < deadline, "the manual run was never recorded"
            time.sleep(0.1)
    assert page.status_code == 200 and "<title>brokersched</title>" in page.text
    names = [job["name"] for job in jobs["jobs"]]
    assert names == [
        "outbox.flush",
        "payments.sync",
        "invoices.render",
        "export.slow",
        "cache.warm",
        "report.daily",
    ]
    assert jobs["instance_id"] == "instance-1" and jobs["changes_enabled"] is True
    assert "s3cret" not in str(jobs) and jobs["jobs"][5]["options"]["data"] == "***"
    assert jobs["jobs"][4]["state"] == "paused"
    assert trigger.status_code == 202
    assert (records[0]["reason"], records[0]["outcome"]) == ("manual", "completed")
    process.send_signal(signal.SIGTERM)  # the server, then both instances stop and drain
    out = output_of(started, "dashboard")
    # the only tracebacks are payments.sync's deliberate failures (30% of its runs: how many
    # ran depends on how fast the machine got here), each logged with its failed run
    logged = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} )", out)
    unexpected = [
        record
        for record in logged
        if "Traceback" in record
        and not re.match(
            r"\S+ \S+ WARNING brokersched: run job=payments\.sync .*outcome=failed", record
        )
    ]
    assert not unexpected, "\n".join(unexpected)
    assert TOKEN not in out
    assert out.rstrip().endswith("stopped")

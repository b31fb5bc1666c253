"""``brokersched backfill APP JOB --from T --to T``: in process (click's CliRunner), on an
application on SQLite whose factory makes a new scheduler for each command, as a new process
would."""

from __future__ import annotations

import re
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from brokersched.cli import cli

APP = """
from brokersched import Scheduler, SQLiteBackend


def scheduler():
    made = Scheduler(SQLiteBackend({path!r}, lease_ttl="2s"), jitter=0, drain_timeout="2s")

    @made.every("tick", "1s", catch_up=0, max_late="1s")
    async def tick(ctx):
        assert ctx.reason == "backfill"

    @made.every("boom", "1s", catch_up=0, max_late="1s")
    async def boom(ctx):
        raise ValueError("boom: the handler failed")

    return made
"""


@pytest.fixture
def app(tmp_path: Path) -> str:
    path = tmp_path / f"backfill_{uuid.uuid4().hex[:8]}.py"
    path.write_text(APP.format(path=str(tmp_path / "backfill.db")))
    return f"{path}:scheduler"


def backfill(*args: str) -> Result:
    return CliRunner().invoke(cli, ["backfill", *args])


def past_range() -> tuple[str, str]:
    """Four whole seconds that ended long enough ago for a backfill to take them (2 x max_late,
    2 x lease_ttl and 10 s for records: 16 s)."""
    end = datetime.fromtimestamp(int(time.time()) - 20, UTC)
    return (end - timedelta(seconds=3)).isoformat(), end.isoformat()


def test_a_backfill_twice_runs_each_slot_once(app: str) -> None:
    start, end = past_range()
    first = backfill(app, "tick", "--from", start, "--to", end, "--rate", "50/s")
    assert first.exit_code == 0, first.output
    lines = first.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines[:4]] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert all(re.search(r"Z ran: completed in \d+ms$", line) for line in lines[:4]), lines
    assert lines[-1] == "backfilled job 'tick': 4 completed"
    again = backfill(app, "tick", "--from", start, "--to", end, "--rate", "50/s")
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines()[-1] == "backfilled job 'tick': 4 already-run"


def test_a_dry_run_runs_nothing_and_a_failure_exits_1(app: str) -> None:
    start, end = past_range()
    made = backfill(app, "tick", "--from", end, "--to", end)  # the store, as a fleet makes it
    assert made.exit_code == 0, made.output
    dry = backfill(app, "boom", "--from", start, "--to", end, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.splitlines()[-1] == "would backfill job 'boom': 4 would-run"
    failed = backfill(app, "boom", "--from", end, "--to", end)
    assert failed.exit_code == 1
    assert "ran: failed in" in failed.stdout and "ValueError: boom" in failed.stdout
    assert failed.stdout.splitlines()[-1] == "backfilled job 'boom': 1 failed"


def test_a_dry_run_where_nothing_ever_ran_creates_nothing_and_says_so(
    app: str, tmp_path: Path
) -> None:
    start, end = past_range()
    dry = backfill(app, "tick", "--from", start, "--to", end, "--dry-run")
    assert dry.exit_code == 1, dry.output
    (line,) = dry.stderr.strip().splitlines()
    assert line.startswith("dry run refused: SQLiteBackend 'brokersched_' holds nothing")
    assert "no instance ever ran with this prefix, so neither did job 'tick'" in line
    assert not (tmp_path / "backfill.db").exists()


@pytest.mark.parametrize(
    ("span", "said"),
    [
        (("2027-01-15T08:05:00Z", "2027-01-15T08:00:00Z"), "is before start"),
        (("2020-01-15T08:00:00Z", "2099-01-15T08:00:00Z"), "is in the future"),
        (("yesterday", "now"), "--from 'yesterday' is not an ISO 8601 time"),
    ],
)
def test_a_bad_range_is_one_line_naming_the_values(
    app: str, span: tuple[str, str], said: str
) -> None:
    result = backfill(app, "tick", "--from", span[0], "--to", span[1])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert said in line
    if "before" in said:
        assert "end (2027-01-15T08:00:00+00:00)" in line and "(2027-01-15T08:05:00+00:00)" in line


def test_a_bad_rate_is_refused(app: str) -> None:
    start, end = past_range()
    result = backfill(app, "tick", "--from", start, "--to", end, "--rate", "fast")
    assert result.exit_code == 2
    assert "--rate 'fast' is not a rate: use N/s, N/m or N/h" in result.stderr

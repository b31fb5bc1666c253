"""``brokersched plan OLD NEW``: per job, the slots a rolling deploy runs twice, never or under
another owner while both versions run side by side, with advice; exit 1 on a hazard, 0
without, 2 on a usage error. In process (click's CliRunner), on two versions of a small
application written to ``tmp_path`` as ``old/app.py`` and ``new/app.py`` (one module name,
as two checkouts of one application have), from a fixed instant.

Expected slots are worked out by hand: on 2027-01-15 (winter) Europe/Paris is UTC+1 and
America/New_York UTC-5, so 08:00 local is 07:00Z in Paris and 13:00Z in New York.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from brokersched import _plan
from brokersched._plan import PlannedJob
from brokersched.cli import cli
from brokersched.triggers.after import AfterTrigger
from brokersched.triggers.at import AtTrigger
from brokersched.triggers.cron import parse_cron
from brokersched.triggers.interval import IntervalTrigger
from brokersched.triggers.spec import trigger_from_spec, trigger_spec

FROM = "2027-01-15T00:00:00Z"
HEADER = """\
from brokersched import Scheduler

scheduler = Scheduler()


def noop(ctx):
    pass


"""


@pytest.fixture(autouse=True)
def forget_the_apps(tmp_path: Path) -> Iterator[None]:
    """``jobs`` keeps the application it imported (a process runs one command); the next
    test's ``app`` module must not be found already imported."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None)
        if file is not None and Path(file).is_relative_to(tmp_path):
            del sys.modules[name]


def app(tmp_path: Path, version: str, *jobs: str, module: str = "app") -> str:
    """An application of ``jobs`` (registration lines) as ``<tmp>/<version>/<module>.py``."""
    folder = tmp_path / version
    folder.mkdir()
    (folder / f"{module}.py").write_text(HEADER + "\n".join(jobs) + "\n")
    return f"{folder / module}.py:scheduler"


def plan(old: str, new: str, *options: str) -> Result:
    return CliRunner().invoke(cli, ["plan", old, new, "--from", FROM, *options])


def planned(old: str, new: str, *options: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """The exit code and the ``--json`` lines by job."""
    result = plan(old, new, "--json", *options)
    assert result.exit_code in (0, 1), result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return result.exit_code, {row["job"]: row for row in rows}


def hazards(row: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(h["kind"], h["cause"], h["count"]) for h in row["hazards"]]


def slots(row: dict[str, Any], index: int = 0) -> list[tuple[str, str]]:
    return [(s["old"], s["new"]) for s in row["hazards"][index]["slots"]]


def test_no_hazard(tmp_path: Path) -> None:
    """The same jobs; one added, one removed; one running more often (its old slots are all
    still there); a dst policy that only adds slots; a job unclaimed in both versions that
    moved (each instance runs its own version's slots, as always): nothing to warn about."""
    old = app(tmp_path, "old",
              'scheduler.every("flush", "1h", noop)',
              'scheduler.every("gone", "1h", noop)',
              'scheduler.every("poll", "5m", noop)',
              'scheduler.cron("night", "30 2 * * *", noop, timezone="Europe/Paris", dst="skip")',
              'scheduler.every("local", "1h", noop, claim=False)')  # fmt: skip
    new = app(tmp_path, "new",
              'scheduler.every("flush", "1h", noop)',
              'scheduler.every("poll", "1m", noop)',
              'scheduler.cron("night", "30 2 * * *", noop, timezone="Europe/Paris")',
              'scheduler.every("local", "1h", noop, claim=False, offset="30m")',
              'scheduler.every("added", "2h", noop)')  # fmt: skip
    code, rows = planned(old, new)
    assert code == 0
    assert list(rows) == ["flush", "poll", "night", "local", "added", "gone"]
    assert all(row["hazards"] == [] for row in rows.values())
    assert rows["poll"]["changes"] == ["interval 5m to 1m"]
    assert rows["night"]["changes"] == ["dst 'skip' to none"]
    assert rows["added"]["old"] is None and rows["gone"]["new"] is None
    table = plan(old, new)
    assert table.exit_code == 0, table.output
    assert "no hazard: the two versions may run side by side" in table.stdout


def test_a_renamed_key_runs_every_slot_twice(tmp_path: Path) -> None:
    old = app(tmp_path, "old", 'scheduler.every("report", "15m", noop)')
    new = app(tmp_path, "new", 'scheduler.every("report-v2", "15m", noop)')
    code, rows = planned(old, new, "--hours", "2")
    assert code == 1
    row = rows["report-v2"]
    assert row["old"]["name"] == "report" and row["new"]["key"] == "report-v2"
    assert row["changes"] == ["renamed 'report' to 'report-v2'", "key 'report' to 'report-v2'"]
    assert hazards(row) == [("twice", "key", 8)]
    assert slots(row)[:2] == [
        ("2027-01-15T00:00:00.000Z", "2027-01-15T00:00:00.000Z"),
        ("2027-01-15T00:15:00.000Z", "2027-01-15T00:15:00.000Z"),
    ]
    assert "Keep key='report' on job 'report-v2'" in row["hazards"][0]["advice"]


def test_a_job_added_on_the_schedule_of_a_job_removed_is_taken_for_a_rename(
    tmp_path: Path,
) -> None:
    """Nothing tells the two apart; a gate had better ask (keep the key, or say so)."""
    old = app(tmp_path, "old", 'scheduler.every("gone", "1h", noop)')
    new = app(tmp_path, "new", 'scheduler.every("added", "1h", noop)')
    code, rows = planned(old, new, "--hours", "1")
    assert code == 1
    assert list(rows) == ["added"]
    assert rows["added"]["changes"] == ["renamed 'gone' to 'added'", "key 'gone' to 'added'"]
    assert hazards(rows["added"]) == [("twice", "key", 1)]


def test_a_rename_that_keeps_its_key_is_no_hazard(tmp_path: Path) -> None:
    old = app(tmp_path, "old", 'scheduler.every("report", "15m", noop)')
    new = app(tmp_path, "new", 'scheduler.every("report-v2", "15m", noop, key="report")')
    code, rows = planned(old, new)
    assert code == 0
    assert rows["report-v2"]["changes"] == ["renamed 'report' to 'report-v2'"]


def test_a_moved_grid_runs_each_occurrence_twice(tmp_path: Path) -> None:
    old = app(tmp_path, "old", 'scheduler.every("flush", "1h", noop)')
    new = app(tmp_path, "new", 'scheduler.every("flush", "1h", noop, offset="30m")')
    code, rows = planned(old, new, "--hours", "3")
    assert code == 1
    row = rows["flush"]
    assert row["changes"] == ["offset 0s to 30m"]
    assert hazards(row) == [("twice", "schedule", 3)]
    assert slots(row) == [
        ("2027-01-15T00:00:00.000Z", "2027-01-15T00:30:00.000Z"),
        ("2027-01-15T01:00:00.000Z", "2027-01-15T01:30:00.000Z"),
        ("2027-01-15T02:00:00.000Z", "2027-01-15T02:30:00.000Z"),
    ]
    assert "stop-the-world" in row["hazards"][0]["advice"]


def test_a_changed_time_zone_runs_twice_one_way_and_never_the_other(tmp_path: Path) -> None:
    paris = 'scheduler.cron("digest", "0 8 * * *", noop, timezone="Europe/Paris")'
    new_york = 'scheduler.cron("digest", "0 8 * * *", noop, timezone="America/New_York")'
    east, west = app(tmp_path, "old", paris), app(tmp_path, "new", new_york)
    code, rows = planned(east, west)
    assert code == 1
    assert rows["digest"]["changes"] == ["time zone 'Europe/Paris' to 'America/New_York'"]
    assert hazards(rows["digest"]) == [("twice", "schedule", 1)]
    assert slots(rows["digest"]) == [("2027-01-15T07:00:00.000Z", "2027-01-15T13:00:00.000Z")]
    code, rows = planned(west, east)
    assert code == 1
    assert hazards(rows["digest"]) == [("never", "schedule", 1)]
    assert slots(rows["digest"]) == [("2027-01-15T13:00:00.000Z", "2027-01-15T07:00:00.000Z")]
    assert "quiet hour" in rows["digest"]["hazards"][0]["advice"]


def test_a_window_that_holds_no_moved_occurrence_is_no_hazard(tmp_path: Path) -> None:
    """Between 00:00Z and 06:00Z neither 07:00Z (Paris) nor 13:00Z (New York) comes."""
    old = app(
        tmp_path, "old", 'scheduler.cron("digest", "0 8 * * *", noop, timezone="Europe/Paris")'
    )
    new = app(tmp_path, "new",
              'scheduler.cron("digest", "0 8 * * *", noop, timezone="America/New_York")',
              )  # fmt: skip
    code, rows = planned(old, new, "--hours", "6")
    assert code == 0 and rows["digest"]["hazards"] == []


def test_an_earlier_cron_time_may_run_never(tmp_path: Path) -> None:
    old = app(tmp_path, "old", 'scheduler.cron("digest", "0 9 * * *", noop)')
    new = app(tmp_path, "new", 'scheduler.cron("digest", "0 8 * * *", noop)')
    code, rows = planned(old, new)
    assert code == 1
    assert rows["digest"]["changes"] == ["cron '0 9 * * *' to '0 8 * * *'"]
    assert hazards(rows["digest"]) == [("never", "schedule", 1)]
    assert slots(rows["digest"]) == [("2027-01-15T09:00:00.000Z", "2027-01-15T08:00:00.000Z")]


@pytest.mark.parametrize(("before", "after"), [("True", "False"), ("False", "True")])
def test_a_changed_claim_changes_the_owner(tmp_path: Path, before: str, after: str) -> None:
    old = app(tmp_path, "old", f'scheduler.every("sync", "1h", noop, claim={before})')
    new = app(tmp_path, "new", f'scheduler.every("sync", "1h", noop, claim={after})')
    code, rows = planned(old, new, "--hours", "2")
    assert code == 1
    assert hazards(rows["sync"]) == [("owner", "claim", 2)]
    assert slots(rows["sync"])[0] == ("2027-01-15T00:00:00.000Z", "2027-01-15T00:00:00.000Z")
    assert rows["sync"]["hazards"][0]["advice"].startswith(f"claim changes from {before} to")


def test_a_key_another_job_claimed_in_the_old_version(tmp_path: Path) -> None:
    """Job 'archive' takes key 'purge' while old instances still claim 'purge' for job
    'purge': at each shared slot one of the two jobs never runs."""
    old = app(tmp_path, "old", 'scheduler.every("purge", "1h", noop)')
    new = app(tmp_path, "new",
              'scheduler.every("purge", "1h", noop, key="purge-v2")',
              'scheduler.every("archive", "30m", noop, key="purge")')  # fmt: skip
    code, rows = planned(old, new, "--hours", "2")
    assert code == 1
    assert hazards(rows["purge"]) == [("twice", "key", 2)]
    assert hazards(rows["archive"]) == [("never", "shared-key", 2)]
    assert slots(rows["archive"]) == [
        ("2027-01-15T00:00:00.000Z", "2027-01-15T00:00:00.000Z"),
        ("2027-01-15T01:00:00.000Z", "2027-01-15T01:00:00.000Z"),
    ]
    assert (
        "Give job 'archive' a key no job of the old version uses"
        in (rows["archive"]["hazards"][0]["advice"])
    )


def test_a_saved_listing_as_old(tmp_path: Path) -> None:
    """``jobs --json`` saved from the old version gives the plan the APP itself gives."""
    # Another module name: jobs keeps the module it imported, so "app" would be taken.
    old = app(
        tmp_path,
        "old",
        'scheduler.cron("digest", "0 8 * * *", noop, timezone="Europe/Paris", dst="skip")',
        'scheduler.every("report", "15m", noop)',
        'scheduler.every("sync", "1h", noop, offset="10m", claim=False)',
        module="listed",
    )
    new = app(tmp_path, "new",
              'scheduler.cron("digest", "0 8 * * *", noop, timezone="America/New_York")',
              'scheduler.every("report-v2", "15m", noop)',
              'scheduler.every("sync", "1h", noop, offset="10m")')  # fmt: skip
    listing = CliRunner().invoke(cli, ["jobs", old, "--json"])
    assert listing.exit_code == 0, listing.output
    saved = tmp_path / "old-jobs.jsonl"
    saved.write_text(listing.stdout)
    digest = json.loads(listing.stdout.splitlines()[0])
    assert digest["trigger"] == {
        "kind": "cron", "expression": "0 8 * * *", "timezone": "Europe/Paris", "dst": "skip",
    }  # fmt: skip
    assert digest["claim"] is True
    from_listing = planned(str(saved), new)
    from_app = planned(old, new)
    assert from_listing == from_app
    code, rows = from_listing
    assert code == 1
    assert [hazards(row) for row in rows.values()] == [
        [("twice", "schedule", 1)], [("twice", "key", 96)], [("owner", "claim", 24)],
    ]  # fmt: skip


def test_a_listing_without_triggers_is_a_usage_error(tmp_path: Path) -> None:
    saved = tmp_path / "old-jobs.jsonl"
    saved.write_text(json.dumps({"name": "flush", "key": "flush", "enabled": True}) + "\n")
    new = app(tmp_path, "new", 'scheduler.every("flush", "1h", noop)')
    result = plan(str(saved), new)
    assert result.exit_code == 2
    assert f"{saved}, line 1: not a job of 'brokersched jobs APP --json': job 'flush' of " in (
        result.stderr
    )
    assert "lacks trigger, claim: save it again" in result.stderr


def test_usage_errors(tmp_path: Path) -> None:
    new = app(tmp_path, "new", 'scheduler.every("flush", "1h", noop)')
    assert plan(new, new, "--hours", "0").exit_code == 2
    missing = plan(str(tmp_path / "nowhere.py") + ":scheduler", new)
    assert missing.exit_code == 2 and "no Python file" in missing.stderr
    assert CliRunner().invoke(cli, ["plan", new, new, "--from", "soon"]).exit_code == 2


def test_the_table_names_each_hazard_and_its_advice(tmp_path: Path) -> None:
    old = app(tmp_path, "old", 'scheduler.every("report", "15m", noop)')
    new = app(tmp_path, "new", 'scheduler.every("report-v2", "15m", noop)')
    result = CliRunner().invoke(
        cli, ["plan", old, new, "--from", FROM, "--hours", "1"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 1
    assert "twice (key)" in result.stdout
    assert "2027-01-15 00:00:00Z" in result.stdout and "... 4 in all" in result.stdout
    assert result.stdout.rstrip().endswith("1 hazard in 1 job")


@pytest.mark.parametrize(
    "trigger",
    [
        IntervalTrigger(timedelta(minutes=5), timedelta(seconds=30)),
        parse_cron("30 2 * * *", "Europe/Paris", dst="run-twice"),
        parse_cron("*/5 * * * *", "+05:30"),
        AtTrigger(datetime(2027, 1, 1, tzinfo=UTC)),
        AfterTrigger(timedelta(seconds=10)),
    ],
)
def test_a_trigger_as_data_gives_the_same_slots(trigger: Any) -> None:
    spec = trigger_spec(trigger)
    again = trigger_from_spec(json.loads(json.dumps(spec)))
    assert trigger_spec(again) == spec
    start = datetime(2026, 10, 24, tzinfo=UTC)
    assert again.next_runs(5, start) == trigger.next_runs(5, start)


def test_a_dense_job_is_compared_until_its_slot_budget_runs_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``MAX_SLOTS`` slots a version's search stops, and the plan says where."""
    monkeypatch.setattr(_plan, "MAX_SLOTS", 1000)
    start_ms = int(datetime.fromisoformat(FROM).timestamp() * 1000)
    old = PlannedJob.of("tick", "tick", True, True, IntervalTrigger(timedelta(seconds=1)))
    new = PlannedJob.of("tick", "tick-v2", True, True, IntervalTrigger(timedelta(seconds=1)))
    [job_plan] = _plan.plan_deploy([old], [new], start_ms, start_ms + 3_600_000)
    # 250 s of margin before the window (a quarter of the budget), then 750 s of it.
    assert job_plan.compared_until_ms == start_ms + 750_000
    [hazard] = job_plan.hazards
    assert (hazard.kind, hazard.cause, len(hazard.slots)) == ("twice", "key", 750)

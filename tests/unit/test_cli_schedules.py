"""``brokersched schedules APP list|get|put|delete|export|import`` in process, on SQLite files
(``tests/support/cli_apps/schedules_app.py``), no scheduler started: a write's version and
who made it, ``--if-version`` conflicts (exit 1, nothing changed), a refused schedule (exit 2,
one line naming the value, nothing written), an export imported elsewhere giving the same
schedules, an import whose bad entries are named and not written, a dry run writing nothing,
secrets masked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from brokersched.cli import cli

APP = "tests.support.cli_apps.schedules_app:create"
SECRET = "pw-do-not-show-42"


class Fleet:
    """The commands on one SQLite file."""

    def __init__(self, path: Path, backend: str = "sqlite") -> None:
        # a wide terminal, whatever runs the tests: the tables' columns are read whole
        self.env = {
            "BROKERSCHED_TEST_DB": str(path),
            "BROKERSCHED_TEST_BACKEND": backend,
            "COLUMNS": "200",
        }

    def __call__(self, *args: str, stdin: str | None = None) -> Result:
        return CliRunner().invoke(cli, ["schedules", APP, *args], env=self.env, input=stdin)

    def ok(self, *args: str, stdin: str | None = None) -> Result:
        result = self(*args, stdin=stdin)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return result

    def get(self, schedule_id: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.ok("get", schedule_id, "--json").stdout)
        return found

    def ids(self) -> list[str]:
        lines = self.ok("list", "--json").stdout.splitlines()
        return [json.loads(line)["id"] for line in lines]


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path / "fleet.db")


def test_put_writes_a_version_each_time_and_get_and_list_show_the_latest(fleet: Fleet) -> None:
    first = fleet.ok(
        "put", "acme", "--task", "reports.send", "--cron", "0 8 * * MON-FRI",
        "--timezone", "Europe/Paris", "--data", '{"tenant": "acme"}', "--option", "timeout=30s",
        "--by", "alice", "--json",
    )  # fmt: skip
    written = json.loads(first.stdout)
    assert (written["version"], written["updated_by"]) == (1, "alice")
    assert written["trigger"] == {
        "kind": "cron", "expression": "0 8 * * MON-FRI", "timezone": "Europe/Paris", "dst": None
    }  # fmt: skip
    assert (written["options"], written["data"]) == (
        {"timeout": "30s", "timezone": "Europe/Paris"},
        {"tenant": "acme"},
    )
    second = fleet.ok("put", "acme", "--task", "reports.send", "--every", "10s")
    assert second.stdout.startswith("wrote schedule 'acme' version 2: task reports.send, every 10s")
    assert "(by cli:" in second.stdout  # who, unless --by says
    got = fleet.get("acme")
    assert (got["version"], got["trigger"]["kind"], got["data"]) == (2, "every", None)
    assert got["updated_by"].startswith("cli:")
    fleet.ok("put", "acme-eu", "--task", "reports.send", "--at", "2027-01-15T08:00:00+01:00")
    fleet.ok("put", "beta", "--task", "reports.send", "--every", "1m")
    assert fleet.ids() == ["acme", "acme-eu", "beta"]
    listed = fleet.ok("list", "--prefix", "acme").stdout
    assert "acme-eu" in listed and "beta" not in listed
    row = next(line for line in listed.splitlines() if line.split()[:1] == ["acme"])
    assert row.split()[:5] == ["acme", "reports.send", "every", "10s", "2"], row
    shown = fleet.ok("get", "acme-eu").stdout
    assert "trigger:       at 2027-01-15T07:00:00+00:00" in shown, shown
    assert "version:       1" in shown


def test_if_version_orders_two_writers_a_conflict_exits_1_and_changes_nothing(
    fleet: Fleet,
) -> None:
    fleet.ok("put", "acme", "--task", "reports.send", "--every", "10s", "--if-version", "0")
    again = fleet("put", "acme", "--task", "reports.send", "--every", "20s", "--if-version", "0")
    assert again.exit_code == 1
    assert "conflict: schedule 'acme' is at version 1, not 0" in again.stderr
    fleet.ok("put", "acme", "--task", "reports.send", "--every", "20s", "--if-version", "1")
    stale = fleet("put", "acme", "--task", "reports.send", "--every", "30s", "--if-version", "1")
    assert (stale.exit_code, stale.stdout) == (1, "")
    assert "is at version 2, not 1" in stale.stderr
    refused = fleet("delete", "acme", "--if-version", "1")
    assert refused.exit_code == 1 and "is at version 2, not 1" in refused.stderr
    got = fleet.get("acme")
    assert (got["version"], got["trigger"]["interval_ms"]) == (2, 20_000)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--every", "10x"), "interval '10x' is not a duration"),
        (("--cron", "0 8 * *"), "cron expression '0 8 * *' has 4 fields; 5 or 6 are accepted"),
        (
            ("--cron", "0 8 * * *", "--timezone", "Europe/Pariss"),
            "Europe/Pariss",
        ),
        (("--every", "1m", "--option", "bogus=1"), "unknown option 'bogus' (valid options:"),
        (("--every", "1m", "--option", "key=other"), "option 'key' is not taken by a stored"),
        (("--every", "1m", "--cron", "* * * * *"), "needs exactly one of --every, --cron or --at"),
        (("--every", "1m", "--data", "{not json"), "--data '{not json' is not JSON"),
        (("--every", "1m", "--option", "every=5m"), "is not a job option: use --every"),
        (("--at", "2027-01-15T08:00"), "--at 2027-01-15T08:00 has no offset: give one"),
        (("--at", "0001-01-01T00:00:00+05:00"), "is out of range (years 1 to 9999, UTC)"),
        (("--at", "tomorrow"), "--at 'tomorrow' is not an ISO 8601 time with an offset"),
    ],
)
def test_a_refused_schedule_exits_2_with_one_line_and_writes_nothing(
    fleet: Fleet, args: tuple[str, ...], said: str
) -> None:
    result = fleet("put", "acme", "--task", "reports.send", *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert said in line, line
    assert fleet("get", "acme").exit_code == 1


def test_delete_stops_the_schedule_and_a_second_delete_exits_1(fleet: Fleet) -> None:
    fleet.ok("put", "acme", "--task", "reports.send", "--every", "10s")
    done = fleet.ok("delete", "acme", "--by", "ops", "--if-version", "1")
    assert done.stdout.startswith("deleted schedule 'acme'") and "(by ops)" in done.stdout
    missing = fleet("get", "acme")
    assert missing.exit_code == 1 and "no schedule 'acme'" in missing.stderr
    again = fleet("delete", "acme")
    assert again.exit_code == 1 and "no schedule 'acme'" in again.stderr
    assert fleet.ids() == []
    fleet.ok("put", "acme", "--task", "reports.send", "--every", "10s", "--if-version", "0")


def put_three(fleet: Fleet) -> None:
    fleet.ok("put", "acme", "--task", "reports.send", "--every", "10s", "--data", '{"n": 1}')
    fleet.ok(
        "put", "beta", "--task", "reports.send", "--cron", "30 7 * * *", "--timezone",
        "America/New_York", "--option", "max_late=2m", "--option", "jitter=5s",
    )  # fmt: skip
    fleet.ok("put", "gamma", "--task", "reports.other", "--at", "2027-03-01T00:00:00Z")


def same(entry: dict[str, Any]) -> tuple[Any, ...]:
    return entry["task"], entry["trigger"], entry["options"], entry["data"]


@pytest.mark.parametrize("array", [False, True])
def test_an_export_imported_elsewhere_gives_the_same_schedules(
    fleet: Fleet, tmp_path: Path, array: bool
) -> None:
    put_three(fleet)
    exported = fleet.ok("export", *(["--array"] if array else [])).stdout
    other = Fleet(tmp_path / "other.db")
    done = other.ok("import", "-", "--by", "restore", stdin=exported)
    assert done.stdout.strip() == "wrote 3 of 3 schedules"
    assert other.ids() == ["acme", "beta", "gamma"]
    for schedule_id in ("acme", "beta", "gamma"):
        imported, original = other.get(schedule_id), fleet.get(schedule_id)
        assert same(imported) == same(original)
        assert (imported["version"], imported["updated_by"]) == (1, "restore")
    # imported again: each one's next version
    other.ok("import", "-", stdin=exported)
    assert other.get("beta")["version"] == 2


BAD_FILE = [
    {"id": "good-1", "task": "reports.send", "trigger": {"kind": "every", "interval_ms": 60000}},
    {"id": "bad-cron", "task": "reports.send", "trigger": {"kind": "cron", "expression": "99 *"}},
    {"id": "bad-kind", "task": "reports.send", "trigger": {"kind": "sometimes"}},
    {"task": "reports.send", "trigger": {"kind": "every", "interval_ms": 60000}},
    {
        "id": "bad-option",
        "task": "reports.send",
        "trigger": {"kind": "every", "interval_ms": 60000},
        "options": {"bogus": 1},
    },
    {"id": "good-2", "task": "reports.send", "trigger": {"kind": "at", "at": "2027-01-01T00:00Z"}},
]


def test_an_import_writes_the_good_entries_names_the_bad_ones_and_exits_1(
    fleet: Fleet, tmp_path: Path
) -> None:
    path = tmp_path / "schedules.jsonl"
    path.write_text("\n".join(json.dumps(entry) for entry in BAD_FILE) + "\n")
    result = fleet("import", str(path))
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stdout.strip() == "wrote 2 of 6 schedules"
    refused = [line for line in result.stderr.splitlines() if line.startswith("refused: ")]
    assert [line.split(":")[1].strip() for line in refused] == [
        "bad-cron", "bad-kind", "#4", "bad-option"
    ]  # fmt: skip
    assert "unknown option 'bogus'" in refused[3]
    assert "refused 4: bad-cron, bad-kind, #4, bad-option" in result.stderr
    assert fleet.ids() == ["good-1", "good-2"]


def test_a_dry_run_checks_every_entry_and_writes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "schedules.json"
    path.write_text(json.dumps(BAD_FILE))
    result = fleet("import", str(path), "--dry-run")
    assert result.exit_code == 1
    assert result.stdout.strip() == "would write 2 of 6 schedules"
    assert "refused 4: bad-cron, bad-kind, #4, bad-option" in result.stderr
    good = json.dumps([BAD_FILE[0], BAD_FILE[5]])
    assert fleet.ok("import", "-", "--dry-run", stdin=good).stdout.strip() == (
        "would write 2 of 2 schedules"
    )
    assert fleet.ids() == []


def test_a_dry_run_refuses_a_lease_option_on_a_claim_only_backend_without_connecting(
    tmp_path: Path,
) -> None:
    claim_only = Fleet(tmp_path / "unused.db", backend="redis")
    entry = {**BAD_FILE[0], "id": "acme", "options": {"overlap": "skip"}}
    result = claim_only("import", "-", "--dry-run", stdin=json.dumps(entry))
    assert result.exit_code == 1
    assert "refused: acme: " in result.stderr and "overlap" in result.stderr, result.stderr


def test_secrets_in_a_schedules_data_are_masked_unless_export_reveal(fleet: Fleet) -> None:
    data = json.dumps({"broker": f"amqp://app:{SECRET}@mq.internal/"})
    fleet.ok("put", "acme", "--task", "reports.send", "--every", "1m", "--data", data)
    for args in (("get", "acme"), ("get", "acme", "--json"), ("list",), ("list", "--json")):
        shown = fleet.ok(*args).stdout
        assert SECRET not in shown and "acme" in shown, args
    masked = fleet.ok("export")
    assert SECRET not in masked.stdout and "amqp://app:***@mq.internal/" in masked.stdout
    assert "1 schedules had a secret masked as ***: --reveal" in masked.stderr
    revealed = fleet.ok("export", "--reveal")
    assert SECRET in revealed.stdout and revealed.stderr == ""


def test_an_unknown_file_or_garbled_line_writes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    missing = fleet("import", str(tmp_path / "nope.jsonl"))
    assert missing.exit_code == 2
    garbled = fleet("import", "-", stdin=json.dumps(BAD_FILE[0]) + "\n{oops\n")
    assert garbled.exit_code == 2 and "line 2: not JSON" in garbled.stderr
    assert fleet.ids() == []

"""``brokersched pause|resume|disable|enable|skip`` beside a live fleet: a fleet member runs in
a process of its own on a real backend, the commands in others, as an operator runs them. A
pause ``--for`` a few seconds stops the member's slots and ends by itself; a skip of two slots
skips exactly those; every change is kept with who and why; bad input is one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support.cli_apps.process import RunningCLI, brokersched
from tests.support.names import unique

APP = "tests.support.cli_apps.ops_app:create"  # one job, tick, every second


@pytest.fixture(params=["rabbitmq", "postgres", "sqlite"])
def fleet_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    kind = request.param
    if kind == "sqlite":
        url = str(tmp_path / "fleet.db")
        with contextlib.closing(sqlite3.connect(url)):
            pass
    else:
        url = request.getfixturevalue({"rabbitmq": "amqp_url", "postgres": "postgres_dsn"}[kind])
    return {"BROKERSCHED_TEST_BACKEND": kind, "BROKERSCHED_TEST_URL": url,
            "BROKERSCHED_TEST_PREFIX": unique("ctl").lower()}  # fmt: skip


def completed_slot(line: str) -> int | None:
    if "run job=tick" not in line or "outcome=completed" not in line:
        return None
    return int(line.split(" slot=")[1].split(" ")[0])


async def command(env: dict[str, str], *args: str, exit_code: int = 0) -> str:
    done = await asyncio.to_thread(brokersched, *args, env=env, timeout=60)
    assert done.returncode == exit_code, done.stdout + done.stderr
    return done.stdout if exit_code == 0 else done.stderr


async def test_pause_for_a_while_and_skip_two_slots_reach_a_live_fleet(
    fleet_env: dict[str, str],
) -> None:
    member = RunningCLI("run", APP, env=fleet_env)

    def wait_for_run_after(after_ms: int) -> int:
        line = member.wait_for_line(lambda line: (completed_slot(line) or 0) > after_ms, 30)
        slot = completed_slot(line)
        assert slot is not None
        return slot

    try:
        wait_for_run_after(0)
        until_ms = (int(time.time()) + 8) * 1000  # a whole second: a slot falls on it
        until = datetime.fromtimestamp(until_ms / 1000, UTC).isoformat()
        said = await command(
            fleet_env, "pause", APP, "tick", "--until", until, "--note", "db failover",
            "--by", "ops",
        )  # fmt: skip
        written_ms = int(time.time() * 1000)  # the CLI is done: the pause is in the store
        assert written_ms < until_ms
        assert said.startswith("paused job 'tick' for the fleet until "), said
        assert "- db failover (by ops;" in said
        # No slot from the write to the pause's end runs; the one at its end does.
        assert wait_for_run_after(written_ms) == until_ms

        control = json.loads(await command(fleet_env, "skip", APP, "tick", "2", "--json"))
        written_ms = int(time.time() * 1000)
        skip = control["skip"]
        assert skip["count"] == 2 and skip["through_ms"] - skip["after_ms"] <= 2000
        # The skipped slots that fell due once it was in the store did not run, nor the
        # others (one fell due while the CLI wrote it, on a slow machine); the next one did.
        first = wait_for_run_after(max(written_ms, skip["after_ms"]))
        assert first == max(skip["through_ms"], written_ms // 1000 * 1000) + 1000, control

        await command(fleet_env, "disable", APP, "tick", "--note", "retired")
        stopped_ms = int(time.time() * 1000)
        await asyncio.sleep(2.5)  # the member honours it within a heartbeat, before a claim
        assert not [
            line for line in member.lines if (completed_slot(line) or 0) > stopped_ms + 1000
        ]
        said = await command(fleet_env, "enable", APP, "tick")
        assert said.startswith("enabled job 'tick' for the fleet (by cli:"), said
        wait_for_run_after(int(time.time() * 1000))
        audit = json.loads(await command(fleet_env, "resume", APP, "tick", "--json"))
        actions = [(c["action"], c.get("note")) for c in audit["changes"]]
        assert actions == [
            ("pause", "db failover"),
            ("skip", None),
            ("disable", "retired"),
            ("enable", None),
            ("resume", None),
        ]
    finally:
        member.stop()
        member.kill()
        await asyncio.to_thread(brokersched, "purge", APP, "--force", env=fleet_env, timeout=90)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("pause", "--until", "2001-01-01T00:00Z"), "is not in the future"),
        (("pause", "--until", "tomorrow"), "--until 'tomorrow' is not an ISO 8601 time"),
        (("pause", "--for", "soon"), "--for"),
        (("pause", "--for", "1h", "--until", "2099-01-01T00:00Z"), "--until or --for, not both"),
        (("skip", "1001"), "from 0 (cancel a skip) to 1000, got 1001"),
        (("pause", "--note", "x" * 501), "at most 500 characters"),
        (("pause", "--until", "9999-12-31T23:59:59Z"), "more than 100 years ahead"),
        (
            ("pause", "--until", "2027-03-28T02:30", "-z", "Europe/Paris"),
            "--until 2027-03-28T02:30 does not exist in Europe/Paris",
        ),
        (
            ("pause", "--until", "2027-10-31T02:30", "-z", "Europe/Paris"),
            "--until 2027-10-31T02:30 happens twice in Europe/Paris",
        ),
    ],
)
def test_a_bad_change_is_one_line_naming_it(
    args: tuple[str, ...], says: str, tmp_path: Path
) -> None:
    env = {"BROKERSCHED_TEST_BACKEND": "sqlite", "BROKERSCHED_TEST_URL": str(tmp_path / "f.db"),
           "BROKERSCHED_TEST_PREFIX": "ctl"}  # fmt: skip
    action, *rest = args
    done = brokersched(action, APP, "tick", *rest, env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "f.db").exists()  # refused before anything was made

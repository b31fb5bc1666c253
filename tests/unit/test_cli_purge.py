"""``brokersched purge`` judges a running fleet by its instances' presence: an instance alive
or late refuses it (named, with when it was last seen), a dead or stopped one does not; a
presence that cannot be read refuses it too, unless ``--force``. In process, on memory
backends (``tests/support/cli_apps/presence_app.py``); the real servers are in
tests/deploy/test_cli_ops.py."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner, Result

from brokersched.cli import cli

APP = "tests.support.cli_apps.presence_app:create"


def purge(presence: str, *options: str) -> Result:
    env = {"BROKERSCHED_TEST_PRESENCE": presence}
    return CliRunner().invoke(cli, ["purge", APP, *options], env=env)


#: The sign of each running instance of presence_app's fleet (last seen: 1 s, 9 s ago).
SIGN = re.compile(
    r"live: instance '(web-[a-z]+)' \(host host-1, pid 4242\) is (alive|late): last seen "
    r"(\d+)s ago, at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{3})?Z \(heartbeat 5s\)"
)


def signs(stdout: str) -> list[tuple[str, str, int]]:
    found = []
    for line in stdout.splitlines():
        if line.startswith("live: "):
            match = SIGN.fullmatch(line)
            assert match is not None, line
            found.append((match[1], match[2], int(match[3])))
    return found


def test_an_alive_or_late_instance_refuses_purge() -> None:
    result = purge("fleet")
    assert result.exit_code == 1, result.output
    assert "refused: an instance of the prefix seems to run" in result.stderr
    [alive, late] = signs(result.stdout)
    # Whole seconds, floored, on a clock of whole milliseconds: 9 s ago may read 8 s.
    assert alive[:2] == ("web-alive", "alive") and 0 <= alive[2] <= 3, alive
    assert late[:2] == ("web-late", "late") and 8 <= late[2] <= 11, late


def test_the_dry_run_shows_the_same_signs() -> None:
    result = purge("fleet", "--dry-run")
    assert result.exit_code == 0, result.output
    assert [name for name, _, _ in signs(result.stdout)] == ["web-alive", "web-late"]


def test_force_removes_while_an_instance_runs() -> None:
    result = purge("fleet", "--force")
    assert result.exit_code == 0, result.output
    assert "warning: --force: removing while an instance may run" in result.stderr


@pytest.mark.parametrize(
    ("presence", "why"),
    [
        ("fails", "its presence could not be read (PresenceBackend: connection refused)"),
        ("none", "NoPresence does not implement reading its instances' presence without"),
        (
            "garbled",
            "its presence could not be read (MemoryBackend: a presence record of its prefix "
            "is not brokersched's",
        ),
    ],
)
def test_a_presence_that_cannot_be_read_refuses_purge(presence: str, why: str) -> None:
    """Nothing tells whether a fleet runs: refused (exit 1) unless --force; the dry run says
    so too."""
    result = purge(presence)
    assert result.exit_code == 1, result.output
    said = "presence: cannot tell whether an instance runs: "
    assert f"{said}{why}" in result.stdout, result.stdout
    assert "refused: cannot tell whether an instance of the prefix runs" in result.stderr
    listed = purge(presence, "--dry-run")
    assert listed.exit_code == 0 and f"{said}{why}" in listed.stdout, listed.output
    forced = purge(presence, "--force")
    assert forced.exit_code == 0, forced.output
    assert "nothing to remove" in forced.stdout
    assert "warning: --force" in forced.stderr


def test_a_fleet_of_dead_and_stopped_instances_does_not_refuse() -> None:
    result = purge("quiet")
    assert result.exit_code == 0, result.output
    assert "nothing to remove" in result.stdout and "live:" not in result.stdout

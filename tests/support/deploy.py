"""A real server process of the deployment tests (uvicorn, gunicorn, a container's command)
whose output goes to a file the test reads, and a plain HTTP GET."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.wait import until_sync


class Server:
    """A real server process whose output goes to a file the test reads."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("w") as sink:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.log.read_text()

    def runs(self) -> list[tuple[int, str, int]]:
        """(pid, job, slot) of every completed run logged so far."""
        return [(int(m["pid"]), m["job"], int(m["slot"])) for m in RUN.finditer(self.text())]

    def wait_until(self, done: Callable[[], object], what: str, timeout: float = 30) -> None:
        """Until ``done()``; fails at once if the server exited, with its log."""

        def holds() -> object:
            assert self.process.poll() is None, self.text()
            return done()

        try:
            until_sync(holds, timeout=timeout, what=what, every=0.1)
        except TimeoutError as exc:
            pytest.fail(f"{exc}:\n{self.text()[-4000:]}")

    def terminate(self, timeout: float = 30) -> float:
        """SIGTERM, then the seconds it took to exit (killed, and a failure, past ``timeout``)."""
        began = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"no exit within {timeout}s of SIGTERM:\n{self.text()[-4000:]}")
        return time.monotonic() - began

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


RUN = re.compile(
    r" (?P<pid>\d+) brokersched INFO run job=(?P<job>\S+) run_id=\S+ slot=(?P<slot>\d+) "
    r"reason=\S+ .*outcome=completed"
)

"""Run ``python -m brokersched`` as a subprocess, and follow a long-running one's log lines."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # COLUMNS: rich must not wrap table rows; the apps are imported from the repository root.
    return {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", **(extra or {})}


def brokersched(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run one CLI command to its end."""
    return subprocess.run(
        [sys.executable, "-m", "brokersched", *args],
        cwd=ROOT,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class RunningCLI:
    """``brokersched run ...`` in the background; its stderr lines are read by a thread."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "brokersched", *args],
            cwd=ROOT,
            env=cli_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float = 15) -> str:
        """The first (new) stderr line that satisfies ``predicate``; fails at the deadline."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"the process exited; its stderr:\n{self.output()}")
            self.lines.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"no such line within {timeout}s; stderr so far:\n{self.output()}")

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 15) -> int:
        """Send ``signum``, wait for the exit, collect the rest of stderr; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout)
        while (line := self._queue.get_nowait() if not self._queue.empty() else None) is not None:
            self.lines.append(line)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def output(self) -> str:
        return "\n".join(self.lines)

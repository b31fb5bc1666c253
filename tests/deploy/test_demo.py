"""The README's first command runs this demo: it must work with no server at all."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO_ROOT

DEMO = REPO_ROOT / "examples" / "demo.py"


def test_the_demo_runs_each_claimed_slot_once() -> None:
    result = subprocess.run(
        [sys.executable, str(DEMO), "--seconds", "2.5"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},  # no BROKERSCHED_* server URLs: nothing to connect to
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "run twice: 0" in result.stdout
    assert "claimed slots ran" in result.stdout


def test_ctrl_c_stops_the_demo_cleanly() -> None:
    """Ctrl-C used to print a KeyboardInterrupt traceback and "scheduler was never stopped"
    warnings; now the fleet stops as at the end, and the summary is printed."""
    import queue
    import signal
    import threading

    with subprocess.Popen(  # closes the pipes whatever happens (an unclosed one fails a later test)
        [sys.executable, str(DEMO), "--seconds", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
    ) as demo:
        lines: queue.Queue[str] = queue.Queue()
        assert demo.stdout is not None and demo.stderr is not None
        reader = threading.Thread(target=lambda: [lines.put(line) for line in demo.stdout or ()])
        reader.start()
        try:
            # the fleet is running once a claimed slot completed (the demo fails a run that
            # claimed nothing, and cache.refresh is per-instance work: it may complete first)
            pattern = re.compile(r"(outbox\.flush|report\.every-2s) .* completed")
            while not pattern.search(lines.get(timeout=30)):
                pass
            demo.send_signal(signal.SIGINT)
            returncode = demo.wait(timeout=30)
        finally:
            if demo.poll() is None:
                demo.kill()
            reader.join(timeout=10)
        stdout = "".join(lines.queue)
        stderr = demo.stderr.read()
    assert returncode == 0, stdout + stderr
    assert stderr == "", stderr  # no traceback, no "never stopped" warning
    assert "interrupted: stopping the fleet" in stdout and "run twice: 0" in stdout

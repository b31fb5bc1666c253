"""The README's first command runs this demo: it must work with no server at all."""

from __future__ import annotations

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

    demo = subprocess.Popen(
        [sys.executable, str(DEMO), "--seconds", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    assert demo.stdout is not None and demo.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in demo.stdout or ()])
    reader.start()
    try:
        while "completed" not in lines.get(timeout=30):  # the fleet is running
            pass
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=30) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    reader.join(timeout=10)
    stdout = "".join(lines.queue)
    stderr = demo.stderr.read()
    demo.stdout.close()
    demo.stderr.close()
    assert stderr == "", stderr  # no traceback, no "never stopped" warning
    assert "interrupted: stopping the fleet" in stdout and "run twice: 0" in stdout

"""The README's first command runs this demo: it must work with no server at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "examples" / "demo.py"


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

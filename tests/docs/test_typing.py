"""Type checkers refuse lease-only options on claim-only backends before the code runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "typing"
BIN = Path(sys.executable).parent
REFUSED = HERE / "refused.py"
EXPECTED = sorted(
    n for n, line in enumerate(REFUSED.read_text().splitlines(), 1) if line.endswith("# E")
)


def run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool if (BIN / tool).exists() else shutil.which(tool)
    if exe is None:
        pytest.fail(f"{tool} is not installed: pip install -e '.[dev]'")
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=300, cwd=HERE.parent.parent
    )


def error_lines(output: str, name: str) -> list[int]:
    return sorted({int(m) for m in re.findall(rf"{name}:(\d+)(?::\d+)?: error", output)})


def test_mypy_accepts_the_valid_calls() -> None:
    result = run("mypy", "--strict", "--no-incremental", str(HERE / "accepted.py"))
    assert result.returncode == 0, result.stdout


def test_mypy_refuses_each_invalid_call() -> None:
    result = run("mypy", "--strict", "--no-incremental", str(REFUSED))
    assert error_lines(result.stdout, "refused.py") == EXPECTED, result.stdout


def test_pyright_accepts_the_valid_calls() -> None:
    result = run("pyright", str(HERE / "accepted.py"))
    assert result.returncode == 0, result.stdout


def test_pyright_refuses_each_invalid_call() -> None:
    result = run("pyright", str(REFUSED))
    lines = sorted({int(m) for m in re.findall(r"refused\.py:(\d+):\d+ - error", result.stdout)})
    assert lines == EXPECTED, result.stdout

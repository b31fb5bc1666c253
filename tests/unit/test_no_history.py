"""Code says what it does and why; its history (issue numbers, who found what) is the
CHANGELOG's. Read from the source, not run: no file of brokersched cites one of this project's
issues by number, and no test's name (module, class or function) names an issue. Another
project's issue is cited by its own number (``nats-server#4320``, aio-pika's ``#601``), which
is not matched."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import brokersched

LIBRARY = Path(brokersched.__file__).parent
TESTS = Path(__file__).resolve().parents[1]

# "issue 24", "Issue 18:", "issue 28.2", "issues 13 and 24", "issue18"; not "issue #601".
CITES_AN_ISSUE = re.compile(r"\b[Ii]ssues?[ _-]?\d")


@functools.cache
def citing_files() -> dict[str, list[str]]:
    """Each text file of brokersched citing an issue: ``path:line: text`` of every citation."""
    found: dict[str, list[str]] = {}
    for path in sorted(LIBRARY.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text: nothing a reader is told
        name = path.relative_to(LIBRARY).as_posix()
        for number, line in enumerate(text.splitlines(), 1):
            if CITES_AN_ISSUE.search(line):
                found.setdefault(name, []).append(f"brokersched/{name}:{number}: {line.strip()}")
    return found


@functools.cache
def history_named_tests() -> set[str]:
    """``module::name`` of each test module, class or function whose name says "issue"."""
    found: set[str] = set()
    for path in sorted(TESTS.rglob("*.py")):
        module = path.relative_to(TESTS).as_posix()
        if "issue" in path.stem.lower():
            found.add(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and (
                node.name.lower().startswith("test") and "issue" in node.name.lower()
            ):
                found.add(f"{module}::{node.name}")
    return found


def test_the_library_carries_no_history() -> None:
    cited = [line for lines in citing_files().values() for line in lines]
    assert cited == [], "history belongs in CHANGELOG.md; say what the code does and why:\n" + (
        "\n".join(cited)
    )


def test_no_test_name_carries_history() -> None:
    named = sorted(history_named_tests())
    assert named == [], "name each test after what it checks, not the issue it came from"

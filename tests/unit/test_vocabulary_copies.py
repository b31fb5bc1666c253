"""Every vocabulary is written once (read from the source, not run). A vocabulary is a named
``Literal`` of three words or more (``Outcome = Literal["completed", "failed", ...]``), the
names of the job options and those of the Prometheus series; everything else derives from it
(``typing.get_args``, the admin API's ``GET /vocabulary`` for the dashboard).

A copy is a literal list, tuple or set (in Python, or an array in the dashboard's JavaScript)
that names three members of a vocabulary or more, and more than half of it: an enumeration of
the vocabulary, which goes stale when the vocabulary grows. A shorter list says something of a
few members (``LEASE_ONLY``). A Python constant annotated with the vocabulary's type that names
some of its members, not all, is a deliberate subset (``FAILED: frozenset[Outcome]``: mypy
checks its members). Words of a vocabulary that is part of a larger one (the events the
dashboard's stream carries, of the scheduler's events) are judged against the larger one.
Tables keyed by the words (a word's colour, its explanation) are not
lists: they fall back on a default for a word they lack."""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from brokersched import _metrics
from brokersched._metrics import PrometheusMetrics
from brokersched._options import JobOptions

PACKAGE = Path(__file__).resolve().parents[2] / "brokersched"
STATIC = PACKAGE / "web" / "static"
_JS_ARRAY = re.compile(r"\[([^\[\]]*)\]")
_JS_STRING = re.compile(r"""(["'])((?:\\.|(?!\1).)*)\1""")


@dataclass(frozen=True)
class Vocabulary:
    name: str
    words: frozenset[str]
    where: str


@dataclass(frozen=True)
class Copy:
    where: str
    vocabulary: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {len(self.words)} words of {self.vocabulary} {list(self.words)}"


def python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _strings(node: ast.AST) -> list[str]:
    elements = node.elts if isinstance(node, ast.List | ast.Tuple | ast.Set) else []
    return [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _is_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Subscript) and (
        (isinstance(node.value, ast.Name) and node.value.id == "Literal")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "Literal")
    )


@functools.cache
def vocabularies() -> tuple[Vocabulary, ...]:
    found = [
        Vocabulary("job options", frozenset(JobOptions.model_fields), "JobOptions"),
        Vocabulary("metric names", frozenset(metric_names()), "PrometheusMetrics"),
    ]
    for path in python_files():
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:  # module-level aliases: X = Literal[...]
            if isinstance(node, ast.Assign | ast.AnnAssign) and _is_literal(node.value):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                assert isinstance(target, ast.Name)
                # the words as Python reads them (a Literal may hold another: SlotState)
                words = get_args(getattr(importlib.import_module(module), target.id))
                if len(words) >= 3 and all(isinstance(word, str) for word in words):
                    found.append(Vocabulary(target.id, frozenset(words), f"{module}:{node.lineno}"))
    return tuple(found)


def metric_names() -> list[str]:
    metrics = PrometheusMetrics()
    names = []
    for family in metrics.registry.collect():
        names.append(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def _copies(words: list[str], where: str, typed: set[str] | None = None) -> Iterator[Copy]:
    every = vocabularies()
    for vocabulary in every:
        if any(vocabulary.words < other.words for other in every):
            continue  # a part of a larger vocabulary: the words are judged against that one
        named = [word for word in dict.fromkeys(words) if word in vocabulary.words]
        if len(named) < 3 or 2 * len(named) <= len(vocabulary.words):
            continue
        if typed is not None and vocabulary.name in typed and len(named) < len(vocabulary.words):
            continue  # a deliberate subset, typed with its vocabulary
        yield Copy(where, vocabulary.name, tuple(named))


def python_copies(path: Path, text: str | None = None) -> list[Copy]:
    tree = ast.parse(path.read_text() if text is None else text)
    literal_slices = {
        id(node.slice)
        for node in ast.walk(tree)
        if _is_literal(node) and isinstance(node, ast.Subscript)
    }
    typed_by: dict[int, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            names = {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}
            for inner in ast.walk(node.value):
                typed_by[id(inner)] = names
    found: list[Copy] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple | ast.Set) and id(node) not in literal_slices:
            where = f"{path.name}:{node.lineno}"
            found += _copies(_strings(node), where, typed_by.get(id(node)))
    return found


def javascript_copies(name: str, text: str) -> list[Copy]:
    found: list[Copy] = []
    for match in _JS_ARRAY.finditer(text):
        words = [m.group(2) for m in _JS_STRING.finditer(match.group(1))]
        line = text.count("\n", 0, match.start()) + 1
        found += _copies(words, f"{name}:{line}")
    return found


def test_the_rule_finds_copies_and_leaves_subsets_and_tables_alone() -> None:
    source = (
        "OUTCOMES = ('completed', 'failed', 'timed-out', 'interrupted')\n"
        "REASONS = ['schedule', 'catch-up', 'retry', 'manual', 'start']\n"
        "FAILED: frozenset[Outcome] = frozenset({'failed', 'timed-out', 'interrupted'})\n"
        "ALL: tuple[Outcome, ...] = "
        "('completed', 'failed', 'timed-out', 'interrupted', 'missed', 'replaced')\n"
        "LEASE_ONLY = ('overlap', 'max_attempts', 'catch_up')\n"
        "STYLE = {'completed': 'green', 'failed': 'red', 'timed-out': 'yellow'}\n"
        "Outcome = Literal['completed', 'failed', 'timed-out', 'interrupted']\n"
    )
    found = {(c.where, c.vocabulary) for c in python_copies(Path("x.py"), source)}
    assert found == {("x.py:1", "Outcome"), ("x.py:2", "RunReason"), ("x.py:4", "Outcome")}
    script = 'const A = ["skip", "start", "complete", "fail"];\nconst B = { late: 1, paused: 2 };\n'
    assert [(c.where, c.vocabulary) for c in javascript_copies("a.js", script)] == [
        ("a.js:1", "EventName")
    ]


def test_the_vocabularies_are_found() -> None:
    names = {vocabulary.name for vocabulary in vocabularies()}
    assert {"Outcome", "RunReason", "SkipReason", "AbortReason", "Liveness"} <= names
    assert {"ControlAction", "Kind", "job options", "metric names"} <= names
    assert (
        "brokersched_runs_total"
        in next(v for v in vocabularies() if v.name == "metric names").words
    )


def test_the_metrics_are_documented_as_the_registry_names_them() -> None:
    """The series' names are defined once, by the collectors; the module's docstring and
    docs/operations.md name each of them, and no other."""
    names = set(metric_names())
    operations = (PACKAGE.parent / "docs" / "operations.md").read_text()
    for where, text in (("docs/operations.md", operations), ("_metrics", _metrics.__doc__ or "")):
        named = set(re.findall(r"brokersched_[a-z_]+", text))
        assert (where, sorted(names - named), sorted(named - names)) == (where, [], [])


def test_no_vocabulary_is_copied_in_the_python_source() -> None:
    copies = [str(copy) for path in python_files() for copy in python_copies(path)]
    assert copies == [], "derive these from their vocabulary (typing.get_args):\n" + "\n".join(
        copies
    )


def test_no_vocabulary_is_copied_in_the_dashboard() -> None:
    copies = [
        str(copy)
        for path in sorted(STATIC.glob("*.js"))
        for copy in javascript_copies(path.name, path.read_text())
    ]
    assert copies == [], "read these from GET /vocabulary:\n" + "\n".join(copies)

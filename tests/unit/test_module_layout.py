"""The package's layout, read from the source (not run): no import circle between the modules of
brokersched, and no module longer than a reader can hold (``MAX_LINES``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import brokersched

ROOT = Path(brokersched.__file__).parent
MAX_LINES = 800

Graph = dict[str, set[str]]


def modules_under(root: Path, package: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def run_at_import(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported: not those in functions, nor under
    ``if TYPE_CHECKING:``; a class's body runs, and so do both branches of any other ``if``
    and every part of a ``try`` (either may be the one that runs)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not is_type_checking(node.test):
                yield from run_at_import(node.body)
            yield from run_at_import(node.orelse)
        elif isinstance(node, ast.Try | ast.TryStar):
            for part in (node.body, node.orelse, node.finalbody):
                yield from run_at_import(part)
            for handler in node.handlers:
                yield from run_at_import(handler.body)
        elif isinstance(node, ast.With | ast.AsyncWith | ast.ClassDef):
            yield from run_at_import(node.body)


def imported_by(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that importing ``name`` imports first: each one named, a
    submodule named by ``from package import submodule``, and the packages above them (their
    ``__init__`` runs first) except those above ``name`` itself (already being imported)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    root = name.partition(".")[0]
    targets: set[str] = set()
    for node in run_at_import(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets.add(source)
            targets |= {f"{source}.{alias.name}" for alias in node.names}
    own = {name.rsplit(".", n)[0] for n in range(name.count(".") + 1)}
    found: set[str] = set()
    for target in targets:
        if target.partition(".")[0] != root:
            continue
        parts = target.split(".")
        found |= {".".join(parts[:n]) for n in range(2, len(parts) + 1)}
    return {module for module in found if module in known} - own


def import_graph(root: Path, package: str) -> Graph:
    known = modules_under(root, package)
    return {name: imported_by(name, path, known) for name, path in known.items()}


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph(ROOT, "brokersched")
    assert "brokersched._job" in graph["brokersched._runner"]  # the scan sees the imports
    assert circles(graph) == []


def test_the_scan_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .c import C\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .sub import d\n"
        "if TYPE_CHECKING:\n"
        "    from .e import E\n"
        "def late():\n"
        "    from .e import E\n"
        "class A:\n"
        "    from . import b\n"
    )
    (package / "b.py").write_text("try:\n    from .sub.c import C\nexcept ImportError:\n    pass\n")
    (package / "sub" / "c.py").write_text("from ..a import A\n")
    (package / "sub" / "d.py").write_text("")
    (package / "e.py").write_text("from .a import A\n")
    graph = import_graph(package, "pkg")
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.d", "pkg.b"}
    assert graph["pkg.sub.c"] == {"pkg.a"}  # its own package is being imported already
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"]]


def test_no_module_is_longer_than_a_reader_can_hold() -> None:
    long = {
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        if len(path.read_text().splitlines()) > MAX_LINES
    }
    assert long == set(), f"over {MAX_LINES} lines: cut each by role"


# Every backend package has the same files for the same concerns (docs/contributing.md,
# "Backend packages"): a new kind of stored record goes into each package's ``_fleet.py``.
BACKEND_FILES = (
    "__init__.py",  # exports only
    "_backend.py",  # the backend class: configuration and life cycle
    "_options.py",  # the constructor's options, declared
    "_connection.py",  # the client adapter: connect, calls, errors
    "_history.py",  # the run history
    "_fleet.py",  # the fleet's records: presence, controls, missed slots
    "_ops.py",  # inventory, purge, doctor
)
DECISIONS = ("_claims.py", "_leases.py")  # how a slot is won: at least one of them
NO_SERVER = {"sqlite"}  # a file, no server: no budget to watch (``_budget.py``)


def backend_packages(root: Path) -> list[Path]:
    return sorted(path.parent for path in (root / "backends").glob("*/__init__.py"))


def missing_files(package: Path) -> list[str]:
    """The common files ``package`` lacks, by name."""
    have = {path.name for path in package.glob("*.py")}
    missing = [name for name in BACKEND_FILES if name not in have]
    if not have & set(DECISIONS):
        missing.append(" or ".join(DECISIONS))
    if package.name not in NO_SERVER and "_budget.py" not in have:
        missing.append("_budget.py")
    return missing


def definitions(path: Path) -> list[str]:
    """What a package's ``__init__`` does besides its docstring, imports and ``__all__``."""
    extra: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
            "__all__"
        ]:
            continue
        extra.append(f"line {node.lineno}: {type(node).__name__}")
    return extra


def test_every_backend_package_has_the_common_files() -> None:
    packages = backend_packages(ROOT)
    assert {package.name for package in packages} >= {
        "nats",
        "postgres",
        "rabbitmq",
        "redis",
        "sqlite",
    }
    missing = {package.name: missing_files(package) for package in packages}
    assert {name: files for name, files in missing.items() if files} == {}, (
        "every backend package has the same files for the same concerns (docs/contributing.md)"
    )


def test_a_backend_package_s_init_only_exports() -> None:
    extra = {
        package.name: found
        for package in backend_packages(ROOT)
        if (found := definitions(package / "__init__.py"))
    }
    assert extra == {}, "a backend's code lives in its modules; __init__.py re-exports it"


def test_the_layout_check_names_the_missing_file(tmp_path: Path) -> None:
    package = tmp_path / "backends" / "broker"
    package.mkdir(parents=True)
    for name in (*BACKEND_FILES, "_claims.py", "_budget.py"):
        (package / name).write_text("")
    assert missing_files(package) == []
    (package / "_fleet.py").unlink()
    (package / "_claims.py").unlink()
    (package / "_budget.py").unlink()
    assert missing_files(package) == ["_fleet.py", "_claims.py or _leases.py", "_budget.py"]
    (package / "__init__.py").write_text('"""doc"""\nfrom ._x import X\n__all__ = ["X"]\nY = 1\n')
    assert definitions(package / "__init__.py") == ["line 4: Assign"]


def test_each_backend_keeps_the_fleet_s_records_in_its_fleet_module() -> None:
    """``_fleet.py`` is where the kinds of fleet record (``FleetKind``) are stored, in every
    backend, so that a new kind is added there and nowhere else."""
    elsewhere = [
        package.name
        for package in backend_packages(ROOT)
        if "FleetKind"
        not in {
            alias.name
            for node in ast.walk(ast.parse((package / "_fleet.py").read_text()))
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
    ]
    assert elsewhere == [], "_fleet.py stores the fleet's records (of each FleetKind)"

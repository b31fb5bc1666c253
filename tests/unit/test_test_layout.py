"""The suite's own layout (read from the source, not run): every test module is in a tier's
folder, and a test module imports from ``tests.support`` only, never another test module, so
moving or deleting a test file never breaks another one."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.conftest import TIERS

TESTS = Path(__file__).resolve().parents[1]


@functools.cache
def python_files() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "typing" not in path.parts)


def module_of(path: Path) -> str:
    parts = ["tests", *path.relative_to(TESTS).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    return imports_in(path.read_text(), package)


def imports_in(text: str, package: str) -> list[tuple[int, str]]:
    tree = ast.parse(text)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # ``from tests import test_x`` and ``from tests.support import x`` name modules too
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def is_test_module(module: str) -> bool:
    return module.rpartition(".")[2].startswith("test_") or module.endswith(".conftest")


def test_every_test_module_is_in_a_tier_folder() -> None:
    misplaced = [
        str(path.relative_to(TESTS))
        for path in python_files()
        if path.name.startswith("test_") and path.relative_to(TESTS).parts[0] not in TIERS
    ]
    assert misplaced == [], f"test modules outside the tiers' folders {TIERS}"


def test_no_module_of_the_suite_imports_a_test_module() -> None:
    """Helpers and fixtures live in tests/support (fixtures of one folder in its conftest.py,
    which pytest finds by itself): a test module imported as a library runs its tests twice
    and ties the two files together."""
    offenders = [
        offence
        for path in python_files()
        if path != Path(__file__).resolve()  # it reads the tiers of tests/conftest.py
        for offence in imports_a_test_module(path)
    ]
    assert offenders == []


def test_the_support_package_is_all_a_test_module_imports_from_tests() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{line} imports {module}"
        for path in python_files()
        for line, module in imports_of(path)
        if (module == "tests" or module.startswith("tests."))
        and not module.startswith("tests.support")
        and not (path.name == "test_test_layout.py" and module == "tests.conftest.TIERS")
    ]
    assert offenders == []


def imports_a_test_module(path: Path) -> list[str]:
    return [
        f"{path.relative_to(TESTS)}:{line} imports {module}"
        for line, module in imports_of(path)
        if module.startswith("tests.")
        and any(is_test_module(".".join(module.split(".")[:n])) for n in range(2, 6))
    ]


def test_the_check_sees_each_form_of_importing_a_test_module() -> None:
    forms = [
        "from tests.backends.rabbitmq.test_rabbitmq_backend import TrackedBackend",
        "from tests.backends.rabbitmq import test_rabbitmq_backend",
        "import tests.unit.test_scheduler",
        "from .test_scheduler import Recorder",
        "from tests.backends.rabbitmq.conftest import make",
    ]
    for form in forms:
        modules = [module for _, module in imports_in(form, "tests.unit")]
        assert any(
            any(is_test_module(".".join(m.split(".")[:n])) for n in range(2, 6)) for m in modules
        ), form
    assert not any(
        is_test_module(".".join(m.split(".")[:n]))
        for _, m in imports_in("from tests.support.wait import until", "tests.unit")
        for n in range(2, 6)
    )

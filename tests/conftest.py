"""The tiers of the suite are its folders, and nothing else says which test is in which:

- ``unit/``: no server, no process, no real time (virtual time, ``TestClock``): seconds.
- ``backends/<name>/``: one backend against its real server (``multi/``: one behaviour on
  several backends); the conformance suites go with their backend.
- ``cluster/``: 3-node brokers of their own, kills, partitions, processes per instance.
- ``deploy/``: processes: the CLI, servers (uvicorn, gunicorn, Django), the examples.
- ``web/``: the admin API and the dashboard (one test drives a browser).
- ``docs/``: the README's examples and the typing of the API (pyright).

Each test gets its tier's marker here (``-m unit``, ``-m "not cluster"``...); a ``unit`` test
that asks for a server is an error. The helpers and fixtures are in ``tests/support``, the one
place a test module imports from (``tests/unit/test_test_layout.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.support.leftovers", "tests.support.servers", "tests.support.clocks"]

TIERS = ("unit", "backends", "cluster", "deploy", "web", "docs")
SERVER_FIXTURES = {"amqp_url", "nats_url", "current_nats_url", "postgres_dsn", "redis_url"}
HERE = Path(__file__).parent


def tier_of(path: Path) -> str:
    """The tier of a test file: the first folder under tests/."""
    return path.relative_to(HERE).parts[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tiers' folders {TIERS}")
        item.add_marker(tier)
        if tier == "unit" and (servers := SERVER_FIXTURES & set(item.fixturenames)):
            raise pytest.UsageError(
                f"{item.nodeid} needs a server ({', '.join(sorted(servers))}): a unit test "
                "needs none; move it to tests/backends/"
            )

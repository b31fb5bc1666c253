"""The broker's budget from the management API's answers (``GET /api/nodes``, the queues'
types): the fullest node's share, by open files or by the quorum queues its limit holds."""

from __future__ import annotations

from typing import Any

import pytest

from brokersched.backends.rabbitmq._budget import read_budget


def node(name: str, used: int, total: int, **alarms: bool) -> dict[str, Any]:
    return {"name": name, "fd_used": used, "fd_total": total, **alarms}


def test_an_idle_node_is_ok() -> None:
    budget = read_budget([node("a", 100, 1024)], ["classic"] * 50)
    assert budget.state == "ok"
    assert budget.used == pytest.approx(100 / 1024)
    assert "node a: 100 of 1024 file descriptors used, 0 quorum queues of the 309" in budget.detail


@pytest.mark.parametrize(
    ("quorum", "state"), [(185, "ok"), (186, "warn"), (247, "warn"), (248, "shed"), (310, "shed")]
)
def test_quorum_queues_count_against_what_the_open_files_limit_holds(
    quorum: int, state: str
) -> None:
    """1024 open files hold (1024 - 97) / 3 = 309 quorum queues: warn from 60 %, shed from 80 %."""
    budget = read_budget([node("a", 120, 1024)], ["quorum"] * quorum + ["stream"])
    assert (budget.state, budget.used) == (state, pytest.approx(quorum / 309))


def test_the_fullest_node_decides_and_an_alarm_sheds() -> None:
    nodes = [node("a", 100, 4096), node("b", 900, 1024), node("c", 10, 65536)]
    budget = read_budget(nodes, [])
    assert budget.state == "shed" and budget.detail.startswith("node b: 900 of 1024")
    alarmed = read_budget([node("a", 10, 65536, mem_alarm=True)], [])
    assert alarmed.state == "shed" and "memory alarm on a" in alarmed.detail


def test_a_node_that_tells_no_limit_is_said() -> None:
    budget = read_budget([{"name": "a"}], ["quorum"])
    assert (budget.state, budget.detail) == ("ok", "no node tells its open-files limit")

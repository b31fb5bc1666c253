"""The broker's budget from the management API's answers (``GET /api/nodes``, the queues'
types): the fullest node's share, by open files or by the quorum queues its limit holds."""

from __future__ import annotations

from typing import Any

import pytest

from brokersched.backends.rabbitmq._budget import read_budget


def node(name: str, used: int, total: int, **more: object) -> dict[str, Any]:
    return {"name": name, "fd_used": used, "fd_total": total, **more}


def test_open_files_of_classic_queues_do_not_count() -> None:
    """The file-handle cache closes classic queues' handles when it needs them (the soak: 1,800
    claim queues took 947 of 1,024 and the node answered in 0.2 s)."""
    budget = read_budget([node("a", 947, 1024)], ["classic"] * 1800)
    assert (budget.state, budget.used) == ("ok", 0.0)
    assert budget.detail == (
        "node a: 0 quorum queues of the 309 its open-files limit (1024) holds, "
        "947 file descriptors used"
    )


@pytest.mark.parametrize(
    ("quorum", "state"), [(185, "ok"), (186, "warn"), (247, "warn"), (248, "shed"), (310, "shed")]
)
def test_quorum_queues_count_against_what_the_open_files_limit_holds(
    quorum: int, state: str
) -> None:
    """1024 open files hold (1024 - 97) / 3 = 309 quorum queues: warn from 60 %, shed from 80 %."""
    budget = read_budget([node("a", 120, 1024)], ["quorum"] * quorum + ["stream"])
    assert (budget.state, budget.used) == (state, pytest.approx(quorum / 309))


def test_the_fullest_node_decides_sockets_count_and_an_alarm_sheds() -> None:
    nodes = [node("a", 100, 4096), node("b", 90, 1024), node("c", 10, 65536)]
    assert read_budget(nodes, ["quorum"] * 200).detail.startswith("node b: 200 quorum queues")
    nodes[2] |= {"sockets_used": 700, "sockets_total": 800}
    budget = read_budget(nodes, ["quorum"] * 200)
    assert budget.state == "shed" and budget.detail.endswith("sockets at 88%")
    alarmed = read_budget([node("a", 10, 65536, mem_alarm=True)], [])
    assert alarmed.state == "shed" and "memory alarm on a" in alarmed.detail


def test_a_node_that_tells_no_limit_is_said() -> None:
    budget = read_budget([{"name": "a"}], ["quorum"])
    assert (budget.state, budget.detail) == ("ok", "no node tells its open-files limit")

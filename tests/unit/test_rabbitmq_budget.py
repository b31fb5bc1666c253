"""The broker's budget from the management API's answers (``GET /api/nodes``, the queues, the
connections): the fullest node's share of what its version's open files hold (3.x: the quorum
queues its limit holds; 4.x: the files it holds, each live claim queue one)."""

from __future__ import annotations

from typing import Any

import pytest

from brokersched.abc import Slot
from brokersched.backends.rabbitmq._budget import read_budget
from brokersched.backends.rabbitmq._files import files_needed, major_version, node_files
from brokersched.backends.rabbitmq._ops import fd_finding, limit_finding


def node(
    name: str, used: int, total: int, version: str | None = "3.10.8", **more: Any
) -> dict[str, Any]:
    apps = [{"name": "rabbit", "version": version}] if version else []
    return {"name": name, "fd_used": used, "fd_total": total, "applications": apps, **more}


def classic(n: int, *, node: str = "a", persistent: int | None = 1) -> list[dict[str, Any]]:
    row: dict[str, Any] = {"type": "classic", "node": node}
    if persistent is not None:
        row |= {"messages": persistent, "messages_persistent": persistent}
    return [dict(row) for _ in range(n)]


def quorum(n: int) -> list[dict[str, Any]]:
    return [{"type": "quorum", "node": "a"} for _ in range(n)]


def test_open_files_of_classic_queues_do_not_count_on_3x() -> None:
    """The file-handle cache closes classic queues' handles when it needs them (the soak: 1,800
    claim queues took 947 of 1,024 and the node answered in 0.2 s)."""
    budget = read_budget([node("a", 947, 1024)], classic(1800))
    assert (budget.state, budget.used) == ("ok", 0.0)
    assert budget.detail == (
        "node a (RabbitMQ 3.10.8): 0 quorum queues of the 309 its open-files limit (1024) "
        "holds, 947 file descriptors used"
    )


@pytest.mark.parametrize(
    ("count", "state"), [(185, "ok"), (186, "warn"), (247, "warn"), (248, "shed"), (310, "shed")]
)
def test_quorum_queues_count_against_what_the_open_files_limit_holds_on_3x(
    count: int, state: str
) -> None:
    """1024 open files hold (1024 - 97) / 3 = 309 quorum queues: warn from 60 %, shed from 80 %."""
    budget = read_budget([node("a", 120, 1024)], [*quorum(count), {"type": "stream"}])
    assert (budget.state, budget.used) == (state, pytest.approx(count / 309))


def test_idle_quorum_queues_cost_nothing_on_4x() -> None:
    """4.0.5: 200 idle quorum queues held 1 file in all (their log); 260 at 1,024 read shed
    under the 3.x rule while the node answered in 9 ms."""
    budget = read_budget([node("a", 45, 1024, "4.0.5")], quorum(1500))
    assert budget.state == "ok"
    assert budget.used == pytest.approx(50 / 1024)
    assert "0 classic queues holding a persistent message" in budget.detail


@pytest.mark.parametrize(
    ("claims", "state"), [(560, "ok"), (570, "warn"), (760, "warn"), (770, "shed"), (978, "shed")]
)
def test_live_claim_queues_count_against_the_open_files_limit_on_4x(
    claims: int, state: str
) -> None:
    """4.0.5 at 1,024: a file per classic queue holding a persistent message, ~50 for the
    node, one per connection; emfile came at ~978 live claim queues. fd_used (46) trails."""
    connections = [{"node": "a"}] * 4
    budget = read_budget([node("a", 46, 1024, "4.0.5")], classic(claims), connections)
    assert budget.state == state
    assert budget.used == pytest.approx((50 + claims + 4) / 1024)
    assert f"{claims} classic queues holding a persistent message" in budget.detail
    assert "4 connections" in budget.detail


def test_on_4x_empty_queues_and_other_nodes_do_not_count_and_fd_used_does_when_larger() -> None:
    queues = [
        *classic(300, persistent=0),  # declared ahead, or drained: no file
        *classic(300, node="b"),  # the other node's
        *classic(10, persistent=None),  # no statistics yet: a claim queue holds its message
        {"type": "stream", "node": "b"},  # a replica on each node: 2 files
    ]
    budget = read_budget([node("a", 40, 1024, "4.0.5")], queues)
    assert budget.used == pytest.approx((50 + 10 + 2) / 1024)
    assert read_budget([node("a", 900, 1024, "4.0.5")], queues).state == "shed"


def test_a_cluster_in_a_rolling_upgrade_weighs_each_node_by_its_version() -> None:
    nodes = [node("a", 45, 1024, "3.13.7"), node("b", 45, 1024, "4.0.5")]
    queues = [*classic(700, node="b"), *quorum(100)]
    budget = read_budget(nodes, queues)
    assert budget.detail.startswith("node b (RabbitMQ 4.0.5): 750 of its open-files limit")
    assert budget.state == "warn"


def test_an_unknown_version_takes_the_fuller_rule() -> None:
    assert major_version(None) is None and major_version("4.1.0-beta.3") == 4
    files = node_files(node("a", 45, 1024, None), [*classic(800), *quorum(10)])
    assert files.share == pytest.approx(850 / 1024)
    assert files.detail.endswith("(version unknown: the fuller of the 3.x and 4.x rules)")


def test_the_fullest_node_decides_sockets_count_on_3x_and_an_alarm_sheds() -> None:
    nodes = [node("a", 100, 4096), node("b", 90, 1024), node("c", 10, 65536)]
    assert read_budget(nodes, quorum(200)).detail.startswith("node b (RabbitMQ 3.10.8): 200 quorum")
    nodes[2] |= {"sockets_used": 700, "sockets_total": 800}
    budget = read_budget(nodes, quorum(200))
    assert budget.state == "shed" and budget.detail.endswith("sockets at 88%")
    alarmed = read_budget([node("a", 10, 65536, mem_alarm=True)], [])
    assert alarmed.state == "shed" and "memory alarm on a" in alarmed.detail


def test_a_node_that_tells_no_limit_is_said() -> None:
    budget = read_budget([{"name": "a"}], quorum(1))
    assert (budget.state, budget.detail) == ("ok", "no node tells its open-files limit")


# -- doctor ---------------------------------------------------------------------------------


def test_fd_finding_by_version() -> None:
    assert fd_finding(node("a", 120, 1024), quorum(300)).severity == "error"  # of 309
    assert fd_finding(node("a", 120, 1024), quorum(10)).severity == "warning"  # below 4096
    assert fd_finding(node("a", 120, 65536), quorum(300)).severity == "ok"
    four = node("a", 46, 1024, "4.0.5")
    assert fd_finding(four, quorum(300)).severity == "warning"  # 1024: below 4096
    assert fd_finding({**four, "fd_total": 65536}, quorum(3000)).severity == "ok"
    error = fd_finding(four, classic(800))
    assert error.severity == "error" and "emfile" in error.consequence


def slots_of(jobs: int, per_job: int) -> list[Slot]:
    return [Slot(f"job.{j}", 1000 * n) for j in range(jobs) for n in range(per_job)]


def test_the_limit_40_one_second_jobs_need_with_a_5_minute_slot_ttl() -> None:
    """Live claim queues = jobs x slot_ttl / interval (+ one declared ahead each): 40 x 300 =
    12,000, with 3 connections, 1 stream and ~50 files for a 4.x node."""
    from datetime import timedelta

    need = files_needed(4, claim_queues=12_040, connections=3)
    assert need.files == 50 + 12_040 + 2 + 3
    four = limit_finding("4.0.5", slots_of(40, 300), timedelta(minutes=5), connections=3)
    assert four.severity == "warning" and "not known without management_url" in four.consequence
    assert "40 claimed job(s) keep up to 12040 claim queues alive" in four.found
    assert "at least 15360 is needed, 20480 recommended" in four.found  # 12095 / 0.8, / 0.6
    at_1024 = limit_finding(
        "4.0.5",
        slots_of(40, 300),
        timedelta(minutes=5),
        connections=3,
        nodes=[node("a", 46, 1024, "4.0.5")],
    )
    assert (
        at_1024.severity == "error" and "lowest limit of the cluster is 1024" in at_1024.consequence
    )
    at_65536 = limit_finding(
        "4.0.5",
        slots_of(40, 300),
        timedelta(minutes=5),
        connections=3,
        nodes=[node("a", 46, 65536, "4.0.5")],
    )
    assert at_65536.severity == "ok"
    three = limit_finding(
        "3.10.8",
        slots_of(40, 300),
        timedelta(minutes=5),
        connections=3,
        nodes=[node("a", 46, 1024)],
    )
    assert (
        three.severity == "ok" and "claim queues hold no file the node cannot close" in three.found
    )
    assert "at least 1024 is needed" in three.found

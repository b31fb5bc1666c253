"""The broker's budget, watched while ``RabbitMQBackend`` runs with ``management_url``.

A node that runs out of open files stops serving its clients: a 3.x node once its quorum
queues hold its file-handle budget (it stops answering every client and does not recover), a
4.x node once its files are spent (``emfile``: publishes nacked, queues crashed, connections
closed). What spends them depends on the version (``_files``: 3.x quorum queues; 4.x the
classic queues holding a persistent message, brokersched's live claim queues among them,
streams and connections). Every ``budget_interval`` (30 s) the backend reads the nodes (their
version, open-files limit, sockets, memory and disk alarms), the broker's queues and, when a
node is 4.x, its connections from the management API, weighs each node by the rule of its
version, and takes the fullest node's share of its budget:

- from ``WARN`` of it, a warning is logged and claim queues are no longer declared ahead;
- from ``SHED`` (or under a memory or disk alarm), the backend sheds: it declares no new claim
  queue, so a slot whose queue does not exist yet is skipped (``backend-error``, "shedding"),
  never run twice; a claim into a queue that exists goes on, as it makes nothing (on 4.x the
  claim queues in place already hold their files).
It leaves that state once the reading is back under ``WARN``. A reading that fails keeps the
last state (logged once): the management API being away says nothing about the broker. The
watch itself (period, states, logs) is ``backends/_budget.BudgetWatch``, shared by every backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

from ...abc import BrokerBudget
from .._budget import PERIOD_S, SHED, WARN, BudgetWatch, Effects
from ._files import CONNECTION_COLUMNS, QUEUE_COLUMNS, counts_connections, node_files
from ._ops import Management

__all__ = ["PERIOD_S", "SHED", "WARN", "BudgetWatch", "budget_watch", "read_budget"]

_log = logging.getLogger("brokersched.backends.rabbitmq")


def read_budget(
    nodes: Sequence[dict[str, Any]],
    queues: Sequence[dict[str, Any]],
    connections: Sequence[dict[str, Any]] = (),
) -> BrokerBudget:
    """The budget from ``GET /api/nodes``, the queues (``QUEUE_COLUMNS``) and the connections
    (``node``) of the broker: the fullest node's share of what its version's open files
    hold (``_files.node_files``)."""
    alarms = sorted(
        {f"{alarm} alarm on {node.get('name', '?')}" for node in nodes for alarm in _alarms(node)}
    )
    worst, detail = 0.0, "no node tells its open-files limit"
    for node in nodes:
        files = node_files(node, queues, connections)
        if files.share is not None and files.share >= worst:
            worst, detail = files.share, files.detail
    state: Literal["ok", "warn", "shed"] = (
        "shed" if alarms or worst >= SHED else "warn" if worst >= WARN else "ok"
    )
    return BrokerBudget(used=worst, state=state, detail="; ".join([detail, *alarms]))


_ALARMS = (("mem_alarm", "memory"), ("disk_free_alarm", "disk"))


def _alarms(node: dict[str, Any]) -> list[str]:
    return [name for key, name in _ALARMS if node.get(key)]


_EFFECTS = Effects(
    server="broker",
    warn=f"claim queues are no longer declared ahead, and from {SHED:.0%} none is declared",
    shed="no new claim queue is declared, so slots whose queue does not exist yet are skipped",
    back="claim queues are declared again",
    fix="Raise the node's open-files limit (brokersched doctor names the limit the application "
    "needs), keep slot_ttl just above the largest jitter + max_late (fewer live claim queues on "
    "4.x), or remove retired prefixes (brokersched purge)",
)


def budget_watch(backend: str, management: Management, *, period: float = PERIOD_S) -> BudgetWatch:
    """The watch of the broker's budget through the management API."""

    async def read() -> BrokerBudget:
        nodes = await management.get("nodes")
        queues = await management.get(f"queues?columns={QUEUE_COLUMNS}")
        connections = (
            await management.get(f"connections?columns={CONNECTION_COLUMNS}")
            if counts_connections(nodes)
            else []
        )
        return read_budget(nodes, queues, connections)

    return BudgetWatch(backend, read, _EFFECTS, logger=_log, period=period)

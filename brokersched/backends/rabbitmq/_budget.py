"""The broker's budget, watched while ``RabbitMQBackend`` runs with ``management_url``.

A RabbitMQ 3.x node stops answering every client (AMQP handshakes, ``rabbitmqctl``) once its
quorum queues hold its file-handle budget, about (open-files limit - 97) / 3 of them, and does
not recover by itself (docs/backends.md, "Broker cost and sizing"). Every ``budget_interval``
(30 s) the backend reads the nodes (open-files limit, sockets, memory and disk alarms) and the
quorum queues of the broker from the management API, and takes the fullest node's share of
its budget:

- from ``WARN`` of it, a warning is logged and claim queues are no longer declared ahead;
- from ``SHED`` (or under a memory or disk alarm), the backend sheds: it declares no new claim
  queue, so a slot whose queue does not exist yet is skipped (``backend-error``, "shedding"),
  never run twice; a claim into a queue that exists goes on, as it makes nothing.
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
from ._ops import Management, quorum_budget

__all__ = ["PERIOD_S", "SHED", "WARN", "BudgetWatch", "budget_watch", "read_budget"]

_log = logging.getLogger("brokersched.backends.rabbitmq")


def read_budget(nodes: Sequence[dict[str, Any]], queue_types: Sequence[str]) -> BrokerBudget:
    """The budget from ``GET /api/nodes`` and the types of ``GET /api/queues``: the fullest
    node's share, of the quorum queues its open-files limit holds or of its sockets.

    Open files as such are not counted: a 3.x node's file-handle cache closes the handles of
    classic queues it least recently used when it needs them (bench/soak_rabbitmq.py: ~1,800
    claim queues took up to 956 of 1,024 and the node answered within 0.4 s), while those of
    quorum queues stay held, and the sockets are what every new client needs."""
    quorum = sum(kind == "quorum" for kind in queue_types)
    alarms = sorted(
        {f"{alarm} alarm on {node.get('name', '?')}" for node in nodes for alarm in _alarms(node)}
    )
    worst, detail = 0.0, "no node tells its open-files limit"
    for node in nodes:
        total = node.get("fd_total")
        if not isinstance(total, int) or total <= 0:
            continue
        holds = quorum_budget(total)
        sockets = _share(node.get("sockets_used"), node.get("sockets_total"))
        share = max(quorum / holds if holds else 1.0, sockets)
        if share >= worst:
            worst = share
            detail = (
                f"node {node.get('name', '?')}: {quorum} quorum queues of the {holds} its "
                f"open-files limit ({total}) holds, {node.get('fd_used')} file descriptors used"
                + (f", sockets at {sockets:.0%}" if sockets else "")
            )
    state: Literal["ok", "warn", "shed"] = (
        "shed" if alarms or worst >= SHED else "warn" if worst >= WARN else "ok"
    )
    return BrokerBudget(used=worst, state=state, detail="; ".join([detail, *alarms]))


_ALARMS = (("mem_alarm", "memory"), ("disk_free_alarm", "disk"))


def _share(used: object, total: object) -> float:
    if isinstance(used, int) and isinstance(total, int) and total > 0:
        return used / total
    return 0.0


def _alarms(node: dict[str, Any]) -> list[str]:
    return [name for key, name in _ALARMS if node.get(key)]


_EFFECTS = Effects(
    server="broker",
    warn=f"claim queues are no longer declared ahead, and from {SHED:.0%} none is declared",
    shed="no new claim queue is declared, so slots whose queue does not exist yet are skipped",
    back="claim queues are declared again",
    fix="Raise the node's open-files limit or remove retired prefixes (brokersched purge)",
)


def budget_watch(backend: str, management: Management, *, period: float = PERIOD_S) -> BudgetWatch:
    """The watch of the broker's budget through the management API."""

    async def read() -> BrokerBudget:
        nodes = await management.get("nodes")
        queues = await management.get("queues?columns=type")
        return read_budget(nodes, [queue.get("type") for queue in queues])

    return BudgetWatch(backend, read, _EFFECTS, logger=_log, period=period)

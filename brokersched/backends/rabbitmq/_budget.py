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
last state (logged once): the management API being away says nothing about the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Literal

from ..._clock import Clock
from ..._exceptions import BackendError
from ...abc import BrokerBudget
from ._ops import Management, quorum_budget

__all__ = ["PERIOD_S", "SHED", "WARN", "BudgetWatch", "read_budget"]

_log = logging.getLogger("brokersched.backends.rabbitmq")

WARN, SHED = 0.6, 0.8
PERIOD_S = 30.0


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


class BudgetWatch:
    """Reads the budget at ``start()`` and every ``period`` seconds until ``close()``."""

    def __init__(self, backend: str, management: Management, *, period: float = PERIOD_S) -> None:
        self._backend = backend
        self._management = management
        self._period = period
        self.reading: BrokerBudget | None = None
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def shedding(self) -> bool:
        return self.reading is not None and self.reading.state == "shed"

    @property
    def declares_ahead(self) -> bool:
        return self.reading is None or self.reading.state == "ok"

    async def start(self, clock: Clock) -> None:
        await self.read()
        self._task = asyncio.create_task(self._every_period(clock), name="brokersched-budget")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _every_period(self, clock: Clock) -> None:
        while True:
            await clock.sleep(self._period)
            try:
                await self.read()
            except Exception:  # an answer of a shape not foreseen: said, and read again later
                _log.exception("%s: the broker's budget could not be read", self._backend)

    async def read(self) -> None:
        """One reading; its change of state logged."""
        try:
            nodes = await self._management.get("nodes")
            queues = await self._management.get("queues?columns=type")
        except BackendError as exc:
            if not self._failing:
                _log.warning("%s: the broker's budget could not be read: %s", self._backend, exc)
            self._failing = True
            return
        self._failing = False
        reading = read_budget(nodes, [queue.get("type") for queue in queues])
        was = "ok" if self.reading is None else self.reading.state
        if was == "shed" and reading.state == "warn":  # shedding until back under WARN
            reading = dataclasses.replace(reading, state="shed")
        self.reading = reading
        if reading.state == was:
            return
        if reading.state == "shed":
            _log.error(
                "%s: shedding: the broker is at %.0f%% of its budget (%s): no new claim queue "
                "is declared, so slots whose queue does not exist yet are skipped, until it is "
                "back under %.0f%%. Raise the node's open-files limit or remove retired "
                "prefixes (brokersched purge)",
                self._backend,
                reading.used * 100,
                reading.detail,
                WARN * 100,
            )
        elif reading.state == "warn":
            _log.warning(
                "%s: the broker is at %.0f%% of its budget (%s); claim queues are no longer "
                "declared ahead, and from %.0f%% none is declared",
                self._backend,
                reading.used * 100,
                reading.detail,
                SHED * 100,
            )
        else:
            _log.warning(
                "%s: the broker is back at %.0f%% of its budget: claim queues are declared again",
                self._backend,
                reading.used * 100,
            )

    def shed_error(self, what: str) -> BackendError:
        reading = self.reading
        assert reading is not None
        return BackendError(
            f"{self._backend}: shedding: {what} is not declared, the broker being at "
            f"{reading.used * 100:.0f}% of its budget ({reading.detail}); the slot is skipped, "
            "not run"
        )

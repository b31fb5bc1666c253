"""The JetStream account's budget, read over the backend's own connection
(``js.account_info()``, ``$JS.API.INFO``): storage and memory used against the account's
limits, and its streams against ``max_streams``, of the account or of each of its tiers
(``R1``, ``R3``...) when its limits are tiered; a limit of -1 (or 0) is no limit. The server's
version and ``max_payload`` (the largest message, a run record's bound) are told in the detail.

Storage and memory shed: near its limit, JetStream refuses the account's writes (every
application of the account, not only brokersched), so from ``SHED`` the backend publishes no
new claim (``NATSBackend``) nor takes a new lease (``NATSLeaseBackend``): those slots are
skipped (``backend-error``, "shedding"), never run twice. Streams only warn: brokersched makes
its streams at start. An account without limits reads as unlimited: the server's own
``max_file_store`` / ``max_memory_store`` are not visible to an account.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...abc import BrokerBudget
from .._budget import BudgetWatch, Effects, Part, judge, share
from ._errors import Translated

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js.api import AccountInfo
    from nats.js.client import JetStreamContext

__all__ = ["EFFECTS", "nats_budget_watch", "read_budget"]

_log = logging.getLogger("brokersched.backends.nats")

EFFECTS = Effects(
    server="JetStream account",
    warn="claims go on",
    shed=(
        "no new claim is published nor lease taken, so those slots are skipped (near its "
        "limits JetStream refuses every write of the account)"
    ),
    back="claims are made again",
    fix=(
        "Raise the account's JetStream limits (max_file, max_mem), or remove streams the "
        "account no longer needs (brokersched purge for retired prefixes)"
    ),
)


def read_budget(
    info: AccountInfo, *, max_payload: int | None = None, version: str | None = None
) -> BrokerBudget:
    """The budget from ``js.account_info()`` (``info.tiers`` when the limits are tiered),
    the connection's ``max_payload`` and the server's version."""
    scopes: list[tuple[str, Any]] = [("", info)]
    if info.tiers:
        scopes += [(f"tier {name}: ", tier) for name, tier in sorted(info.tiers.items())]
    parts: list[Part] = []
    for at, scope in scopes:
        limits = scope.limits
        for figure, used, limit, sheds, size in (
            ("storage", scope.storage, limits.max_storage, True, True),
            ("memory", scope.memory, limits.max_memory, True, True),
            ("streams", scope.streams, limits.max_streams, False, False),
        ):
            if (taken := share(used, limit)) is not None:
                shown = (_size(used), _size(limit)) if size else (used, limit)
                parts.append(Part(f"{at}{figure} {shown[0]} of {shown[1]}", taken, sheds=sheds))
    budget = judge(parts, unknown="the account has no JetStream limits")
    notes = [f"server {version}" if version else "", _payload(max_payload)]
    if any(notes):
        detail = "; ".join([budget.detail, ", ".join(note for note in notes if note)])
        budget = dataclasses.replace(budget, detail=detail)
    return budget


def nats_budget_watch(
    backend: str,
    connection: Callable[[], tuple[NATSClient, JetStreamContext]],
    secrets: list[str],
    period: float,
) -> BudgetWatch:
    """The watch of the account's budget on the backend's connection (``connection()``)."""

    async def read() -> BrokerBudget:
        nc, js = connection()
        with Translated("reading the account's budget", secrets=secrets, backend=backend):
            info = await js.account_info()
        found = nc.connected_server_version
        version = f"{found.major}.{found.minor}.{found.patch}" if found.major else None
        return read_budget(info, max_payload=nc.max_payload, version=version)

    return BudgetWatch(backend, read, EFFECTS, logger=_log, period=period)


def _payload(max_payload: int | None) -> str:
    return f"max_payload {_size(max_payload)}" if max_payload else ""


def _size(count: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"

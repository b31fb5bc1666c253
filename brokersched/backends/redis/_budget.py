"""The Redis server's budget, read over the backend's own connection: ``INFO
memory`` (``used_memory`` against ``maxmemory``, ``maxmemory_policy``) and ``INFO clients``
(``connected_clients`` against ``maxclients``: in ``INFO`` since Redis 7, else ``CONFIG GET
maxclients`` where it is allowed, else not counted), of the server or of every primary of a
cluster; the fullest decides.

Memory sheds only under an evicting policy: near ``maxmemory`` Redis evicts keys to make room,
a claim or a lease written then can be evicted and its slot run twice, so from ``SHED`` the
backend makes no new claim (``RedisBackend``) nor lease (``RedisLeaseBackend``): those slots
are skipped (``backend-error``, "shedding"), never run twice. (Both backends refuse to start
on an evicting policy, and each claim reads the policy itself and refuses one set while they
run (``_scripts._GUARD``): a reading every ``budget_interval`` could not, as a burst between
two readings evicts claims made before it; the shedding adds the warning and the metric.)
Under ``noeviction`` a full Redis refuses writes and claims fail closed by themselves: the
reading only warns. Clients only warn: a full server refuses new connections, and claims fail
closed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ...abc import BrokerBudget
from .._budget import SHED, BudgetWatch, Effects, Part, judge, share

__all__ = ["EFFECTS", "read_budget", "redis_budget_watch"]

_log = logging.getLogger("brokersched.backends.redis")

EFFECTS = Effects(
    server="server",
    warn=(
        f"claims go on (under an evicting policy none is made from {SHED:.0%}; under "
        "noeviction a full Redis refuses writes and claims fail closed)"
    ),
    shed=(
        "no new claim or lease is made, as Redis may evict it to make room, so those slots "
        "are skipped"
    ),
    back="claims are made again",
    fix="Raise maxmemory, free memory on the server, or set maxmemory-policy noeviction",
)


def read_budget(nodes: Sequence[tuple[str, Mapping[str, Any]]]) -> BrokerBudget:
    """The budget from each server's ``INFO memory`` and ``INFO clients`` (one mapping, as
    redis-py parses them, with ``maxclients`` from ``CONFIG GET`` where ``INFO`` lacks it),
    named by where it came from (``""`` for a single server)."""
    parts: list[Part] = []
    for where, info in nodes:
        at = f"{where}: " if where else ""
        used, limit = _int(info, "used_memory"), _int(info, "maxmemory")
        policy = _text(info, "maxmemory_policy")
        memory = share(used, limit)
        if memory is not None:
            evicting = policy != "noeviction"  # an unknown policy (None) may evict
            effect = (
                "writes are refused when it is full"
                if not evicting
                else f"{policy or 'an unknown policy'}: keys are evicted when it is full"
            )
            parts.append(
                Part(
                    f"{at}used_memory {_size(used)} of maxmemory {_size(limit)} ({effect})",
                    memory,
                    sheds=evicting,
                )
            )
        elif used is not None:
            parts.append(Part(f"{at}used_memory {_size(used)}, no maxmemory", 0.0, sheds=False))
        clients, most = _int(info, "connected_clients"), _int(info, "maxclients")
        if (taken := share(clients, most)) is not None:
            parts.append(Part(f"{at}{clients} of maxclients {most} clients", taken, sheds=False))
    return judge(parts, unknown="INFO tells neither memory nor clients")


def redis_budget_watch(
    backend: str, read: Callable[[], Awaitable[BrokerBudget]], period: float
) -> BudgetWatch:
    return BudgetWatch(backend, read, EFFECTS, logger=_log, period=period)


def _int(info: Mapping[Any, Any], name: str) -> int | None:
    value = info.get(name, info.get(name.encode()))
    if isinstance(value, bytes):
        value = value.decode()
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _text(info: Mapping[Any, Any], name: str) -> str | None:
    value = info.get(name, info.get(name.encode()))
    if isinstance(value, bytes):
        value = value.decode()
    return str(value) if value not in (None, "") else None


def _size(count: int | None) -> str:
    if count is None:
        return "?"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"

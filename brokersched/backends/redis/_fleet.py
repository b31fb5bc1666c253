"""The fleet's records of both Redis backends: one hash per kind,
``P:{%fleet}:instance`` and ``P:{%fleet}:control`` (``%fleet`` is no escaped job name, so no
job's keys can meet them; one hash slot on a cluster). Each field holds
``<expires_ms>:<JSON>`` (``0``: kept for ever); a read leaves out, and deletes, the expired
ones, and the instance hash itself expires once no instance wrote it for its time to live.
Control records change by compare-and-set, in a script (``_scripts.FLEET_SWAP``). The
commands are the connection's (``RedisConnection.fleet_read`` and its neighbours)."""

from __future__ import annotations

from datetime import timedelta

from ...abc import FleetKind
from ._base import fleet_key
from ._link import RedisLink

__all__ = ["FleetRecords", "fleet_key"]


class FleetRecords:
    """``Backend``'s fleet primitives over a ``RedisLink``."""

    _redis: RedisLink

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._redis.fleet_read(kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._redis.fleet_put(kind, key, value, ttl=ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._redis.fleet_swap(kind, key, old, new)

"""The fleet's records of both Redis backends (issue 25): one hash per kind,
``P:{%fleet}:instance`` and ``P:{%fleet}:control`` (``%fleet`` is no escaped job name, so no
job's keys can meet them; one hash slot on a cluster). Each field holds
``<expires_ms>:<JSON>`` (``0``: kept for ever); a read leaves out, and deletes, the expired
ones, and the instance hash itself expires once no instance wrote it for its time to live.
Control records change by compare-and-set, in a script (``_scripts.FLEET_SWAP``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..._durations import to_ms
from ...abc import FleetKind
from ._base import RedisConnection

__all__ = ["FleetRecords", "fleet_key"]


def fleet_key(prefix: str, kind: FleetKind) -> str:
    return f"{prefix}:{{%fleet}}:{kind}"


class FleetRecords:
    """``Backend``'s fleet primitives over a ``RedisConnection``."""

    _redis: RedisConnection

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        key = fleet_key(self._redis.prefix, kind)
        now = self._redis.now_ms()

        async def read(client: Any) -> dict[str, str]:
            found: dict[str, str] = {}
            expired: list[bytes] = []
            for field, raw in (await client.hgetall(key)).items():
                expires, _, value = raw.decode().partition(":")
                if expires != "0" and int(expires) <= now:
                    expired.append(field)
                else:
                    found[field.decode()] = value
            if expired:
                await client.hdel(key, *expired)
            return found

        return await self._redis.call(f"read the fleet's {kind}s", read)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        name = fleet_key(self._redis.prefix, kind)
        ttl_ms = to_ms(ttl)
        stored = f"{self._redis.now_ms() + ttl_ms}:{value}"

        async def put(client: Any) -> None:
            pipe = client.pipeline(transaction=False)  # (MULTI is not in the README's ACL)
            pipe.hset(name, key, stored)
            pipe.pexpire(name, ttl_ms)
            await pipe.execute()

        await self._redis.call(f"write its {kind} record", put)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        name = fleet_key(self._redis.prefix, kind)
        held = "" if old is None else f"0:{old}"

        action = f"change the {kind} record of {key}"
        return bool(await self._redis.script("FLEET_SWAP", action, [name], [key, held, f"0:{new}"]))

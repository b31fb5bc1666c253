"""The fleet's records of both Redis backends: one hash per kind,
``P:{%fleet}:instance`` and ``P:{%fleet}:control`` (``%fleet`` is no escaped job name, so no
job's keys can meet them; one hash slot on a cluster). Each field holds
``<expires_ms>:<JSON>`` (``0``: kept for ever); a read leaves out, and deletes, the expired
ones, and the instance hash itself expires once no instance wrote it for its time to live.
Control records change by compare-and-set, in a script (``_scripts.FLEET_SWAP``). The
commands run over the connection (``read_records`` and its neighbours, which
``RedisConnection.fleet_read`` and its neighbours call)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..._durations import to_ms
from ...abc import FleetKind
from ._keys import fleet_key
from ._link import RedisLink

__all__ = ["FleetRecords", "put_record", "read_records", "swap_record"]


class FleetRecords:
    """``Backend``'s fleet primitives over a ``RedisLink``."""

    _redis: RedisLink

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._redis.fleet_read(kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._redis.fleet_put(kind, key, value, ttl=ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._redis.fleet_swap(kind, key, old, new)


async def read_records(redis: RedisLink, kind: FleetKind) -> dict[str, str]:
    key = fleet_key(redis.prefix, kind)
    now = redis.now_ms()

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

    return await redis.call(f"read the fleet's {kind}s", read)


async def put_record(
    redis: RedisLink, kind: FleetKind, key: str, value: str, *, ttl: timedelta
) -> None:
    name = fleet_key(redis.prefix, kind)
    ttl_ms = to_ms(ttl)
    stored = f"{redis.now_ms() + ttl_ms}:{value}"

    async def put(client: Any) -> None:
        pipe = client.pipeline(transaction=False)  # (MULTI is not in the README's ACL)
        pipe.hset(name, key, stored)
        pipe.pexpire(name, ttl_ms)
        await pipe.execute()

    await redis.call(f"write its {kind} record", put)


async def swap_record(
    redis: RedisLink, kind: FleetKind, key: str, old: str | None, new: str
) -> bool:
    name = fleet_key(redis.prefix, kind)
    held = "" if old is None else f"0:{old}"
    action = f"change the {kind} record of {key}"
    return bool(await redis.script("FLEET_SWAP", action, [name], [key, held, f"0:{new}"]))

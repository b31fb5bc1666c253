"""``inventory()``, ``purge()`` and ``doctor()`` of both Redis backends, on a client of their
own (``RedisConnection.operate``): the keys of a prefix (``SCAN``, on every primary of a
cluster), the signs that an instance of it runs, and the server's checks of ``open()`` as
findings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..._clock import host_time_ms
from ...abc import BrokerBudget, Finding, FleetKind, Inventory, Slot, StoredObject
from .._ops import (
    LIVE_WINDOW_MS,
    NamespaceInventory,
    ago,
    recent_claims,
    server_finding,
    slot_memory_finding,
)
from ._keys import fleet_key
from ._link import RedisLink

__all__ = [
    "MIN_VERSION",
    "Operations",
    "doctor",
    "inventory",
    "purge",
    "run_doctor",
    "run_inventory",
    "run_presence",
    "run_purge",
]

MIN_VERSION = (5, 0)
_SCAN_COUNT = 1000
_UNLINK_BATCH = 500


def _ours(key: str, prefix: str) -> bool:
    """Whether ``key`` belongs to ``prefix`` (and not to a longer prefix ``<prefix>:x``): every
    key of a prefix is ``<prefix>:{<job>}:...`` or its slot memory record."""
    rest = key[len(prefix) + 1 :]
    return key.startswith(f"{prefix}:") and (rest.startswith("{") or rest == "slot-memory")


async def _nodes(client: Any, cluster: bool) -> list[Any]:
    return list(client.get_primaries()) if cluster else [None]


async def _scan(client: Any, cluster: bool, prefix: str) -> list[str]:
    keys: set[str] = set()
    for node in await _nodes(client, cluster):
        where = {} if node is None else {"target_nodes": node}
        cursor: int | bytes = 0
        while True:
            cursor, batch = await client.execute_command(
                "SCAN", cursor, "MATCH", f"{prefix}:*", "COUNT", _SCAN_COUNT, **where
            )
            if isinstance(cursor, dict):  # redis-py's cluster client: {node: cursor}
                (cursor,) = cursor.values()
            keys.update(key.decode() for key in batch)
            if int(cursor) == 0:
                break
    return sorted(key for key in keys if _ours(key, prefix))


async def inventory(
    client: Any, cluster: bool, prefix: str, client_name: str, backend: str
) -> Inventory:
    keys = await _scan(client, cluster, prefix)
    seconds, micros = await client.execute_command("TIME", **_any_node(cluster))
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    live = recent_claims(
        [ms for key in keys if (ms := _claim_slot(key)) is not None], now_ms, "claim keys"
    )
    for key in keys:
        live += await _signs(client, key, now_ms)
    live += await _connections(client, cluster, client_name)
    objects = tuple(StoredObject("key", key) for key in keys)
    return Inventory(backend, prefix, objects, live=tuple(live))


def _any_node(cluster: bool) -> dict[str, Any]:
    return {"target_nodes": "random"} if cluster else {}


def _claim_slot(key: str) -> int | None:
    kind = key.rsplit(":", 2)
    if len(kind) == 3 and kind[1] == "claim" and kind[2].lstrip("-").isdigit():
        return int(kind[2])
    return None


async def _signs(client: Any, key: str, now_ms: int) -> list[str]:
    """What ``key`` tells of an instance running: a live lease, a run recorded in the last
    minute."""
    if key.endswith(":runs"):
        signs = []
        for slot, raw in (await client.hgetall(key)).items():
            run = json.loads(raw)
            expires = int(float(run.get("expires", 0)))
            if expires > now_ms - LIVE_WINDOW_MS:
                signs.append(
                    f"slot {slot.decode()} leased to instance {run.get('instance_id')!r} "
                    f"until {ago(expires, now_ms)}: {key}"
                )
        return signs
    if key.endswith(":history"):
        newest = await client.lindex(key, 0)
        if newest is None:
            return []
        at_ms = int(newest.split(b":", 1)[0])  # history_entry: "<started_ms>:<JSON>"
        if at_ms > now_ms - LIVE_WINDOW_MS:
            return [f"a run started {ago(at_ms, now_ms)} was recorded: {key}"]
    return []


async def _connections(client: Any, cluster: bool, client_name: str) -> list[str]:
    """The connections named after the prefix (``CLIENT LIST``; refused by some ACLs and
    managed services: then nothing is known)."""
    from redis.exceptions import ResponseError

    signs: list[str] = []
    for node in await _nodes(client, cluster):
        where = {} if node is None else {"target_nodes": node}
        try:
            answer = await client.execute_command("CLIENT", "LIST", **where)
        except ResponseError:
            return []
        text = answer.decode() if isinstance(answer, bytes) else str(answer)
        count = sum(f" name={client_name} " in f" {line} " for line in text.splitlines())
        if count:
            signs.append(f"{count} connection(s) named {client_name!r} (CLIENT LIST)")
    return signs


async def purge(client: Any, cluster: bool, found: Inventory) -> None:
    keys = [item.name for item in found.objects if item.kind == "key"]
    keys = [key for key in keys if _ours(key, found.namespace)]
    if cluster:  # keys of different jobs live on different nodes: one at a time
        for key in keys:
            await client.execute_command("UNLINK", key)
        return
    for start in range(0, len(keys), _UNLINK_BATCH):
        await client.execute_command("UNLINK", *keys[start : start + _UNLINK_BATCH])


async def doctor(
    client: Any, cluster: bool, memory_key: str | None, slot_ttl: timedelta | None
) -> list[Finding]:
    """The server's version and mode; with ``memory_key`` (``RedisBackend``), the fleet's
    slot memory against ``slot_ttl``."""
    info = await client.execute_command("INFO", "server", **_any_node(cluster))
    version = _field(info, "redis_version")
    findings = [server_finding("Redis", version, MIN_VERSION)]
    mode = _field(info, "redis_mode")
    findings.append(Finding("ok", "cluster mode", f"redis_mode {mode}, cluster={cluster}"))
    if (mode == "cluster") != cluster:
        findings[-1] = Finding(
            "error",
            "cluster mode",
            f"the server runs redis_mode {mode} but the backend has cluster={cluster}",
            "the backend cannot reach the keys of every job (MOVED errors): slots are skipped",
            "set cluster=True for a Redis Cluster, cluster=False otherwise",
        )
    if memory_key is not None and slot_ttl is not None:
        memory = await client.hget(memory_key, "memory_ms")
        memory_ms = None if memory is None else int(memory)
        findings.append(slot_memory_finding("RedisBackend", memory_key, memory_ms, slot_ttl))
    return findings


def _field(info: Any, name: str) -> str | None:
    if isinstance(info, dict):
        value = info.get(name)
        return None if value is None else str(value)
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


# -- what the backends call ---------------------------------------------------------------------


async def run_inventory(redis: RedisLink, namespace: str | None) -> Inventory:
    prefix = redis.namespace(namespace)
    name = f"brokersched:{prefix}"

    async def call(client: Any) -> Inventory:
        return await inventory(client, redis.cluster, prefix, name, redis.backend)

    return await redis.operate("list its keys", call)


async def run_presence(
    redis: RedisLink, namespace: str | None, kind: FleetKind = "instance"
) -> list[str]:
    """The records of ``kind`` (instance, by default) of the prefix's fleet hash not yet
    expired (on the writers' clock, as ``FleetRecords`` judges them), left as they are."""
    key = fleet_key(redis.namespace(namespace), kind)

    async def call(client: Any) -> list[str]:
        now = host_time_ms()
        found: list[str] = []
        for raw in (await client.hgetall(key)).values():
            expires, _, value = raw.decode().partition(":")
            if expires == "0" or int(expires) > now:
                found.append(value)
        return found

    return await redis.operate(f"read the fleet's {kind} records", call)


async def run_purge(redis: RedisLink, found: Inventory) -> Inventory:
    async def call(client: Any) -> Inventory:
        await purge(client, redis.cluster, found)
        name = f"brokersched:{found.namespace}"
        return await inventory(client, redis.cluster, found.namespace, name, redis.backend)

    return await redis.operate("delete its keys", call)


async def run_doctor(
    redis: RedisLink, memory_key: str | None, slot_ttl: timedelta | None
) -> list[Finding]:
    async def call(client: Any) -> list[Finding]:
        findings = await doctor(client, redis.cluster, memory_key, slot_ttl)
        return [*findings, *await redis.server_findings(client)]

    return await redis.operate("check the server", call)


class Operations(NamespaceInventory):
    """``inventory()``, ``purge()``, ``doctor()`` and ``budget`` of both Redis backends, over their
    ``RedisLink``; a backend with a fleet slot memory names it in ``_slot_memory()``."""

    _redis: RedisLink

    def _slot_memory(self) -> tuple[str | None, timedelta | None]:
        """The key of the fleet's slot memory record and this instance's ``slot_ttl``."""
        return None, None

    @property
    def budget(self) -> BrokerBudget | None:
        """The server's budget as last read while started (``_budget``: memory against
        ``maxmemory``, clients against ``maxclients``); ``None`` before, or with
        ``budget_interval=None``."""
        watch = self._redis.budget
        return None if watch is None else watch.reading

    async def _inventory(self, namespace: str | None) -> Inventory:
        """Every key of the prefix (``SCAN``, every primary of a cluster). Live: a claim of a
        slot of the last minute, a lease live in the last minute, a run recorded in the last
        minute, a connection named ``brokersched:<prefix>``."""
        return await run_inventory(self._redis, namespace)

    async def _presence_records(self, namespace: str | None) -> list[str]:
        return await run_presence(self._redis, namespace)

    async def _control_records(self) -> list[str]:
        return await run_presence(self._redis, None, "control")

    async def purge(self, inventory: Inventory) -> Inventory:
        return await run_purge(self._redis, inventory)

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        return await run_doctor(self._redis, *self._slot_memory())

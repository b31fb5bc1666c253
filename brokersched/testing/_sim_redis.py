"""The fleet simulator's Redis: the real ``RedisBackend`` over a model of the Redis commands it
sends, keys forgotten by their ``PX`` on the store's clock (``_sim_store``)."""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from .._clock import Clock, datetime_to_ms
from .._durations import to_ms
from .._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ..abc import (
    Finding,
    FleetKind,
    JobPolicy,
    RunRecord,
)
from ..backends._budget import BudgetWatch
from ..backends.redis import RedisBackend
from ..backends.redis._connection import RedisConnection
from ..backends.redis._link import RedisLink
from ..backends.redis._server import guard_refusal
from ._sim_store import Store, records_put, records_read, records_swap

__all__ = ["RedisData", "RedisModel", "sim_redis"]


T = TypeVar("T")

if TYPE_CHECKING:  # both sides of each seam implement its Protocol (mypy checks it here)

    def _links(real: RedisConnection, model: RedisModel) -> list[RedisLink]:
        return [real, model]


# -- Redis: the real RedisBackend over a model of its commands ---------------------------------


@dataclass
class _Key:
    value: Any
    expires_ms: int | None  # the store's clock


class RedisData:
    """The keys of one Redis server, expiring on its clock."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys: dict[str, _Key] = {}
        self.evicted = 0  # INFO stats evicted_keys
        self.history: dict[str, list[RunRecord]] = {}  # the history lists, newest first

    def now(self) -> int:
        return self.store.clock.now_ms()

    def get(self, name: str) -> Any:
        key = self.keys.get(name)
        if key is None:
            return None
        if key.expires_ms is not None and key.expires_ms <= self.now():
            del self.keys[name]
            return None
        return key.value

    def claim(self, name: str, record: str, value: Any, px: int, start: int) -> list[bytes]:
        """The CLAIM script (``redis/_scripts.py``): ``SET NX PX`` behind the eviction
        guard."""
        if self.get(name) is not None:
            return [b"lost"]
        refused = self.guard(record, start)
        if refused is not None:
            return refused
        self.keys[name] = _Key(value, self.now() + px)
        job, _, slot = name.partition(":{")[2].rpartition("}:claim:")
        self.store.won(job, int(slot), json.loads(value)["instance_id"])
        return [b"won"]

    def guard(self, record: str, start: int) -> list[bytes] | None:
        """The eviction guard (``redis/_scripts._GUARD``): the policy in force, then the
        eviction count against the job's record of it."""
        if self.store.policy_evicts:
            return [b"evicting", b"volatile-lru"]
        seen = self.get(record)
        since = None if seen is None else int(seen["since"])
        if seen is None or int(seen["count"]) != self.evicted:
            since = 0 if seen is None and self.evicted == 0 else self.now()
            self.keys[record] = _Key({"count": str(self.evicted), "since": str(since)}, None)
        assert since is not None
        if since <= start:
            return None
        return [b"evicted", str(self.evicted).encode(), str(since).encode()]

    def pexpire(self, name: str, px: int) -> None:
        if self.get(name) is not None:
            self.keys[name].expires_ms = self.now() + px

    def fleet_memory(self, record: str, wanted: int, skew: int) -> list[Any]:
        """The FLEET_MEMORY script (``redis/_scripts.py``)."""
        now = self.now()
        fields = self.get(record) or {}
        memory = int(fields.get("memory_ms", 0))
        before = memory
        raises = json.loads(fields.get("raises", "[]"))
        created = fields.get("created_ms")
        if memory == 0:
            created, raises, memory = str(now), [], wanted
            fields = {"memory_ms": str(memory), "raises": "[]", "created_ms": created}
            self.keys[record] = _Key(fields, None)
        elif wanted > memory:
            kept = [r for r in raises if int(r[0]) + skew + int(r[1]) > now]
            raises = [*kept, [str(now), str(memory)]]
            memory = wanted
            fields = {**fields, "memory_ms": str(memory), "raises": json.dumps(raises)}
            self.keys[record] = _Key(fields, None)
        return [str(memory).encode(), json.dumps(raises).encode(), (created or "0").encode(),
                str(before).encode()]  # fmt: skip

    def evict(self, rng: random.Random) -> str:
        """The policy set to evict (``volatile-lru``) and at work: some keys with a TTL go;
        or, when it evicts already, set back to ``noeviction``."""
        if self.store.policy_evicts:
            self.store.policy_evicts = False
            return "maxmemory-policy back to noeviction"
        self.store.policy_evicts = True
        volatile = [name for name, key in self.keys.items() if key.expires_ms is not None]
        gone = [name for name in volatile if rng.random() < 0.5]
        for name in gone:
            del self.keys[name]
        self.evicted += len(gone)
        return f"maxmemory-policy volatile-lru: {len(gone)} keys evicted"


class _Pipeline:
    def __init__(self, data: RedisData) -> None:
        self._data = data
        self._commands: list[Callable[[], Any]] = []

    def hmget(self, name: str, *fields: str) -> None:
        def run() -> list[Any]:
            values = self._data.get(name) or {}
            return [None if f not in values else str(values[f]).encode() for f in fields]

        self._commands.append(run)

    def pexpire(self, name: str, px: int) -> None:
        self._commands.append(lambda: self._data.pexpire(name, px))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return [command() for command in self._commands]


class _Client:
    def __init__(self, data: RedisData) -> None:
        self._data = data

    def pipeline(self, transaction: bool = False) -> _Pipeline:
        return _Pipeline(self._data)

    async def pexpire(self, name: str, px: int) -> None:
        self._data.pexpire(name, px)


class RedisModel:
    """A model of one Redis server as ``RedisBackend`` sees it through its ``RedisLink``
    (``backends/redis/_link.py``): the scripts it sends (``CLAIM``, ``FLEET_MEMORY``) as rules
    over ``RedisData``, the commands of its exchanges (``_Client``), its history lists and the
    fleet's records. Calls are answered behind the store's faults (``Store.call``); the
    history and the fleet's records draw none (the simulator keeps its own ledger of runs,
    and its seeds were found with them so). ``dead``: the instance was killed (no answer,
    ever)."""

    def __init__(self, store: Store, data: RedisData, prefix: str) -> None:
        self.store, self.data, self.prefix = store, data, prefix
        self.backend = "RedisBackend"
        self.cluster = False
        self.redacted = "redis://sim"
        self.clock: Clock | None = None
        self.budget: BudgetWatch | None = None  # the server's budget is not modelled
        self.dead = False

    async def open(self, clock: Clock) -> None:
        if self.store.policy_evicts:  # RedisConnection.open's check of maxmemory-policy
            raise ConfigurationError("maxmemory-policy evicts keys", option="maxmemory-policy")
        self.clock = clock

    async def close(self) -> None:
        self.clock = None

    def now_ms(self) -> int:
        if self.clock is None:
            raise BackendUnavailableError(f"{self.backend} is not started")
        return self.clock.now_ms()

    async def call(
        self, action: str, exchange: Callable[[Any], Awaitable[T]], timeout: float | None = None
    ) -> T:
        limit = 5.0 if timeout is None else max(0.0, timeout)
        return await self.store.call(
            self.dead, limit, lambda: exchange(_Client(self.data)), write=True
        )

    async def script(
        self,
        name: str,
        action: str,
        keys: list[str],
        args: list[str | int],
        timeout: float | None = None,
    ) -> Any:
        if name != "FLEET_MEMORY":
            raise BackendError(f"{self.backend}: script {name} is not modelled")

        async def run() -> list[Any]:
            return self.data.fleet_memory(keys[0], int(args[0]), int(args[1]))

        return await self.store.call(self.dead, 5.0, run, write=True)

    async def scripts(
        self,
        name: str,
        action: str,
        calls: Sequence[tuple[list[str], list[str | int]]],
        timeout: float | None = None,
    ) -> list[Any]:
        if name != "CLAIM":
            raise BackendError(f"{self.backend}: script {name} is not modelled")

        async def run() -> list[Any]:
            return [
                self.data.claim(keys[0], keys[1], str(args[0]), int(args[1]), int(args[2]))
                for keys, args in calls
            ]

        limit = 5.0 if timeout is None else max(0.0, timeout)
        return await self.store.call(self.dead, limit, run, write=True)

    def refusal(self, answer: Sequence[Any], what: str) -> BackendError | None:
        return guard_refusal(self.backend, self.redacted, answer, what)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        """``RECORD``: newest first, trimmed to the job's size."""
        kept = self.data.history.setdefault(job.name, [])
        kept.insert(0, record)
        del kept[job.history_size :]

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        kept = self.data.history.get(job.name, [])[: max(0, min(limit, job.history_size))]
        if job.history_ttl is None:
            return list(kept)
        cutoff = self.now_ms() - to_ms(job.history_ttl)
        return [record for record in kept if datetime_to_ms(record.started_at) >= cutoff]

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await records_read(self.store, self.dead, kind)

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await records_put(self.store, self.dead, kind, key, value, ttl)

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await records_swap(self.store, self.dead, kind, key, old, new)

    def namespace(self, namespace: str | None) -> str:
        return self.prefix if namespace is None else namespace

    async def operate(self, action: str, call: Callable[[Any], Awaitable[T]]) -> T:
        raise BackendError(f"{self.backend} could not {action}: the model keeps no server")

    async def server_findings(self, client: Any) -> list[Finding]:
        return []


def sim_redis(
    store: Store, data: RedisData, *, slot_ttl: timedelta, prefix: str
) -> tuple[RedisBackend, RedisModel]:
    """The real ``RedisBackend`` (its fleet memory, claim deadlines, read shortcut, history
    and fleet's records) over a model of one Redis server, and that model (its ``dead`` is
    the instance's kill)."""
    model = RedisModel(store, data, prefix)
    return RedisBackend.over(model, slot_ttl=slot_ttl), model

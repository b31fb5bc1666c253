"""Models of each backend's store for the fleet simulator (``brokersched.testing.simulate``).

Each model keeps what its real store keeps, on the store's own clock, and forgets as it
forgets: leases by the lease protocol itself (``MemoryBackend``), Redis keys by their
``PX``, NATS message ids by the duplicate window in force when JetStream purges them,
RabbitMQ claim queues by their ``x-expires`` counted from their last declare. The claim rules
(``_slotmemory.py``) and the scheduler are the real code; the Redis model runs the real
``RedisBackend`` over a model of the Redis commands it sends.

Faults apply to every call of a store: down (refused at once), held (answered late, or not at
all within the caller's timeout: the call may have been applied), a lock held by another
process (SQLite), answers later than a lease (the call applied at once, its answer delivered
``late_ms`` later, or never if its caller stops waiting first). A killed instance's backend
answers nothing, ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import random
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .._clock import Clock, datetime_to_ms
from .._durations import to_ms
from .._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from .._slotmemory import (
    BOOT_MEMORY,
    DEFAULT_CLAIM_SKEW,
    FleetMemory,
    claim_deadline_ms,
    claim_margin,
    margin_ms,
)
from ..abc import (
    Capabilities,
    Claim,
    ClaimBackend,
    Finding,
    FleetKind,
    JobPolicy,
    Lease,
    LeaseOutcome,
    LeaseState,
    RunReason,
    RunRecord,
    Slot,
)
from ..backends._budget import BudgetWatch
from ..backends._lease import LeaseRow
from ..backends.memory import MemoryBackend, MemoryStore
from ..backends.nats import NATSLeaseBackend
from ..backends.nats._rows import Conflict, Rows, Table, decode_row
from ..backends.redis import RedisBackend
from ..backends.redis._connection import RedisConnection
from ..backends.redis._link import RedisLink
from ..backends.redis._server import guard_refusal
from ._clock import FleetClock, InstanceClock

__all__ = [
    "RedisData",
    "RedisModel",
    "SimLeaseBackend",
    "SimNATS",
    "SimNATSLease",
    "SimRabbitMQ",
    "Store",
    "Wins",
    "sim_redis",
]

T = TypeVar("T")

if TYPE_CHECKING:  # both sides of each seam implement its Protocol (mypy checks it here)

    def _links(real: RedisConnection, model: RedisModel) -> list[RedisLink]:
        return [real, model]


#: The slots won by a claim, applied by the store whether or not its answer came back:
#: (key, slot_ms) -> (instance, the store's clock at the win), for the invariant that every
#: slot either ran or has a documented skip reason.
Wins = dict[tuple[str, int], tuple[str, int]]


@dataclass
class Store:
    """What a store shares between the instances' backends: its clock, its faults."""

    fleet: FleetClock
    clock: InstanceClock  # the store's own wall clock (it may be skewed or stepped)
    rng: random.Random
    down_until: int = -1  # monotonic ms: calls refused at once (restarting)
    held_until: int = -1  # calls held: answered late, or lost (a link that drops or stalls)
    locked_until: int = -1  # another process holds the write lock (SQLite)
    shed_until: int = -1  # the backend sheds: no new claim (near its server's budget)
    late_until: int = -1  # calls applied at once, answered late_ms later (or never)
    late_ms: int = 0
    busy_timeout_ms: int = 5000
    wins: Wins = field(default_factory=dict)
    # the slots won by a call whose answer was lost and whose caller was cancelled waiting
    # (a drain's end, or the caller's own timeout, which then reports the claim skipped)
    cut: set[tuple[str, int]] = field(default_factory=set)
    # (key, slot, instance, attempt) of the leases whose release reached the store in time
    released: set[tuple[str, int, str, int]] = field(default_factory=set)
    # (key, slot, instance, attempt) -> when its lease expires on the fleet's true time
    expiry: dict[tuple[str, int, str, int], int] = field(default_factory=dict)
    # the run ids of the leases granted: a run under a lease begins with its lease's run id, a
    # retry= attempt under it gets one of its own
    leased: set[str] = field(default_factory=set)
    # run id -> when its lease expires on the fleet's true time (granted or last renewed)
    run_expiry: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)  # instance -> its last claim granted
    # Redis: this server's maxmemory-policy is set to evict while the fleet runs (and back),
    # at its eviction steps; ``policy_evicts``: it evicts now
    evicting: bool = False
    policy_evicts: bool = False
    stray: set[str] = field(default_factory=set)  # RabbitMQ: queues made beforehand
    # the fleet's records (presence, controls): (kind, key) -> (JSON, expiry on the store's clock)
    records: dict[tuple[str, str], tuple[str, int | None]] = field(default_factory=dict)

    def won(self, key: str, slot_ms: int, instance: str) -> None:
        self.wins[(key, slot_ms)] = (instance, self.clock.now_ms())
        self.accepted[instance] = self.fleet.now_ms()

    async def fleet_call(self, dead: bool, apply: Callable[[], Awaitable[T]]) -> T:
        """A call for the fleet's records: refused at once while the store is down, held or
        locked. It draws nothing from the store's faults, so that the claims' faults, and the
        seeds found before these calls existed, stay as they were."""
        if dead:
            await asyncio.get_running_loop().create_future()  # a killed process: never
        now = self.fleet.monotonic_ms()
        if now < max(self.down_until, self.held_until, self.locked_until):
            raise BackendUnavailableError("the store is away")
        return await apply()

    async def call(
        self, dead: bool, timeout_s: float, apply: Callable[[], Awaitable[T]], *, write: bool
    ) -> T:
        """``apply`` as the store would answer it now, for a caller that waits ``timeout_s``."""
        if dead:
            await asyncio.get_running_loop().create_future()  # a killed process: never
        now = self.fleet.monotonic_ms()
        deadline = now + round(timeout_s * 1000)
        if now < self.down_until:
            raise BackendUnavailableError("the store is down (connection refused)")
        if write and now < self.locked_until:
            wait = min(self.locked_until, now + self.busy_timeout_ms, deadline) - now
            await self.fleet.sleep(wait / 1000)
            if self.fleet.monotonic_ms() < self.locked_until:
                raise BackendError("database is locked")
        if now < self.held_until:
            reaches = self.rng.random() < 0.5  # the request got through; its answer did not
            if self.held_until <= deadline and self.rng.random() < 0.5:
                await self.fleet.sleep((self.held_until - now) / 1000)  # a stall: late answer
                return await apply()
            taken: set[tuple[str, int]] = set()
            if reaches:
                before = dict(self.wins)
                await apply()
                taken = {slot for slot, win in self.wins.items() if before.get(slot) != win}
            try:
                await self.fleet.sleep(max(deadline - now, 0) / 1000)
            except asyncio.CancelledError:  # its caller gave up (a drain's end, say): the
                # claims it took are never answered (a claim timing out instead says so)
                self.cut |= taken
                raise
            raise BackendError("no answer from the store (the link was cut)")
        if now < self.late_until:
            return await self._answer_late(apply, now + self.late_ms, deadline)
        return await apply()

    async def _answer_late(
        self, apply: Callable[[], Awaitable[T]], answer_at: int, deadline: int
    ) -> T:
        """``apply`` now, its answer (or its error) at ``answer_at`` (monotonic); none if that
        is past its caller's ``deadline``."""
        try:
            answer: T | Exception = await apply()
        except Exception as exc:
            answer = exc
        await self.fleet.sleep(max(min(answer_at, deadline) - self.fleet.monotonic_ms(), 0) / 1000)
        if answer_at > deadline:
            raise BackendError("no answer from the store in time (it came too late)")
        if isinstance(answer, Exception):
            raise answer
        return answer


class _History:
    """A history stream of runs per job, newest first, as the claim backends keep it: each
    job's subject holds the largest ``history_size`` any record asked for (NATS's
    ``max_msgs_per_subject``; RabbitMQ's reader bounds it by job); a read takes at most the
    job's own. Not behind the store's faults (the simulator keeps its own ledger of runs)."""

    def __init__(self) -> None:
        self.runs: dict[str, list[RunRecord]] = {}
        self.size = 0

    def record(self, job: JobPolicy, record: RunRecord) -> None:
        self.size = max(self.size, job.history_size)
        kept = self.runs.setdefault(job.name, [])
        kept.insert(0, record)
        del kept[self.size :]

    def read(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return self.runs.get(job.name, [])[: max(0, min(limit, job.history_size))]


async def _records_read(store: Store, dead: bool, kind: FleetKind) -> dict[str, str]:
    """The fleet's records (presence, controls) of ``kind`` the store keeps, not expired on
    its clock; refused while it is away (``Store.fleet_call``)."""

    async def apply() -> dict[str, str]:
        now = store.clock.now_ms()
        return {
            key: value
            for (k, key), (value, expires) in store.records.items()
            if k == kind and (expires is None or expires > now)
        }

    return await store.fleet_call(dead, apply)


async def _records_put(
    store: Store, dead: bool, kind: FleetKind, key: str, value: str, ttl: timedelta
) -> None:
    async def apply() -> None:
        store.records[kind, key] = (value, store.clock.now_ms() + to_ms(ttl))

    await store.fleet_call(dead, apply)


async def _records_swap(
    store: Store, dead: bool, kind: FleetKind, key: str, old: str | None, new: str
) -> bool:
    async def apply() -> bool:
        held = store.records.get((kind, key))
        if (held[0] if held is not None else None) != old:
            return False
        store.records[kind, key] = (new, None)
        return True

    return await store.fleet_call(dead, apply)


class _SimFleet:
    """The fleet's records kept by the store (``_records_read`` and its neighbours), for the
    simulated backends that model the whole backend."""

    sim: Store
    dead: bool

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await _records_read(self.sim, self.dead, kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await _records_put(self.sim, self.dead, kind, key, value, ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await _records_swap(self.sim, self.dead, kind, key, old, new)


class SimLeaseBackend(_SimFleet, MemoryBackend):
    """A lease store (PostgreSQL, SQLite, Redis) as the lease protocol itself, on the store's
    clock, behind the store's faults."""

    def __init__(
        self, store: Store, rows: MemoryStore, *, lease_ttl: timedelta, instance: str
    ) -> None:
        super().__init__(lease_ttl=lease_ttl, store=rows, store_clock=store.clock)
        self.sim, self.instance = store, instance
        self.dead = False

    def _bound(self) -> float:
        return max(self.lease_ttl.total_seconds() / 3, 0.2)

    async def acquire(
        self,
        slot: Slot,
        *,
        policy: JobPolicy,
        instance_id: str,
        run_id: str,
        reason: RunReason,
        timeout: float,
    ) -> Lease | Literal["overlap", "not-acquired"]:
        async def apply() -> Lease | Literal["overlap", "not-acquired"]:
            answer = await MemoryBackend.acquire(
                self, slot, policy=policy, instance_id=instance_id, run_id=run_id,
                reason=reason, timeout=timeout,
            )  # fmt: skip
            if isinstance(answer, Lease):
                self.sim.won(slot.job, slot.slot_ms, instance_id)
                self._expires(answer)
            return answer

        return await self.sim.call(self.dead, timeout, apply, write=True)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        async def apply() -> list[LeaseOutcome]:
            answers = await MemoryBackend.acquire_many(
                self, claims, instance_id=instance_id, timeout=timeout
            )
            for claim, answer in zip(claims, answers, strict=True):
                if isinstance(answer, Lease):
                    self.sim.won(claim.slot.job, claim.slot.slot_ms, instance_id)
                    self._expires(answer)
            return answers

        return await self.sim.call(self.dead, timeout, apply, write=True)

    async def renew(self, lease: Lease) -> bool:
        async def apply() -> bool:
            renewed = await MemoryBackend.renew(self, lease)
            if renewed:
                self._expires(lease)
            return renewed

        return await self.sim.call(self.dead, self._bound(), apply, write=True)

    def _expires(self, lease: Lease) -> None:
        """Note when ``lease`` expires, on the fleet's true time (the store's clock may be
        off): the simulator's invariants judge a release that came too late by it."""
        row = self.store.jobs.get(lease.job)
        held = row.leases.get(lease.slot_ms) if row is not None else None
        if held is not None:
            off = self.sim.clock.now_ms() - self.sim.fleet.now_ms()
            key = (lease.job, lease.slot_ms, held.instance_id, held.attempt)
            self.sim.expiry[key] = held.expires_ms - off
            self.sim.leased.add(held.run_id)
            self.sim.run_expiry[held.run_id] = held.expires_ms - off

    def _held(self, lease: Lease) -> bool:
        """Whether ``lease`` still holds its slot in the store (not taken over)."""
        row = self.store.jobs.get(lease.job)
        held = row.leases.get(lease.slot_ms) if row is not None else None
        return held is not None and held.token == lease.token

    async def _release(self, lease: Lease, record: tuple[JobPolicy, RunRecord] | None) -> None:
        """End ``lease`` (with its run's record) and note it released if that took effect: the
        memory backend yields before it decides, so a take-over may come first (the release
        is then stale)."""
        held = self._held(lease)
        await MemoryBackend.release(self, lease, record=record)
        row = self.store.jobs.get(lease.job)
        if held and (row is None or lease.slot_ms not in row.leases):
            self.sim.released.add((lease.job, lease.slot_ms, self.instance, lease.attempt))

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        async def apply() -> None:
            if handover:
                await MemoryBackend.release(self, lease, handover=handover, record=record)
            else:
                await self._release(lease, record)

        await self.sim.call(self.dead, self._bound(), apply, write=True)

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[tuple[JobPolicy, RunRecord] | None] | None = None,
    ) -> list[Exception | None]:
        ends = records if records is not None else [None] * len(leases)

        async def apply() -> list[Exception | None]:
            for lease, end in zip(leases, ends, strict=True):  # one transaction
                await self._release(lease, end)
            return [None for _ in leases]

        return await self.sim.call(self.dead, self._bound(), apply, write=True)

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        async def apply() -> list[Lease]:
            leases = await MemoryBackend.take_over(self, policies, instance_id=instance_id)
            for lease in leases:
                self.sim.won(lease.job, lease.slot_ms, instance_id)
                self._expires(lease)
            return leases

        return await self.sim.call(self.dead, 5.0, apply, write=True)

    async def lease_state(self, job: str) -> LeaseState:
        return await self.sim.call(
            self.dead, 5.0, lambda: MemoryBackend.lease_state(self, job), write=False
        )

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self.sim.call(
            self.dead, 5.0, lambda: MemoryBackend.record(self, job, record), write=True
        )

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        await self.sim.call(
            self.dead, 5.0, lambda: MemoryBackend.record_many(self, records), write=True
        )


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
        return await _records_read(self.store, self.dead, kind)

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await _records_put(self.store, self.dead, kind, key, value, ttl)

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await _records_swap(self.store, self.dead, kind, key, old, new)

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


# -- NATS: message ids deduplicated within the claims stream's window ---------------------------


class _NATSData:
    """The claims stream: its duplicate window over time, the ids it still remembers, and the
    fleet's record of raises (``_streams.Streams._note_raise``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.windows: list[tuple[int, int]] = []  # (since, window ms) on the store's clock
        self.ids: dict[str, int] = {}  # message id -> when stored
        self.raises: FleetMemory | None = None
        self.history = _History()

    def window(self) -> int:
        return self.windows[-1][1] if self.windows else 0

    def remembers(self, msg_id: str) -> bool:
        """JetStream purges an id once its age passes the window in force at purge time (an
        update re-runs the purge with the new window): gone if it outlived the window at any
        moment since it was stored."""
        stored = self.ids.get(msg_id)
        if stored is None:
            return False
        now = self.store.clock.now_ms()
        spans = [*self.windows, (now, self.window())]
        for (_, window), (until, _) in itertools.pairwise(spans):
            if until > stored and until - stored > window:
                return False
        return True

    def raise_to(self, memory_ms: int, at_ms: int, skew_ms: int) -> None:
        before = self.window()
        if memory_ms <= before:
            return
        self.windows.append((self.store.clock.now_ms(), memory_ms))
        if before:
            noted = self.raises or FleetMemory(before, 0)
            self.raises = FleetMemory(before, 0, noted.raises).raised(memory_ms, at_ms, skew_ms)


class SimNATS(_SimFleet, ClaimBackend):
    """A model of ``NATSBackend``'s claims: the window raised at start (and for boot claims),
    the raises read at start, the deadline of ``_claims``."""

    def __init__(self, store: Store, data: _NATSData, *, slot_ttl: timedelta) -> None:
        super().__init__()
        self.sim, self.data, self.dead = store, data, False
        self._slot_ttl = slot_ttl
        self._skew_ms = to_ms(DEFAULT_CLAIM_SKEW)
        self._clock: Clock | None = None
        self._view = FleetMemory(0, 0)

    @staticmethod
    def stream(store: Store) -> _NATSData:
        return _NATSData(store)

    @property
    def capabilities(self) -> Capabilities:
        margin = claim_margin(self._slot_ttl, self._skew_ms)
        return Capabilities(False, self._slot_ttl, False, False, margin)

    async def _open(self, clock: Clock) -> None:
        async def start() -> None:
            self.data.raise_to(to_ms(self._slot_ttl), clock.now_ms(), self._skew_ms)
            self._read(self.data)

        self._clock = clock
        await self.sim.call(self.dead, 5.0, start, write=True)

    def _read(self, data: _NATSData) -> None:
        raises = data.raises.raises if data.raises is not None else ()
        self._view = FleetMemory(data.window(), 0, raises)

    async def _close(self) -> None:
        self._clock = None

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        return claim_deadline_ms(self._view, slot.slot_ms, skew_ms=self._skew_ms)

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        assert self._clock is not None
        now = self._clock.now_ms()
        deadline = self.claim_deadline_ms(slot)
        in_range = 0 <= now - slot.slot_ms < to_ms(self._slot_ttl)
        if in_range and deadline is not None and now > deadline:
            raise BackendError(f"slot {slot.key} is too late to claim safely")

        async def publish() -> bool:
            if self.data.remembers(slot.key):
                return False
            self.data.ids[slot.key] = self.sim.clock.now_ms()
            self.sim.won(slot.job, slot.slot_ms, instance_id)
            return True

        return await self.sim.call(self.dead, timeout, publish, write=True)

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        assert self._clock is not None
        clock = self._clock
        if self._view.memory_ms < to_ms(BOOT_MEMORY):

            async def raise_window() -> None:
                self.data.raise_to(to_ms(BOOT_MEMORY), clock.now_ms(), self._skew_ms)
                self._read(self.data)

            await self.sim.call(self.dead, timeout, raise_window, write=True)
        return await self.claim(slot, instance_id=instance_id, run_id=run_id, timeout=timeout)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        self.data.history.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return self.data.history.read(job, limit)


# -- NATS KV leases: the real NATSLeaseBackend's rows over a model of the bucket --------------

#: The tokens of the leases a ``SimNATSLease.release`` (no hand-over) is ending, in its task.
_RELEASING: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "releasing", default=frozenset()
)
_ESCAPED = re.compile(r"(?:=[0-9A-F]{2})+")


def _job_of(key: str) -> str:
    """The job of a row key (``_rows.row_key`` undone)."""
    return _ESCAPED.sub(
        lambda m: bytes.fromhex(m[0].replace("=", "")).decode(), key.removeprefix("job.")
    )


class _Bucket:
    """The KV bucket: entries with their revisions (the store's clock is the store's).

    ``flaky_until`` (monotonic ms): until then, a call's answer is lost now and then, the call
    applied or not (a link that drops packets; a stream leader that dies after it stored a
    write and before it answered): the writes whose outcome the caller cannot know."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.flaky_until = -1
        self.history: dict[str, list[RunRecord]] = {}  # the history stream: newest first, by job

    def lost(self) -> bool:
        """Whether this call's answer is lost (drawn while the link is flaky)."""
        store = self.store
        return store.fleet.monotonic_ms() < self.flaky_until and store.rng.random() < 0.3


class _SimTable(Table):
    """What ``Rows`` asks of the bucket, behind the store's faults: a write whose answer is
    lost may have been applied (``Store.call``)."""

    def __init__(self, owner: SimNATSLease) -> None:
        self.owner, self.bucket, self.sim = owner, owner.bucket_data, owner.sim

    async def read(self, key: str, timeout: float) -> tuple[bytes | None, int]:
        async def read() -> tuple[bytes | None, int]:
            await asyncio.sleep(0)  # a round trip: other instances' decisions interleave
            value, revision = self.bucket.entries.get(key, (None, 0))
            return value, revision

        return await self.sim.call(self.owner.dead, timeout, read, write=False)

    async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
        async def write() -> None:
            await asyncio.sleep(0)
            if self.bucket.lost():
                if self.sim.rng.random() < 0.5:
                    with contextlib.suppress(Conflict):
                        store()
                raise BackendError("no answer from the bucket (the link dropped it)")
            store()

        def store() -> None:
            before, revision = self.bucket.entries.get(key, (None, 0))
            if revision != last:
                raise Conflict(key)
            self.owner.applied(_job_of(key), before, value)
            self.bucket.revision += 1
            self.bucket.entries[key] = (value, self.bucket.revision)

        await self.sim.call(self.owner.dead, timeout, write, write=True)

    async def read_at(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
        async def read() -> tuple[bytes | None, int, int]:
            await asyncio.sleep(0)
            if self.bucket.lost():
                raise BackendError("no answer from the bucket (the link dropped it)")
            value, revision = self.bucket.entries.get(key, (None, 0))
            return value, revision, self.sim.clock.now_ms()

        return await self.sim.call(self.owner.dead, timeout, read, write=False)


class SimNATSLease(_SimFleet, NATSLeaseBackend):
    """The real ``NATSLeaseBackend`` (its compare-and-set rounds, the resolution of writes
    without an answer, the lease protocol) over a model of its bucket; what each write changed
    is noted for the simulator's invariants, as ``SimLeaseBackend`` notes it."""

    def __init__(
        self, store: Store, bucket: _Bucket, *, lease_ttl: timedelta, instance: str
    ) -> None:
        super().__init__(lease_ttl=lease_ttl)
        self.sim, self.bucket_data, self.instance = store, bucket, instance
        self.dead = False

    @staticmethod
    def data(store: Store) -> _Bucket:
        return _Bucket(store)

    async def _open(self, clock: Clock) -> None:
        self._clock = clock
        fleet = self.sim.fleet
        self._rows = Rows(
            _SimTable(self),
            self.name,
            lambda: fleet.monotonic_ms() / 1000,
            fleet.sleep,
            clock.blocking,
            clock.timeout,
        )

    async def _close(self) -> None:
        self._clock, self._rows = None, None

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        pass

    # The history stream, as backfill reads it to skip the slots that ran (the simulator keeps
    # its own ledger of runs besides).
    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        async def write() -> None:
            kept = self.bucket_data.history.setdefault(job.name, [])
            kept.insert(0, record)
            del kept[job.history_size :]

        await self.sim.call(self.dead, 5.0, write, write=True)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        async def read() -> list[RunRecord]:
            return self.bucket_data.history.get(job.name, [])[:limit]

        return await self.sim.call(self.dead, 5.0, read, write=False)

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        mark = _RELEASING.set(_RELEASING.get() if handover else frozenset({lease.token}))
        try:
            await super().release(lease, handover=handover, record=record)
        finally:
            _RELEASING.reset(mark)

    def applied(self, job: str, before: bytes | None, after: bytes) -> None:
        """A write of ``job``'s row lands: note the leases it granted (a claim, a restart),
        the expiries it set, and the leases a release ended in time."""
        old, _ = decode_row(before)
        new, _ = decode_row(after)
        for slot, lease in new.leases.items():
            held = old.leases.get(slot)
            if held is None or held.token != lease.token:
                self.sim.won(job, slot, lease.instance_id)
            if lease.state == "running" and held != lease:
                self._expires(job, slot, lease)
        releasing = _RELEASING.get()
        for slot, held in old.leases.items():
            gone = new.leases.get(slot)
            if held.token in releasing and (gone is None or gone.token != held.token):
                self.sim.released.add((job, slot, self.instance, held.attempt))

    def _expires(self, job: str, slot: int, lease: LeaseRow) -> None:
        off = self.sim.clock.now_ms() - self.sim.fleet.now_ms()
        self.sim.expiry[(job, slot, lease.instance_id, lease.attempt)] = lease.expires_ms - off
        self.sim.leased.add(lease.run_id)
        self.sim.run_expiry[lease.run_id] = lease.expires_ms - off


# -- RabbitMQ: a queue per slot, expiring x-expires after its last declare ---------------------


@dataclass
class _Queue:
    x_expires: int
    used_ms: int  # the store's clock: its last declare
    held_by: str | None = None


class _RabbitData:
    """The broker: claim queues and the fleet's record (``<prefix>.slot-memory``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.queues: dict[str, _Queue] = {}
        self.record: FleetMemory | None = None
        self.history = _History()

    def queue(self, name: str) -> _Queue | None:
        queue = self.queues.get(name)
        if queue is not None and queue.used_ms + queue.x_expires <= self.store.clock.now_ms():
            del self.queues[name]
            return None
        return queue

    def stray(self, name: str) -> None:
        """A queue made beforehand by something else, holding a message: other arguments
        (no x-expires, here: a day), and no claim of brokersched's in it."""
        self.queues[name] = _Queue(86_400_000, self.store.clock.now_ms(), "stray")
        self.store.stray.add(name)

    def declare(self, name: str, x_expires: int) -> _Queue | None:
        """The queue, its expiry renewed; ``None``: one exists with another ``x-expires``
        (``406``)."""
        queue = self.queue(name)
        if queue is None:
            queue = self.queues[name] = _Queue(x_expires, self.store.clock.now_ms())
        if queue.x_expires != x_expires:
            return None
        queue.used_ms = self.store.clock.now_ms()
        return queue


class SimRabbitMQ(_SimFleet, ClaimBackend):
    """A model of ``RabbitMQBackend``'s claims: the fleet record (made, adopted or raised at
    start), a claim queue per slot declared with the view's memory, publish first, a check
    after an ack, queues declared ahead by a slot's winner, the deadline of ``_claims``."""

    _LEAD_MS = 750

    def __init__(
        self, store: Store, data: _RabbitData, *, slot_ttl: timedelta, declare_ahead: bool
    ) -> None:
        super().__init__()
        self.sim, self.data, self.dead = store, data, False
        self._slot_ttl = slot_ttl
        self._declare_ahead = declare_ahead
        self._skew_ms = to_ms(DEFAULT_CLAIM_SKEW)
        self._clock: Clock | None = None
        self._view: FleetMemory | None = None

    @staticmethod
    def broker(store: Store) -> _RabbitData:
        return _RabbitData(store)

    @property
    def capabilities(self) -> Capabilities:
        lead = self._lead(to_ms(self._slot_ttl))
        margin = claim_margin(self._slot_ttl, self._skew_ms, lead)
        return Capabilities(False, self._slot_ttl, False, True, margin)

    async def _open(self, clock: Clock) -> None:
        self._clock = clock
        await self.sim.call(self.dead, 5.0, self._settle, write=True)

    async def _settle(self) -> None:
        """Under the record's lock (atomic here): make, adopt or raise the record."""
        assert self._clock is not None
        own, record = to_ms(self._slot_ttl), self.data.record
        if record is None:
            record = self.data.record = FleetMemory(own, self._clock.now_ms())
        elif record.memory_ms < own:
            record = record.raised(own, self._clock.now_ms(), self._skew_ms)
            self.data.record = record
        self._view = record

    async def _close(self) -> None:
        self._clock = None

    @property
    def fleet_slot_memory(self) -> timedelta | None:
        """As ``RabbitMQBackend``'s: the fleet's slot memory as last read."""
        view = self._view
        return (
            None if view is None or self._clock is None else timedelta(milliseconds=view.memory_ms)
        )

    def _lead(self, memory_ms: int) -> int:
        return min(self._LEAD_MS, memory_ms // 4)

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        view = self._view
        if view is None:  # as RabbitMQBackend: its own slot_ttl until it reads the record
            return super().claim_deadline_ms(slot)
        limit = view.limit_ms(slot.slot_ms, self._skew_ms)
        lead = self._lead(view.memory_ms)
        return slot.slot_ms + limit - margin_ms(limit, skew_ms=self._skew_ms, lead_ms=lead)

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        return await self._claim(slot, instance_id, timeout, boot=False)

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        return await self._claim(slot, instance_id, timeout, boot=True)

    async def _claim(self, slot: Slot, instance_id: str, timeout: float, *, boot: bool) -> bool:
        assert self._clock is not None
        deadline = None if boot else self.claim_deadline_ms(slot)
        if deadline is not None and self._clock.now_ms() > deadline:
            raise BackendError(f"slot {slot.key} is too late to claim safely")

        async def claim() -> bool:
            for _ in range(4):
                record = self.data.record
                if record is None or self._view is None or record != self._view:
                    await self._settle()  # the fence is gone: read the record again
                    continue
                late = None if boot else self.claim_deadline_ms(slot)
                if late is not None and self._clock is not None and self._clock.now_ms() > late:
                    # As RabbitMQBackend's claim budget, again under the view just read.
                    raise BackendError(f"slot {slot.key} is too late to claim safely")
                memory = to_ms(BOOT_MEMORY) if boot else self._view.memory_ms
                queue = self.data.queue(slot.key)
                if queue is not None and queue.held_by is not None:
                    self._check_refusal(slot, memory)  # nacked
                    return False
                declared = self.data.declare(slot.key, memory)
                if declared is None:
                    if queue is not None and queue.held_by is not None:
                        return False
                    raise BackendError(f"claim queue of {slot.key}: another slot memory")
                declared.held_by = instance_id
                self.sim.won(slot.job, slot.slot_ms, instance_id)
                return True
            raise BackendError("the fleet's slot memory kept changing")

        return await self.sim.call(self.dead, timeout, claim, write=True)

    def _check_refusal(self, slot: Slot, memory_ms: int) -> None:
        """A claim nacked (``RabbitMQBackend._check_refusal``): the queue is declared to check
        that brokersched made it; one made with other arguments fails closed (a stray message in
        it would lose the slot silently)."""
        if self.data.declare(slot.key, memory_ms) is None and slot.key in self.sim.stray:
            raise BackendError(f"claim queue of {slot.key} is not brokersched's")

    async def prepare_claims(self, slots: Sequence[Slot]) -> None:
        if not self._declare_ahead or self._view is None or self._clock is None:
            return
        view, now = self._view, self._clock.now_ms()

        async def declare() -> None:
            for slot in slots:
                if 0 < slot.slot_ms - now <= self._lead(view.memory_ms):
                    self.data.declare(slot.key, view.memory_ms)

        await self.sim.call(self.dead, 5.0, declare, write=True)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        self.data.history.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return self.data.history.read(job, limit)

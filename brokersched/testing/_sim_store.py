"""What every model of a store shares, for the fleet simulator (``brokersched.testing.simulate``):
the store's clock and faults (``Store``), the wins it applied, a history of runs as the claim
backends keep it, and the fleet's records (presence, controls).

Faults apply to every call of a store: down (refused at once), held (answered late, or not at
all within the caller's timeout: the call may have been applied), a lock held by another
process (SQLite), answers later than a lease (the call applied at once, its answer delivered
``late_ms`` later, or never if its caller stops waiting first). A killed instance's backend
answers nothing, ever.

Each model keeps what its real store keeps, on the store's own clock, and forgets as it
forgets: leases by the lease protocol itself (``_sim_lease``), Redis keys by their ``PX``
(``_sim_redis``), NATS message ids by the duplicate window in force when JetStream purges them
and NATS KV rows by their revisions (``_sim_nats``), RabbitMQ claim queues by their
``x-expires`` counted from their last declare (``_sim_rabbitmq``). The claim rules
(``_slotmemory.py``) and the scheduler are the real code.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from .._durations import to_ms
from .._exceptions import BackendError, BackendUnavailableError
from ..abc import (
    FleetKind,
    JobPolicy,
    RunRecord,
)
from ._clock import FleetClock, InstanceClock

__all__ = ["History", "SimFleet", "Store", "Wins", "records_put", "records_read", "records_swap"]

T = TypeVar("T")

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


class History:
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


async def records_read(store: Store, dead: bool, kind: FleetKind) -> dict[str, str]:
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


async def records_put(
    store: Store, dead: bool, kind: FleetKind, key: str, value: str, ttl: timedelta
) -> None:
    async def apply() -> None:
        store.records[kind, key] = (value, store.clock.now_ms() + to_ms(ttl))

    await store.fleet_call(dead, apply)


async def records_swap(
    store: Store, dead: bool, kind: FleetKind, key: str, old: str | None, new: str
) -> bool:
    async def apply() -> bool:
        held = store.records.get((kind, key))
        if (held[0] if held is not None else None) != old:
            return False
        store.records[kind, key] = (new, None)
        return True

    return await store.fleet_call(dead, apply)


class SimFleet:
    """The fleet's records kept by the store (``records_read`` and its neighbours), for the
    simulated backends that model the whole backend."""

    sim: Store
    dead: bool

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await records_read(self.sim, self.dead, kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await records_put(self.sim, self.dead, kind, key, value, ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await records_swap(self.sim, self.dead, kind, key, old, new)

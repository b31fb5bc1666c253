"""The fleet simulator's NATS: claims deduplicated by message id within the claims stream's
window, as JetStream purges them; and NATS KV leases, the real ``NATSLeaseBackend`` made over a
model of its bucket's revisions (``BucketModel``, a ``KVLink``: ``backends/nats/_link.py``;
``_sim_store`` holds the store's clock and faults)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import re
from collections.abc import Awaitable
from datetime import timedelta
from typing import TYPE_CHECKING

from .._clock import Clock
from .._durations import to_ms
from .._exceptions import BackendError
from .._slotmemory import (
    BOOT_MEMORY,
    DEFAULT_CLAIM_SKEW,
    FleetMemory,
    claim_deadline_ms,
    claim_margin,
)
from ..abc import (
    Capabilities,
    ClaimBackend,
    FleetKind,
    JobPolicy,
    Lease,
    RunRecord,
    Slot,
)
from ..backends._lease import LeaseRow
from ..backends.nats import NATSLeaseBackend
from ..backends.nats._link import KVLink
from ..backends.nats._rows import Conflict, Table, decode_row
from ._sim_store import History, SimFleet, Store, records_put, records_read, records_swap

if TYPE_CHECKING:  # both sides of each seam implement its Protocol (mypy checks it here)
    from ..backends.nats._bucket import KVTable
    from ..backends.nats._connection import OwnBucket

    def _links(real: OwnBucket, model: BucketModel) -> list[KVLink]:
        return [real, model]

    def _tables(real: KVTable, model: _SimTable) -> list[Table]:
        return [real, model]


__all__ = ["BucketModel", "SimNATS", "SimNATSLease", "nats_bucket", "sim_nats_lease"]


# -- NATS: message ids deduplicated within the claims stream's window ---------------------------


class _NATSData:
    """The claims stream: its duplicate window over time, the ids it still remembers, and the
    fleet's record of raises (``_streams.Streams._note_raise``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.windows: list[tuple[int, int]] = []  # (since, window ms) on the store's clock
        self.ids: dict[str, int] = {}  # message id -> when stored
        self.raises: FleetMemory | None = None
        self.history = History()

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


class SimNATS(SimFleet, ClaimBackend):
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


# -- NATS KV leases: the real NATSLeaseBackend over a model of its bucket ----------------------

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


class BucketModel:
    """The bucket as one instance's ``NATSLeaseBackend`` sees it through its ``KVLink``
    (``backends/nats/_link.py``): the rows' table behind the store's faults (``_SimTable``),
    the history stream and the fleet's records; what each write changed is noted for the
    simulator's invariants, as ``SimLeaseBackend`` notes it. ``dead``: the instance was killed
    (no answer, ever)."""

    def __init__(self, store: Store, bucket: _Bucket, instance: str) -> None:
        self.sim, self.bucket_data, self.instance = store, bucket, instance
        self.dead = False

    async def open(self, clock: Clock) -> Table:
        return _SimTable(self)

    async def close(self) -> None:
        pass

    def monotonic(self) -> float:
        return self.sim.fleet.monotonic_ms() / 1000

    def sleep(self, seconds: float) -> Awaitable[object]:
        return self.sim.fleet.sleep(seconds)

    async def prepare(self, history_size: int) -> None:
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

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await records_read(self.sim, self.dead, kind)

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await records_put(self.sim, self.dead, kind, key, value, ttl)

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await records_swap(self.sim, self.dead, kind, key, old, new)

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


class _SimTable:
    """What ``Rows`` asks of the bucket (``_rows.Table``), behind the store's faults: a write
    whose answer is lost may have been applied (``Store.call``)."""

    def __init__(self, owner: BucketModel) -> None:
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


class SimNATSLease(NATSLeaseBackend):
    """The real ``NATSLeaseBackend`` (its compare-and-set rounds, the resolution of writes
    without an answer, the lease protocol) over a model of its bucket (``BucketModel``, made
    with ``over``); a release (no hand-over) marks the leases it ends, so that the model can
    tell them from the leases a take-over ends."""

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


def sim_nats_lease(
    store: Store, bucket: _Bucket, *, lease_ttl: timedelta, instance: str
) -> tuple[SimNATSLease, BucketModel]:
    """The real ``NATSLeaseBackend`` over a model of its bucket, and that model (its ``dead``
    is the instance's kill)."""
    model = BucketModel(store, bucket, instance)
    return SimNATSLease.over(model, lease_ttl=lease_ttl), model


def nats_bucket(store: Store) -> _Bucket:
    """The bucket every instance's model shares."""
    return _Bucket(store)

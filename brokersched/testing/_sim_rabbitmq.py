"""The fleet simulator's RabbitMQ: a claim queue per slot, expiring ``x-expires`` after its last
declare on the store's clock, and the fleet's slot memory record (``_sim_store``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from .._clock import Clock
from .._durations import to_ms
from .._exceptions import BackendError
from .._slotmemory import (
    BOOT_MEMORY,
    DEFAULT_CLAIM_SKEW,
    FleetMemory,
    claim_margin,
    margin_ms,
)
from ..abc import (
    Capabilities,
    ClaimBackend,
    JobPolicy,
    RunRecord,
    Slot,
)
from ._sim_store import History, SimFleet, Store

__all__ = ["SimRabbitMQ"]


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
        self.history = History()

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


class SimRabbitMQ(SimFleet, ClaimBackend):
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

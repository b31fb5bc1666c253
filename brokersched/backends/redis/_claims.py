"""The claims of ``RedisBackend`` (``_backend``): one ``SET key value NX PX <memory>`` per slot,
in a script behind the eviction guard (``_scripts.CLAIM``).

One slot memory per fleet (the rules: ``brokersched/_slotmemory.py``)
    A claim key lives as long as its *winner* said. Were that each instance's own
    ``slot_ttl``, an instance with 2s would win a slot, Redis would forget it 2s later, and an
    instance with 20s, later by jitter but within its larger ``max_late``, would win it again.
    So every instance of a prefix claims with the *fleet's* slot memory, the longest
    ``slot_ttl`` among them, kept in ``<prefix>:slot-memory`` (a hash: ``memory_ms``,
    ``created_ms`` and the recent raises):

    * ``start()`` adopts the record's memory when it is longer than ``slot_ttl``, and raises
      it (``FLEET_MEMORY``, one script) when ``slot_ttl`` is longer; no record: it makes it.
    * A claim reads the record first (one more round trip, shared by the claims of one
      instant) unless this instance read it ``max_clock_skew`` after the slot fell due already
      (the common case when several jobs share an instant; a claim is then its script alone):
      any change of the record that matters to a slot is then in the view. If the read shows a
      longer memory (a raise this instance had not seen), the instance adopts it, and the
      claim is made with it.
    * Every claim is made before its deadline (``_slotmemory.claim_deadline_ms``): a slot that
      fell due before a raise from ``m`` (within the clocks' skew) is claimed at most ``m``
      late, one that fell due before the record was made not late at all (fail closed,
      ``BackendError``: the slot is skipped), never twice.
    * A record gone (deleted by hand, lost by Redis) is made again by the next claim, from
      this instance's ``slot_ttl``, never from the memory it believed: deleting it is how the
      fleet's memory is lowered (deploy the shorter ``slot_ttl`` everywhere, then ``DEL
      <prefix>:slot-memory``); instances with a longer ``slot_ttl`` raise it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..._durations import to_ms
from ..._exceptions import BackendError
from ..._slotmemory import BOOT_MEMORY, FleetMemory, claim_deadline_ms
from ...abc import Claim, Slot
from .._claims import ClaimBackendBase, shown
from ._keys import claim_key, evictions_key
from ._link import RedisLink

__all__ = ["SlotMemoryClaims", "slot_memory_key"]

logger = logging.getLogger("brokersched.backends.redis")


def slot_memory_key(prefix: str) -> str:
    """``<prefix>:slot-memory``: the fleet's slot memory record (no job has a key without a
    ``{``, so it can never be a job's)."""
    return f"{prefix}:slot-memory"


def _parse(
    memory: bytes | str | None, raises: bytes | str | None, created: bytes | str | None
) -> FleetMemory | None:
    """The record as ``HMGET memory_ms raises created_ms`` reads it; ``None``: no record. A
    record of a release that did not note its creation counts as made at the epoch."""
    if memory is None:
        return None
    entries = json.loads(raises or "[]") or []
    pairs = tuple((int(at), int(frm)) for at, frm in entries)
    return FleetMemory(int(memory), int(created or 0), pairs)


class SlotMemoryClaims(ClaimBackendBase):
    """A claim backend whose claims are ``SET NX PX`` scripts with the fleet's slot memory
    (see the module's docstring); ``RedisBackend`` is one over its connection."""

    _redis: RedisLink

    def _setup_claims(self) -> None:
        self._memory: FleetMemory | None = None
        self._raising: asyncio.Lock = asyncio.Lock()
        # When (this instance's clock) the record was last read, as sent: a claim of a slot
        # that fell due max_clock_skew before that needs no read of its own.
        self._read_sent_ms = -(2**63)

    @property
    def fleet_slot_memory(self) -> timedelta | None:
        """How long Redis remembers a claimed slot for the whole fleet of this prefix (the
        longest ``slot_ttl`` among its instances, as last read); ``None`` until started."""
        memory = self._memory
        return None if memory is None else timedelta(milliseconds=memory.memory_ms)

    async def _raise_memory(self) -> FleetMemory:
        """Make the record, or raise it to this instance's slot_ttl; the record as it is
        afterwards."""
        async with self._raising:
            sent_ms = self._redis.now_ms()
            memory, raises, created, before = await self._redis.script(
                "FLEET_MEMORY",
                "read the fleet's slot memory",
                [slot_memory_key(self._redis.prefix)],
                [to_ms(self._slot_ttl), self._skew_ms],
            )
        record = _parse(memory, raises, created)
        assert record is not None
        self._read_sent_ms = max(self._read_sent_ms, sent_ms)
        if 0 < int(before) < record.memory_ms:
            logger.warning(
                "%s raised the slot memory of the fleet of prefix %r from %s to %s: slots that "
                "fell due before are claimed at most %s late (to lower it again, deploy the "
                "shorter slot_ttl everywhere, then DEL %s)",
                self.name, self._redis.prefix, shown(int(before)), shown(record.memory_ms),
                shown(int(before)), slot_memory_key(self._redis.prefix),
            )  # fmt: skip
        return record

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        memory = self._memory
        if memory is None:
            return super().claim_deadline_ms(slot)
        return claim_deadline_ms(memory, slot.slot_ms, skew_ms=self._skew_ms)

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        """See ``ClaimBackend.claim``; across a change of the fleet's slot memory, two claims
        of a slot never both win (see the module's docstring)."""
        return _one(await self._claim([(slot, run_id)], instance_id, timeout, memory_ms=None))

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        """A boot window's claim: its key lives ``BOOT_MEMORY`` at least."""
        boot = to_ms(BOOT_MEMORY)
        return _one(await self._claim([(slot, run_id)], instance_id, timeout, memory_ms=boot))

    async def claim_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[bool | Exception]:
        """One pipelined round trip: a claim's script per claim, after a read of the fleet's slot
        memory unless it is known for every slot (as ``claim()`` does for each)."""
        pairs = [(claim.slot, claim.run_id) for claim in claims]
        return await self._claim(pairs, instance_id, timeout, memory_ms=None)

    async def _claim(
        self,
        claims: list[tuple[Slot, str]],
        instance_id: str,
        timeout: float,
        *,
        memory_ms: int | None,
    ) -> list[bool | Exception]:
        """Claim each slot (``memory_ms``: the least its key lives, beside the fleet's); one
        error raised for a single claim, per claim for several.

        The record is read first when this instance last read it too early to know what it
        says of these slots: a claim decided on an outdated view (a record made again with a
        shorter memory meanwhile) could win a slot whose first claim Redis has forgotten
        already, and run it twice. The read and the claims are then two round trips; a
        raise between them only limits these slots to the memory they are claimed with."""
        if self._memory is None:
            raise BackendError(f"{self.name} is not started")
        if (budget := self._redis.budget) is not None and budget.shedding:
            what = "claim of " + (claims[0][0].key if len(claims) == 1 else f"{len(claims)} slots")
            error = budget.shed_error(f"the {what} is not made")
            if len(claims) == 1:
                raise error
            return [error for _ in claims]
        known = self._read_sent_ms - self._skew_ms
        if memory_ms is None and any(slot.slot_ms > known for slot, _ in claims):
            began = self._redis.now_ms()
            await self._read_record(timeout)
            timeout = max(timeout - (self._redis.now_ms() - began) / 1000, 0.0)
        memory = self._memory
        assert memory is not None
        px = max(memory.memory_ms, memory_ms or 0)
        # The earliest a claim of the slot can have been made (the eviction guard's window): a
        # boot window is claimed within BOOT_MEMORY before the instant that names it.
        before_ms = self._skew_ms + (0 if memory_ms is None else to_ms(BOOT_MEMORY))
        outcomes: list[bool | Exception] = []
        sent: list[tuple[int, Slot]] = []  # (index, slot)
        calls: list[tuple[list[str], list[str | int]]] = []
        for n, (slot, run_id) in enumerate(claims):
            try:
                if memory_ms is None:
                    self._refuse_too_late(memory, slot, self._redis.now_ms(), _FORGOTTEN)
            except BackendError as exc:
                if len(claims) == 1:
                    raise
                outcomes.append(exc)
                continue
            outcomes.append(False)
            value = json.dumps({"instance_id": instance_id, "run_id": run_id}, separators=_COMPACT)
            keys = [
                claim_key(self._redis.prefix, slot),
                evictions_key(self._redis.prefix, slot.job),
            ]
            calls.append((keys, [value, px, slot.slot_ms - before_ms]))
            sent.append((n, slot))
        if not sent:
            return outcomes
        action = f"claim {claims[0][0].key}" if len(claims) == 1 else f"claim {len(sent)} slots"
        try:
            answers = await self._redis.scripts("CLAIM", action, calls, timeout)
        except BackendError as exc:
            if len(claims) == 1:
                raise
            for n, _ in sent:
                outcomes[n] = exc
            return outcomes
        for (n, slot), answer in zip(sent, answers, strict=True):
            failed = (
                BackendError(f"{self.name} could not claim {slot.key}: {answer}")
                if isinstance(answer, Exception)
                else self._redis.refusal(answer, f"the claim of {slot.key}")
            )
            if failed is not None and len(claims) == 1:
                raise failed
            outcomes[n] = failed if failed is not None else answer[0] == b"won"
        return outcomes

    async def _read_record(self, timeout: float) -> None:
        """Read the fleet's record; adopt what changed (made again, raised, gone)."""
        record = slot_memory_key(self._redis.prefix)
        sent_ms = self._redis.now_ms()

        async def read(client: Any) -> FleetMemory | None:
            pipe = client.pipeline(transaction=False)
            pipe.hmget(record, "memory_ms", "raises", "created_ms")
            (fields,) = await pipe.execute()
            return _parse(*fields)

        seen = await self._redis.call(f"read {record}", read, timeout)
        self._read_sent_ms = max(self._read_sent_ms, sent_ms)
        if seen != self._memory:
            await self._adopt(seen)

    async def _adopt(self, seen: FleetMemory | None) -> None:
        """The record changed: raised by another instance (adopted), made again by another
        instance (adopted, raised to this slot_ttl if longer), or gone (made again)."""
        if seen is not None and seen.memory_ms >= to_ms(self._slot_ttl):
            believed = self._memory
            self._memory = seen
            if believed is None or seen.memory_ms != believed.memory_ms:
                logger.info(
                    "%s: the fleet of prefix %r now remembers claimed slots for %s",
                    self.name, self._redis.prefix, shown(seen.memory_ms),
                )  # fmt: skip
            return
        if seen is not None:
            self._memory = seen  # until raised: its shorter deadlines are the safe ones
        try:
            self._memory = await self._raise_memory()
        except BackendError:  # the next claim tries again
            logger.warning("%s could not restore the fleet's slot memory", self.name)


_COMPACT = (",", ":")
_FORGOTTEN = (
    ", so an instance may have claimed it under a memory that has forgotten it (or will "
    "before this claim lands)"
)


def _one(outcomes: list[bool | Exception]) -> bool:
    """A single claim's outcome (its error was raised already)."""
    assert isinstance(outcomes[0], bool)
    return outcomes[0]

"""RedisBackend: claim-only, one ``SET key value NX PX <memory>`` per slot.

One slot memory per fleet (as RabbitMQ's issue 18)
    A claim key lives as long as its *winner* said. Were that each instance's own
    ``slot_ttl``, an instance with 2s would win a slot, Redis would forget it 2s later, and an
    instance with 20s, later by jitter but within its larger ``max_late``, would win it again.
    So every instance of a prefix claims with the *fleet's* slot memory, the longest
    ``slot_ttl`` among them, kept in ``<prefix>:slot-memory`` (a hash: ``memory_ms`` and the
    recent raises):

    * ``start()`` adopts the record's memory when it is longer than ``slot_ttl``, and raises
      it (``FLEET_MEMORY``, one script) when ``slot_ttl`` is longer; no record: it makes it.
    * A claim reads the record in the same round trip (a pipeline: ``HMGET`` then the
      ``SET``) unless this instance read it after the slot fell due already (the common case
      when several jobs share an instant; a claim is then the ``SET`` alone). The read comes
      after the slot's instant, and the memory only grows; so if it shows the memory the
      ``SET`` used, that memory was at least the fleet's when the slot fell due. If it shows a
      longer one (a raise this instance had not seen), a claim that won extends its key to it
      (``PEXPIRE``) and the instance adopts it for later claims.
    * A raise at ``R`` from ``m``: a slot that fell due before ``R`` may have been claimed under
      ``m``, so it is claimed at most ``m`` late (less a margin for the clocks); later than
      that the claim fails closed (``BackendError``, the slot is skipped), never wins twice.
    * Lowering: an instance with a shorter ``slot_ttl`` keeps the fleet's longer memory. To
      lower it, deploy the shorter ``slot_ttl`` everywhere, then delete ``<prefix>:slot-memory``
      (the next start makes it again from the instances' own ``slot_ttl``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..._clock import Clock
from ..._durations import Duration, format_duration, positive_duration, to_ms
from ..._exceptions import BackendError
from ...abc import Capabilities, Claim, ClaimBackend, JobPolicy, RunRecord, Slot
from ._base import RedisConnection, claim_key

__all__ = ["RedisBackend", "slot_memory_key"]

logger = logging.getLogger("brokersched.backends.redis")

#: How far the instances' clocks and the server's may disagree when a raise and a slot are
#: compared (claim-only backends need NTP anyway).
_CLOCK_MARGIN_MS = 250


def slot_memory_key(prefix: str) -> str:
    """``<prefix>:slot-memory``: the fleet's slot memory record (no job has a key without a
    ``{``, so it can never be a job's)."""
    return f"{prefix}:slot-memory"


@dataclass(frozen=True, slots=True)
class _Memory:
    """The fleet's slot memory as last read: ``raises`` are ``(at_ms, from_ms)``."""

    memory_ms: int
    raises: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, memory: bytes | str | None, raises: bytes | str | None) -> _Memory | None:
        if memory is None:
            return None
        entries = json.loads(raises or "[]")
        pairs = tuple((int(at), int(frm)) for at, frm in entries) if entries else ()
        return cls(int(memory), pairs)

    def claim_limit_ms(self, slot_ms: int) -> int | None:
        """How late ``slot_ms`` may be claimed when a shorter memory may have applied to it
        (the shortest raised from after it fell due); ``None``: no such limit."""
        shorter = [frm for at, frm in self.raises if at > slot_ms - _CLOCK_MARGIN_MS]
        return min(shorter) if shorter else None


class RedisBackend(ClaimBackend):
    """Claims slots in Redis: the first ``SET <prefix>:{<job>}:claim:<slot_ms> ... NX PX
    <slot_ttl>`` of a slot wins; Redis forgets the slot ``slot_ttl`` later (on its own clock).

    ``url``: ``redis://``, ``rediss://`` (TLS) or ``unix://``; its password never appears in a
    log, an error or ``repr``. ``cluster=True``: a Redis Cluster (``redis.asyncio.cluster``),
    reached through any of its nodes. ``require_persistence``: refuse to start on a server
    without an append-only file (by default a warning is logged). Other keyword arguments go to
    redis-py's ``from_url`` (``ssl_ca_certs``, ``max_connections``, ``username``...).
    History: a list per job, trimmed to ``history_size`` (and ``history_ttl``) on each write.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        slot_ttl: Duration = "5m",
        prefix: str = "brokersched",
        cluster: bool = False,
        require_persistence: bool = False,
        **client_options: Any,
    ) -> None:
        super().__init__()
        self._slot_ttl = positive_duration(slot_ttl, option="slot_ttl", backend=self.name)
        self._memory: _Memory | None = None
        self._raising: asyncio.Lock = asyncio.Lock()
        # When (this instance's clock) the record was last read, as sent: a claim of a slot
        # that fell due before that needs no read of its own.
        self._read_sent_ms = -(2**63)
        self._redis = RedisConnection(
            self.name,
            url,
            prefix=prefix,
            cluster=cluster,
            require_persistence=require_persistence,
            client_options=client_options,
        )

    def __repr__(self) -> str:
        cluster = ", cluster=True" if self._redis.cluster else ""
        return (
            f"{self.name}({self._redis.redacted!r}, slot_ttl="
            f"{format_duration(self._slot_ttl)!r}, prefix={self.prefix!r}{cluster})"
        )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            leases=False, slot_memory=self._slot_ttl, history_ttl=True, history_size_per_job=True
        )

    @property
    def slot_ttl(self) -> timedelta:
        return self._slot_ttl

    @property
    def prefix(self) -> str:
        return self._redis.prefix

    @property
    def fleet_slot_memory(self) -> timedelta | None:
        """How long Redis remembers a claimed slot for the whole fleet of this prefix (the
        longest ``slot_ttl`` among its instances, as last read); ``None`` until started."""
        memory = self._memory
        return None if memory is None else timedelta(milliseconds=memory.memory_ms)

    async def _open(self, clock: Clock) -> None:
        await self._redis.open(clock)
        try:
            self._memory = await self._raise_memory()
        except BaseException:
            await self._redis.close()
            raise
        fleet = self._memory.memory_ms
        if fleet > to_ms(self._slot_ttl):
            logger.info(
                "%s: the fleet of prefix %r remembers claimed slots for %s, longer than this "
                "instance's slot_ttl %s: claims use the fleet's (to lower it, deploy the "
                "shorter slot_ttl everywhere, then DEL %s)",
                self.name, self.prefix, _shown(fleet), format_duration(self._slot_ttl),
                slot_memory_key(self.prefix),
            )  # fmt: skip

    async def _close(self) -> None:
        await self._redis.close()
        self._memory = None
        self._read_sent_ms = -(2**63)

    async def _raise_memory(self) -> _Memory:
        """Make the record at least this instance's slot_ttl and what it believed (a record
        lost by Redis, or made again smaller); the record as it is afterwards."""
        async with self._raising:
            sent_ms = self._redis.now_ms()
            believed = self._memory.memory_ms if self._memory is not None else ""
            memory, raises, before = await self._redis.script(
                "FLEET_MEMORY",
                "read the fleet's slot memory",
                [slot_memory_key(self.prefix)],
                [to_ms(self._slot_ttl), believed],
            )
        record = _Memory.parse(memory, raises)
        assert record is not None
        self._read_sent_ms = max(self._read_sent_ms, sent_ms)
        if 0 < int(before) < record.memory_ms:
            logger.warning(
                "%s raised the slot memory of the fleet of prefix %r from %s to %s: slots that "
                "fell due before are claimed at most %s late (to lower it again, deploy the "
                "shorter slot_ttl everywhere, then DEL %s)",
                self.name, self.prefix, _shown(int(before)), _shown(record.memory_ms),
                _shown(int(before)), slot_memory_key(self.prefix),
            )  # fmt: skip
        return record

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        """See ``ClaimBackend.claim``; across a change of the fleet's slot memory, two claims
        of a slot never both win (see the module's docstring)."""
        memory = self._memory
        if memory is None:
            raise BackendError(f"{self.name} is not started")
        self._check_not_too_late(memory, slot)
        key = claim_key(self.prefix, slot)
        value = json.dumps({"instance_id": instance_id, "run_id": run_id}, separators=(",", ":"))
        if self._read_sent_ms >= slot.slot_ms + _CLOCK_MARGIN_MS:
            # The record was read after the slot fell due: its memory then is known.

            async def set_only(client: Any) -> bool:
                return await client.set(key, value, nx=True, px=memory.memory_ms) is True

            return await self._redis.call("claim " + slot.key, set_only, timeout)
        record = slot_memory_key(self.prefix)
        sent_ms = self._redis.now_ms()

        async def claim(client: Any) -> tuple[bool, _Memory | None]:
            pipe = client.pipeline(transaction=False)
            pipe.hmget(record, "memory_ms", "raises")
            pipe.set(key, value, nx=True, px=memory.memory_ms)
            (seen_memory, seen_raises), won = await pipe.execute()
            seen = _Memory.parse(seen_memory, seen_raises)
            if won is True and seen is not None and seen.memory_ms > memory.memory_ms:
                await client.pexpire(key, seen.memory_ms)  # a raise we had not seen
            return won is True, seen

        won, seen = await self._redis.call("claim " + slot.key, claim, timeout)
        if seen != memory:
            await self._adopt(memory, seen)
        else:
            self._read_sent_ms = max(self._read_sent_ms, sent_ms)
        return won

    async def claim_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[bool | Exception]:
        """One pipelined round trip: a ``SET NX`` per claim, after a read of the fleet's slot
        memory unless it is known for every slot (as ``claim()`` does for each)."""
        memory = self._memory
        if memory is None:
            raise BackendError(f"{self.name} is not started")
        outcomes: list[bool | Exception] = []
        sent: list[tuple[int, str, str]] = []  # (index, key, value)
        for n, claim in enumerate(claims):
            try:
                self._check_not_too_late(memory, claim.slot)
            except BackendError as exc:
                outcomes.append(exc)
                continue
            outcomes.append(False)
            value = json.dumps(
                {"instance_id": instance_id, "run_id": claim.run_id}, separators=(",", ":")
            )
            sent.append((n, claim_key(self.prefix, claim.slot), value))
        if not sent:
            return outcomes
        known = self._read_sent_ms - _CLOCK_MARGIN_MS
        read = any(claims[n].slot.slot_ms > known for n, _, _ in sent)
        record = slot_memory_key(self.prefix)
        sent_ms = self._redis.now_ms()

        async def set_all(client: Any) -> tuple[list[Any], _Memory | None]:
            pipe = client.pipeline(transaction=False)
            if read:
                pipe.hmget(record, "memory_ms", "raises")
            for _, key, value in sent:
                pipe.set(key, value, nx=True, px=memory.memory_ms)
            answers: list[Any] = await pipe.execute(raise_on_error=False)
            if not read:
                return answers, memory
            seen_record = answers.pop(0)
            if isinstance(seen_record, Exception):
                raise seen_record  # the claims' answers are not definite without it
            seen = _Memory.parse(*seen_record)
            if seen is not None and seen.memory_ms > memory.memory_ms:  # a raise not seen
                won = [key for (_, key, _), answer in zip(sent, answers, strict=True) if answer]
                if won:
                    again = client.pipeline(transaction=False)
                    for key in won:
                        again.pexpire(key, seen.memory_ms)
                    await again.execute()
            return answers, seen

        try:
            answers, seen = await self._redis.call(f"claim {len(sent)} slots", set_all, timeout)
        except BackendError as exc:
            for n, _, _ in sent:
                outcomes[n] = exc
            return outcomes
        if seen != memory:
            await self._adopt(memory, seen)
        elif read:
            self._read_sent_ms = max(self._read_sent_ms, sent_ms)
        for (n, key, _), answer in zip(sent, answers, strict=True):
            if isinstance(answer, Exception):
                outcomes[n] = BackendError(f"{self.name} could not claim {key}: {answer}")
            else:
                outcomes[n] = answer is True
        return outcomes

    def _check_not_too_late(self, memory: _Memory, slot: Slot) -> None:
        """Only for claims within this instance's own slot_ttl after the slot (the
        scheduler's range)."""
        late_ms = self._redis.now_ms() - slot.slot_ms
        if not 0 <= late_ms < to_ms(self._slot_ttl):
            return
        limit = memory.claim_limit_ms(slot.slot_ms)
        if limit is None or late_ms < limit - _CLOCK_MARGIN_MS:
            return
        raise BackendError(
            f"{self.name}: slot {slot.key} is too late to claim safely: the fleet's slot memory "
            f"was {_shown(limit)} when it fell due (raised to {_shown(memory.memory_ms)} since), "
            "so an instance may have claimed it under the shorter memory, which has already "
            "forgotten it; the slot is not run here"
        )

    async def _adopt(self, believed: _Memory, seen: _Memory | None) -> None:
        """The record changed (raised by another instance), or is gone or lower (a Redis that
        lost it): adopt a longer memory, restore a lost or lowered record."""
        if seen is not None and seen.memory_ms >= believed.memory_ms:
            self._memory = seen
            if seen.memory_ms > believed.memory_ms:
                logger.info(
                    "%s: the fleet of prefix %r now remembers claimed slots for %s",
                    self.name, self.prefix, _shown(seen.memory_ms),
                )  # fmt: skip
            return
        try:
            self._memory = await self._raise_memory()
        except BackendError:  # the next claim tries again
            logger.warning("%s could not restore the fleet's slot memory", self.name)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self._redis.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await self._redis.history(job, limit)


def _shown(ms: int) -> str:
    return format_duration(timedelta(milliseconds=ms))

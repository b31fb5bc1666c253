"""The fleet's slot memory: how long the claim queues of every instance of a prefix remember
a claimed slot.

One slot memory per fleet
    A claim queue keeps the ``x-expires`` of whoever declared it first. Were that each
    instance's own ``slot_ttl``, an instance with 2s would win a slot, its queue would vanish
    after 2s, and an instance with 20s, later by jitter but within its larger ``max_late``,
    would win the slot again. So every instance of a prefix uses the *fleet's* slot memory:

    * The record: a durable queue ``<prefix>.slot-memory`` holding one JSON message, the slot
      memory (the longest ``slot_ttl`` seen since the record was created), when the record was
      created and when it was raised from what. It is read and written only under a lock, an
      exclusive consumer on ``<prefix>.slot-memory.lock`` (released when its channel closes,
      also when the holder's connection dies): instances starting together queue up.
    * ``start()`` adopts the record when its ``slot_ttl`` is not longer (a longer memory is
      always safe), and makes it when there is none. A longer ``slot_ttl`` raises the record,
      but only once the instance will claim: in ``prepare()`` (the scheduler calls it with its
      jobs before it arms any), else at its first claim. A script that only reads history
      with the default ``slot_ttl`` never raises a fleet's memory.
    * The fence: a durable exchange ``<prefix>.slot-memory.<ms>ms`` per slot memory, bound to
      the record queue (auto-delete: deleting the record queue deletes every fence). A raise
      creates the new fence and deletes the old one before it writes the record. Every claim
      checks its view's fence first (a passive declare, after the slot's instant): an instance
      whose view was overtaken gets ``404`` before it declares anything, reads the record
      again and claims with the new memory. A rolling deploy that raises ``slot_ttl`` needs
      no downtime and no operator step.
    * Why that is enough: a claim made under memory ``m`` saw the fence of ``m`` after the
      slot's instant, so that slot fell due before ``m`` was raised. The record keeps the
      recent raises; an instance claims a slot that fell due before a raise from ``m`` at most
      ``m`` late (a little less), and a slot that fell due before the record was (re)created
      not at all when late: while a queue made under ``m`` can still exist it sees it
      (declaring with another ``x-expires`` gets ``406``; a queue that holds a claim is a
      loss, an empty one fails closed), and later it does not claim. So two claims of a slot
      never both win, however the instances' starts interleave with the raise. (This holds
      for claims made at or after the slot's instant, as the scheduler makes them, on clocks
      that agree, as the scheduler already requires.)
    * No claim of a slot the broker may have forgotten: a claim queue may expire once the slot
      is the fleet's memory old, and a claim then would win a slot that already ran. So every
      claim, ``claim()`` called directly included, must be done (its declare and publish) before
      the slot is the memory minus 1 s old, else it is refused (``BackendError``: the
      scheduler skips the slot with ``backend-error``). The scheduler itself never claims that
      late: ``jitter + max_late`` stay below ``slot_ttl`` and its claims stop 1 s before.
    * Lowering: an instance with a shorter ``slot_ttl`` keeps the fleet's longer memory. To
      lower it, deploy the shorter ``slot_ttl`` everywhere, then delete the record queue
      (``rabbitmqctl delete_queue <prefix>.slot-memory``): every fence goes with it, the
      next claims find no fence, and the record is made again from the ``slot_ttl`` of the
      instances still running (the longest wins again). Slots falling due around that moment
      may be skipped (``backend-error``), never run twice.
    * Instances of brokersched before this scheme know nothing of the record or the fences:
      change ``slot_ttl`` only once every instance runs a version that does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ... import _redact
from ..._clock import Clock
from ..._durations import format_duration, to_ms
from ..._exceptions import BackendError
from ..._slotmemory import FleetMemory
from .._claims import shown
from ._connection import OPERATION_TIMEOUT_S, retrieve
from ._names import fence_exchange_name, lock_queue_name, record_queue_name

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
    from pamqp.common import FieldTable

__all__ = [
    "NewerRecord",
    "SideChannels",
    "SlotMemory",
    "View",
    "held_lock",
    "memory_of",
    "record_from_json",
    "record_json",
    "shown",
    "take_lock",
]

_log = logging.getLogger("brokersched.backends.rabbitmq")

#: A short-lived channel off the pool (``confirms``: in publisher-confirm mode).
SideChannels = Callable[..., AbstractAsyncContextManager["AbstractChannel"]]

_LOCK_RETRY_S = (0.01, 0.1)  # another instance holds the slot-memory lock: wait this long
_RECORD_VERSION = 1
_PLAIN: FieldTable = {"x-queue-type": "classic"}  # a vhost may default to quorum queues


def record_json(record: FleetMemory) -> bytes:
    return json.dumps(
        {"version": _RECORD_VERSION, **record.to_dict()}, separators=(",", ":")
    ).encode()


def record_from_json(body: bytes) -> FleetMemory:
    """Raises ``ValueError`` for what is not a record, ``NewerRecord`` for a record of a later
    version."""
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    version = data.get("version")
    if version != _RECORD_VERSION:
        if isinstance(version, int) and version > _RECORD_VERSION:
            raise NewerRecord(version)
        raise ValueError(f"unknown version {version!r}")
    return FleetMemory.from_dict(data)


class NewerRecord(Exception):
    """The record was written by a later brokersched (its format version)."""


@dataclass(frozen=True, slots=True)
class View:
    """What this instance believes the fleet's slot memory is, and the fence that proves it."""

    record: FleetMemory
    fence: str
    claim_arguments: FieldTable


def memory_of(body: bytes) -> int:
    """The memory of a slot memory record (``ValueError`` for anything else)."""
    try:
        return record_from_json(body).memory_ms
    except NewerRecord as exc:
        raise ValueError(str(exc)) from None


class SlotMemory:
    """This instance's view of the fleet's slot memory: read at start, raised to this
    ``slot_ttl`` before the first claim, read again when a claim finds its view stale. The only
    owner of the view."""

    def __init__(
        self,
        backend: str,
        prefix: str,
        slot_ttl: timedelta,
        skew_ms: int,
        *,
        channels: SideChannels,
        errors: Callable[[str], AbstractContextManager[None]],
        describe: Callable[[BaseException], str],
        secrets: Sequence[str],
    ) -> None:
        self._backend = backend
        self._prefix = prefix
        self._slot_ttl = slot_ttl
        self._skew_ms = skew_ms
        self._channels = channels
        self._errors = errors
        self._describe = describe
        self._secrets = secrets
        self._clock: Clock | None = None  # set by open()
        self._opened = False
        self.view: View | None = None  # the fleet's slot memory, as read at start or since
        self.seen_ms: int | None = None  # the record's memory when it could not be adopted
        self._refreshing: asyncio.Task[View] | None = None

    def open(self, clock: Clock) -> None:
        self._clock, self._opened = clock, True

    async def close(self) -> None:
        refreshing = self._refreshing
        self.view = self._refreshing = None
        self.seen_ms, self._opened = None, False
        if refreshing is not None and not refreshing.done():
            refreshing.cancel()
            await asyncio.gather(refreshing, return_exceptions=True)

    @property
    def memory_ms(self) -> int | None:
        """The fleet's memory as last read (``None`` before ``start()``)."""
        return self.view.record.memory_ms if self.view is not None else self.seen_ms

    async def require_view(self) -> View:
        """The current view; the record is raised by the first claim of an instance whose
        ``prepare()`` did not already raise it."""
        return self.view if self.view is not None else await self.refresh(None)

    async def refresh(self, seen: View | None) -> View:
        """The view after reading the record again, unless it changed since ``seen`` (then the
        current one). One reading at a time per backend; a claim that stops waiting (its
        deadline) does not cut it short: a reading cut half-way could leave a raise undone."""
        if self.view is not seen and self.view is not None:
            return self.view
        task = self._refreshing
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._settled())
            task.add_done_callback(retrieve)
            self._refreshing = task
        return await asyncio.shield(task)

    async def _settled(self) -> View:
        view = await self.read(write=True)
        assert view is not None
        return view

    async def read(self, *, write: bool) -> View | None:
        """Read the record, or make it if there is none: the view, or ``None`` while the record
        is shorter than this ``slot_ttl``. Only with ``write`` is it raised: an instance that
        only reads history, say, never raises the fleet's memory."""
        action = (
            f"reading the fleet's slot memory (queue {self._record_name!r}, under the lock"
            f" {lock_queue_name(self._prefix)!r} that instances take in turn)"
        )
        from aio_pika.exceptions import ChannelPreconditionFailed

        with self._errors(action):
            try:
                async with asyncio.timeout(OPERATION_TIMEOUT_S):
                    view = await self._settle(write=write)
            except ChannelPreconditionFailed as exc:
                raise BackendError(
                    f"{self._backend}: {action} failed: a queue of it exists with other arguments"
                    f" ({self._describe(exc)}), made by something other than brokersched (a"
                    " policy does not do this). Delete it (rabbitmqctl delete_queue NAME):"
                    " brokersched makes it again, and the fleet's slot memory from the"
                    " instances' slot_ttl"
                ) from _redact.chainable(exc, self._secrets)
        if view is None:
            return None
        if view == self.view:
            return self.view  # unchanged: claims in flight keep a view that is still current
        if self._opened:  # not stopped meanwhile
            self.view = view
        return view

    @property
    def _record_name(self) -> str:
        return record_queue_name(self._prefix)

    async def _settle(self, *, write: bool) -> View | None:
        """Under the lock: read the record; adopt it, raise it to this ``slot_ttl``, or make it."""
        own = to_ms(self._slot_ttl)
        async with self._fleet_lock() as channel:
            records = await channel.declare_queue(self._record_name, durable=True, arguments=_PLAIN)
            count = records.declaration_result.message_count or 0
            message = await records.get(no_ack=False, fail=False) if count else None
            try:
                record = self._parse_record(message.body if message else None, count)
            except BackendError:  # a later version's record: back in its queue, as it was
                assert message is not None
                await self._put_back(channel, message)
                raise
            self.seen_ms = None if record is None else record.memory_ms
            if message is None or record is None:  # none yet, or unusable
                record = await self._make_record(channel, own)
            elif record.memory_ms >= own:
                await self._put_fence(channel, records, record.memory_ms)  # back if deleted
                await self._put_back(channel, message)
                self._log_adopted(record)
            elif not write:
                await self._put_back(channel, message)
                return None
            else:
                record = await self._raise(channel, records, message, record, own)
        return self._view_of(record)

    async def _make_record(self, channel: AbstractChannel, own_ms: int) -> FleetMemory:
        """A new record of this ``slot_ttl``, with no fence left over from before (deleting the
        record queue deletes them all)."""
        assert self._clock is not None
        await channel.queue_delete(self._record_name)
        records = await channel.declare_queue(self._record_name, durable=True, arguments=_PLAIN)
        record = FleetMemory(own_ms, self._clock.now_ms())  # after every old fence went
        await self._put_fence(channel, records, own_ms)
        await self._write_record(channel, record)
        return record

    async def _put_back(self, channel: AbstractChannel, message: AbstractIncomingMessage) -> None:
        await message.reject(requeue=True)
        # A queue answers in order: once this passive declare returns, the record is back in
        # its queue, before the lock goes with the channel.
        await channel.declare_queue(self._record_name, passive=True)

    async def _raise(
        self,
        channel: AbstractChannel,
        records: AbstractQueue,
        message: AbstractIncomingMessage,
        record: FleetMemory,
        own_ms: int,
    ) -> FleetMemory:
        assert self._clock is not None
        await self._put_fence(channel, records, own_ms)
        # From here on no claim under the old memory passes its fence: a slot falling due now
        # or later can only be claimed under the new one. The record keeps when this was.
        await channel.exchange_delete(fence_exchange_name(self._prefix, record.memory_ms))
        raised = record.raised(own_ms, self._clock.now_ms(), self._skew_ms)
        await message.ack()  # a crash before the write leaves no record: the next one resets
        await self._write_record(channel, raised)
        self._log_raised(record.memory_ms)
        return raised

    async def _write_record(self, channel: AbstractChannel, record: FleetMemory) -> None:
        from aio_pika import DeliveryMode, Message

        message = Message(
            record_json(record),
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
        )
        await channel.default_exchange.publish(message, self._record_name, mandatory=True)

    def _parse_record(self, body: bytes | None, count: int) -> FleetMemory | None:
        if body is None:
            return None
        try:
            record = record_from_json(body)
        except NewerRecord as exc:
            raise BackendError(
                f"{self._backend}: queue {self._record_name!r} holds a slot memory record of format"
                f" version {exc.args[0]}, written by a later brokersched: upgrade this instance"
            ) from None
        except (ValueError, TypeError, KeyError, IndexError):
            _log.warning(
                "queue %r holds a message that is not a slot memory record: made again",
                self._record_name,
            )
            return None
        if count > 1:
            _log.warning("queue %r holds %d records: made again", self._record_name, count)
            return None
        return record

    async def _put_fence(
        self, channel: AbstractChannel, records: AbstractQueue, memory_ms: int
    ) -> None:
        from aio_pika import ExchangeType

        fence = await channel.declare_exchange(
            fence_exchange_name(self._prefix, memory_ms),
            ExchangeType.DIRECT,
            durable=True,
            auto_delete=True,  # goes with the record queue's binding
        )
        await records.bind(fence, routing_key=self._record_name)

    def _view_of(self, record: FleetMemory) -> View:
        arguments: FieldTable = {
            "x-queue-type": "classic",
            "x-max-length": 1,
            "x-overflow": "reject-publish",
            "x-expires": record.memory_ms,
        }
        return View(record, fence_exchange_name(self._prefix, record.memory_ms), arguments)

    def _log_adopted(self, record: FleetMemory) -> None:
        previous = self.view.record.memory_ms if self.view is not None else None
        own = to_ms(self._slot_ttl)
        if record.memory_ms == own or record.memory_ms == previous:
            return
        _log.info(
            "%s: the fleet of prefix %r remembers claimed slots for %s (its record, queue %r),"
            " longer than this instance's slot_ttl %s: claims here use %s too (safe, it only"
            " keeps more claim queues alive). To lower it: give every instance the shorter"
            " slot_ttl, then delete the record (rabbitmqctl delete_queue %s)",
            self._backend,
            self._prefix,
            shown(record.memory_ms),
            self._record_name,
            format_duration(self._slot_ttl),
            shown(record.memory_ms),
            self._record_name,
        )

    def _log_raised(self, previous_ms: int) -> None:
        _log.warning(
            "%s: raised the slot memory of the fleet of prefix %r from %s to %s (this"
            " instance's slot_ttl): instances still on %s switch at their next claim, and a"
            " slot that fell due before now is claimed at most %s late. Claim queues now live"
            " %s (broker memory grows with it); to lower it again: give every instance the"
            " shorter slot_ttl, then delete the record (rabbitmqctl delete_queue %s)",
            self._backend,
            self._prefix,
            shown(previous_ms),
            format_duration(self._slot_ttl),
            shown(previous_ms),
            shown(previous_ms),
            format_duration(self._slot_ttl),
            self._record_name,
        )

    def _fleet_lock(self) -> AbstractAsyncContextManager[AbstractChannel]:
        return held_lock(self._channels, lock_queue_name(self._prefix), _LOCK_RETRY_S)


@contextlib.asynccontextmanager
async def held_lock(
    channels: SideChannels, name: str, retry_s: tuple[float, float]
) -> AsyncGenerator[AbstractChannel, None]:
    """A confirm channel holding the exclusive consumer of the lock queue ``name``; the lock
    goes when the channel closes (or its connection dies). Waits while another instance holds
    it, ``retry_s`` (a random pause within) between tries (the caller's deadline bounds the
    wait)."""
    while True:
        async with channels(confirms=True) as channel:
            lock = await channel.declare_queue(name, durable=True, arguments=_PLAIN)
            if await take_lock(lock):
                yield channel
                return
        await asyncio.sleep(random.uniform(*retry_s))


async def take_lock(lock: AbstractQueue) -> bool:
    """Take the fleet's lock: the exclusive consumer of the lock queue ``lock``, held by the
    channel it was declared on until that channel closes. ``False``: another instance holds it."""
    from aiormq.exceptions import ChannelAccessRefused

    async def ignore(message: AbstractIncomingMessage) -> None:
        """Nothing is ever published to the lock queue."""

    if lock.declaration_result.consumer_count:
        return False
    try:
        await lock.consume(ignore, exclusive=True)
    except ChannelAccessRefused:  # another instance got there first
        return False
    return True

"""RabbitMQ claims: a queue per slot that takes one message.

How a claim works
    Every slot gets its own durable classic queue ``<prefix>.claim.<job>.<slot_ms>`` declared
    with ``x-max-length=1``, ``x-overflow=reject-publish`` and ``x-expires`` = the fleet's slot
    memory (below). A claim publishes one persistent message to it through the default
    exchange, ``mandatory=True``, on a channel in publisher-confirm mode. The broker acks the
    first message (won) and nacks every later one while the queue holds it (lost). So a claim
    publishes *first*: a nack is the whole of a losing claim (one publish; no declare, which
    for a durable queue is a metadata transaction across a cluster), but for the first loss of
    a job and then one a minute, which declares the queue to check that brokersched made it
    (``_check_refusal``: a queue made beforehand by something else, holding a message, would
    refuse every claim of its slot, and nobody would say why). A publish that comes back
    unrouted (no queue yet, or its node is down) makes the claim check the fleet's fence
    exchange, declare the queue and publish again; one acked by an existing empty queue (its
    maker's publish still on the way) is checked with a declare of the queue (``406`` when it
    was made under another memory, or no message in it when it was deleted since: fail
    closed; an outdated view is read again and the check made under the new one, so a raise
    costs no run). The queue expires when nobody has declared
    it for the slot memory, so the slot is remembered that long after the claim that made it.
    Nothing ever consumes a claim queue: a message taken out of it would let the next publish
    in. The instance that won a job's slot declares the queue of the job's next slot half a
    second before it (``prepare_claims``, at most 750 ms before): the claims of the instant,
    often made all at once by every instance, then find it, and the broker creates no queue
    while they wait (a queue declared under a memory that changed before the instant makes its
    claims fail closed, as above; ``declare_ahead=False`` turns it off).

Why each detail (measured on RabbitMQ 3.10)
    * Classic, never quorum: quorum queues do not enforce ``reject-publish`` exactly and let
      two or more claims of one slot win. ``x-queue-type`` is set explicitly because a vhost may
      default to quorum queues.
    * Durable queue, persistent message: a transient queue vanishes with a broker restart, after
      which a late claimer would win a slot that already ran. The record, the lock and the
      fences are durable too; a broker that loses its definitions loses every claim anyway.
    * No ``x-message-ttl``: a late claimer would win once the message expired.
    * Nothing reads the message in a claim queue, not even to put it back: a queue's cap counts
      ready messages, so while one is out (a ``basic.get`` before its reject) the next claim's
      publish is acked, and that claim wins the slot a second time (measured on 3.10).
      Brokersched tells its own queues from others by their arguments (a declare), never by
      what they hold.
    * A ``406`` names the first argument that differs: ``x-expires`` set on both sides is
      another slot memory (a fleet in a raise, or an older brokersched); anything else means
      brokersched did not make the queue, and the claim fails closed saying what differs.
    * ``mandatory=True``: without it a publish to a queue that does not exist (or expired
      between the declare and the publish) is acked, a false win. A returned message makes the
      claim declare the queue.
    * Plain channels on the robust connection, never robust channels: a robust channel would
      re-declare every slot queue it ever saw after a reconnect (a leak, and a way to
      resurrect a forgotten slot); a plain channel remembers nothing (what ``robust=False``
      does for one declare, for every declare).
    * A pool of channels, each used by one operation at a time: synchronous AMQP methods
      serialise per channel, and a channel error (``404`` from a fence that is gone, ``406``
      from a claim queue declared with another memory) closes only the channel it happened
      on, which the pool then replaces.

Failures
    A claim that gets no definite answer within its deadline, or whose connection drops after
    the publish left and before the confirm came back, raises ``BackendError``: the scheduler
    skips the slot (``backend-error``). An ambiguous claim may have won on the broker, in which
    case nobody runs the slot; it is never run twice. The connection is robust: it reconnects by
    itself and claims resume.

Broker cost
    One live queue per job per slot claimed within the fleet's slot memory: a job running every
    ``interval`` keeps about ``memory / interval + 1`` claim queues alive, each costing roughly
    30-37 KB of broker memory (measured on 3.10); on 4.x, which has no file-handle cache, each
    one also holds an open file of the node while it holds its persistent claim message (the
    budget watch counts them, ``_files``). Per prefix: the record and lock queues, one
    fence exchange and the history stream. Broker CPU (3.10, ``bench/bench_rabbitmq.py
    --cpu``): 4-5 ms per winning claim and 1.1-1.4 ms for its queue's expiry later, 0.35 ms
    per losing claim.

Overload
    A claim waits for one of the pool's ``channels``; one that finds none free within a quarter
    of ``claim_timeout`` is skipped (``BackendError``, "overloaded"): past what the broker can
    answer, slots are skipped at once instead of piling up and running late.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from ..._clock import Clock
from ..._durations import format_duration, to_ms
from ..._exceptions import BackendError
from ..._slotmemory import BOOT_MEMORY, DEFAULT_CLAIM_SKEW, margin_ms
from ...abc import Slot
from .._claims import ClaimBackendBase
from ._connection import OPERATION_TIMEOUT_S, ChannelPool, Overloaded
from ._names import claim_queue_name
from ._slotmemory import SlotMemory, View, shown

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractMessage
    from pamqp.common import FieldTable

    from ._budget import BudgetWatch

__all__ = [
    "ClaimAttempt",
    "ClaimQueues",
    "Inequivalent",
    "OtherMemory",
    "StaleView",
    "claim_margin_ms",
]

_log = logging.getLogger("brokersched.backends.rabbitmq")

_DECLARE_ATTEMPTS = 3  # a claim queue can expire between declare and publish; rarely twice
_VIEW_ATTEMPTS = 4  # a claim reads the record again at most this often (raises are rare)
_DEFAULT_SKEW_MS = to_ms(DEFAULT_CLAIM_SKEW)
# A boot window's claim queue (claim_boot): the fleet's memory does not apply to it.
_BOOT_QUEUE: FieldTable = {
    "x-queue-type": "classic",
    "x-max-length": 1,
    "x-overflow": "reject-publish",
    "x-expires": to_ms(BOOT_MEMORY),
}
# prepare_claims() declares a slot's claim queue at most this long (or a quarter of the slot
# memory) before the slot: the queue then expires at least memory minus that after the slot if
# its winner dies before its check renews it, so claims stop that much earlier too.
_PREPARED_AHEAD_MS = 750
# A claim refused at its first publish checks that the queue refusing it is brokersched's at most
# this often per job (see _check_refusal): the first loss of a job, then one a minute.
_REFUSAL_CHECK_EVERY_MS = 60_000


def _prepared_ahead_ms(memory_ms: int) -> int:
    return min(_PREPARED_AHEAD_MS, memory_ms // 4)


def claim_margin_ms(memory_ms: int, skew_ms: int = _DEFAULT_SKEW_MS) -> int:
    """How long before a slot is ``memory_ms`` (the memory that applies to it) old its claims
    are refused: the clocks' skew, a claim's flight and how long before its slot a claim queue
    may have been declared (``_claims.margin_ms``); 2 s with a memory of 8 s or more."""
    return margin_ms(memory_ms, skew_ms=skew_ms, lead_ms=_prepared_ahead_ms(memory_ms))


_HOME_NODE = re.compile(r"home node '([^']+)'")  # RabbitMQ's 404 for a queue on a down node


class StaleView(Exception):
    """The view's fence is gone: the record changed since this instance read it. ``acked``:
    this claim's message is in the claim queue already (an empty queue took it)."""

    def __init__(self, *, acked: bool = False) -> None:
        super().__init__(acked)
        self.acked = acked


class OtherMemory(Exception):
    """The claim queue exists with another ``x-expires`` (``406``); the broker's reply."""


# What a claim queue holds of the claim that declares it: "in-it" (an empty queue took this
# claim), "refused" (the queue refused it: it held a message already), "not-yet" (no queue
# took it: the claim declares the queue before it publishes again).
_Holds = Literal["in-it", "refused", "not-yet"]

# RabbitMQ's 406 for a declare that does not match the queue (rabbit_misc, 3.x and 4.x). It names
# the first argument that differs in its own order (durable, then x-expires before the others),
# quoting each side as 'v', "the value 'v' of type 't'", or none (not set).
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<argument>[^']+)' for queue '[^']*' in vhost '.*': received"
    r" (?P<ours>.+) but current is (?P<theirs>.+?)\s*$"
)
_QUOTED = re.compile(r"(?:the value )?'(?P<value>.*?)'(?: of type '[^']*')?")


@dataclass(frozen=True, slots=True)
class Inequivalent:
    """The difference a ``406`` names: ``ours`` what brokersched declared, ``theirs`` what the
    queue has (``None``: not set)."""

    argument: str
    ours: str | None
    theirs: str | None

    @classmethod
    def parse(cls, reply: str) -> Inequivalent | None:
        found = _INEQUIVALENT.search(reply)
        if found is None:
            return None
        return cls(found["argument"], _unquoted(found["ours"]), _unquoted(found["theirs"]))

    @property
    def other_memory(self) -> bool:
        """Only ``x-expires`` differs so far, and both sides set it: a queue of another slot
        memory, as an instance with another view (or an older brokersched) declares it."""
        return self.argument == "x-expires" and None not in (self.ours, self.theirs)

    def __str__(self) -> str:
        theirs = "not set there" if self.theirs is None else f"{self.theirs!r} there"
        ours = (
            "brokersched does not set it"
            if self.ours is None
            else f"brokersched's is {self.ours!r}"
        )
        return f"{self.argument} is {theirs}, {ours}"


def _unquoted(value: str) -> str | None:
    if value == "none":
        return None
    found = _QUOTED.fullmatch(value)
    return found["value"] if found else value


@dataclass(slots=True)
class ClaimAttempt:
    """``unconfirmed`` while a claim's publish may have reached the broker without its confirm
    reaching us: a failure then is ambiguous."""

    unconfirmed: bool = False


class ClaimQueues(ClaimBackendBase):
    """The claim protocol on per-slot queues; ``RabbitMQBackend`` supplies the connection and
    the configuration (set before its first claim)."""

    _prefix: str
    _claim_timeout: timedelta
    _channel_wait: float
    _declare_ahead: bool
    _memory: SlotMemory
    _clock: Clock | None
    _budget: BudgetWatch | None

    def __init__(self) -> None:
        super().__init__()
        # Per job key: when a queue that refused a claim of the job was last found brokersched's.
        self._refusals_checked: dict[str, int] = {}

    @abstractmethod
    def _require_pool(self) -> ChannelPool: ...

    @abstractmethod
    def _client_errors(self, action: str) -> AbstractContextManager[None]: ...

    @abstractmethod
    def _describe(self, exc: BaseException) -> str: ...

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        """See ``ClaimBackend.claim``. Across a change of the fleet's slot memory, two claims
        of a slot never both win as long as claims are made at or after the slot's instant
        (as the scheduler makes them); see the module's docstring."""
        pool = self._require_pool()
        queue = claim_queue_name(self._prefix, slot)
        body = json.dumps({"instance_id": instance_id, "run_id": run_id}).encode()
        deadline = min(timeout, self._claim_timeout.total_seconds())
        attempt = ClaimAttempt()
        try:
            with self._client_errors(f"claim of slot {slot.key}"):
                async with asyncio.timeout(deadline):
                    return await self._claim_in_view(pool, queue, slot, body, attempt)
        except BackendError as exc:
            if not attempt.unconfirmed:
                raise
            _log.warning(
                "claim of slot %s is ambiguous (no confirm from the broker): treated as not won,"
                " the slot is skipped",
                slot.key,
            )
            raise BackendError(
                f"{self.name}: claim of slot {slot.key} is ambiguous (the publish left but no"
                " confirm came back); the slot is not run"
            ) from exc

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        """A fleet boot window's claim: a claim queue of its own whose ``x-expires`` is
        ``BOOT_MEMORY`` whatever the fleet's slot memory (every instance declares it alike), so
        neither the fleet's record nor its fence is involved: the first message the queue takes
        wins, every later one is nacked."""
        from aio_pika import DeliveryMode, Message

        pool = self._require_pool()
        queue = claim_queue_name(self._prefix, slot)
        body = json.dumps({"instance_id": instance_id, "run_id": run_id}).encode()
        message = Message(
            body,
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=slot.key,
        )
        attempt = ClaimAttempt()
        deadline = min(timeout, self._claim_timeout.total_seconds())
        try:
            with self._client_errors(f"boot claim of {slot.key}"):
                async with asyncio.timeout(deadline), pool.channel(self._channel_wait) as channel:
                    for _ in range(_DECLARE_ATTEMPTS):
                        won = await self._publish(channel, queue, message, attempt)
                        if won is not None:
                            return won
                        self._refuse_if_shedding(f"boot claim queue {queue!r} is not declared")
                        await channel.declare_queue(queue, durable=True, arguments=_BOOT_QUEUE)
        except Overloaded as busy:
            raise BackendError(self._overloaded(slot, busy)) from None
        raise BackendError(f"{self.name}: boot claim queue {queue!r} kept vanishing")

    async def prepare_claims(self, slots: Sequence[Slot]) -> None:
        """Declare the claim queues of ``slots`` due within the next 750 ms (others are left to
        their claims), one after the other on one channel, if one is free: claims come first."""
        if not self._declare_ahead or not (self._budget is None or self._budget.at_ease):
            return
        pool, view = self._require_pool(), await self._memory.require_view()
        assert self._clock is not None
        now = self._clock.now_ms()
        queues = [
            claim_queue_name(self._prefix, slot)
            for slot in slots
            if 0 < slot.slot_ms - now <= _prepared_ahead_ms(view.record.memory_ms)
        ]
        if queues:
            with self._client_errors(f"preparing the claims of {len(queues)} slots"):
                async with asyncio.timeout(OPERATION_TIMEOUT_S), pool.channel(0) as channel:
                    for queue in queues:
                        await channel.declare_queue(
                            queue, durable=True, arguments=view.claim_arguments
                        )

    async def _claim_in_view(
        self, pool: ChannelPool, queue: str, slot: Slot, body: bytes, attempt: ClaimAttempt
    ) -> bool:
        """Claim under the current view; read the record again when the view proves stale."""
        acked = False  # this claim is in the queue, taken under a view that proved stale
        for _ in range(_VIEW_ATTEMPTS):
            view = await self._memory.require_view()
            window = asyncio.timeout(self._claim_budget(view, slot))
            try:
                async with window, pool.channel(self._channel_wait) as channel:
                    return await self._claim_on(
                        channel, queue, slot, body, attempt, view, acked=acked
                    )
            except Overloaded as busy:
                raise BackendError(self._overloaded(slot, busy)) from None
            except StaleView as stale:
                acked = acked or stale.acked
                await self._memory.refresh(view)
            except OtherMemory as other:
                if await self._memory.refresh(view) != view:
                    continue  # ours was the stale view: claim again under the new one
                if await self._held(pool, queue):
                    return False  # another instance's claim is in it: the slot is taken
                raise BackendError(
                    f"{self.name}: claim queue {queue!r} was declared with another slot memory"
                    f" ({other}); this instance uses the fleet's"
                    f" {shown(view.record.memory_ms)} (its own slot_ttl is"
                    f" {format_duration(self._slot_ttl)}). An instance with an outdated view"
                    " switches at its next claim; one of a brokersched version without the"
                    " fleet record must be upgraded before slot_ttl changes. The slot is not"
                    " run here"
                ) from None
            except TimeoutError:
                if not window.expired():
                    raise
                raise BackendError(self._too_late(view, slot)) from None
        raise BackendError(
            f"{self.name}: the fleet's slot memory kept changing during the claim of slot"
            f" {slot.key}; the slot is not run here"
        )

    def _refuse_if_shedding(self, what: str) -> None:
        """No new claim queue while the broker is near its budget (``_budget``)."""
        if self._budget is not None:
            self._budget.refuse_if_shedding(what)

    def _overloaded(self, slot: Slot, busy: Overloaded) -> str:
        return (
            f"{self.name}: overloaded: the claim of slot {slot.key} found none of the"
            f" {busy.size} channels free within {self._channel_wait * 1000:.0f} ms (a quarter"
            f" of claim_timeout; {busy.waiting} claims waiting): claims come faster than the"
            " broker answers, and this one is skipped rather than run late. See docs/backends.md,"
            " 'Broker cost and sizing (RabbitMQ)'"
        )

    def _claim_lead_ms(self) -> int:
        return _prepared_ahead_ms(to_ms(self._slot_ttl))

    def _claim_limit_ms(self, view: View, slot: Slot) -> int:
        """How late after its instant ``slot`` may still be claimed: the fleet's slot memory,
        or the shorter memory that may have applied to it (``FleetMemory.limit_ms``)."""
        return view.record.limit_ms(slot.slot_ms, self._skew_ms)

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        view = self._memory.view
        if view is None:
            return super().claim_deadline_ms(slot)
        limit = self._claim_limit_ms(view, slot)
        return slot.slot_ms + limit - claim_margin_ms(limit, self._skew_ms)

    def _claim_budget(self, view: View, slot: Slot) -> float:
        """Seconds left to claim ``slot`` safely: until it is the claim limit old, less a margin
        (the broker expires a claim queue on its own timer, not ours). Past that, the claim
        queue of an earlier claim may be gone, and this claim could win a slot that already ran:
        refused. The scheduler never claims that late (``jitter + max_late`` stay below
        ``slot_ttl``); this guards ``claim()`` called directly, and a claim held up in flight."""
        assert self._clock is not None
        limit_ms = self._claim_limit_ms(view, slot)
        left_ms = slot.slot_ms + limit_ms - claim_margin_ms(limit_ms, self._skew_ms)
        budget = (left_ms - self._clock.now_ms()) / 1000
        if budget <= 0:
            raise BackendError(self._too_late(view, slot))
        return budget

    def _too_late(self, view: View, slot: Slot) -> str:
        assert self._clock is not None
        age = shown(max(self._clock.now_ms() - slot.slot_ms, 0))
        limit = self._claim_limit_ms(view, slot)
        memory_ms = view.record.memory_ms
        margin = claim_margin_ms(memory_ms, self._skew_ms)
        old = self._clock.now_ms() - slot.slot_ms >= memory_ms - margin
        if old or limit == memory_ms:
            return (
                f"{self.name}: slot {slot.key} is {age} old, too late to claim safely: the"
                f" fleet's slot memory is {shown(memory_ms)}, and a claim queue may expire"
                f" from then on (this refuses claims from the memory minus a"
                f" {margin}ms margin), after which a claim could win a slot that"
                " already ran; the slot is not run here. The scheduler never claims this late"
                " (jitter + max_late stay below slot_ttl): a claim made by hand, or held up"
                " in flight"
            )
        return (
            f"{self.name}: slot {slot.key} is {age} old, too late to claim safely:"
            f" {self._forgotten(view.record, slot)}, so an"
            " instance may have claimed it under a shorter memory that has already forgotten"
            " it; the slot is not run here"
        )

    async def _claim_on(
        self,
        channel: AbstractChannel,
        queue: str,
        slot: Slot,
        body: bytes,
        attempt: ClaimAttempt,
        view: View,
        *,
        acked: bool,
    ) -> bool:
        """``acked``: the claim is in the queue already (taken under a view that proved stale):
        only its check, under this view, is left."""
        from aio_pika import DeliveryMode, Message
        from aio_pika.exceptions import ChannelNotFoundEntity

        message = Message(
            body,
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=slot.key,
        )
        # Publish first: a claim queue that exists answers by itself, so a losing claim costs
        # the broker one publish, not the declare of a durable queue (a metadata transaction
        # across the cluster). Only a claim finding no queue declares it.
        # A queue on a cluster node that is down returns the publish (NO_ROUTE, measured on
        # 3.10) like a missing one: the declare below then fails closed, naming the node.
        first = True if acked else await self._publish(channel, queue, message, attempt)
        if first is False:  # refused by the queue (reject-publish): it holds a message
            await self._check_refusal(channel, queue, slot, view)
            return False
        try:  # after the slot's instant: this view's memory was the fleet's when it fell due
            await channel.declare_exchange(view.fence, passive=True)
        except ChannelNotFoundEntity as exc:
            # Stale. A claim that an empty queue took is checked again under the new view: a
            # queue of the new memory holds it as it would hold a claim made under that view.
            raise StaleView(acked=first is True) from exc
        if first is True:  # an empty queue took it: one made under this view's memory?
            await self._declare_claim_queue(channel, queue, slot, view, holds="in-it")
            return True
        for _ in range(_DECLARE_ATTEMPTS):  # no queue yet: the first claim of the slot
            self._refuse_if_shedding(f"claim queue {queue!r} is not declared")
            await self._declare_claim_queue(channel, queue, slot, view, holds="not-yet")
            won = await self._publish(channel, queue, message, attempt)
            if won is not None:
                return won
        raise BackendError(
            f"{self.name}: claim queue {queue!r} vanished {_DECLARE_ATTEMPTS} times between"
            " declare and publish"
        )

    async def _publish(
        self,
        channel: AbstractChannel,
        queue: str,
        message: AbstractMessage,
        attempt: ClaimAttempt,
    ) -> bool | None:
        """Publish a claim: ``True`` acked (in the queue), ``False`` nacked (the queue holds
        another claim), ``None`` returned unrouted (no such queue, or its node is down)."""
        from aio_pika.exceptions import DeliveryError, PublishError

        attempt.unconfirmed = True
        try:
            await channel.default_exchange.publish(message, queue, mandatory=True)
        except PublishError:  # returned unrouted (a subclass of DeliveryError: first)
            attempt.unconfirmed = False
            return None
        except DeliveryError:  # nacked
            attempt.unconfirmed = False
            return False
        attempt.unconfirmed = False
        return True

    async def _check_refusal(
        self, channel: AbstractChannel, queue: str, slot: Slot, view: View
    ) -> None:
        """The queue refused this claim: it held a message already. Check, for the first such
        loss of the job and then at most once a minute, that brokersched made the queue.

        Brokersched declares every claim queue with the same arguments (only ``x-expires``, the
        slot memory, varies), and only a claim is ever published to one. A queue made beforehand
        by something else (by hand or by another tool, capped by its arguments or by a policy)
        and holding a message refuses every claim of the slot: unchecked, every instance would
        lose, and nobody would run the slot or say why. A declare with this view's arguments
        tells: ``406`` when the queue was made otherwise (``_declare_claim_queue`` fails closed,
        naming the difference), none when it is brokersched's.

        Why not look at the message instead: a message taken out of a claim queue, even for a
        moment, lets the next publish in (its count is of ready messages; measured on 3.10), and
        that claim, made by any instance of the fleet, older versions included, would win the
        slot a second time. A declare takes nothing and decides nothing; it renews the queue's
        expiry, which only makes the slot remembered longer.

        Why not at every loss: a loss is one refused publish, and the declare adds two thirds
        to its cost on the broker (measured on 3.10, 2000 losses: 0.26-0.32 ms of broker CPU
        each, 0.43-0.54 ms checked) and halves the losses it answers per second. Something that
        makes claim queues beforehand goes on doing it, so one check a minute per job finds it,
        and a job running less often than once a minute has each of its losses checked. A queue
        made with brokersched's very arguments and a foreign message in it passes for a claim
        (docs/limits.md).
        """
        assert self._clock is not None
        now_ms = self._clock.monotonic_ms()
        last_ms = self._refusals_checked.get(slot.job)
        if last_ms is not None and now_ms - last_ms < _REFUSAL_CHECK_EVERY_MS:
            return
        # OtherMemory: brokersched's, made under another memory; a loss (the fence is not read)
        with contextlib.suppress(OtherMemory):
            await self._declare_claim_queue(channel, queue, slot, view, holds="refused")
        self._refusals_checked[slot.job] = now_ms  # a queue found foreign is checked again

    async def _declare_claim_queue(
        self, channel: AbstractChannel, queue: str, slot: Slot, view: View, *, holds: _Holds
    ) -> None:
        """Declare (or check) the claim queue with this view's arguments. ``holds``: whether
        this claim is in it already; if so and the queue was made under another memory, that
        claim cannot stand, and nobody else's can either: fail closed."""
        from aio_pika.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed

        try:
            declared = await channel.declare_queue(
                queue, durable=True, arguments=view.claim_arguments
            )
        except ChannelPreconditionFailed as exc:
            reply = self._describe(exc)
            found = Inequivalent.parse(str(exc))
            # A reply this backend cannot read is taken for another memory, as before: both
            # fail closed, and that keeps a raise of slot_ttl working on such a server.
            if found is not None and not found.other_memory:
                raise BackendError(self._other_settings(queue, slot, found, holds)) from exc
            if holds != "in-it":
                raise OtherMemory(reply) from exc
            raise BackendError(
                f"{self.name}: claim queue {queue!r} was declared with another slot memory"
                f" ({reply}); this instance uses the fleet's"
                f" {shown(view.record.memory_ms)} (its own slot_ttl is"
                f" {format_duration(self._slot_ttl)}). This claim is in it, so no other claim"
                " of the slot wins, and the slot is not run here. An instance with an outdated"
                " view switches at its next claim; one of a brokersched version without the"
                " fleet record must be upgraded before slot_ttl changes"
            ) from exc
        except ChannelNotFoundEntity as exc:
            raise BackendError(self._home_down(queue, slot, exc)) from exc
        if holds == "in-it" and not declared.declaration_result.message_count:
            # The queue that took this claim was deleted (by hand, or with a lost node) before
            # the check, whose declare made a new, empty one: a later claim would win that too.
            raise BackendError(
                f"{self.name}: claim queue {queue!r} was gone right after it took the claim of"
                f" slot {slot.key} (deleted meanwhile): the slot may already be claimed"
                " elsewhere, so it is not run here"
            )

    def _other_settings(self, queue: str, slot: Slot, found: Inequivalent, holds: _Holds) -> str:
        """A claim queue that brokersched did not make: every version declares the arguments it
        does now, with only x-expires varying."""
        if holds == "in-it":
            held = (
                "This claim went into it, so no other claim of the slot can stand either, and"
                " the slot is not run here"
            )
        elif holds == "refused":
            held = (
                "It holds a message that refuses every claim of the slot (whatever put it"
                " there): no instance runs the slot"
            )
        else:
            held = "A claim in it could not be trusted, so the slot is not run here"
        return (
            f"{self.name}: claim queue {queue!r} of slot {slot.key} was made with other"
            f" settings than brokersched's ({found}; RabbitMQ names the first difference), so"
            f" not by brokersched. {held}. To fix: rabbitmqctl delete_queue {queue}, and find"
            f" what makes queues named {self._prefix}.claim.* beforehand (a script, another"
            " tool, a definitions import) or publishes into them"
        )

    def _home_down(self, queue: str, slot: Slot, exc: BaseException) -> str:
        """A claim queue on a cluster node that is down: it may hold a claim (fail closed)."""
        found = _HOME_NODE.search(str(exc))
        node = repr(found[1]) if found else "(unnamed)"
        return (
            f"{self.name}: claim queue {queue!r} of slot {slot.key} lives on node {node}, which"
            " is down or unreachable: it may hold another instance's claim, so the slot is not"
            f" run here ({self._describe(exc)})"
        )

    async def _held(self, pool: ChannelPool, queue: str) -> bool:
        """Whether ``queue`` holds a claim (a passive declare; it does not change the queue's
        arguments, and a queue that vanished meanwhile holds none)."""
        from aio_pika.exceptions import ChannelNotFoundEntity

        try:
            async with pool.channel() as channel:
                declared = await channel.declare_queue(queue, passive=True)
        except ChannelNotFoundEntity:
            return False
        return bool(declared.declaration_result.message_count)

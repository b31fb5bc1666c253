"""The fleet's records of ``RabbitMQBackend``: presence and controls.

Two queues per prefix, whatever the number of jobs and instances (no broker object
per job or instance): ``<prefix>.fleet``, a durable classic queue holding one JSON message, the
state of every record (``{"version": n, "instance": {id: [expires_ms, JSON]}, "control":
{job: JSON}, ...}``: a key per kind of record, each record JSON kept for ever, or
``[expires_ms, JSON]`` when written with a time to live: presence, missed-slot reports), and
``<prefix>.fleet.lock``, whose exclusive consumer is the lock every read and write of it is
made under (as the slot memory record's: ``_slotmemory.take_lock``; the lock goes with its
channel, also when the holder's connection dies).

A write publishes the new state (confirmed) before it acks the old one: a holder that dies in
between leaves both, and the next reader keeps the one of the higher ``version``. Presence
expires on the writers' clock (the scheduler's), judged at each read and dropped at each write.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..._clock import Clock
from ..._durations import to_ms
from ..._exceptions import BackendUnavailableError
from ...abc import FleetKind
from ._connection import OPERATION_TIMEOUT_S
from ._slotmemory import SideChannels, held_lock

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
    from pamqp.common import FieldTable

__all__ = [
    "FleetRecords",
    "State",
    "fleet_lock_name",
    "fleet_queue_name",
    "live_instances",
    "newest",
]

_LOCK_RETRY_S = (0.005, 0.05)
_PLAIN: FieldTable = {"x-queue-type": "classic"}
State = dict[str, Any]
Change = Callable[[State, int], bool]  # changes the state in place; False: leave it as it was


def fleet_queue_name(prefix: str) -> str:
    return f"{prefix}.fleet"


def fleet_lock_name(prefix: str) -> str:
    return f"{prefix}.fleet.lock"


def _empty() -> State:
    return {"version": 0, "instance": {}, "control": {}}


class FleetRecords:
    """The record queue of one backend, read and written under its lock."""

    def __init__(
        self,
        backend: str,
        prefix: str,
        *,
        channels: SideChannels,
        errors: Callable[[str], AbstractContextManager[None]],
        clock: Callable[[], Clock | None],
    ) -> None:
        self._backend = backend
        self._prefix = prefix
        self._channels = channels
        self._errors = errors
        self._clock = clock

    def _now_ms(self) -> int:
        clock = self._clock()
        if clock is None:
            raise BackendUnavailableError(f"{self._backend} is not started; call start() first")
        return clock.now_ms()

    async def read(self, kind: FleetKind) -> dict[str, str]:
        now = self._now_ms()
        state = await self._locked(f"read the fleet's {kind}s", lambda state, now: False)
        records = state.get(kind, {})
        return {key: _text(entry) for key, entry in records.items() if _live(entry, now)}

    async def put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        def put(state: State, now: int) -> bool:
            records = state.setdefault(kind, {})
            for old in [k for k, entry in records.items() if not _live(entry, now)]:
                del records[old]
            records[key] = [now + to_ms(ttl), value]
            return True

        await self._locked(f"write its {kind} record", put)

    async def swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        swapped = False

        def swap(state: State, now: int) -> bool:
            nonlocal swapped
            records = state.setdefault(kind, {})
            held = records.get(key)
            if (None if held is None or not _live(held, now) else _text(held)) != old:
                return False
            records[key] = new
            swapped = True
            return True

        await self._locked(f"change the {kind} record of {key}", swap)
        return swapped

    async def _locked(self, action: str, change: Change) -> State:
        """The state, after ``change`` made under the lock (written when it says so)."""
        shown = f"{action} (queue {fleet_queue_name(self._prefix)!r}, under its lock)"
        with self._errors(shown):
            async with asyncio.timeout(OPERATION_TIMEOUT_S):
                lock = held_lock(self._channels, fleet_lock_name(self._prefix), _LOCK_RETRY_S)
                async with lock as channel:
                    return await self._apply(channel, change)

    async def _apply(self, channel: AbstractChannel, change: Change) -> State:
        name = fleet_queue_name(self._prefix)
        queue = await channel.declare_queue(name, durable=True, arguments=_PLAIN)
        held: list[AbstractIncomingMessage] = []
        for _ in range(queue.declaration_result.message_count or 0):
            message = await queue.get(no_ack=False, fail=False)
            if message is not None:
                held.append(message)
        state = newest(held)
        if not change(state, self._now_ms()):
            for message in held:
                await message.reject(requeue=True)
            # A queue answers in order: once this returns, the messages are back.
            await channel.declare_queue(name, passive=True)
            return state
        state["version"] += 1
        await self._publish(channel, name, state)
        for message in held:
            await message.ack()
        return state

    async def _publish(self, channel: AbstractChannel, name: str, state: State) -> None:
        from aio_pika import DeliveryMode, Message

        body = json.dumps(state, separators=(",", ":")).encode()
        message = Message(
            body, content_type="application/json", delivery_mode=DeliveryMode.PERSISTENT
        )
        await channel.default_exchange.publish(message, name, mandatory=True)


def _text(entry: str | list[Any]) -> str:
    """A record's JSON: kept as it is (for ever), or ``[expires_ms, JSON]`` (``put``)."""
    return entry if isinstance(entry, str) else str(entry[1])


def _live(entry: str | list[Any], now_ms: int) -> bool:
    return isinstance(entry, str) or int(entry[0]) > now_ms


def live_instances(state: State, now_ms: int) -> list[str]:
    """The instance records of ``state`` not yet expired at ``now_ms`` (the writers' clock)."""
    return [text for expires, text in state["instance"].values() if expires > now_ms]


def newest(messages: list[AbstractIncomingMessage]) -> State:
    """The state of the highest version among ``messages`` (empty if none parses)."""
    best = _empty()
    for message in messages:
        try:
            state = json.loads(message.body)
            if not isinstance(state, dict) or not isinstance(state.get("version"), int):
                raise ValueError("not a record")
        except ValueError:
            continue
        if state["version"] >= best["version"]:
            best = {**_empty(), **state}
    return best

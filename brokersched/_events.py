"""Events a scheduler emits — ``skip``, ``start``, ``complete``, ``fail``, ``claim``,
``record-dropped``, ``missed`` — and
``Events``, which holds the listeners and calls them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, get_args

from ._clock import ms_to_datetime
from ._exceptions import ConfigurationError
from ._tasks import TaskSet
from .abc import Outcome, RunReason

__all__ = [
    "ClaimEvent",
    "Event",
    "EventName",
    "Events",
    "Listener",
    "MissedEvent",
    "RecordDroppedEvent",
    "RunEvent",
    "SkipEvent",
    "SkipReason",
    "StartEvent",
]

logger = logging.getLogger("brokersched")

EventName = Literal["skip", "start", "complete", "fail", "claim", "record-dropped", "missed"]
SkipReason = Literal["late", "overlap", "not-acquired", "paused", "backend-error", "clock-skew"]


@dataclass(frozen=True, slots=True)
class _SlotEvent:
    job: str
    slot_ms: int

    @property
    def scheduled_at(self) -> datetime:
        return ms_to_datetime(self.slot_ms)


@dataclass(frozen=True, slots=True)
class SkipEvent(_SlotEvent):
    reason: SkipReason
    detail: str | None = None
    run: RunReason = "schedule"  # what was skipped: a slot, a boot run ("start"), a manual run


@dataclass(frozen=True, slots=True)
class StartEvent(_SlotEvent):
    run_id: str
    reason: RunReason
    attempt: int


@dataclass(frozen=True, slots=True)
class RunEvent(_SlotEvent):
    """``complete`` (outcome ``completed``) or ``fail`` (``failed``, ``timed-out``,
    ``interrupted``, ``replaced``). ``error`` is the message; ``exception`` the object a
    handler raised (``None`` for other outcomes)."""

    run_id: str
    reason: RunReason
    attempt: int
    outcome: Outcome
    error: str | None
    duration_ms: int
    exception: BaseException | None = None


@dataclass(frozen=True, slots=True)
class ClaimEvent(_SlotEvent):
    """A claim was answered (won or not) or failed: which backend, and how long it took."""

    backend: str
    seconds: float


@dataclass(frozen=True, slots=True)
class RecordDroppedEvent(_SlotEvent):
    """A run's record was never written: the backend stayed away while ``record_buffer``
    records waited, or ``stop()`` could not write it in time. ``job`` is the job's key (its
    name unless ``key=`` was given); ``dropped`` counts this scheduler's drops so far."""

    run_id: str
    outcome: Outcome
    dropped: int


@dataclass(frozen=True, slots=True)
class MissedEvent(_SlotEvent):
    """A scheduled slot that no instance ran within its ``max_late`` (``brokersched._missed``),
    emitted by the one instance that reports it for the fleet. ``detail`` says why it was not
    run there. ``job`` is the job's name."""

    detail: str | None = None


Event = SkipEvent | StartEvent | RunEvent | ClaimEvent | RecordDroppedEvent | MissedEvent
Listener = Callable[[Event], Awaitable[None] | None]


class Events:
    """The listeners of one scheduler. A listener that raises is logged and never stops the
    scheduler; an async one runs as a task that ``stop()`` drains."""

    def __init__(self, tasks: TaskSet) -> None:
        self._tasks = tasks
        self._listeners: dict[str, list[Callable[[Any], Any]]] = {
            name: [] for name in get_args(EventName)
        }

    def on(self, name: str, listener: Callable[[Any], Any]) -> None:
        if name not in self._listeners:
            raise ConfigurationError(
                f"unknown event {name!r}; use one of {', '.join(self._listeners)}", option="event"
            )
        self._listeners[name].append(listener)

    def off(self, name: str, listener: Callable[[Any], Any]) -> None:
        """Remove a listener added with ``on`` (nothing if it is not there)."""
        listeners = self._listeners.get(name, [])
        if listener in listeners:
            listeners.remove(listener)

    def emit(self, name: EventName, event: Event) -> None:
        for listener in self._listeners[name]:
            try:
                result = listener(event)
                if asyncio.iscoroutine(result):
                    self._tasks.spawn(_await_listener(result), name=f"brokersched:on:{name}")
            except Exception:
                logger.exception("event listener %r failed on %s", listener, name)


async def _await_listener(awaitable: Awaitable[object]) -> None:
    try:
        await awaitable
    except Exception:
        logger.exception("async event listener failed")

"""Events a scheduler emits: ``skip``, ``start``, ``complete``, ``fail``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from ._clock import ms_to_datetime
from .abc import Outcome, RunReason

__all__ = ["Event", "EventName", "Listener", "RunEvent", "SkipEvent", "SkipReason", "StartEvent"]

EventName = Literal["skip", "start", "complete", "fail"]
SkipReason = Literal["late", "overlap", "not-acquired", "paused", "backend-error"]


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


@dataclass(frozen=True, slots=True)
class StartEvent(_SlotEvent):
    run_id: str
    reason: RunReason
    attempt: int


@dataclass(frozen=True, slots=True)
class RunEvent(_SlotEvent):
    """``complete`` (outcome ``completed``) or ``fail`` (``failed``, ``timed-out``,
    ``interrupted``)."""

    run_id: str
    reason: RunReason
    attempt: int
    outcome: Outcome
    error: str | None
    duration_ms: int


Event = SkipEvent | StartEvent | RunEvent
Listener = Callable[[Event], Awaitable[None] | None]

"""What every claim-only backend shares (RabbitMQ, Redis, NATS), beside ``LeaseBackendBase``.

The rules of the slot memory themselves (which memory applied to a slot, the claim margins and
deadlines) are the contract's: ``brokersched/_slotmemory.py``. Here: ``slot_ttl`` and
``max_clock_skew``, as ``ClaimOptions`` checked them; the capabilities a claim backend
declares; and the refusal of a claim too late for the fleet's slot memory, in its words.
"""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

from .._durations import format_duration, to_ms
from .._exceptions import BackendError
from .._slotmemory import FleetMemory, claim_deadline_ms, claim_margin
from ..abc import Capabilities, ClaimBackend, Slot
from ._options import ClaimOptions

__all__ = ["ClaimBackendBase", "shown"]


def shown(memory_ms: int) -> str:
    """A slot memory as the messages show it (``5m``, ``1.5s``)."""
    return format_duration(timedelta(milliseconds=memory_ms))


class ClaimBackendBase(ClaimBackend):
    """A claim-only backend: a slot's first claim wins, and the backend remembers it for the
    fleet's slot memory (at least this instance's ``slot_ttl``)."""

    #: What the backend's history keeps per job (``Capabilities``).
    history_ttl: ClassVar[bool] = False
    history_size_per_job: ClassVar[bool] = True

    def _set_memory(self, options: ClaimOptions) -> None:
        """Keep ``slot_ttl`` and ``max_clock_skew`` (in a constructor)."""
        self._slot_ttl, self._skew_ms = options.slot_ttl, to_ms(options.max_clock_skew)

    @property
    def slot_ttl(self) -> timedelta:
        return self._slot_ttl

    def _claim_lead_ms(self) -> int:
        """How long before its slot the backend may act on a claim (RabbitMQ declares a claim
        queue ahead): the claim margin grows by it."""
        return 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            leases=False,
            slot_memory=self._slot_ttl,
            history_ttl=self.history_ttl,
            history_size_per_job=self.history_size_per_job,
            claim_margin=claim_margin(self._slot_ttl, self._skew_ms, self._claim_lead_ms()),
        )

    def _in_own_memory(self, slot: Slot, now_ms: int) -> bool:
        """Whether ``slot`` fell due within this instance's ``slot_ttl`` before ``now_ms``: the
        scheduler's range (a slot claimed by hand years later is the caller's business)."""
        return 0 <= now_ms - slot.slot_ms < to_ms(self._slot_ttl)

    def _forgotten(self, memory: FleetMemory, slot: Slot) -> str:
        """Why ``memory`` may no longer remember ``slot``'s first claim, in a refusal's words."""
        limit = memory.limit_ms(slot.slot_ms, self._skew_ms)
        if slot.slot_ms < memory.created_ms:
            return "the fleet's slot memory record was made after the slot fell due"
        if limit < memory.memory_ms:
            return (
                f"the fleet's slot memory was {shown(limit)} when it fell due (raised to "
                f"{shown(memory.memory_ms)} since)"
            )
        return f"the fleet's slot memory is {shown(limit)}"

    def _refuse_too_late(self, memory: FleetMemory, slot: Slot, now_ms: int, risk: str) -> None:
        """Refuse (``BackendError``) a claim of ``slot`` past its deadline under the fleet's
        ``memory``, in the scheduler's range (``_in_own_memory``); ``risk``: what a claim that
        late could do, in the refusal's words."""
        if not self._in_own_memory(slot, now_ms):
            return
        if now_ms <= claim_deadline_ms(memory, slot.slot_ms, skew_ms=self._skew_ms):
            return
        raise BackendError(
            f"{self.name}: slot {slot.key} is too late to claim safely: "
            f"{self._forgotten(memory, slot)}{risk}; the slot is not run here"
        )

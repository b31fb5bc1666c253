"""The claim rules every claim-only backend shares (RabbitMQ, Redis, NATS), apart from storage.

A claim-only backend remembers a claimed slot for a while (its *slot memory*) and forgets it
after. Two claims of one slot must never both win, so every claim of a slot must be made while
the first claim of it is still remembered. Written once, here:

* **One memory per fleet.** The instances of a prefix share one record of the slot memory, the
  longest ``slot_ttl`` among them (``FleetMemory``): ``memory_ms``, when the record was made
  (``created_ms``) and its recent raises (``raises``: when, and from what).
* **Which memory applied to a slot.** A slot's first claim may come up to ``skew_ms`` before
  its instant (a fast clock), so a raise written at ``at`` may have found a slot falling due up
  to ``skew_ms`` after ``at`` claimed already, under the memory raised from. A slot that fell
  due before the record was made may have been claimed under a record since lost (deleted by
  hand, a store restarted empty), whose memory is unknown: nothing. ``FleetMemory.limit_ms``.
* **One claim deadline.** A slot may be claimed until ``slot + limit - margin``, where the
  margin covers the clocks (``skew_ms``: a slow instance claims later than a fast one that
  claimed first), the flight of the claim and what the backend does ahead of a slot
  (RabbitMQ's declared-ahead queues live from their declare). ``claim_deadline_ms``.
* **Boot windows.** Fleet boot runs are claimed on a grid of one-minute windows whatever the
  slot memory (``_boot``), and need their claims remembered for ``BOOT_MEMORY``: backends
  remember boot claims at least that long.

Changing the record: a raise is written with the time it is made and the memory it replaces; a
record is never lowered in place: to lower it, the operator deletes it (every instance then
adopts the record made again from the ``slot_ttl`` of the instances that run, and slots that
fell due before it are not claimed late). An instance never writes back a record it believed:
that would restore the memory the operator deleted, and the lowering would take no effect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "BOOT_MEMORY",
    "DEFAULT_CLAIM_SKEW",
    "FLIGHT_MS",
    "FleetMemory",
    "claim_deadline_ms",
    "claim_margin",
    "margin_ms",
]

#: How far the clocks of a fleet's instances may disagree, by default, on a claim-only backend:
#: NTP keeps it to milliseconds.
DEFAULT_CLAIM_SKEW = timedelta(seconds=1)

#: A claim's own flight (and the store's timer resolution): how long after it is sent it may
#: still be decided.
FLIGHT_MS = 250

#: How long a claim-only backend remembers a fleet boot run's claims, whatever its slot memory:
#: three boot windows (see ``_boot``).
BOOT_MEMORY = timedelta(minutes=3)


@dataclass(frozen=True, slots=True)
class FleetMemory:
    """The fleet's slot memory record (see the module's docstring); JSON, never pickled."""

    memory_ms: int
    created_ms: int
    raises: tuple[tuple[int, int], ...] = ()  # (at_ms, from_ms), oldest first

    def limit_ms(self, slot_ms: int, skew_ms: int) -> int:
        """For how long after its instant ``slot_ms`` is remembered for sure: the record's
        memory, or the memory a raise replaced if the slot may have been claimed before it,
        or 0 for a slot that fell due before the record was made."""
        if slot_ms < self.created_ms:
            return 0
        shorter = [frm for at, frm in self.raises if slot_ms <= at + skew_ms]
        return min([self.memory_ms, *shorter])

    def raised(self, memory_ms: int, at_ms: int, skew_ms: int) -> FleetMemory:
        """This record raised to ``memory_ms`` at ``at_ms``. Raises that can no longer limit a
        claim (their slots are older than the memory they replaced) are dropped."""
        recent = tuple((at, frm) for at, frm in self.raises if at + skew_ms + frm > at_ms)
        return FleetMemory(memory_ms, self.created_ms, (*recent, (at_ms, self.memory_ms)))

    def to_dict(self) -> dict[str, object]:
        return {
            "slot_memory_ms": self.memory_ms,
            "created_ms": self.created_ms,
            "raises": [list(entry) for entry in self.raises],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: object) -> FleetMemory:
        """Raises ``ValueError`` for what is not a record."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        try:
            raises = tuple((_ms(at), _ms(frm)) for at, frm in data.get("raises", ()))
            return cls(_ms(data["slot_memory_ms"]), _ms(data["created_ms"]), raises)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a slot memory record: {exc!r}") from None


def claim_deadline_ms(memory: FleetMemory, slot_ms: int, *, skew_ms: int, lead_ms: int = 0) -> int:
    """The last instant (the claimer's clock) at which ``slot_ms`` may be claimed under
    ``memory``: its limit, less the clocks' skew, a claim's flight and ``lead_ms``, how long
    before a slot the backend may have made what remembers its claim."""
    limit = memory.limit_ms(slot_ms, skew_ms)
    return slot_ms + limit - margin_ms(limit, skew_ms=skew_ms, lead_ms=lead_ms)


def margin_ms(limit_ms: int, *, skew_ms: int, lead_ms: int = 0) -> int:
    """How long before a slot is ``limit_ms`` old its claims stop (see ``claim_deadline_ms``):
    the clocks' skew, whole; a claim's flight, 250 ms or an eighth of a shorter memory (a
    fleet that remembers slots for a second has its store close by); the backend's lead."""
    return skew_ms + min(FLIGHT_MS, limit_ms // 8) + lead_ms


def claim_margin(memory: timedelta, skew_ms: int, lead_ms: int = 0) -> timedelta:
    """``margin_ms`` for a slot memory: what ``Capabilities.claim_margin`` says."""
    limit = round(memory.total_seconds() * 1000)
    return timedelta(milliseconds=margin_ms(limit, skew_ms=skew_ms, lead_ms=lead_ms))


def _ms(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count of milliseconds")
    return value

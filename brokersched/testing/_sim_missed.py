"""The fleet simulator's view of missed slots (``brokersched._missed``): which skips an instance
must follow up with a check, until when, and the invariants the ledger judges at the end
(``Ledger.unreported``) from what it noted here."""

from __future__ import annotations

from typing import Any

from .._events import MissedEvent, SkipEvent
from .._missed import UNKNOWN_FATE
from .._options import JobSettings
from ..abc import ClaimBackend, Slot
from ._sim_ledger import CHECK_GIVE_UP_MS, CHECKED_FROM_MS, Ledger

__all__ = ["note_report", "note_skip", "unreported"]

#: The clock of an instance that judges a slot's fate: within a second of the fleet's (no
#: instance judges a slot right on a clock further off).
_CLOCK_OFF_MS = 1000


def note_skip(
    ledger: Ledger,
    event: SkipEvent,
    key: str,
    instance: Any,
    settings: JobSettings,
    lease: bool,
    store_ahead_ms: int = 0,
) -> None:
    """``instance`` skipped a scheduled slot of ``key``: if it cannot tell whether another
    instance ran it, when it checks and when it gives up checking (true time). A lease
    store's clock behind the fleet's (``store_ahead_ms`` below 0) puts the check off as
    much: it is judged on the store's clock."""
    give_up = _give_up(event, instance, settings)
    if give_up is None:
        return
    ahead = instance.clock.ahead_ms
    checked = event.slot_ms + settings.max_late_ms + CHECKED_FROM_MS - ahead
    if lease:
        checked += max(0, -store_ahead_ms)
    skip_overlap = lease and settings.policy.overlap == "skip"
    ledger.unknown.setdefault((key, event.slot_ms), {})[instance.name] = (
        checked,
        give_up,
        skip_overlap,
    )


def _give_up(event: SkipEvent, instance: Any, settings: JobSettings) -> int | None:
    """When ``instance`` stops checking whether the slot ``event`` skipped was missed (true
    time), or ``None`` when it need not find out: skipped late or for a backend error, its
    clock close to the fleet's, and on a claim-only backend in time to claim it once more
    while the backend remembers it (the README's limit)."""
    if event.reason not in UNKNOWN_FATE or event.reason == "clock-skew":
        return None
    if abs(instance.clock.ahead_ms) > _CLOCK_OFF_MS:
        return None
    give_up: int = event.slot_ms + settings.max_late_ms + CHECK_GIVE_UP_MS
    backend = instance.backend
    if isinstance(backend, ClaimBackend):
        deadline = backend.claim_deadline_ms(Slot(settings.key, event.slot_ms))
        if deadline is not None:
            if deadline - 1000 <= instance.clock.now_ms():
                return None
            give_up = min(give_up, deadline - 1000)
    return give_up - int(instance.clock.ahead_ms)


def note_report(ledger: Ledger, event: MissedEvent, key: str, instance: str, now: int) -> None:
    ledger.reported.setdefault((key, event.slot_ms), []).append((instance, now))


def unreported(sim: Any) -> list[str]:
    """The end of a simulation ``sim``: the slots never reported missed that had to be."""
    troubled = [  # a clock step moves an instance's checks too
        (fault.begin, fault.end or fault.begin)
        for fault in sim.coverage.faults
        if fault.kind != "kill -9"
    ]
    memory = None if sim.lease else min(i.deploy.memory_ms for i in sim.instances)
    claimed = {"tick", "cron", "once", "slow"}
    ledger: Ledger = sim.ledger
    return ledger.unreported(sim.scheduled, claimed, troubled, sim.store.wins, memory)

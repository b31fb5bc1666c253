"""What the backends' ``inventory()``, ``purge()`` and ``doctor()`` share (``brokersched purge``
and ``brokersched doctor``): when activity counts as an instance running, and the findings
every backend makes the same way.

No backend can see an instance of its prefix that is idle between two slots of an hourly job:
each reads the signs it has (a live lease, a run of the last ``LIVE_WINDOW``, a claim still
remembered, a connection named after the prefix), and ``purge`` refuses while there are some.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from datetime import timedelta

from .._durations import format_duration
from ..abc import Backend, Finding, Inventory, Slot

__all__ = [
    "LIVE_WINDOW",
    "LIVE_WINDOW_MS",
    "NamespaceInventory",
    "ago",
    "recent_claims",
    "server_finding",
    "slot_memory_finding",
]

#: Activity this recent (a claim, a lease granted, a run recorded) counts as an instance of the
#: prefix running: ``purge`` refuses without ``--force``.
LIVE_WINDOW = timedelta(seconds=60)
LIVE_WINDOW_MS = round(LIVE_WINDOW.total_seconds() * 1000)


class NamespaceInventory(Backend):
    """A backend whose ``inventory()`` finds its objects from the namespace alone (every one
    but RabbitMQ's, which over AMQP names them from the jobs and slots it is told)."""

    async def inventory(
        self,
        *,
        namespace: str | None = None,
        jobs: Sequence[str] = (),
        slots: Sequence[Slot] = (),
    ) -> Inventory:
        return await self._inventory(namespace)

    @abstractmethod
    async def _inventory(self, namespace: str | None) -> Inventory:
        """``inventory()`` of ``namespace`` (``None``: the backend's own)."""


def ago(then_ms: int, now_ms: int) -> str:
    """``12s ago`` (or ``in 3s`` for an instant ahead of this clock)."""
    delta = now_ms - then_ms
    shown = format_duration(timedelta(milliseconds=abs(delta) // 1000 * 1000))
    return f"{shown} ago" if delta >= 0 else f"in {shown}"


def recent_claims(slots_ms: list[int], now_ms: int, where: str) -> list[str]:
    """One sign for the claims found of ``slots_ms``: a claim object a claim-only backend still
    holds is one the fleet still needs (it expires with the slot memory: until then it is what
    refuses a late claim of its slot), however long ago its slot fell due."""
    if not slots_ms:
        return []
    newest = ago(max(slots_ms), now_ms)
    return [
        f"{len(slots_ms)} claim(s) still remembered, the newest of a slot {newest} ({where}): "
        "removed, a late claim of their slot could win again; they expire with the slot memory"
    ]


def slot_memory_finding(
    backend: str, where: str, fleet_ms: int | None, slot_ttl: timedelta
) -> Finding:
    """The fleet's slot memory record (``_slotmemory.FleetMemory``) against this app's ``slot_ttl``.

    No state of the record can run a slot twice (the claim rules adopt the longest memory): a
    difference is told so that the operator knows which memory the fleet claims under."""
    own = format_duration(slot_ttl)
    check = "fleet slot memory"
    if fleet_ms is None:
        return Finding(
            "ok",
            check,
            f"no slot memory record in {where} (no instance of the prefix started yet)",
            f"the first instance makes it from its slot_ttl ({own} here)",
        )
    fleet = format_duration(timedelta(milliseconds=fleet_ms))
    own_ms = round(slot_ttl.total_seconds() * 1000)
    if fleet_ms == own_ms:
        return Finding(
            "ok", check, f"the fleet remembers claimed slots for {fleet}, this app's slot_ttl"
        )
    if fleet_ms > own_ms:
        return Finding(
            "warning",
            check,
            f"the fleet remembers claimed slots for {fleet}, longer than this app's slot_ttl {own}",
            "this app claims under the fleet's memory (its claims stop later than its own "
            "slot_ttl says, and its claim objects live longer)",
            f"to lower it, deploy slot_ttl={own!r} on every instance, then delete {where}",
        )
    return Finding(
        "warning",
        check,
        f"the fleet remembers claimed slots for {fleet}, shorter than this app's slot_ttl {own}",
        "this app raises the fleet's memory when it starts; slots that fell due before are "
        "claimed at most that much late",
        f"deploy slot_ttl={fleet!r} here, or let the raise happen (it is safe)",
    )


def server_finding(kind: str, version: str | None, minimum: tuple[int, ...] = ()) -> Finding:
    """The server's version, and whether it is at least ``minimum``."""
    if version is None:
        return Finding("warning", "server version", f"{kind} did not tell its version")
    parts = tuple(int(part) for part in _numbers(version))
    if minimum and parts < minimum:
        least = ".".join(map(str, minimum))
        return Finding(
            "error",
            "server version",
            f"{kind} {version}, older than {least}",
            "brokersched's guarantees are not tested there",
            f"upgrade {kind} to {least} or later",
        )
    return Finding("ok", "server version", f"{kind} {version}")


def _numbers(version: str) -> list[str]:
    numbers: list[str] = []
    for part in version.split("."):
        digits = "".join(char for char in part if char.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(digits)
        if not part.isdigit():
            break
    return numbers

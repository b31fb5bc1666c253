"""``KVLink``: what ``NATSLeaseBackend`` asks of the key-value bucket and the history stream it
talks through.

Two classes implement it: ``OwnBucket`` (``_bucket``), the real one over the backend's own NATS
connection, and the fleet simulator's model of a bucket
(``brokersched.testing._sim_nats.BucketModel``), whose revisions, faults and clock are the
simulated store's. ``NATSLeaseBackend`` is made over either (``NATSLeaseBackend(servers, ...)``
makes its own ``OwnBucket``; ``NATSLeaseBackend.over(link, ...)`` takes one), so the simulator
runs the real backend's leases (the lease protocol, the compare-and-set rounds, the resolution
of writes without an answer: ``_rows``) and only the bucket is modelled.
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import timedelta
from typing import Protocol

from ..._clock import Clock
from ...abc import FleetKind, JobPolicy, RunRecord
from ._rows import Table

__all__ = ["KVLink"]


class KVLink(Protocol):
    """One backend's bucket (its lease rows), the history stream beside it and the fleet's
    records. Every call answers within its bound or raises ``BackendError``."""

    async def open(self, clock: Clock) -> Table:
        """Connect, make or check the bucket and the history stream; the table the lease rows
        are read and written through (``_rows.Table``)."""

    async def close(self) -> None: ...

    def monotonic(self) -> float:
        """The time (seconds) the rows' retries of one decision are bounded by."""

    def sleep(self, seconds: float) -> Awaitable[object]:
        """The pause between two attempts of a decision."""

    async def prepare(self, history_size: int) -> None:
        """Make the history stream keep ``history_size`` runs per job (never fewer)."""

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        """Append ``record`` to the job's history (its message id makes a retry a duplicate)."""

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        """The job's latest runs, newest first, within its ``history_ttl``."""

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        """The fleet's records of ``kind`` not yet expired (``Backend._fleet_read``)."""

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        """Write one record of the fleet, expiring ``ttl`` from now."""

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        """Compare-and-set one record (kept for ever): ``True`` when it held ``old``."""

"""What the SQLite and PostgreSQL backends share, apart from SQL itself: a base class, the
rules of refusals and retries, history rows.

Both keep the same three tables (plus ``schema_version``):

* ``jobs``: one row per job ever claimed. ``last_slot_ms`` is the fence (the latest scheduled,
  catch-up or retried slot claimed; ``NO_SLOT`` while only manual runs were), ``manual_slot_ms``
  the fence of manual runs, which never move ``last_slot_ms`` (a manual run claims the instant
  it is asked for, and must not make the scheduled slots before it look claimed);
  ``lease_until`` is the expiry the latest grant was given and ``grant_slot_ms`` that grant's
  slot, so that only its own release ends it. Every claim of a job locks this row, so the claim
  decision is serialised per job; ``lease_until`` lets a claim that waited for the lock see a
  lease granted meanwhile, which a read of ``leases`` from before the wait would miss.
* ``leases``: one row per slot being run or handed over, keyed by ``(job, slot_ms)``; a finished
  run's row is deleted (the fence keeps its slot claimed), so the table stays as small as the
  number of runs in progress.
* ``history``: runs, keyed by ``(job, n)`` where ``n`` counts the job's records, so trimming to
  the newest ``history_size`` is one index range (``n <= newest - size``), never a scan. Its
  nullable ``traceback`` and ``result`` (JSON text) columns are added at start when missing,
  with no schema version change: instances of earlier releases neither write nor read them,
  and keep starting.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from .._clock import Clock
from .._exceptions import BackendError, BackendUnavailableError
from .._results import dumps_result
from ..abc import Claim, Finding, JobPolicy, Lease, LeaseOutcome, Outcome, RunReason, RunRecord
from ._errors import ErrorMap
from ._lease import BATCH_CHUNK, MIN_RENEW_TIMEOUT_S, Ending, LeaseBackendBase, in_chunks
from ._options import LeaseOptions, name_check

__all__ = [
    "MIN_RENEW_TIMEOUT_S",
    "NO_SLOT",
    "SCHEMA_VERSION",
    "SQLLeaseBackend",
    "check_identifier",
    "datetime_to_us",
    "fence",
    "history_cutoff",
    "history_limit",
    "result_text",
    "run_record",
    "schema_finding",
    "us_to_datetime",
]

#: The version of the tables this release writes; stored in ``schema_version`` so that a later
#: release knows what it finds and can migrate it. 2: ``jobs.grant_slot_ms`` and
#: ``jobs.manual_slot_ms`` (manual runs no longer move the fence).
SCHEMA_VERSION = 2

#: ``jobs.last_slot_ms`` of a job only ever run manually: below every slot, so any passes.
NO_SLOT = -(2**63)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class SQLLeaseBackend(LeaseBackendBase):
    """What both SQL backends share beyond every lease backend's settings: the scheduler's
    clock (for history times; leases are judged on the database's clock), the translation
    of their client's errors, and the shape of their batches of claims and of releases."""

    #: The client's exceptions and what they mean (set at construction).
    _errors: ErrorMap

    def __init__(self, options: LeaseOptions) -> None:
        super().__init__(options)
        self._clock: Clock | None = None

    @property
    @abstractmethod
    def _op_timeout(self) -> float:
        """The bound on calls that take no timeout."""

    def _translate(self, action: str) -> AbstractContextManager[None]:
        """Where the client's errors become brokersched's (``backends/_errors.py``: an
        exception not the client's is raised unchanged)."""
        return self._errors(action)

    def _now(self) -> datetime:
        if self._clock is None:
            raise BackendUnavailableError(f"{self.name} is not started")
        return self._clock.now()

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """The claims decided together (``_acquire_batch``), at most ``BATCH_CHUNK`` at a time
        (``in_chunks``: each instance gets its share of the instant's slots). Each claim on its
        own when ``_batchable`` says no, or when the database refused the batch as a whole
        (``_refused``: nothing of it was written)."""
        if not self._batchable(claims):
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        if len(claims) > BATCH_CHUNK:

            async def chunk(part: list[Claim]) -> list[LeaseOutcome]:
                return await self.acquire_many(part, instance_id=instance_id, timeout=timeout)

            return await in_chunks(claims, chunk)
        try:
            return await self._acquire_batch(claims, instance_id, timeout)
        except BackendError as exc:
            if isinstance(exc, BackendUnavailableError) or not self._refused(exc, claims):
                raise
        return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)

    def _batchable(self, claims: Sequence[Claim]) -> bool:
        return len(claims) >= 2

    @abstractmethod
    async def _acquire_batch(
        self, claims: Sequence[Claim], instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """At most ``BATCH_CHUNK`` claims in one round trip, each decided as ``acquire()``
        decides it."""

    @abstractmethod
    def _refused(self, exc: BackendError, claims: Sequence[Claim]) -> bool:
        """Whether the database refused the batch ``claims`` as a whole (``exc``'s cause is its
        answer): nothing of it was written."""

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[Ending] | None = None,
    ) -> list[Exception | None]:
        """``_release_all``: one transaction, all or none."""
        ends = records if records is not None else [None] * len(leases)
        try:
            await self._release_all(list(zip(leases, ends, strict=True)))
        except BackendError as exc:
            return [exc for _ in leases]
        return [None for _ in leases]

    @abstractmethod
    async def _release_all(self, ends: list[tuple[Lease, Ending]]) -> None:
        """End each lease with its record (if any), as ``release()`` would, in one
        transaction."""


def fence(stored: int | None) -> int | None:
    """A job's fence as ``jobs.last_slot_ms`` stores it: ``None`` for ``NO_SLOT`` (only manual
    runs so far) or no row."""
    return None if stored == NO_SLOT else stored


def check_identifier(option: str, max_length: int) -> Callable[[object, str], str]:
    """The check of a plain SQL identifier, which the tables' names are built from."""
    return name_check(
        option,
        rf"[A-Za-z_][A-Za-z0-9_]{{0,{max_length - 1}}}",
        f"letters, digits and underscores, not starting with a digit, at most {max_length} "
        "characters",
    )


def datetime_to_us(value: datetime) -> int:
    """Exact microseconds since the Unix epoch (SQLite stores times as integers)."""
    return (value - _EPOCH) // _MICROSECOND


def us_to_datetime(value: int) -> datetime:
    return _EPOCH + value * _MICROSECOND


def result_text(result: Any) -> str | None:
    """``RunRecord.result`` as the ``result`` column holds it: its JSON text, ``NULL`` for
    ``None``."""
    return None if result is None else dumps_result(result)


def run_record(row: Sequence[Any], started_at: datetime, finished_at: datetime | None) -> RunRecord:
    """A history row ``(job, slot_ms, run_id, instance_id, reason, attempt, outcome, error,
    traceback, result)``; each backend converts its own time columns."""
    job, slot_ms, run_id, instance_id, reason, attempt, outcome, error, traceback, result = row
    return RunRecord(
        job=job,
        slot_ms=slot_ms,
        run_id=run_id,
        instance_id=instance_id,
        reason=cast(RunReason, reason),
        attempt=attempt,
        started_at=started_at,
        finished_at=finished_at,
        outcome=cast(Outcome, outcome),
        error=error,
        traceback=traceback,
        result=None if result is None else json.loads(result),
    )


def history_cutoff(policy: JobPolicy, now: datetime) -> datetime | None:
    """Runs that started before this are dropped (``history_ttl``); ``None`` keeps all."""
    return None if policy.history_ttl is None else now - policy.history_ttl


def history_limit(policy: JobPolicy, limit: int) -> int:
    return max(0, min(limit, policy.history_size))


def schema_finding(version: int | None, at: str, it: str) -> Finding:
    """``brokersched doctor``'s finding on the schema version found: ``at`` says where, up to
    the number ("schema brokersched at version"), ``it`` how to name it ("it", "them")."""
    if version == SCHEMA_VERSION:
        return Finding("ok", "schema", f"{at} {version}")
    if version is not None and version > SCHEMA_VERSION:
        return Finding(
            "error",
            "schema",
            f"{at} {version}, newer than this brokersched's {SCHEMA_VERSION}",
            f"this brokersched refuses to start on {it}",
            "upgrade brokersched",
        )
    return Finding(
        "warning",
        "schema",
        f"{at} {version}, older than {SCHEMA_VERSION}",
        f"the first instance that starts upgrades {it}",
        "nothing to do; upgrade every instance of the fleet",
    )

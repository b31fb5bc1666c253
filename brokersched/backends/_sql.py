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
  the newest ``history_size`` is one index range (``n <= newest - size``), never a scan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from .._clock import Clock
from .._durations import Duration, to_ms
from .._exceptions import BackendUnavailableError, ConfigurationError
from ..abc import Capabilities, JobPolicy, LeaseBackend, Outcome, RunReason, RunRecord
from ._lease import CAPABILITIES, check_lease_ttl, check_max_clock_skew

__all__ = [
    "MIN_RENEW_TIMEOUT_S",
    "NO_SLOT",
    "SCHEMA_VERSION",
    "SQLLeaseBackend",
    "check_identifier",
    "datetime_to_us",
    "history_cutoff",
    "history_limit",
    "run_record",
    "us_to_datetime",
]

#: The version of the tables this release writes; stored in ``schema_version`` so that a later
#: release knows what it finds and can migrate it. 2: ``jobs.grant_slot_ms`` and
#: ``jobs.manual_slot_ms`` (manual runs no longer move the fence).
SCHEMA_VERSION = 2

#: ``jobs.last_slot_ms`` of a job only ever run manually: below every slot, so any passes.
NO_SLOT = -(2**63)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

#: The least time a renewal is given, however short ``lease_ttl`` is (a round trip, a lock).
MIN_RENEW_TIMEOUT_S = 0.2


class SQLLeaseBackend(LeaseBackend):
    """What both SQL backends share: the lease ttl, the allowed clock skew, the capabilities,
    the scheduler's clock (for history times; leases are judged on the database's clock)."""

    def __init__(self, lease_ttl: Duration, max_clock_skew: Duration) -> None:
        super().__init__()
        self._lease_ttl = check_lease_ttl(lease_ttl, backend=self.name)
        self._max_clock_skew = check_max_clock_skew(max_clock_skew, backend=self.name)
        self._clock: Clock | None = None

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def lease_ttl(self) -> timedelta:
        return self._lease_ttl

    @property
    def max_clock_skew(self) -> timedelta:
        """How far ahead of the database's clock a claimed slot may be (see ``ClockSkewError``)."""
        return self._max_clock_skew

    @property
    def _ttl_ms(self) -> int:
        return to_ms(self._lease_ttl)

    @property
    def _skew_ms(self) -> int:
        return to_ms(self._max_clock_skew)

    @property
    def _renew_timeout(self) -> float:
        """The bound on ``renew()`` and ``release()``: a third of ``lease_ttl`` (at least
        ``MIN_RENEW_TIMEOUT_S``).

        The runner renews every third of the ttl and aborts the run when no renewal succeeded
        in time; a renewal that answers later than that is of no use to it, and one left
        waiting would let the lease expire (and another instance take the slot over) while
        the runner has not been told. A release answered later than that could land after
        the lease expired, when the slot has been restarted elsewhere: the runner is told it
        failed in time, and retries it while it still holds the lease.
        """
        return max(self._lease_ttl.total_seconds() / 3, MIN_RENEW_TIMEOUT_S)

    def _now(self) -> datetime:
        if self._clock is None:
            raise BackendUnavailableError(f"{self.name} is not started")
        return self._clock.now()


def check_identifier(value: object, *, option: str, backend: str, max_length: int) -> str:
    """``value`` if it is a plain SQL identifier: the tables' names are built from it."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value) or len(value) > max_length:
        raise ConfigurationError(
            f"{option} {value!r} of {backend} must be letters, digits and underscores, not "
            f"starting with a digit, at most {max_length} characters",
            option=option,
            backend=backend,
        )
    return value


def datetime_to_us(value: datetime) -> int:
    """Exact microseconds since the Unix epoch (SQLite stores times as integers)."""
    return (value - _EPOCH) // _MICROSECOND


def us_to_datetime(value: int) -> datetime:
    return _EPOCH + value * _MICROSECOND


def run_record(row: Sequence[Any], started_at: datetime, finished_at: datetime | None) -> RunRecord:
    """A history row ``(job, slot_ms, run_id, instance_id, reason, attempt, outcome, error)``;
    each backend converts its own time columns."""
    job, slot_ms, run_id, instance_id, reason, attempt, outcome, error = row
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
    )


def history_cutoff(policy: JobPolicy, now: datetime) -> datetime | None:
    """Runs that started before this are dropped (``history_ttl``); ``None`` keeps all."""
    return None if policy.history_ttl is None else now - policy.history_ttl


def history_limit(policy: JobPolicy, limit: int) -> int:
    return max(0, min(limit, policy.history_size))

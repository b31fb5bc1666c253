"""What the SQLite and PostgreSQL backends share, apart from SQL itself: a base class, the
rules of refusals and retries, history rows.

Both keep the same three tables (plus ``schema_version``):

* ``jobs``: one row per job ever claimed. ``last_slot_ms`` is the fence (the latest slot claimed);
  ``lease_until`` is the expiry the latest grant was given. Every claim of a job locks this row,
  so the claim decision is serialised per job; ``lease_until`` lets a claim that waited for the
  lock see a lease granted meanwhile, which a read of ``leases`` from before the wait would miss.
* ``leases``: one row per slot being run or handed over, keyed by ``(job, slot_ms)``; a finished
  run's row is deleted (the fence keeps its slot claimed), so the table stays as small as the
  number of runs in progress.
* ``history``: runs, keyed by ``(job, n)`` where ``n`` counts the job's records, so trimming to
  the newest ``history_size`` is one index range (``n <= newest - size``), never a scan.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from .._clock import Clock
from .._durations import Duration, parse_duration, to_ms
from .._exceptions import BackendUnavailableError, ConfigurationError
from ..abc import Capabilities, JobPolicy, Lease, LeaseBackend, Outcome, RunReason, RunRecord

__all__ = [
    "CAPABILITIES",
    "MIN_RENEW_TIMEOUT_S",
    "SCHEMA_VERSION",
    "DeadRun",
    "SQLLeaseBackend",
    "check_identifier",
    "datetime_to_us",
    "history_cutoff",
    "history_limit",
    "interrupted",
    "new_run_id",
    "new_token",
    "refusal",
    "retry_attempt",
    "run_record",
    "us_to_datetime",
]

#: The version of the tables this release writes; stored in ``schema_version`` so that a later
#: release knows what it finds and can migrate it.
SCHEMA_VERSION = 1

CAPABILITIES = Capabilities(
    leases=True, slot_memory=None, history_ttl=True, history_size_per_job=True
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

INTERRUPTED_ERROR = "runner lost its lease"

#: The least time a renewal is given, however short ``lease_ttl`` is (a round trip, a lock).
MIN_RENEW_TIMEOUT_S = 0.2


class SQLLeaseBackend(LeaseBackend):
    """What both SQL backends share: the lease ttl, the capabilities, the scheduler's clock
    (for history times; leases are judged on the database's clock)."""

    def __init__(self, lease_ttl: Duration) -> None:
        super().__init__()
        self._lease_ttl = parse_duration(lease_ttl, name="lease_ttl")
        if self._lease_ttl <= timedelta(0):
            raise ConfigurationError(
                f"lease_ttl of {self.name} must be greater than 0",
                option="lease_ttl",
                backend=self.name,
            )
        self._clock: Clock | None = None

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def lease_ttl(self) -> timedelta:
        return self._lease_ttl

    @property
    def _ttl_ms(self) -> int:
        return to_ms(self._lease_ttl)

    @property
    def _renew_timeout(self) -> float:
        """The bound on ``renew()``: a third of ``lease_ttl`` (at least ``MIN_RENEW_TIMEOUT_S``).

        The runner renews every third of the ttl and aborts the run when no renewal succeeded
        in time; a renewal that answers later than that is of no use to it, and one left
        waiting would let the lease expire (and another instance take the slot over) while
        the runner has not been told.
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


def new_token() -> str:
    """A lease's token: random, so a stale runner can never guess a newer lease's."""
    return secrets.token_hex(16)


def new_run_id() -> str:
    """The run id of a retry the backend starts (the scheduler names the runs it starts)."""
    return secrets.token_hex(8)


def datetime_to_us(value: datetime) -> int:
    """Exact microseconds since the Unix epoch (SQLite stores times as integers)."""
    return (value - _EPOCH) // _MICROSECOND


def us_to_datetime(value: int) -> datetime:
    return _EPOCH + value * _MICROSECOND


def refusal(
    slot_ms: int, latest: int | None, live: bool | None, policy: JobPolicy
) -> Literal["overlap", "not-acquired"]:
    """Why a claim was refused, from the job's row as read after the refusal.

    The row may be older than the decision (PostgreSQL reads it with the statement's snapshot):
    a slot that passes the fence on a row with no live lease was then lost to a concurrent
    claimer, which is ``not-acquired`` as well.
    """
    if latest is None or latest >= slot_ms:
        return "not-acquired"
    return "overlap" if policy.overlap == "skip" and live else "not-acquired"


def retry_attempt(state: str, attempt: int, latest: bool, max_attempts: int) -> int | None:
    """The attempt a taken-over slot restarts with, or ``None`` when it is left.

    Only the job's latest slot is restarted; a hand-over keeps its attempt (the runner did not
    die), a dead runner's slot counts one more, up to ``max_attempts``.
    """
    attempt = attempt if state == "handover" else attempt + 1
    return attempt if latest and attempt <= max_attempts else None


@dataclass(frozen=True, slots=True)
class DeadRun:
    """A lease row found expired or handed over by ``take_over``."""

    job: str
    slot_ms: int
    run_id: str
    instance_id: str
    reason: str
    attempt: int
    state: str
    started_at: datetime

    def retried(self, token: str, run_id: str, attempt: int) -> Lease:
        return Lease(self.job, self.slot_ms, token, run_id, attempt, "retry")


def interrupted(run: DeadRun, now: datetime) -> RunRecord:
    """The history record of a runner that died: its runner cannot write it, the backend does."""
    return RunRecord(
        job=run.job,
        slot_ms=run.slot_ms,
        run_id=run.run_id,
        instance_id=run.instance_id,
        reason=cast(RunReason, run.reason),
        attempt=run.attempt,
        started_at=run.started_at,
        finished_at=now,
        outcome="interrupted",
        error=INTERRUPTED_ERROR,
    )


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

"""The lease rules every lease backend shares (memory, SQLite, PostgreSQL), apart from storage.

* **Time.** A claim is judged on the backend's clock (the database's), never the instance's:
  a slot further ahead of that clock than ``max_clock_skew`` is refused with
  ``ClockSkewError``. Instances claim a slot at or after its time (plus jitter), so only a
  fast clock asks for a future slot, and fencing would then refuse every earlier slot to the
  whole fleet: one machine 2 minutes fast would silence the job for 2 minutes.
* **Manual runs** (``reason="manual"``) are fenced among themselves only: they never move the
  fence that scheduled, catch-up and retried slots must pass.
* **Take-over.** A dead runner's or handed-over slot restarts only while it is the job's latest
  slot (``is_latest``), has waited for a runner no longer than the job's retry window (since it
  was handed over, or since the dead runner's lease expired), and (for a dead runner) within
  ``max_attempts``; the dead attempt is recorded ``interrupted`` by the taker, which is the only
  one who knows.
* **Configuration.** ``lease_ttl`` and ``max_clock_skew``, and a lock wait that fits in one
  renewal period.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, cast

from .._clock import ms_to_datetime
from .._durations import Duration, format_duration, parse_duration, positive_duration, to_ms
from .._exceptions import ClockSkewError, ConfigurationError
from ..abc import (
    Capabilities,
    Claim,
    JobPolicy,
    Lease,
    LeaseBackend,
    LeaseOutcome,
    RunReason,
    RunRecord,
    Slot,
    new_run_id,
)

__all__ = [
    "BATCH_CHUNK",
    "CAPABILITIES",
    "DEFAULT_MAX_CLOCK_SKEW",
    "INTERRUPTED_ERROR",
    "MIN_RENEW_TIMEOUT_S",
    "ClockSkewError",
    "DeadRun",
    "JobState",
    "LeaseBackendBase",
    "check_lease_ttl",
    "check_lock_wait",
    "check_max_clock_skew",
    "check_slot_time",
    "in_chunks",
    "interrupted",
    "is_latest",
    "new_run_id",
    "new_token",
    "refusal",
    "restart_attempt",
    "retry_window_ms",
]

CAPABILITIES = Capabilities(
    leases=True, slot_memory=None, history_ttl=True, history_size_per_job=True
)

#: How far ahead of the backend's clock a claimed slot may be. Instances claim a slot at or
#: after its time, so this is only the disagreement allowed between their clocks and the
#: backend's: NTP keeps it to milliseconds; a few seconds leave room for a VM resuming.
DEFAULT_MAX_CLOCK_SKEW = timedelta(seconds=5)

INTERRUPTED_ERROR = "runner lost its lease"


# -- configuration -------------------------------------------------------------------------


def _duration(value: Duration, *, option: str, backend: str) -> timedelta:
    try:
        return parse_duration(value, name=option)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{exc} ({backend})", option=option, backend=backend) from None


def check_lease_ttl(value: Duration, *, backend: str) -> timedelta:
    return positive_duration(value, option="lease_ttl", backend=backend)


def check_max_clock_skew(value: Duration, *, backend: str) -> timedelta:
    skew = _duration(value, option="max_clock_skew", backend=backend)
    if skew < timedelta(0):
        raise ConfigurationError(
            f"max_clock_skew of {backend} must be 0 or more (got {value!r})",
            option="max_clock_skew",
            backend=backend,
        )
    return skew


def check_lock_wait(
    value: Duration | None,
    lease_ttl: timedelta,
    *,
    option: str,
    default: timedelta,
    backend: str,
) -> timedelta:
    """How long the backend lets a statement wait for another client's lock.

    It must fit in a third of ``lease_ttl``: the runner renews every third, and a release (or
    renewal) left waiting longer could land after the lease expired, when another instance has
    already restarted the slot. Unset, it is ``default`` or a third of ``lease_ttl`` if shorter.
    """
    bound = lease_ttl / 3
    if value is None:
        return min(default, bound)
    wait = _duration(value, option=option, backend=backend)
    if wait > bound:
        raise ConfigurationError(
            f"{option} ({format_duration(wait)}) of {backend} must be at most a third of "
            f"lease_ttl ({format_duration(lease_ttl)}): a release or renewal waiting "
            f"{format_duration(wait)} for another process's lock can land after the lease "
            "expired, and another instance runs the slot again; raise lease_ttl to "
            f"{format_duration(wait * 3)} or more, or lower {option} to "
            f"{format_duration(bound)} or less (or leave it unset)",
            option=option,
            backend=backend,
        )
    return wait


# -- claims --------------------------------------------------------------------------------


def check_slot_time(
    slot: Slot, now_ms: int, max_skew: timedelta, *, backend: str, clock: str
) -> None:
    """Raise ``ClockSkewError`` if ``slot`` is more than ``max_skew`` ahead of ``now_ms``, the
    backend's clock (named ``clock`` in the message)."""
    ahead_ms = slot.slot_ms - now_ms
    if ahead_ms <= to_ms(max_skew):
        return
    ahead = format_duration(timedelta(milliseconds=ahead_ms))
    raise ClockSkewError(
        f"{backend} refused {slot.key}: the slot ({ms_to_datetime(slot.slot_ms).isoformat()}) "
        f"is {ahead} ahead of {clock} ({ms_to_datetime(now_ms).isoformat()}), more than "
        f"max_clock_skew ({format_duration(max_skew)}); this instance's clock is fast: fix "
        "its time sync (NTP), or raise max_clock_skew",
        slot_ms=slot.slot_ms,
        ahead_ms=ahead_ms,
    )


@dataclass(frozen=True, slots=True)
class JobState:
    """A job's fences and liveness as read back after a refused claim (``None``: no row)."""

    fence: int | None  # the latest scheduled, catch-up or retried slot claimed
    manual_fence: int | None  # the latest manual slot claimed
    live: bool


def refusal(
    reason: RunReason, slot_ms: int, state: JobState | None, policy: JobPolicy
) -> Literal["overlap", "not-acquired"]:
    """Why a claim was refused, from the job's state as read after the refusal.

    The state may be older than the decision (PostgreSQL reads it with the statement's
    snapshot): a slot that passes its fence on a state with no live lease was then lost to a
    concurrent claimer, which is ``not-acquired`` as well.
    """
    if state is None:
        return "not-acquired"
    fence = state.manual_fence if reason == "manual" else state.fence
    if reason == "catch-up" and state.fence is None:
        return "not-acquired"  # only manual runs so far: a catch-up is granted after a claim
    if fence is not None and fence >= slot_ms:
        return "not-acquired"
    return "overlap" if policy.overlap == "skip" and state.live else "not-acquired"


#: The most claims of a batch one statement (PostgreSQL) or transaction (SQLite) decides.
BATCH_CHUNK = 16


async def in_chunks(
    claims: Sequence[Claim], decide: Callable[[list[Claim]], Awaitable[list[LeaseOutcome]]]
) -> list[LeaseOutcome]:
    """``decide`` the claims in chunks of at most ``BATCH_CHUNK``, concurrently, each chunk's
    jobs drawn at random; the outcomes in the order of ``claims`` (a chunk that failed as a
    whole gives its error to each of its claims).

    One statement decides its claims one job after the other, holding each job's row until it
    commits: a whole instant in one statement would go to the instance whose statement locked
    the first job first, all of it, and its rivals would wait for that one statement. Random
    chunks, each in the order of job names (so that statements never wait on each other in a
    circle), spread the jobs of one instant over the instances as single claims do.
    """
    order = list(range(len(claims)))
    random.shuffle(order)
    parts = [order[n : n + BATCH_CHUNK] for n in range(0, len(order), BATCH_CHUNK)]
    answers = await asyncio.gather(
        *(decide([claims[n] for n in part]) for part in parts), return_exceptions=True
    )
    outcomes: dict[int, LeaseOutcome] = {}
    for part, answer in zip(parts, answers, strict=True):
        if isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
        for k, n in enumerate(part):
            outcomes[n] = answer if isinstance(answer, Exception) else answer[k]
    return [outcomes[n] for n in range(len(claims))]


def new_token() -> str:
    """A lease's token: random, so a stale runner can never guess a newer lease's."""
    return secrets.token_hex(16)


# -- take-over -----------------------------------------------------------------------------


def retry_window_ms(policy: JobPolicy, lease_ttl: timedelta) -> int | None:
    """How long a slot may wait for a new runner (on the backend's clock, from the moment it
    was handed over or its dead runner's lease expired) and still restart; ``None``: no bound.

    The scheduler sets ``JobPolicy.retry_window`` to ``max(catch_up, max_late)``: how late
    the job accepts a start at all. It is counted from the moment the slot lost its runner, not
    from the slot's time, so that a long run handed over by a rolling restart is resumed at once
    however old its slot, while a slot left by a full-fleet stop is not rerun at the next start.
    It is never shorter than ``lease_ttl``: while any instance runs, it sweeps every
    ``lease_ttl / 2``, so a dead runner's slot is always restarted (within ``max_attempts``).
    """
    window = policy.retry_window
    return None if window is None else to_ms(max(window, lease_ttl))


@dataclass(frozen=True, slots=True)
class DeadRun:
    """A lease found expired or handed over by ``take_over``."""

    job: str
    slot_ms: int
    run_id: str
    instance_id: str
    reason: str
    attempt: int
    state: str  # "running" (its runner died or lost the lease) or "handover"
    started_at: datetime
    waited_ms: int  # since it was handed over or its lease expired, on the backend's clock

    def retried(self, token: str, run_id: str, attempt: int) -> Lease:
        return Lease(self.job, self.slot_ms, token, run_id, attempt, "retry")

    def waited_too_long(self, window_ms: int | None) -> bool:
        return window_ms is not None and self.waited_ms > window_ms


def is_latest(slot_ms: int, fence: int | None, manual_fence: int | None) -> bool:
    """Whether a slot is still the job's latest, so worth restarting: the latest slot claimed,
    or the latest manual run with no slot claimed after it. (PostgreSQL: the same in SQL.)"""
    if slot_ms == fence:
        return True
    return slot_ms == manual_fence and (fence is None or fence < slot_ms)


def restart_attempt(
    dead: DeadRun, *, latest: bool, policy: JobPolicy, window_ms: int | None
) -> int | None:
    """The attempt a taken-over slot restarts with, or ``None`` when it is left.

    Restarted only when it is the job's latest slot (``is_latest``) that has not waited longer
    than ``window_ms`` (``retry_window_ms``); a hand-over keeps its attempt (the runner did not
    die), a dead runner's slot counts one more, up to ``max_attempts``. (PostgreSQL: the same
    rule in SQL.)
    """
    if not latest or dead.waited_too_long(window_ms):
        return None
    attempt = dead.attempt if dead.state == "handover" else dead.attempt + 1
    return attempt if attempt <= policy.max_attempts else None


def interrupted(
    dead: DeadRun,
    now: datetime,
    *,
    restarted: bool,
    window_ms: int | None,
    max_attempts: int | None = None,
) -> RunRecord | None:
    """The history record a taker writes for ``dead``, or ``None`` for a hand-over (its runner
    recorded the run itself when it stopped). A dead runner cannot record its run, and a runner
    that lost its lease leaves the record to the taker, so each lost attempt is recorded once.
    """
    if dead.state == "handover":
        return None
    error = INTERRUPTED_ERROR
    if not restarted and dead.waited_too_long(window_ms):
        window = timedelta(milliseconds=window_ms or 0)
        waited = timedelta(milliseconds=dead.waited_ms)
        error += (
            f"; not restarted: it waited {format_duration(waited)} for a runner, longer than "
            f"its retry window ({format_duration(window)})"
        )
    elif not restarted and max_attempts is not None and dead.attempt >= max_attempts:
        error += f"; not restarted: max_attempts ({max_attempts}) reached"
    return RunRecord(
        job=dead.job,
        slot_ms=dead.slot_ms,
        run_id=dead.run_id,
        instance_id=dead.instance_id,
        reason=cast(RunReason, dead.reason),
        attempt=dead.attempt,
        started_at=dead.started_at,
        finished_at=now,
        outcome="interrupted",
        error=error,
    )


#: The least time a renewal or a release is given, however short ``lease_ttl`` is.
MIN_RENEW_TIMEOUT_S = 0.2


class LeaseBackendBase(LeaseBackend):
    """What every lease backend shares: ``lease_ttl`` and ``max_clock_skew`` (checked once, the
    same way), the capabilities, and the bound on renewals and releases."""

    def __init__(self, *, lease_ttl: Duration, max_clock_skew: Duration) -> None:
        super().__init__()
        self._lease_ttl = check_lease_ttl(lease_ttl, backend=self.name)
        self._max_clock_skew = check_max_clock_skew(max_clock_skew, backend=self.name)

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def lease_ttl(self) -> timedelta:
        return self._lease_ttl

    @property
    def max_clock_skew(self) -> timedelta:
        """How far ahead of the backend's clock a claimed slot may be (see ``ClockSkewError``)."""
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
        the runner has not been told. A release is bounded alike so that one stuck on a dead
        link or behind another client's lock gives way to the runner's next try (it retries
        a failed release at short intervals until it lands, past the lease's expiry if need
        be: ``LeaseBackend.release``) rather than hold it until the lease has expired.
        """
        return max(self._lease_ttl.total_seconds() / 3, MIN_RENEW_TIMEOUT_S)

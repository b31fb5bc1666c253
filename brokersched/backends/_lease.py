"""The lease rules every lease backend shares (memory, SQLite, PostgreSQL, Redis), apart from
storage.

* **Time.** A claim is judged on the backend's clock (the store's: the database's, Redis's,
  the host's for SQLite), never the instance's: a slot further ahead of that clock than
  ``max_clock_skew`` is refused with ``ClockSkewError``. Instances claim a slot at or after its
  time (plus jitter), so only a fast clock asks for a future slot, and fencing would then
  refuse every earlier slot to the whole fleet: one machine 2 minutes fast would silence the
  job for 2 minutes. The refusal says which clock moved (``skew_diagnosis``): the store's
  clock comes back with every claim's answer, so an instance knows the gap between the two at
  its last accepted claim.
* **Manual runs** (``reason="manual"``) are fenced among themselves only: they never move the
  fence that scheduled, catch-up and retried slots must pass.
* **Take-over.** A dead runner's or handed-over slot restarts only while it is the job's latest
  slot (``is_latest``), has waited for a runner no longer than the job's retry window (since it
  was handed over, or since the dead runner's lease expired), and (for a dead runner) within
  ``max_attempts``; the dead attempt is recorded ``interrupted`` by the taker, which is the only
  one who knows.
* **A lease is counted on from when its request was sent.** The store sets a lease's expiry
  ``lease_ttl`` after it *receives* the request that grants or extends it, so the holder knows
  it valid only until ``lease_ttl`` after it *sent* that request, however late the answer
  comes. No handler starts on a lease that may have expired by then (the scheduler keeps a
  tenth of ``lease_ttl`` in hand, as its renewals do): a claim, a batch of claims or a
  take-over answered later is not run, and its lease is handed back (a hand-over that lands
  restarts the slot elsewhere; one the fleet's sweep came before changes nothing). Another
  instance may already run that slot as a dead runner's. So a claim is given no longer than
  that to answer, retries included, whatever is left of ``max_late``.
* **Configuration.** ``lease_ttl`` and ``max_clock_skew``, as ``LeaseOptions`` checked them
  (``_options``); a lock wait fits in one renewal period (SQLite's ``busy_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import ClassVar, Literal, cast

from .._clock import Clock, ms_to_datetime
from .._durations import format_duration, to_ms
from .._exceptions import BackendError, ClockSkewError
from ..abc import (
    Capabilities,
    Claim,
    JobPolicy,
    Lease,
    LeaseBackend,
    LeaseOutcome,
    LeaseState,
    Overlap,
    RunReason,
    RunRecord,
    Slot,
    new_run_id,
)
from ._options import LeaseOptions

__all__ = [
    "BATCH_CHUNK",
    "CAPABILITIES",
    "DEFAULT_MAX_CLOCK_SKEW",
    "INTERRUPTED_ERROR",
    "MIN_RENEW_TIMEOUT_S",
    "Acquire",
    "AcquireAnswer",
    "Answer",
    "ClockName",
    "ClockReading",
    "ClockSkewError",
    "DeadRun",
    "Ending",
    "Granted",
    "JobRow",
    "JobState",
    "LeaseBackendBase",
    "LeaseRow",
    "Release",
    "Renew",
    "Request",
    "Store",
    "TakeOver",
    "TakenOver",
    "TooFarAhead",
    "check_slot_time",
    "decide",
    "in_chunks",
    "interrupted",
    "is_latest",
    "last_renewed",
    "new_run_id",
    "new_token",
    "outcome",
    "refusal",
    "restart_attempt",
    "retry_window_ms",
    "skew_diagnosis",
]

CAPABILITIES = Capabilities(
    leases=True, slot_memory=None, history_ttl=True, history_size_per_job=True
)

#: How far ahead of the backend's clock a claimed slot may be. Instances claim a slot at or
#: after its time, so this is only the disagreement allowed between their clocks and the
#: backend's: NTP keeps it to milliseconds; a few seconds leave room for a VM resuming.
DEFAULT_MAX_CLOCK_SKEW = timedelta(seconds=5)

INTERRUPTED_ERROR = "runner lost its lease"

#: What a claim answers once a slot too far ahead has been raised as ``ClockSkewError``.
Granted = Lease | Literal["overlap", "not-acquired"]
#: The run's record a release writes, if any: its job's policy and the record.
Ending = tuple[JobPolicy, RunRecord] | None


# -- claims --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClockName:
    """How messages name a lease backend's clock, and the machine whose time sync keeps it."""

    name: str  # "PostgreSQL's clock_timestamp()"
    host: str  # "the PostgreSQL server"


@dataclass(frozen=True, slots=True)
class ClockReading:
    """The store's clock as one claim's answer gave it, with this instance's wall and
    monotonic clocks when the answer came."""

    store_ms: int
    wall_ms: int
    mono_ms: int


#: Two gaps between a pair of clocks measured this close count as "neither clock moved": the
#: store reads its clock somewhere within the claim's round trip. A second more per 2000 s
#: between the readings: NTP slews a clock by at most 500 ppm.
_STEADY_MS = 1000
_SLEW_DIVISOR = 2000

ClockMoved = Literal["instance", "store"] | None


def skew_diagnosis(
    agreed: ClockReading | None, now: ClockReading | None, store: ClockName
) -> tuple[ClockMoved, str]:
    """Which clock moved, from the reading of the last claim that passed the time check
    (``agreed``) and the refused one's (``now``); the sentence that tells the operator.

    This instance's wall clock minus its monotonic clock changes only when the wall clock
    steps; the store's clock minus this instance's monotonic clock changes when the store's
    steps. So if the first held still and the second fell, the store's clock went back.
    """
    if agreed is None or now is None:
        return None, (
            f"this instance's clock is fast, or {store.name} is slow (no claim of this "
            "instance has passed this check yet, so it cannot tell which): fix the time sync "
            "(NTP) of the one that is wrong, or raise max_clock_skew"
        )
    elapsed = now.mono_ms - agreed.mono_ms
    own = (now.wall_ms - now.mono_ms) - (agreed.wall_ms - agreed.mono_ms)
    theirs = (now.store_ms - now.mono_ms) - (agreed.store_ms - agreed.mono_ms)
    steady = _STEADY_MS + elapsed // _SLEW_DIVISOR
    since = f"since its last accepted claim {_about(elapsed)} ago"
    if abs(theirs) <= steady and own > steady:
        return "instance", (
            f"this instance's clock stepped forward by ~{_about(own)} {since}, while "
            f"{store.name} kept time with its monotonic clock: fix this instance's time sync "
            "(NTP), or raise max_clock_skew"
        )
    if abs(own) <= steady and theirs < -steady:
        gap = agreed.store_ms - agreed.wall_ms
        was = f"~{_about(abs(gap))} {'ahead of' if gap > 0 else 'behind'} it"
        if abs(gap) < _STEADY_MS:
            was = "within a second of it"
        return "store", (
            f"{store.name} appears to have stepped back by ~{_about(-theirs)}: this instance's "
            f"clock kept time with its monotonic clock {since}, when {store.name} read {was}; "
            f"fix the time sync (NTP) of {store.host}: every instance is refused the same "
            "way until it is fixed (or max_clock_skew is raised above the step)"
        )
    return None, (
        f"this instance's clock is fast, or {store.name} is slow: {since}, this instance's "
        f"clock moved {_signed(own)} against its monotonic clock and {store.name} "
        f"{_signed(theirs)}; fix the time sync (NTP) of the one that is wrong, or raise "
        "max_clock_skew"
    )


def _about(ms: int) -> str:
    """A duration rounded for a message: to the second from a second on."""
    rounded = round(ms, -3) if ms >= 1000 else round(ms, -1)
    return format_duration(timedelta(milliseconds=rounded))


def _signed(ms: int) -> str:
    return ("+" if ms >= 0 else "-") + _about(abs(ms))


def check_slot_time(
    slot: Slot,
    store_ms: int,
    max_skew: timedelta,
    *,
    backend: str,
    store: ClockName,
    now: ClockReading | None = None,
    agreed: ClockReading | None = None,
) -> None:
    """Raise ``ClockSkewError`` if ``slot`` is more than ``max_skew`` ahead of ``store_ms``, the
    backend's clock; the message says which clock moved (``skew_diagnosis`` of ``agreed``, the
    last accepted claim's reading, and ``now``, this answer's)."""
    ahead_ms = slot.slot_ms - store_ms
    if ahead_ms <= to_ms(max_skew):
        return
    ahead = format_duration(timedelta(milliseconds=ahead_ms))
    moved, why = skew_diagnosis(agreed, now, store)
    raise ClockSkewError(
        f"{backend} refused {slot.key}: the slot ({ms_to_datetime(slot.slot_ms).isoformat()}) "
        f"is {ahead} ahead of {store.name} ({ms_to_datetime(store_ms).isoformat()}), more "
        f"than max_clock_skew ({format_duration(max_skew)}); {why}",
        slot_ms=slot.slot_ms,
        ahead_ms=ahead_ms,
        moved=moved,
    )


@dataclass(frozen=True, slots=True)
class JobState:
    """A job's fences and liveness as read back after a refused claim (``None``: no row)."""

    fence: int | None  # the latest scheduled, catch-up or retried slot claimed
    manual_fence: int | None  # the latest manual slot claimed
    live: bool
    taken: bool = False  # the claimed slot has a lease row (run or handed over) already


def refusal(
    reason: RunReason, slot_ms: int, state: JobState | None, policy: JobPolicy
) -> Literal["overlap", "not-acquired"]:
    """Why a claim was refused, from the job's state as read after the refusal, in the order
    ``_acquire`` decides.

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
    if state.taken:
        return "not-acquired"  # a manual run at a scheduled slot's very instant (``_acquire``)
    return "overlap" if policy.exclusive and state.live else "not-acquired"


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


def outcome(decide: Callable[..., Granted], *args: object) -> LeaseOutcome:
    """``decide(*args)``, or the ``BackendError`` it raised: a batch's outcome of one claim
    (one claim's error never fails the others)."""
    try:
        return decide(*args)
    except BackendError as exc:
        return exc


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


def last_renewed(dead: DeadRun, now: datetime, ttl_ms: int) -> datetime:
    """When ``dead``'s runner last renewed its lease (or was granted it), on the taker's clock
    read at ``now``: its runner's last sign of life. Every grant and renewal sets the lease to
    expire ``lease_ttl`` later, and it expired ``waited_ms`` ago (both durations on the store's
    clock, so the instances' clocks need not agree). Never before the run started, nor after
    ``now`` (a runner configured with another ``lease_ttl`` than the taker's)."""
    renewed = now - timedelta(milliseconds=dead.waited_ms + ttl_ms)
    return min(max(renewed, dead.started_at), now)


def interrupted(
    dead: DeadRun,
    now: datetime,
    *,
    restarted: bool,
    window_ms: int | None,
    ttl_ms: int,
    max_attempts: int | None = None,
) -> RunRecord | None:
    """The history record a taker writes for ``dead``, or ``None`` for a hand-over (its runner
    recorded the run itself when it stopped). A dead runner cannot record its run, and a runner
    that lost its lease leaves the record to the taker, so each lost attempt is recorded once.
    The run is recorded as ending at its runner's last sign of life (``last_renewed``), not at
    the take-over, which comes a lease and a sweep later.
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
        finished_at=last_renewed(dead, now, ttl_ms),
        outcome="interrupted",
        error=error,
    )


# -- the decision ----------------------------------------------------------------------------
#
# The lease protocol as one pure function: ``decide(row, request, now_ms)`` takes what a backend
# stores for one job and one request, and returns the job's new row and the answer. The memory
# backend *is* this function; the SQL statements and the Lua scripts implement the same rules
# and are checked against it by ``brokersched.testing.conformance`` (a stateful property test:
# random sequences of claims, renewals, releases, expiries, manual runs and take-overs).


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """A slot being run (``running``) or offered to another instance (``handover``)."""

    token: str
    run_id: str
    instance_id: str
    reason: RunReason
    attempt: int
    state: Literal["running", "handover"]
    started_ms: int  # on the claimer's clock (history times are the instances')
    expires_ms: int  # on the store's clock; a hand-over sets it to the moment of the hand-over

    def live(self, now_ms: int) -> bool:
        """Held by a runner that renews it: it blocks ``overlap="skip"`` and ``"replace"``."""
        return self.state == "running" and self.expires_ms > now_ms


@dataclass(frozen=True, slots=True)
class JobRow:
    """What a lease backend stores for one job (SQL: a ``jobs`` row and its ``leases`` rows).

    ``fence``: the latest scheduled, catch-up or retried slot claimed; ``manual_fence``: the
    latest manual one (manual runs never move ``fence``). ``leases``: by slot; a finished run's
    lease is gone (the fence keeps its slot claimed). Never changed in place: ``decide`` returns
    a new row.
    """

    fence: int | None = None
    manual_fence: int | None = None
    leases: Mapping[int, LeaseRow] = field(default_factory=dict)

    def live_except(self, slot_ms: int, now_ms: int) -> bool:
        return any(lease.live(now_ms) for s, lease in self.leases.items() if s != slot_ms)

    def state(self, now_ms: int | None = None) -> LeaseState:
        """What ``LeaseBackend.lease_state`` answers for this row, read at ``now_ms`` on the
        store's clock."""
        return LeaseState(self.fence, self.manual_fence, frozenset(self.leases), now_ms)


@dataclass(frozen=True, slots=True)
class Acquire:
    slot_ms: int
    reason: RunReason
    overlap: Overlap
    token: str
    run_id: str
    instance_id: str
    started_ms: int


@dataclass(frozen=True, slots=True)
class Renew:
    slot_ms: int
    token: str


@dataclass(frozen=True, slots=True)
class Release:
    slot_ms: int
    token: str
    handover: bool = False


@dataclass(frozen=True, slots=True)
class TakeOver:
    policy: JobPolicy
    instance_id: str
    started_ms: int
    # A restarted slot's lease token and run id (by slot): fresh random ones.
    fresh: Callable[[int], tuple[str, str]] = lambda _slot_ms: (new_token(), new_run_id())


@dataclass(frozen=True, slots=True)
class TooFarAhead:
    """A claim refused because its slot is more than ``max_clock_skew`` ahead of the store."""

    ahead_ms: int


@dataclass(frozen=True, slots=True)
class TakenOver:
    leases: list[Lease]
    records: list[RunRecord]  # the dead attempts, recorded ``interrupted`` by the taker


Request = Acquire | Renew | Release | TakeOver
AcquireAnswer = Lease | Literal["overlap", "not-acquired"] | TooFarAhead
Answer = AcquireAnswer | bool | None | TakenOver


@dataclass(frozen=True, slots=True)
class Store:
    """The store's side of a decision: its clock and the backend's settings."""

    now_ms: int
    ttl_ms: int
    max_skew_ms: int


def decide(job: str, row: JobRow, request: Request, store: Store) -> tuple[JobRow, Answer]:
    """The lease protocol: ``row`` after ``request``, and the answer (see each case below)."""
    match request:
        case Acquire():
            return _acquire(job, row, request, store)
        case Renew():
            return _renew(row, request, store)
        case Release():
            return _release(row, request, store), None
        case TakeOver():
            return _take_over(job, row, request, store)


def _acquire(job: str, row: JobRow, claim: Acquire, store: Store) -> tuple[JobRow, AcquireAnswer]:
    """Granted only for a slot later than the job's fence (manual runs: the manual fence), not
    ahead of the store's clock by more than ``max_clock_skew``, whose lease row is free (a
    manual run at a scheduled slot's very instant), and, with ``overlap`` ``"skip"`` or
    ``"replace"`` (which the scheduler retries once the live run is cut), while no lease
    of the job is live. A catch-up is granted only for a job claimed before."""
    now, slot = store.now_ms, claim.slot_ms
    if slot - now > store.max_skew_ms:
        return row, TooFarAhead(slot - now)
    manual = claim.reason == "manual"
    fence = row.manual_fence if manual else row.fence
    if fence is not None and slot <= fence:
        return row, "not-acquired"
    if claim.reason == "catch-up" and row.fence is None:
        return row, "not-acquired"
    if slot in row.leases:
        return row, "not-acquired"
    if claim.overlap != "allow" and row.live_except(slot, now):
        return row, "overlap"
    lease = LeaseRow(
        claim.token, claim.run_id, claim.instance_id, claim.reason, 1, "running",
        claim.started_ms, now + store.ttl_ms,
    )  # fmt: skip
    leases = {**row.leases, slot: lease}
    fence, manual_fence = (row.fence, slot) if manual else (slot, row.manual_fence)
    granted = Lease(job, slot, claim.token, claim.run_id, 1, claim.reason)
    return JobRow(fence, manual_fence, leases), granted


def _renew(row: JobRow, renew: Renew, store: Store) -> tuple[JobRow, bool]:
    """Extended by ``lease_ttl`` only while live and still this token's."""
    lease = row.leases.get(renew.slot_ms)
    if lease is None or lease.token != renew.token or not lease.live(store.now_ms):
        return row, False
    renewed = replace(lease, expires_ms=store.now_ms + store.ttl_ms)
    return JobRow(row.fence, row.manual_fence, {**row.leases, renew.slot_ms: renewed}), True


def _release(row: JobRow, release: Release, store: Store) -> JobRow:
    """Ends the lease if it is still this token's, also after it expired (nobody took the slot
    over yet: the run finished, and must not look dead). A hand-over offers it to
    ``take_over`` at once."""
    lease = row.leases.get(release.slot_ms)
    if lease is None or lease.token != release.token:
        return row  # stale: the slot was taken over, or released already
    leases = dict(row.leases)
    if release.handover:
        leases[release.slot_ms] = replace(lease, state="handover", expires_ms=store.now_ms)
    else:
        del leases[release.slot_ms]
    return JobRow(row.fence, row.manual_fence, leases)


def _take_over(job: str, row: JobRow, take: TakeOver, store: Store) -> tuple[JobRow, TakenOver]:
    """Every dead lease (expired while running, or handed over), latest slot first: restarted
    (``restart_attempt``) or dropped, the dead attempt recorded once (``interrupted``). With
    ``overlap`` ``"skip"`` or ``"replace"`` a restart waits while another run of the job is
    live (a manual run granted since, or a restart of this sweep): it is left as it is for a
    later sweep."""
    now, policy = store.now_ms, take.policy
    window_ms = retry_window_ms(policy, timedelta(milliseconds=store.ttl_ms))
    leases = dict(row.leases)
    taken = TakenOver([], [])
    for slot in sorted((s for s, lease in row.leases.items() if not lease.live(now)), reverse=True):
        lease = leases[slot]
        dead = DeadRun(
            job, slot, lease.run_id, lease.instance_id, lease.reason, lease.attempt,
            lease.state, ms_to_datetime(lease.started_ms), now - lease.expires_ms,
        )  # fmt: skip
        latest = is_latest(slot, row.fence, row.manual_fence)
        attempt = restart_attempt(dead, latest=latest, policy=policy, window_ms=window_ms)
        blocked = JobRow(row.fence, row.manual_fence, leases).live_except(slot, now)
        if attempt is not None and policy.exclusive and blocked:
            continue
        record = interrupted(
            dead,
            ms_to_datetime(take.started_ms),  # history times are the instances'
            restarted=attempt is not None,
            window_ms=window_ms,
            ttl_ms=store.ttl_ms,
            max_attempts=policy.max_attempts,
        )
        if record is not None:
            taken.records.append(record)
        if attempt is None:
            del leases[slot]
            continue
        token, run_id = take.fresh(slot)
        leases[slot] = LeaseRow(
            token, run_id, take.instance_id, "retry", attempt, "running", take.started_ms,
            now + store.ttl_ms,
        )  # fmt: skip
        taken.leases.append(Lease(job, slot, token, run_id, attempt, "retry"))
    return JobRow(row.fence, row.manual_fence, leases), taken


#: The least time a renewal or a release is given, however short ``lease_ttl`` is.
MIN_RENEW_TIMEOUT_S = 0.2


class LeaseBackendBase(LeaseBackend):
    """What every lease backend shares: ``lease_ttl`` and ``max_clock_skew`` (checked once, the
    same way), the capabilities, the bound on renewals and releases, and the time check of a
    claimed slot with what this instance saw of the store's clock."""

    #: The backend's clock, as refusals name it.
    clock_name: ClassVar[ClockName] = ClockName("the backend's clock", "the backend's host")
    #: Where ``take_over()`` says that a job's slots could not be taken over.
    _log: ClassVar[logging.Logger] = logging.getLogger("brokersched.backends")

    def __init__(self, options: LeaseOptions) -> None:
        super().__init__()
        self._lease_ttl, self._max_clock_skew = options.lease_ttl, options.max_clock_skew
        self._agreed: ClockReading | None = None  # the last claim answer that passed the check

    def _check_slot_time(
        self, slot: Slot, store_ms: int, clock: Clock | None, *, granted: bool = False
    ) -> None:
        """``check_slot_time`` of a claim's answer, which carried the store's clock
        (``store_ms``), with this instance's ``clock`` read now; an answer that passes (or was
        ``granted``: the store checked it already) with both clocks within ``max_clock_skew``
        of each other is remembered, to tell which clock moved at a later refusal.

        Every claim's answer, granted or not, comes through here: the store's clock comes with
        it at no cost.
        """
        now = None
        if clock is not None:
            now = ClockReading(store_ms, clock.now_ms(), clock.monotonic_ms())
        if not granted:
            check_slot_time(
                slot,
                store_ms,
                self._max_clock_skew,
                backend=self.name,
                store=self.clock_name,
                now=now,
                agreed=self._agreed,
            )
        if now is not None and abs(now.store_ms - now.wall_ms) <= to_ms(self._max_clock_skew):
            # Only a reading where both clocks agreed: a claim accepted after the store's clock
            # stepped back (a slot old enough to pass) must not become the reference, or the
            # next refusal could no longer tell which clock moved.
            self._agreed = now

    def _store(self, now_ms: int) -> Store:
        """The store's side of a decision (``decide``) at ``now_ms`` on its clock."""
        return Store(now_ms, self._ttl_ms, self._skew_ms)

    async def acquire(
        self,
        slot: Slot,
        *,
        policy: JobPolicy,
        instance_id: str,
        run_id: str,
        reason: RunReason,
        timeout: float,
    ) -> Granted:
        return await self._acquire(Claim(slot, run_id, policy, reason), instance_id, timeout)

    @abstractmethod
    async def _acquire(self, claim: Claim, instance_id: str, timeout: float) -> Granted:
        """``acquire()`` of one claim (``LeaseBackend.acquire`` is the contract)."""

    async def release(self, lease: Lease, *, handover: bool = False, record: Ending = None) -> None:
        await self._end_lease(lease, handover, record)

    @abstractmethod
    async def _end_lease(self, lease: Lease, handover: bool, record: Ending) -> None:
        """``release()`` of one lease (``LeaseBackend.release`` is the contract)."""

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """Job by job (``_take_over_job``). A job that fails after others gave leases is
        logged and left for the next sweep: the leases already granted must reach their
        runner."""
        leases: list[Lease] = []
        for policy in {policy.name: policy for policy in policies}.values():
            try:
                leases += await self._take_over_job(policy, instance_id)
            except BackendError:
                if not leases:
                    raise
                self._log.warning(
                    "%s could not take over the slots of %s", self.name, policy.name, exc_info=True
                )
        return leases

    async def _take_over_job(self, policy: JobPolicy, instance_id: str) -> list[Lease]:
        """``take_over()`` of one job, for a backend that keeps this class's ``take_over``."""
        raise NotImplementedError(f"{self.name} takes over every job at once")

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

"""Missed slots: a scheduled slot of a claimed job that no instance ran within its lateness
bound, found by the fleet and reported once.

An instance knows what became of a slot when it ran it, lost its claim (another instance has
it) or skipped it on purpose (paused, disabled, ``skip(n)``, overlap). When it skipped the slot
as late, for a backend error or for a clock skew, another instance may have run it, or none did.
Such an instance *watches* the slot: once the fleet's last claim of it could have landed (the
slot plus ``max_late``, and a margin for the clocks and a claim's flight; on a lease backend,
by the store's clock) it asks the backend, through an operation that only one instance can
win, again every few seconds while the backend fails it:

* a claim-only backend: it claims the slot itself. Won, nobody had claimed it, and nobody can
  any more (this claim holds it): the slot is missed, and this instance alone says so. It asks
  only while the backend remembers the slot's claims (``ClaimBackend.claim_deadline_ms``);
  later it cannot tell, and says nothing.
* a lease backend: a slot that was leased still holds its lease or has a record in the history.
  With neither, the instance claims the *report*: a record of the slot in the fleet's records,
  put only if there is none (``Backend.report_missed``), so one report per slot wins.

An instance that won a slot's claim but had its answer too late to run reports it at once (on a
lease backend through the same report claim: a checker may have looked before its grant).

A report is a history record (reason and outcome ``missed``), a ``missed`` event
(``MissedEvent``, which ``brokersched_slots_missed_total`` counts) and a warning in the log, on
the reporting instance alone. Limits (docs/operations.md, "Missed slots"): a slot that fell
due while no instance ran is reported by none; nor one whose watchers all stopped before their
check, or could not reach the backend for three minutes after it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._clock import Timer, datetime_to_ms, ms_to_datetime
from ._durations import format_duration, to_ms
from ._events import MissedEvent, SkipReason
from ._exceptions import BackendError, ClockSkewError
from ._job import JobState
from ._runlog import RunLog
from ._tasks import TaskSet
from .abc import (
    Backend,
    ClaimBackend,
    Lease,
    LeaseBackend,
    RunRecord,
    Slot,
    new_run_id,
)

__all__ = ["UNKNOWN_FATE", "MissedSlots"]

logger = logging.getLogger("brokersched")

#: The skips after which this instance cannot tell whether another one ran the slot.
UNKNOWN_FATE: frozenset[SkipReason] = frozenset({"late", "backend-error", "clock-skew"})
# Past max_late, what a check waits at least for the last claims (a claim's flight, the
# clocks' disagreement on a claim-only backend is in its claim_margin).
_MARGIN_MS = 2_000
# A check the backend failed is tried again this much later, until this long after the slot's
# max_late (a backend back from an outage, the outage that made the slot missed, is asked
# again), or on a claim-only backend until its claim deadline.
_RETRY_MS = 5_000
_GIVE_UP_MS = 180_000
# A claim-only backend's check is sent no closer to its claim deadline than this.
_FLIGHT_MS = 1_000
_CHECK_TIMEOUT_S = 5.0
# The most slots a frozen process's wake watches per job (the latest).
_MAX_PASSED = 100


@dataclass(slots=True)
class _Watched:
    """A job's slots this instance watches: slot -> (when to check it, when to give up), and the
    timer of the first check."""

    job: JobState
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)
    timer: Timer | None = None
    timer_at: int = 0


class MissedSlots:
    """The slots one scheduler watches, its checks and its reports."""

    def __init__(self, backend: Backend, tasks: TaskSet, runlog: RunLog) -> None:
        """``runlog``: the runner's, whose clock, instance id, events and recorder it uses."""
        self.backend = backend
        self.tasks = tasks
        self.clock, self.instance_id = runlog.clock, runlog.instance_id
        self.events, self.recorder = runlog.events, runlog.recorder
        self._watched: dict[str, _Watched] = {}  # job key -> its watched slots
        self._checking = 0  # checks and report claims under way
        self.closed = False

    @property
    def idle(self) -> bool:
        """No slot watched, no check nor report under way."""
        return not self._watched and not self._checking

    def watch(self, job: JobState, slot_ms: int) -> None:
        """Check ``slot_ms`` once no instance can claim it any more (see the module)."""
        if self.closed or not job.settings.claim:
            return
        if not isinstance(self.backend, ClaimBackend | LeaseBackend):
            return  # a backend of another kind: nothing to ask
        at_ms = self._check_at(job, slot_ms)
        if at_ms is None:
            return
        watched = self._watched.setdefault(job.settings.key, _Watched(job))
        watched.job = job
        give_up = slot_ms + job.settings.max_late_ms + _GIVE_UP_MS
        watched.slots.setdefault(slot_ms, (at_ms, give_up))
        self._arm(watched)

    def watch_passed(self, job: JobState, after_ms: int, through_ms: int) -> None:
        """Watch the slots after ``after_ms`` through ``through_ms``, which a frozen process
        passed over (the latest ``_MAX_PASSED`` of them)."""
        slots: deque[int] = deque(maxlen=_MAX_PASSED)
        gap_ms = _gap_ms(job)
        if gap_ms is not None:  # a process frozen for a day: not a day of slots walked through
            after_ms = max(after_ms, through_ms - _MAX_PASSED * gap_ms - 1)
        at = job.spec.schedule.next_ms(after_ms)
        while at is not None and at <= through_ms:
            slots.append(at)
            at = job.spec.schedule.next_ms(at)
        for slot_ms in slots:
            self.watch(job, slot_ms)

    def won_late(self, job: JobState, slot_ms: int, lease: Lease | None) -> None:
        """This instance won the slot's claim (``lease`` on a lease backend, ended already) but
        too late to run it: nobody else can run it, so it is missed."""
        if self.closed:
            return
        detail = f"its claim here was answered after max_late ({_max_late(job)})"
        if lease is None:
            self._report(job, slot_ms, detail)
            return
        self._spawn(self._claim_report(job, slot_ms, detail))

    def close(self) -> None:
        """Stop watching: the scheduler stops (its watched slots go unchecked here)."""
        self.closed = True
        for watched in self._watched.values():
            if watched.timer is not None:
                watched.timer.cancel()
        self._watched.clear()

    # -- when ----------------------------------------------------------------------------

    def _check_at(self, job: JobState, slot_ms: int) -> int | None:
        """When to check ``slot_ms`` (this instance's clock); ``None``: it cannot be told."""
        at_ms = slot_ms + job.settings.max_late_ms + _MARGIN_MS
        backend = self.backend
        if isinstance(backend, LeaseBackend):
            # an instance whose clock is behind claims that much later, a checker whose clock
            # is ahead checks that much earlier
            return at_ms + 2 * to_ms(backend.max_clock_skew)
        assert isinstance(backend, ClaimBackend)
        at_ms += to_ms(backend.capabilities.claim_margin)
        deadline = backend.claim_deadline_ms(Slot(job.settings.key, slot_ms))
        if deadline is None:
            return at_ms
        latest = deadline - _FLIGHT_MS
        return min(at_ms, latest) if latest > self.clock.now_ms() else None

    def _arm(self, watched: _Watched) -> None:
        """A timer at the first check of ``watched`` (unless one comes sooner already)."""
        if not watched.slots:
            return
        at_ms = min(at for at, _ in watched.slots.values())
        if watched.timer is not None:
            if watched.timer_at <= at_ms:
                return
            watched.timer.cancel()
        key = watched.job.settings.key

        def fire() -> None:
            watched.timer = None
            self._spawn(self._check(key))

        watched.timer_at = at_ms
        watched.timer = self.clock.call_later(max(at_ms - self.clock.now_ms(), 0), fire)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._checking += 1

        async def counted() -> None:
            try:
                await work
            finally:
                self._checking -= 1

        self.tasks.spawn(counted(), name="brokersched:missed")

    # -- checks --------------------------------------------------------------------------

    async def _check(self, key: str) -> None:
        """Check every slot of ``key`` whose time has come (one read for them all on a lease
        backend). They are taken out of the watch while checked, so that a check armed
        meanwhile leaves them alone."""
        watched = self._watched.get(key)
        if watched is None or self.closed:
            return
        job, now = watched.job, self.clock.now_ms()
        due = {
            s: watched.slots.pop(s)[1] for s, (at, _) in list(watched.slots.items()) if at <= now
        }
        wanted = [] if job.removed else sorted(s for s in due if not _stopped(job, s))
        try:
            missed, later = await self._missed(job, wanted)
        except (BackendError, ClockSkewError, TimeoutError) as exc:
            missed = []
            self._retry(watched, due, exc)
        else:  # those the store's clock says may still be claimed: checked then
            for slot_ms, at_ms in later.items():
                watched.slots.setdefault(slot_ms, (at_ms, due[slot_ms]))
        if not self.closed:
            self._arm(watched)
            if not watched.slots and self._watched.get(key) is watched:
                del self._watched[key]
        for slot_ms in missed:
            await self._claim_report(job, slot_ms, _WATCHED_DETAIL)

    async def _missed(self, job: JobState, slots: list[int]) -> tuple[list[int], dict[int, int]]:
        """Which of ``slots`` no instance ran, and those to check again later, with when. On a
        claim-only backend, each claimed here is reported at once, and none returned."""
        if not slots:
            return [], {}
        backend, key = self.backend, job.settings.key
        if isinstance(backend, ClaimBackend):
            for slot_ms in slots:  # each reported as soon as won: a later claim may fail
                if await self._claim_slot(backend, job, slot_ms):
                    self._report(job, slot_ms, _WATCHED_DETAIL)
            return [], {}
        assert isinstance(backend, LeaseBackend)
        state = await backend.lease_state(key)
        later: dict[int, int] = {}
        if state.now_ms is not None:
            # Judged on the store's clock, which every instance's claims are: an instance whose
            # clock runs ahead must not find a slot missed that the fleet may still claim.
            margin = job.settings.max_late_ms + _MARGIN_MS + to_ms(backend.max_clock_skew)
            now = self.clock.now_ms()
            for slot_ms in slots:
                if state.now_ms < slot_ms + margin:
                    wait_ms = slot_ms + margin - state.now_ms
                    later[slot_ms] = now + max(wait_ms, _FLIGHT_MS)
            slots = [s for s in slots if s not in later]
            if not slots:
                return [], later
        records = await self._records_since(backend, job, slots[0])
        ran = state.leased | {record.slot_ms for record in records}
        missed = [
            s for s in slots if s not in ran and not _overlapped(job, s, state.leased, records)
        ]
        return missed, later

    async def _claim_slot(self, backend: ClaimBackend, job: JobState, slot_ms: int) -> bool:
        """Claim ``slot_ms`` for its check; ``True``: won, so nobody had claimed it. Only while
        the backend remembers the slot's claims, landing before it forgets them."""
        slot = Slot(job.settings.key, slot_ms)
        deadline, now = backend.claim_deadline_ms(slot), self.clock.now_ms()
        timeout = _CHECK_TIMEOUT_S
        if deadline is not None:
            if deadline - _FLIGHT_MS < now:  # (a retry, or a clock stepped)
                logger.warning(_TOO_LATE, slot.key)
                return False
            timeout = min(timeout, (deadline - now) / 1000)
        return await backend.claim(
            slot, instance_id=self.instance_id, run_id=new_run_id(), timeout=timeout
        )

    async def _records_since(
        self, backend: LeaseBackend, job: JobState, oldest_ms: int
    ) -> list[RunRecord]:
        """The job's newest records, back to the runs of ``oldest_ms`` (as far as the history
        keeps them): a guess of how many first, all it keeps if manual runs, backfills or
        retries made more."""
        policy = job.settings.policy
        limit = self._history_limit(job, oldest_ms)
        records = await backend.history(policy, limit)
        oldest = ms_to_datetime(oldest_ms)
        if len(records) >= limit and records[-1].started_at > oldest:
            records = await backend.history(policy, max(policy.history_size, limit))
        return records

    def _history_limit(self, job: JobState, oldest_ms: int) -> int:
        """Enough of the newest records to reach back to ``oldest_ms``: two per slot since
        (at most, one every ``min_gap``; a retry each), and some."""
        gap_ms = _gap_ms(job)
        count = 1 if gap_ms is None else (self.clock.now_ms() - oldest_ms) // gap_ms + 1
        return min(2 * count + 10, max(job.settings.policy.history_size, 10))

    def _retry(self, watched: _Watched, give_ups: dict[int, int], exc: BaseException) -> None:
        """Each slot of ``give_ups`` (slot -> when to give up) checked again in ``_RETRY_MS``,
        or given up (said in the log)."""
        retry_at = self.clock.now_ms() + _RETRY_MS
        for slot_ms, give_up in give_ups.items():
            if retry_at <= give_up:
                watched.slots.setdefault(slot_ms, (retry_at, give_up))
                continue
            logger.warning(
                "cannot tell whether slot %s:%d ran anywhere: %s",
                watched.job.settings.key,
                slot_ms,
                str(exc) or type(exc).__name__,
            )

    # -- reports -------------------------------------------------------------------------

    async def _claim_report(self, job: JobState, slot_ms: int, detail: str) -> None:
        """A lease backend: report ``slot_ms`` if this instance is the first to claim its
        report (``Backend.report_missed``), tried again while the backend fails it."""
        slot = Slot(job.settings.key, slot_ms)
        give_up = self.clock.now_ms() + _GIVE_UP_MS
        while True:
            try:
                first = await self.backend.report_missed(slot, instance_id=self.instance_id)
            except (BackendError, TimeoutError) as exc:
                if self.closed or self.clock.now_ms() + _RETRY_MS > give_up:
                    logger.warning(
                        "cannot report slot %s as missed: %s",
                        slot.key,
                        str(exc) or type(exc).__name__,
                    )
                    return
                await self.clock.sleep(_RETRY_MS / 1000)
                continue
            if first:
                self._report(job, slot_ms, detail)
            return

    def _report(self, job: JobState, slot_ms: int, detail: str) -> None:
        at = ms_to_datetime(self.clock.now_ms())  # when it was found: the history's order
        error = f"no instance ran it within max_late ({_max_late(job)}): {detail}"
        record = RunRecord(
            job=job.settings.key,
            slot_ms=slot_ms,
            run_id=new_run_id(),
            instance_id=self.instance_id,
            reason="missed",
            attempt=0,
            started_at=at,
            finished_at=at,
            outcome="missed",
            error=error,
        )
        self.recorder.put(job.settings.policy, record)
        logger.warning(
            "missed job=%s slot=%d instance_id=%s detail=%s",
            job.name,
            slot_ms,
            self.instance_id,
            error,
            extra={"event": "missed", "job": job.name, "slot": slot_ms},
        )
        self.events.emit("missed", MissedEvent(job.name, slot_ms, error))


_WATCHED_DETAIL = "skipped here, and claimed by no other instance"
_TOO_LATE = (
    "cannot tell whether slot %s ran anywhere: the backend forgets its claims before it can be "
    "asked (slot_ttl)"
)


def _gap_ms(job: JobState) -> int | None:
    """The shortest time between two slots of ``job``, in ms (``None``: one slot at most)."""
    gap = job.spec.schedule.min_gap()
    return None if gap is None else max(1, to_ms(gap))


def _max_late(job: JobState) -> str:
    return format_duration(timedelta(milliseconds=job.settings.max_late_ms))


def _stopped(job: JobState, slot_ms: int) -> bool:
    """The fleet's controls stopped ``slot_ms`` on purpose: a skip over it, or a pause or a
    disable made before its claims were over (one made later, after an outage say, did not
    stop it: the slot was missed all the same). A halt whose change is not in the audit trail
    any more (or this instance's own, not written yet) counts."""
    why = job.stops(slot_ms)
    control = job.control
    if why is None or why == "skipped" or control is None:
        return why is not None
    action = "disable" if why == "disabled" else "pause"
    made = next((c for c in reversed(control.changes) if c.action == action), None)
    return made is None or datetime_to_ms(made.at) <= slot_ms + job.settings.max_late_ms


def _overlapped(
    job: JobState, slot_ms: int, leased: frozenset[int], records: list[RunRecord]
) -> bool:
    """With ``overlap="skip"``, an earlier slot's run still going at ``slot_ms``: the fleet
    skipped the slot on purpose."""
    if job.settings.policy.overlap != "skip":
        return False
    if any(s < slot_ms for s in leased):
        return True
    due = ms_to_datetime(slot_ms)
    return any(
        r.slot_ms < slot_ms
        and r.started_at <= due
        and (r.finished_at is None or r.finished_at > due)
        for r in records
    )

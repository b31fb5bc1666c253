"""Backfill: ``Scheduler.backfill(name, start, end)`` runs a job's slots of a past range that
never ran (``ctx.reason == "backfill"``), one after the other, at most ``rate`` a second.

A slot runs at most once, whatever else happens to it meanwhile (its scheduled run still going,
a late claim in its jitter, a catch-up, a take-over, a retry, another backfill). On a lease
backend each slot, at its turn, is judged on what the store holds, in this order:

1. **Its lease.** A slot that holds a lease (its run is going, was handed over, or its runner
   died and nobody took it over yet) is the fleet's: ``not-acquired``.
2. **Its record**, read after 1: a slot with a run in the job's history ran: ``already-run``.
   A lease run's record lands before its lease ends (``Recorder.written``), so a slot holds a
   lease or has its record, never neither: a run 1 did not see, 2 does (unless the history
   trimmed it: ``history_size``, ``history_ttl``).
3. **Its claim**, on the record that fences the job's own runs: a slot later than the job's
   fence is claimed on the job's own row, which then refuses the fleet's late claim and a
   catch-up of it (one of them wins); an earlier one, which the fleet can no longer claim,
   under ``<key>:backfill``, whose own fence keeps two backfills from both running it (so a
   slot earlier than the latest one ever backfilled that way is refused: backfill older
   ranges first). After 1 and 2 no run of the slot can begin but through a claim, and the
   claim decides.

A dry run answers from the same reads, and from the ``<key>:backfill`` fence instead of a claim.
Slots the fleet may still claim on time (younger than ``jitter + max_late``) are left to it, on
every backend. On a lease backend their age is judged on the store's clock, read with the
lease state at each slot's turn (the clock the fleet's claims are judged on, within
``max_clock_skew``): a backfill whose own clock is fast never takes a slot not yet due.

On a claim-only backend the slot is claimed under the job's own key, as the fleet claimed it
when it fell due: only while the backend remembers that claim (``slot_ttl``, less its margin),
and only once the fleet's own claim of it is over (``jitter + max_late``, on this instance's
clock: a claim-only backend tells none other).
A ``claim=False`` job, claimed by nothing, is judged by its history alone, once its runs and
their records are surely over (``settle_ms``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from ._clock import Clock, datetime_to_ms, ms_to_datetime
from ._durations import format_duration, to_ms
from ._exceptions import BackendError, ClockSkewError, ConfigurationError
from ._job import JobState
from .abc import (
    ClaimBackend,
    JobPolicy,
    Lease,
    LeaseBackend,
    LeaseState,
    RunReason,
    RunRecord,
    Slot,
    new_run_id,
)

if TYPE_CHECKING:
    from ._runner import Runner

__all__ = [
    "MAX_SLOTS",
    "BackfillSlot",
    "Status",
    "backfill_key",
    "check_range",
    "check_rate",
    "run_backfill",
    "settle_ms",
]

logger = logging.getLogger("brokersched")

#: The most slots one backfill takes on (every second for a day is 86 400).
MAX_SLOTS = 100_000
# How long another instance's record of a run may take to reach the backend.
_RECORD_SLACK_MS = 10_000
# A claim's answer may come this long after max_late.
_CLAIM_SLACK_MS = 1000
# A backfilled slot is past max_late: its claim gets this long.
_CLAIM_TIMEOUT_S = 5.0
# History runs that count as a run of their slot (a manual or boot run is at its own instant).
_SLOT_RUNS: tuple[RunReason, ...] = ("schedule", "catch-up", "retry", "backfill")

Status = Literal["ran", "already-run", "not-acquired", "skipped", "would-run", "stopped"]
_Verdict = tuple[Status, str | None]

_HELD = (
    "the job's own run of this slot still holds its lease: the run is going, or was handed "
    "over, or its runner died and no instance has taken the slot over (to run it again, or "
    "record it interrupted) yet; backfill it again once the fleet's sweep has"
)
_FENCED = "an earlier backfill took this slot or a later one (backfill older ranges first)"
_DISABLED = "the job is disabled for the fleet (enable it to backfill)"


@dataclass(frozen=True, slots=True)
class BackfillSlot:
    """One slot of a backfill: ``index`` of ``total``, what became of it, and the record of
    its run (``ran``; its ``outcome`` says how it went).

    ``status``: ``ran``; ``already-run`` (in the history); ``not-acquired`` (the fleet or
    another backfill has it; ``detail`` says which when known); ``skipped`` (``detail`` says
    why: too recent or not due yet (on a lease backend, by the store's clock), too old for a
    claim-only backend's memory, the job disabled, the backend failed); ``would-run``
    (``dry_run``); ``stopped`` (the scheduler stopped first)."""

    at: datetime
    index: int
    total: int
    status: Status
    detail: str | None = None
    record: RunRecord | None = None


def backfill_key(key: str) -> str:
    """What a lease backend fences a job's backfilled slots under, once the job's own fence
    has passed them."""
    return f"{key}:backfill"


def check_range(job: JobState, start: datetime, end: datetime, now_ms: int) -> list[int]:
    """The slots of ``job`` in ``[start, end]``; refuses a range that ends in the future or
    before it starts, naive datetimes, and ``after()`` jobs."""
    owner = f"backfill of job '{job.name}'"
    for name, value in (("start", start), ("end", end)):
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise ConfigurationError(
                f"{owner}: {name} {value!r} must be a timezone-aware datetime", option=name
            )
    if end < start:
        raise ConfigurationError(
            f"{owner}: end ({end.isoformat()}) is before start ({start.isoformat()})",
            option="end",
            job=job.name,
        )
    if datetime_to_ms(end) > now_ms:
        raise ConfigurationError(
            f"{owner}: end ({end.isoformat()}) is in the future (now "
            f"{ms_to_datetime(now_ms).isoformat()}): a backfill runs past slots only, the "
            "scheduler runs the ones to come",
            option="end",
            job=job.name,
        )
    if job.kind == "after":
        raise ConfigurationError(
            f"{owner}: an after() job has no slots to backfill", option="name", job=job.name
        )
    slots: list[int] = []
    first, last = datetime_to_ms(start), datetime_to_ms(end)
    cursor = job.schedule.next_ms(first - 1)
    while cursor is not None and cursor <= last:
        slots.append(cursor)
        if len(slots) > MAX_SLOTS:
            raise ConfigurationError(
                f"{owner}: {start.isoformat()} to {end.isoformat()} holds more than "
                f"{MAX_SLOTS} slots of {job.schedule.describe()}; backfill a shorter range",
                option="start",
                job=job.name,
            )
        cursor = job.schedule.next_ms(cursor)
    return slots


def settle_ms(job: JobState) -> int:
    """How old a slot must be, when the history was read, for a backfill to take it.

    Claimed: ``jitter + max_late`` (and a moment for the claim's answer), the time the fleet
    has to claim it on time. On a lease backend a later claim is refused by the fence the
    backfill's claim shares with it (see the module). On a claim-only backend the slot's own
    claim would decide too, but a backfill's claim in that time would win the slot from the
    instance it fell due on, to run it early and as a backfill: it is left to the fleet, as
    on a lease backend. Unclaimed (``claim=False``), judged by the history alone: until
    nothing of the fleet can still run it nor record it: its scheduled run (``jitter +
    max_late``) or a catch-up (``catch_up``), the run itself (``timeout``, its retries),
    and its record on its way (``_RECORD_SLACK_MS``). A run without a ``timeout`` can last
    longer: see the README."""
    settings = job.settings
    if settings.claim:
        return settings.jitter_ms + settings.max_late_ms + _CLAIM_SLACK_MS
    window = max(settings.max_late_ms, settings.catch_up_ms)
    run = timedelta(0) if settings.timeout is None else settings.timeout
    if settings.retry is not None:
        run = settings.retry.worst_case(settings.timeout)[0]
    return settings.jitter_ms + window + to_ms(run) + _RECORD_SLACK_MS


def check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
        raise ConfigurationError(f"backfill: rate {rate!r} must be a number of slots a second")
    if rate <= 0:
        raise ConfigurationError(f"backfill: rate ({rate:g}/s) must be greater than 0")
    return float(rate)


async def run_backfill(
    runner: Runner,
    job: JobState,
    slots: list[int],
    history: Callable[[], Awaitable[list[RunRecord]]],
    *,
    rate: float,
    dry_run: bool,
    spawn: Callable[[Coroutine[Any, Any, RunRecord | None]], asyncio.Task[RunRecord | None]],
    progress: Callable[[BackfillSlot], object] | None,
) -> list[BackfillSlot]:
    """Take ``slots`` in order, at most ``rate`` a second: run those that never ran (``spawn``
    runs one through the runner), say what became of the others; ``progress`` is told each.
    ``history`` reads the job's history."""
    backfill = _Backfill(runner, job, history, dry_run=dry_run, spawn=spawn)
    return await backfill.run(slots, rate, progress)


class _Backfill:
    """One backfill of one job: the verdict on each slot, the claim, the run."""

    def __init__(
        self,
        runner: Runner,
        job: JobState,
        history: Callable[[], Awaitable[list[RunRecord]]],
        *,
        dry_run: bool,
        spawn: Callable[[Coroutine[Any, Any, RunRecord | None]], asyncio.Task[RunRecord | None]],
    ) -> None:
        self.runner = runner
        self.clock: Clock = runner.clock
        self.backend = runner.backend
        self.job = job
        self.history = history
        self.dry_run = dry_run
        self.spawn = spawn
        self.key = job.settings.key
        # Judged on the store (see the module): a lease backend, for a job that claims.
        self.leased = isinstance(self.backend, LeaseBackend) and job.settings.claim
        self.ran: set[int] = set()
        self.read_ms = 0  # when the history in ``ran`` was read
        self.fence: int | None = None  # a dry run's view of the ``<key>:backfill`` fence
        self.state = LeaseState()  # the job's, as read for the slot at hand
        # Why the slots left are not taken: one the backend failed on would be fenced away for
        # good by a later slot's claim, so the backfill stops there, to be run again from it.
        self.halted: str | None = None

    async def run(
        self, slots: list[int], rate: float, progress: Callable[[BackfillSlot], object] | None
    ) -> list[BackfillSlot]:
        if slots:
            await self._read_history()
            if self.dry_run and self.leased:
                self.fence = (await self._lease_state(backfill_key(self.key))).fence
        results: list[BackfillSlot] = []
        pace_ms, next_ms = round(1000 / rate), self.clock.monotonic_ms()
        for index, slot_ms in enumerate(slots, 1):
            status, detail, record = *await self._before(slot_ms), None
            if status == "would-run" and not self.dry_run:
                if (wait_ms := next_ms - self.clock.monotonic_ms()) > 0:
                    await self.clock.sleep(wait_ms / 1000)
                next_ms = self.clock.monotonic_ms() + pace_ms
                # After the wait (seconds at a slow rate), the controls are read again.
                status, detail = await self._controls() or await self._on_store(slot_ms)
                if (stopped := self._stopped()) is not None:
                    status, detail = "stopped", stopped
                elif status == "would-run":
                    status, detail, record = await self._take(slot_ms)
            elif status == "would-run":
                status, detail = await self._on_store(slot_ms)
            step = BackfillSlot(ms_to_datetime(slot_ms), index, len(slots), status, detail, record)
            if self._failed(step) and self.halted is None:
                self.halted = (
                    f"an earlier slot ({step.at.isoformat()}) could not be backfilled: run the "
                    "backfill again from it (claiming a later slot would fence it away)"
                )
            results.append(step)
            if progress is not None:
                progress(step)
        return results

    # -- the verdict: what a dry run says, what a real one does -------------------------------

    async def _before(self, slot_ms: int) -> _Verdict:
        """The verdict from what is known without asking the store: ``would-run`` means
        look at the store (``_on_store``)."""
        if slot_ms in self.ran:
            return "already-run", None
        if (stopped := self._stopped()) is not None:
            return "stopped", stopped
        if self.halted is not None:
            return "skipped", self.halted
        if (too_old := self._too_old(slot_ms)) is not None:
            return "skipped", too_old
        if (settle := settle_ms(self.job)) and slot_ms > self.read_ms - settle:
            wait = format_duration(timedelta(milliseconds=settle))
            return "skipped", (
                f"too recent: the fleet may still claim or run it (on this job, a backfill "
                f"takes slots at least {wait} old)"
            )
        return await self._controls() or ("would-run", None)

    async def _controls(self) -> _Verdict | None:
        """The verdict of the fleet's controls, read within the last second: a disabled job's
        slot is skipped."""
        if self.runner.fleet is not None:
            await self.runner.fleet.refresh(self.clock.now_ms() - 1000, within_ms=1000)
        if self.job.disabled:
            return "skipped", _DISABLED
        return None

    async def _on_store(self, slot_ms: int) -> _Verdict:
        """The verdict from the store, right before the claim: ``would-run`` means claim it
        (a dry run: it would be claimed, and run unless the fleet wins the claim first)."""
        if not self.leased:
            return "would-run", self._claim_only_caveat()
        try:
            self.state = await self._lease_state(self.key)
            if (early := self._early(slot_ms)) is not None:
                return "skipped", early
            if slot_ms in self.state.leased:
                return "not-acquired", _HELD
            if not self.dry_run:
                await self._read_history()  # after the lease: a run that ended is in it
                if slot_ms in self.ran:
                    return "already-run", None
        except BackendError as exc:
            return "skipped", f"the backend failed: {exc}"
        if self.dry_run and self.fence is not None and slot_ms <= self.fence:
            return "not-acquired", _FENCED  # the real run claims the backfills' fence first
        return "would-run", None

    def _early(self, slot_ms: int) -> str | None:
        """Why the slot is not the backfill's yet by the store's clock, read with the lease
        state: not due, or the fleet's to claim still. ``_before`` judged it on this
        instance's clock, which may be ahead of the fleet's."""
        store_ms = self.state.now_ms
        settle = settle_ms(self.job)
        if store_ms is None or slot_ms <= store_ms - settle:
            return None
        clock = f"{self.backend.name}'s clock ({ms_to_datetime(store_ms).isoformat()})"
        why = f"not due yet by {clock}" if slot_ms > store_ms else f"too recent by {clock}"
        wait = format_duration(timedelta(milliseconds=settle))
        detail = f"{why}: the fleet may still claim or run it (a backfill takes slots at least "
        detail += f"{wait} old, by the store's clock)"
        if (ahead_s := round((self.clock.now_ms() - store_ms) / 1000)) >= 1:
            detail += f"; this instance's clock is {format_duration(timedelta(seconds=ahead_s))}"
            detail += " ahead of it: fix its time sync (NTP)"
        return detail

    def _failed(self, step: BackfillSlot) -> bool:
        """A slot of a real backfill on a lease backend that the backend failed on."""
        failed = step.status == "skipped" and (step.detail or "").startswith("the backend failed")
        return failed and self.leased and not self.dry_run

    def _on_own_row(self, slot_ms: int) -> bool:
        """Whether the slot is claimed on the job's own row: later than its fence."""
        return self.state.fence is None or slot_ms > self.state.fence

    def _stopped(self) -> str | None:
        if self.runner.stopping:
            return "the scheduler stopped"
        if self.job.removed:
            return "the job was removed"
        return None

    def _too_old(self, slot_ms: int) -> str | None:
        """Why a claim-only backend cannot claim ``slot_ms`` safely any more, if it cannot."""
        backend = self.backend
        if not isinstance(backend, ClaimBackend) or not self.job.settings.claim:
            return None
        deadline = backend.claim_deadline_ms(Slot(self.key, slot_ms))
        if deadline is None or self.clock.now_ms() < deadline:
            return None
        return (
            f"older than {backend.name}'s slot memory: a claim-only backend no longer knows "
            "whether it ran (a lease backend fences backfills for ever)"
        )

    def _claim_only_caveat(self) -> str | None:
        """What a dry run on a claim-only backend cannot know."""
        if not self.dry_run or not self.job.settings.claim:
            return None
        return (
            f"unless the fleet claimed it: {self.backend.name} tells a claim only to a claim, "
            "which a dry run does not make"
        )

    async def _read_history(self) -> None:
        self.read_ms = self.clock.now_ms()
        records = await self.history()
        # Added to what earlier reads saw, never replacing it: the history keeps the latest
        # ``history_size`` records, and this backfill's own push the fleet's out of them.
        self.ran |= {record.slot_ms for record in records if record.reason in _SLOT_RUNS}

    async def _lease_state(self, key: str) -> LeaseState:
        assert isinstance(self.backend, LeaseBackend)
        return await self.backend.lease_state(key)

    # -- the claim and the run ------------------------------------------------------------

    async def _take(self, slot_ms: int) -> tuple[Status, str | None, RunRecord | None]:
        """Claim ``slot_ms`` and run it; what became of it."""
        run_id, sent_ms = new_run_id(), self.clock.monotonic_ms()
        try:
            won = await self._claim(slot_ms, run_id)
        except ClockSkewError as exc:
            return "skipped", str(exc), None
        except (BackendError, TimeoutError) as exc:
            return "skipped", f"the backend failed: {exc or type(exc).__name__}", None
        except Exception as exc:  # a backend bug must not stop the backfill either
            logger.exception("backfill claim of %s:%d failed unexpectedly", self.key, slot_ms)
            return "skipped", f"the backend failed: {type(exc).__name__}", None
        if isinstance(won, tuple):
            return *won, None
        lease = won if isinstance(won, Lease) else None
        if (stopped := self._stopped()) is not None:
            if lease is not None:  # the job's row offers it to the fleet; its backfill key not
                await self.runner.release(lease, handover=lease.job == self.key)
            return "stopped", stopped, None
        if lease is not None:
            run_id = lease.run_id  # a lease taken over has a run of its own
        run = self.runner.execute(
            self.job, slot_ms, lease, reason="backfill", run_id=run_id, leased_ms=sent_ms
        )
        record = await asyncio.shield(self.spawn(run))  # a cancelled backfill cuts no run
        if record is None:
            if (stopped := self._stopped()) is not None:
                return "stopped", stopped, None
            # Not run, and not stopped: its lease came too late to run on (Runner.execute).
            return "skipped", "the backend failed: its lease was answered too late", None
        return "ran", None, record

    async def _claim(self, slot_ms: int, run_id: str) -> Lease | bool | _Verdict:
        """The slot's claim: the lease to run it under, ``True`` (won on a claim-only backend,
        or nothing to claim), or the verdict on a slot not to run."""
        backend, instance_id = self.backend, self.runner.instance_id
        if not self.job.settings.claim:
            return True
        if isinstance(backend, ClaimBackend):
            slot = Slot(self.key, slot_ms)
            timeout = _CLAIM_TIMEOUT_S
            if (deadline := backend.claim_deadline_ms(slot)) is not None:
                timeout = min(timeout, (deadline - self.clock.now_ms()) / 1000)
            won = timeout > 0 and await backend.claim(
                slot, instance_id=instance_id, run_id=run_id, timeout=timeout
            )
            return True if won else ("not-acquired", None)
        # First the backfills' own fence, which keeps the slot from every later backfill
        # whatever the history keeps; then, for a slot the fleet could still claim, the job's
        # own row, whose fence then refuses the fleet's claim of it.
        key = backfill_key(self.key)
        fenced = await self._acquire(Slot(key, slot_ms), _fence_policy(key), run_id)
        if fenced is None:
            return await self._take_over(slot_ms) or ("not-acquired", _FENCED)
        if not self._on_own_row(slot_ms):
            return fenced
        # A backfilled run waits for no run of the job, nor makes one skip as overlap.
        own = await self._acquire(Slot(self.key, slot_ms), _allowing(self.job), run_id)
        if own is not None:
            await self.runner.release(fenced, handover=False)
            return own
        # The fleet claimed this slot or a later one since its lease was read: read again.
        verdict = await self._on_store(slot_ms)
        if verdict[0] != "would-run":
            await self.runner.release(fenced, handover=False)
            return verdict
        return fenced  # the fleet can no longer claim it: it runs under the backfills' fence

    async def _take_over(self, slot_ms: int) -> Lease | None:
        """The slot's lease under the backfills' key, when an earlier backfill's run of it died
        (its process killed, its lease lost): taken over as the fleet's sweep takes a dead
        runner's slot, its dead attempt recorded ``interrupted``, while the job's
        ``max_attempts`` allow another. Only a backfill ever takes these over."""
        key = backfill_key(self.key)
        if slot_ms not in (await self._lease_state(key)).leased:
            return None
        assert isinstance(self.backend, LeaseBackend)
        policy = replace(_fence_policy(key), max_attempts=self.job.settings.policy.max_attempts)
        taken = await self.backend.take_over([policy], instance_id=self.runner.instance_id)
        for lease in taken:
            if lease.slot_ms != slot_ms:  # another dead slot: left to the backfill reaching it
                await self.runner.release(lease, handover=True)
        return next((lease for lease in taken if lease.slot_ms == slot_ms), None)

    async def _acquire(self, slot: Slot, policy: JobPolicy, run_id: str) -> Lease | None:
        assert isinstance(self.backend, LeaseBackend)
        answer = await self.backend.acquire(
            slot,
            policy=policy,
            instance_id=self.runner.instance_id,
            run_id=run_id,
            reason="backfill",
            timeout=self.runner.lease_bound(_CLAIM_TIMEOUT_S),
        )
        return answer if isinstance(answer, Lease) else None


def _allowing(job: JobState) -> JobPolicy:
    return replace(job.settings.policy, overlap="allow")


def _fence_policy(key: str) -> JobPolicy:
    """The ``<key>:backfill`` row's: backfills of distinct slots run side by side."""
    return JobPolicy(key, overlap="allow", max_attempts=1)

"""The life of a slot on one instance: late check, claim, run, record; and the drain on stop.

On a lease backend no handler starts on a lease that may have expired: a lease is counted on
only until ``valid_ms`` after the request that granted it was *sent* (the store set its expiry
later than that, never earlier), so a claim, a batch of claims or a take-over answered after
that is not run (``execute``: handed back, and skipped as ``backend-error``). A claim is given
no longer than that to answer (``Runner.lease_bound``), and the renewer aborts a run shortly
before its lease can expire by the same rule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ._batching import ClaimBatches, ClaimPrepares, Ending, ReleaseBatches
from ._clock import Clock, resolve
from ._context import AbortReason, JobContext, PreviousRun, abort
from ._durations import format_duration, to_ms
from ._events import ClaimEvent, Events, SkipReason
from ._exceptions import BackendError, ClockSkewError
from ._job import AroundRun, Handler, JobState, Run, call_sync, is_async_handler
from ._leasekeeping import ReleaseRetries, Renewer, release_attempt_s, valid_ms
from ._missed import UNKNOWN_FATE, MissedSlots
from ._recorder import Recorder
from ._redact import data_secrets
from ._replace import Replacer, overlap_detail, replaces
from ._retry import Retry
from ._runlog import RunLog
from ._tasks import TaskSet
from ._tracebacks import error_text
from ._tracing import finish_span, run_span
from .abc import (
    Backend,
    Claim,
    ClaimBackend,
    Lease,
    LeaseBackend,
    Outcome,
    RunReason,
    RunRecord,
    Slot,
    new_run_id,
)

if TYPE_CHECKING:
    from ._fleet import Fleet
    from ._storedjobs import StoredJobs

__all__ = ["JOB_DATA", "Runner"]

logger = logging.getLogger("brokersched")

# A claim gets what is left of max_late, but never less than this (the backend needs a moment),
# unless the lease it would grant is shorter (Runner.lease_bound).
_MIN_CLAIM_TIMEOUT_S = 0.5
_CLAIM_SLACK_S = 0.25
# After drain_timeout, cancelled async runs get this long to release their lease and record.
_CUT_GRACE_S = 2.0
# The detail of a slot's "paused" skip, by what stopped it (JobControl.stops).
_STOPPED_DETAIL: dict[str, str | None] = {
    "paused": None,
    "disabled": "disabled",
    "skipped": "skipped (Job.skip)",
}
_ABORT_OUTCOMES: dict[AbortReason, Outcome] = {
    "timeout": "timed-out",
    "lock-lost": "interrupted",
    "removed": "interrupted",
    "shutdown": "interrupted",
    "aborted": "interrupted",
    "replaced": "replaced",
}
# ctx.previous: how long this instance's unwritten records are waited for (as job.history()
# waits), and how many of the newest records are read to find a run that is not the asking
# one (a missed slot's record is no run: a few of them may come first).
_PREVIOUS_WAIT_S = 5.0
_PREVIOUS_SCAN = 16
# ``JobContext.data`` of a manual run given none: the job's own ``data``.
JOB_DATA: Any = object()


class Runner:
    """Claims and runs slots for one scheduler: the life of a slot from its timer on."""

    def __init__(
        self,
        clock: Clock,
        backend: Backend,
        instance_id: str,
        events: Events,
        tasks: TaskSet,
        recorder: Recorder,
        around_run: AroundRun | None = None,
        ended: dict[str, int] | None = None,
        *,
        record_results: bool = True,
    ) -> None:
        self.clock = clock
        self.backend = backend
        self.recorder = recorder
        self.instance_id = instance_id
        self.events = events
        self.tasks = tasks
        self.runs: dict[Run, None] = {}  # in the order they began (see _tasks.Tracked)
        self.around_run = around_run  # Scheduler(around_run=...)
        self.stopping = False  # drain() has begun: nothing new runs
        self.drained = False  # drain_timeout is over: not even a claim won during the drain
        self.fleet: Fleet | None = None  # the fleet's controls, read before each slot's claim
        self.stored: StoredJobs | None = None  # the stored schedules, fresh before their claims
        self._batches = ClaimBatches(
            backend,
            clock,
            tasks,
            instance_id,
            self.claim_one,
            lambda lease: self.release(lease, handover=True),
        )
        self._releases = ReleaseBatches(backend, clock, tasks)
        self._prepares = ClaimPrepares(backend, clock, tasks, lambda: self.stopping)
        # skips, starts, ends
        self.runlog = RunLog(clock, instance_id, events, recorder, record_results=record_results)
        self.missed = MissedSlots(backend, tasks, self.runlog)
        # job key -> the latest slot ended here whose release did not land before its lease
        # expired (see ended_here); the scheduler's, kept from one start to the next
        self._ended = {} if ended is None else ended
        self.replacer = Replacer(  # overlap="replace"
            self, lambda job, reason, slot_ms: self._still_wanted(job, reason, slot_ms)
        )

    def skip(
        self,
        job: JobState,
        slot_ms: int,
        reason: SkipReason,
        detail: str | None = None,
        *,
        run: RunReason = "schedule",
    ) -> None:
        """Log and emit a skip of a run for ``run`` (a slot, a boot run, a manual run...);
        ``not-acquired`` is at debug level (the fleet has the slot). A slot skipped for a
        reason that leaves its fate unknown here is watched, to be reported if missed."""
        self.runlog.skip(job, slot_ms, reason, detail, run=run)
        if run == "schedule" and reason in UNKNOWN_FATE:
            self.missed.watch(job, slot_ms)

    # -- claim ---------------------------------------------------------------------------

    async def run_slot(
        self, job: JobState, slot_ms: int, reason: RunReason, data: Any = JOB_DATA
    ) -> RunRecord | None:
        """Steps 3-6 of a slot's life; returns the record of the run, or ``None`` if skipped.
        ``data``: a manual run's ``ctx.data``, if not the job's."""
        if reason == "schedule" and self._late(job, slot_ms):
            self.skip(job, slot_ms, "late", run=reason)
            return None
        if reason in ("schedule", "manual") and self.fleet is not None:
            # A pause the fleet made before the slot counts; waited for a quarter of max_late
            # at most (and a second), so the claim keeps its time. A job run on every instance
            # (claim=False) keeps its rhythm: it goes by the controls last read.
            within = job.settings.max_late_ms // 4 if job.settings.claim else 0
            await self.fleet.refresh(slot_ms, within_ms=within)
        handler = None
        if job.stored and reason in ("schedule", "catch-up"):
            if not await self._decided(job, slot_ms, reason):
                return None
            if self.stored is not None and (version := self.stored.version_at(job, slot_ms)):
                handler, data = version
        if stop := self._stopped(job, slot_ms, reason):
            self.skip(job, slot_ms, "paused", detail=_STOPPED_DETAIL[stop], run=reason)
            return None
        if not job.settings.claim:
            if not self._still_wanted(job, reason, slot_ms):
                return None  # stop() has begun (or the job is gone): nothing new starts
            if job.runs and not await self.replacer.ended_here(job, slot_ms):
                self.skip(job, slot_ms, "overlap", detail=overlap_detail(job), run=reason)
                return None
            return await self.execute(job, slot_ms, None, reason=reason, data=data, handler=handler)
        run_id = new_run_id()
        claimed = await self.claim_slot(job, slot_ms, run_id, reason, batched=True)
        if claimed is None:
            return None
        lease, leased_ms = claimed
        if lease == "overlap" and replaces(job, reason):
            claimed = await self.replacer.replace(job, slot_ms, run_id, reason)
            if claimed is None:
                return None
            lease, leased_ms = claimed
        if lease is None and reason == "schedule" and self._prepares.enabled:
            self._prepares.after_win(job)
        if isinstance(lease, str):
            if reason == "catch-up":  # nothing was missed after all: not worth an event
                logger.debug("no catch-up for %s:%d (%s)", job.name, slot_ms, lease)
            else:
                self.skip(job, slot_ms, lease, run=reason)  # type: ignore[arg-type]
            return None
        if not self._still_wanted(job, reason, slot_ms, claimed=lease is None):
            # Removed or paused while the claim was in flight, or stopped on a lease backend:
            # the lease is handed over, so another instance may still run the slot.
            if lease is not None:
                await self.release(lease, handover=True)
            logger.info("claimed %s:%d but no longer runs it here", job.name, slot_ms)
            return None
        if reason == "schedule" and self._late(job, slot_ms):
            # A slow claim: the slot stays claimed, so no other instance runs it late either,
            # and this instance reports it missed.
            if lease is not None:
                await self.release(lease, handover=False)
            self.runlog.skip(job, slot_ms, "late", detail="claim answered too late", run=reason)
            self.missed.won_late(job, slot_ms, lease)
            return None
        return await self.execute(
            job,
            slot_ms,
            lease,
            reason=reason,
            run_id=run_id,
            leased_ms=leased_ms,
            data=data,
            handler=handler,
        )

    async def _decided(self, job: JobState, slot_ms: int, reason: RunReason) -> bool:
        """Whether this instance may claim a stored schedule's slot: its view of the stored
        schedules is recent enough to know the version in force at the slot (waited for a
        quarter of ``max_late`` at most, as the controls are), and that version has the slot
        (a change read since the timer was armed may have moved it: nothing to skip then)."""
        stored = self.stored
        within_ms = min(job.settings.max_late_ms // 4, 2000)
        why = "stored schedules are not followed" if stored is None else None
        if stored is not None:
            why = await stored.fresh(slot_ms, within_ms)
        if why is not None:
            self.skip(job, slot_ms, "backend-error", detail=why, run=reason)
            return False
        if job.schedule.next_ms(slot_ms - 1) != slot_ms:
            logger.debug("%s:%d is no longer a slot of its stored schedule", job.name, slot_ms)
            return False
        return True

    async def claim_slot(
        self, job: JobState, slot_ms: int, run_id: str, reason: RunReason, *, batched: bool
    ) -> tuple[Lease | str | None, int] | None:
        """One claim of the slot at ``slot_ms`` (``batched``: with the slots of other jobs due
        at the same instant, if the backend claims them together) and when it was sent (on
        the monotonic clock); ``None`` when it failed or came too late, skipped and said."""
        timeout = self._claim_timeout(job, slot_ms)
        if timeout <= 0:
            self.skip(
                job, slot_ms, "late", detail="the backend's slot memory is ending", run=reason
            )
            return None
        began, leased_ms = time.perf_counter(), self.clock.monotonic_ms()
        try:
            # The backend's own deadline comes first; this one only bounds a backend that hangs.
            async with self.clock.timeout(timeout + _CLAIM_SLACK_S):
                slot = Slot(job.settings.key, slot_ms)
                lease = await self._claim(job, slot, run_id, reason, timeout, batched=batched)
        except ClockSkewError as exc:  # a clock moved; the message says which
            self.skip(job, slot_ms, "clock-skew", detail=str(exc), run=reason)
            return None
        except (BackendError, TimeoutError) as exc:
            self.skip(
                job, slot_ms, "backend-error", detail=str(exc) or type(exc).__name__, run=reason
            )
            return None
        except Exception as exc:  # a backend bug must not stop the scheduler either
            logger.exception("claim of %s:%d failed unexpectedly", job.name, slot_ms)
            self.skip(job, slot_ms, "backend-error", detail=type(exc).__name__, run=reason)
            return None
        finally:
            seconds = time.perf_counter() - began
            self.events.emit("claim", ClaimEvent(job.name, slot_ms, self.backend.name, seconds))
        return lease, leased_ms

    @staticmethod
    def _stopped(job: JobState, slot_ms: int, reason: RunReason) -> str | None:
        """Why the fleet's controls stop this run of the slot at ``slot_ms``: a pause (until an
        instant later than the slot), a skip or a disable stops the slots of the schedule and
        catch-up; a disable stops a manual run too."""
        if reason in ("schedule", "catch-up"):
            return job.stops(slot_ms)
        return "disabled" if job.disabled and reason == "manual" else None

    def _still_wanted(
        self, job: JobState, reason: RunReason, slot_ms: int, *, claimed: bool = False
    ) -> bool:
        """Whether a slot goes on to run. ``claimed``: won on a claim-only backend, whose
        claim no other instance can win any more: stop() having begun, it runs within
        ``drain_timeout`` (told to stop at once) rather than nowhere; once drain_timeout is
        over it is lost, as a claim cut then is. A removed or paused job's does not run."""
        if job.removed or (reason == "schedule" and job.stops(slot_ms)) or self.drained:
            return False
        return claimed or not self.stopping

    def _late(self, job: JobState, slot_ms: int) -> bool:
        return bool(self.clock.now_ms() - slot_ms > job.settings.max_late_ms)

    def _claim_timeout(self, job: JobState, slot_ms: int) -> float:
        """What is left of ``max_late``, at least a moment, but never past a claim-only
        backend's deadline for the slot (``ClaimBackend.claim_deadline_ms``): a claim landing
        after it could win a slot the backend has forgotten; nor, on a lease backend, past the
        lease (``lease_bound``)."""
        now = self.clock.now_ms()
        left_s = max((slot_ms + job.settings.max_late_ms - now) / 1000, _MIN_CLAIM_TIMEOUT_S)
        backend = self.backend
        if isinstance(backend, ClaimBackend):
            deadline = backend.claim_deadline_ms(Slot(job.settings.key, slot_ms))
            if deadline is not None:
                left_s = min(left_s, (deadline - now) / 1000)
        return self.lease_bound(left_s)

    def lease_bound(self, timeout: float) -> float:
        """``timeout`` for a request that grants a lease, but on a lease backend no longer
        than such a lease is counted on (``valid_ms``): a later answer is not run
        (``execute``), so waiting for it would only keep the slot from the rest of the fleet
        (whatever is left of ``max_late``: a NATS claim retries its compare-and-set until
        then)."""
        backend = self.backend
        if isinstance(backend, LeaseBackend):
            return min(timeout, valid_ms(to_ms(backend.lease_ttl)) / 1000)
        return timeout

    async def _claim(
        self,
        job: JobState,
        slot: Slot,
        run_id: str,
        reason: RunReason,
        timeout: float,
        *,
        batched: bool,
    ) -> Lease | str | None:
        """A lease (lease backends), ``None`` (a won claim), or the skip reason."""
        if batched and reason == "schedule" and self._batches.enabled:  # due at one instant
            claim = Claim(slot, run_id, job.settings.policy)
            return await self._batches.claim(claim, timeout)
        return await self.claim_one(Claim(slot, run_id, job.settings.policy, reason), timeout)

    async def claim_one(self, claim: Claim, timeout: float) -> Lease | str | None:
        """One claim, sent on its own: a lease (lease backends), ``None`` (a won claim), or the
        skip reason."""
        backend, instance_id = self.backend, self.instance_id
        slot, run_id, reason = claim.slot, claim.run_id, claim.reason
        if isinstance(backend, LeaseBackend):
            return await backend.acquire(
                slot,
                policy=claim.policy,
                instance_id=instance_id,
                run_id=run_id,
                reason=reason,
                timeout=timeout,
            )
        assert isinstance(backend, ClaimBackend)
        won = await backend.claim(slot, instance_id=instance_id, run_id=run_id, timeout=timeout)
        return None if won else "not-acquired"

    # -- run -----------------------------------------------------------------------------

    async def execute(
        self,
        job: JobState,
        slot_ms: int,
        lease: Lease | None,
        *,
        reason: RunReason | None = None,
        run_id: str | None = None,
        leased_ms: int | None = None,
        data: Any = JOB_DATA,
        handler: Handler | None = None,
    ) -> RunRecord | None:
        """Run a claimed slot. ``leased_ms``: when the request that got ``lease`` was sent, on
        the monotonic clock; a lease whose answer came too late to be counted on is not run
        (``_lapsed``). ``handler``, ``data``: the run's, if not the job's (a stored schedule's
        slot runs its own version's)."""
        if lease is not None and leased_ms is not None and self._lapsed(leased_ms):
            await self._not_run(job, slot_ms, lease, reason or lease.reason, leased_ms)
            return None
        task = asyncio.current_task()
        assert task is not None
        run_id = lease.run_id if lease else run_id or new_run_id()
        ctx = JobContext(
            job=job.name,
            run_id=run_id,
            slot_ms=slot_ms,
            reason=reason or (lease.reason if lease else "schedule"),
            attempt=lease.attempt if lease else 1,
            data=job.settings.data if data is JOB_DATA else data,
            instance_id=self.instance_id,
            clock=self.clock,
            previous=self._previous(job, run_id),
        )
        run = Run(ctx, task, lease, self.clock.now_ms(), self.clock.monotonic_ms(), job, handler)
        job.runs[ctx.run_id] = run
        self.runs[run] = None
        if self.stopping:  # a claim won as the drain began: told at once, like the others
            self.abort(run, "shutdown")
        renewer = None
        if lease is not None:
            valid_from_ms = run.started_mono if leased_ms is None else leased_ms
            renewer = Renewer(
                self.clock,
                self.backend,
                self.tasks,
                run,
                valid_from_ms,
                lambda: self.abort(run, "lock-lost"),
            )
            run.renewer = renewer
        try:
            self.runlog.started(run)
            outcome, error = await self._run_handler(run)
            outcome, error, recorded = await self._retries(run, outcome, error)
            if run.abandoned:
                return None  # stop() gave up waiting for it; the lease is left to expire
            # Lost while the handler ran (a timeout or a stop may have told it first). A lost
            # lease is not ours to release or record: it expires, and the instance that takes
            # the slot over records this attempt (once) and retries it. ``recorded``: a retry's
            # wait was cut short, and the last attempt, which failed, is recorded already.
            lost = renewer is not None and renewer.lost
            if lease is None or lost:
                return recorded or self.runlog.finished(job, run, outcome, error, record=not lost)
            # The run's record ends its lease, in one step (``LeaseBackend.release``): a slot
            # then holds its lease or has its record, never neither, which is what a backfill
            # reads to know it ran. Only a run cut short at an await by a graceful stop is
            # offered to another instance; a handler that returned or raised has done what it
            # will do.
            record = recorded or self.runlog.finished(job, run, outcome, error, record=False)
            ending = None if recorded else (job.settings.policy, record)
            handover = run.cut and run.ctx.abort_reason == "shutdown"
            await self.release(lease, handover=handover, renewer=renewer, record=ending)
            return record
        finally:
            if renewer is not None and not run.abandoned:
                renewer.cancel()
            job.runs.pop(run.ctx.run_id, None)
            self.runs.pop(run, None)

    def _lapsed(self, leased_ms: int) -> bool:
        """Whether a lease granted by a request sent at ``leased_ms`` (monotonic) may have
        expired by now, by the rule the renewer aborts a run on (``valid_ms``)."""
        assert isinstance(self.backend, LeaseBackend)
        valid = valid_ms(to_ms(self.backend.lease_ttl))
        return bool(self.clock.monotonic_ms() >= leased_ms + valid)

    async def _not_run(
        self, job: JobState, slot_ms: int, lease: Lease, reason: RunReason, leased_ms: int
    ) -> None:
        """Skip a slot whose lease came too late to run on: another instance may already run
        it (the lease expired, and it took the slot over), or will once the lease expires.

        The lease is handed over when the fleet's sweep takes over its key (the job's): a
        hand-over that lands, the lease still valid or expired but not yet taken over (a release
        after the expiry still ends it), restarts the slot at once elsewhere or here, as a
        retry at the same attempt; one taken over first is stale, and changes nothing. A boot
        window's or a backfill's lease (keys of their own, never swept) is ended.
        """
        assert isinstance(self.backend, LeaseBackend)
        took = timedelta(milliseconds=self.clock.monotonic_ms() - leased_ms)
        ttl = format_duration(self.backend.lease_ttl)
        detail = (
            f"the answer granting its lease came {format_duration(took)} after it was asked, "
            f"when the lease (lease_ttl {ttl}) could have expired: not run here"
        )
        self.skip(job, slot_ms, "backend-error", detail=detail, run=reason)
        await self.release(lease, handover=lease.job == job.settings.key)

    async def _retries(
        self, run: Run, outcome: Outcome, error: str | None
    ) -> tuple[Outcome, str | None, RunRecord | None]:
        """The job's ``retry``: while an attempt failed with an exception it catches, record
        it, wait on the scheduler's clock and run the handler again under the same claim or
        lease (``ctx.reason == "retry"``, ``ctx.attempt`` one more, a new run id). Answers the
        last attempt's outcome; and its record when a stop, a lost lease or the job's removal
        cut a wait short (the run then ends as that failed attempt, recorded)."""
        retry, tries = run.job.settings.retry, 1
        while retry is not None and tries < retry.attempts:
            delay = self._retry_delay(run, retry, outcome, tries)
            if delay is None:
                break
            record = self.runlog.finished(run.job, run, outcome, error)
            self._next_attempt(run)
            logger.info(
                "retry job=%s slot=%d attempt=%d in %s",
                run.job.name,
                run.ctx.slot_ms,
                run.ctx.attempt,
                format_duration(delay),
            )
            run.waiting = True
            try:
                with self.clock.blocking():  # a virtual clock: its timer or an abort wakes it
                    if await run.ctx.wait_aborted(delay.total_seconds()):
                        return outcome, error, record
            finally:
                run.waiting = False
            tries += 1
            run.started_ms, run.started_mono = self.clock.now_ms(), self.clock.monotonic_ms()
            self.runlog.started(run)
            outcome, error = await self._run_handler(run)
        return outcome, error, None

    def _retry_delay(
        self, run: Run, retry: Retry, outcome: Outcome, tries: int
    ) -> timedelta | None:
        """The wait before the next attempt, or ``None`` when this one is the last: it did not
        fail with an exception ``retry`` catches (a timeout counts as ``TimeoutError``), or
        the run was told to stop, or the next would start past ``retry.deadline``."""
        if outcome == "failed":
            caught = retry.catches(run.exception)
        else:
            caught = outcome == "timed-out" and retry.catches(TimeoutError())
        lost = run.renewer is not None and run.renewer.lost
        if not caught or lost or run.abandoned or run.job.removed:
            return None
        if run.ctx.abort_reason not in (None, "timeout") or self.stopping:
            return None
        delay = retry.delay(tries)
        if retry.deadline is not None:
            end_ms = run.ctx.slot_ms + to_ms(retry.deadline)
            if self.clock.now_ms() + to_ms(delay) > end_ms:
                logger.info(
                    "no retry of job=%s slot=%d: its deadline (%s after the slot) comes first",
                    run.job.name,
                    run.ctx.slot_ms,
                    format_duration(retry.deadline),
                )
                return None
        return delay

    def _next_attempt(self, run: Run) -> None:
        """``run`` becomes its next attempt: a new context (and run id), nothing of the last."""
        ctx, job = run.ctx, run.job
        job.runs.pop(ctx.run_id, None)
        run_id = new_run_id()
        run.ctx = JobContext(
            job=ctx.job,
            run_id=run_id,
            slot_ms=ctx.slot_ms,
            reason="retry",
            attempt=ctx.attempt + 1,
            data=ctx.data,
            instance_id=ctx.instance_id,
            clock=self.clock,
            previous=self._previous(job, run_id),
        )
        job.runs[run.ctx.run_id] = run
        run.finishing = run.cut = False
        run.exception = run.cancelled = run.returned = None

    def _previous(self, job: JobState, run_id: str) -> PreviousRun:
        """``ctx.previous`` of the run ``run_id``: nothing is read unless the handler asks.
        The read is the scheduler's own work (a virtual clock waits for it in real time, as
        for a claim), whichever thread asked."""
        loop = asyncio.get_running_loop()

        def read() -> asyncio.Task[RunRecord | None]:
            return self.clock.spawn(
                self._read_previous(job, run_id), name=f"previous:{job.name}:{run_id}"
            )

        return PreviousRun(read, loop)

    async def _read_previous(self, job: JobState, run_id: str) -> RunRecord | None:
        """The newest record of a finished run of the job that is not the run ``run_id``
        (a missed slot's is no run), once this instance's records waiting to be written are
        (as ``Job.history()`` reads)."""
        await self.recorder.wait_written(_PREVIOUS_WAIT_S)
        records = await self.backend.history(job.settings.policy, _PREVIOUS_SCAN)
        return next((r for r in records if _ran(r) and r.run_id != run_id), None)

    async def _run_handler(self, run: Run) -> tuple[Outcome, str | None]:
        timeout = run.job.settings.timeout
        watchdog = None
        if timeout is not None:
            watchdog = self.clock.call_later(to_ms(timeout), lambda: self.abort(run, "timeout"))
        try:
            with run_span(run.ctx) as span:
                outcome, error = await self._call(run)
                finish_span(span, outcome, error, run.exception)
                return outcome, error
        finally:
            run.finishing = True  # from here on, abort() leaves the run alone
            if watchdog is not None:
                watchdog.cancel()

    async def _call(self, run: Run) -> tuple[Outcome, str | None]:
        ctx, job = run.ctx, run.job
        error: str | None = None
        try:
            handler = run.handler or job.handler
            if is_async_handler(handler):
                with self.clock.blocking():  # a handler may wait on anything (TestClock settles)
                    if self.around_run is None:
                        run.returned = await handler(ctx)  # type: ignore[misc]
                    else:
                        with self.around_run(ctx):
                            run.returned = await handler(ctx)  # type: ignore[misc]
            else:
                run.returned = await asyncio.to_thread(call_sync, handler, ctx, self.around_run)
        except asyncio.CancelledError as exc:
            if ctx.abort_reason is None:
                raise  # not ours: the task itself is being cancelled
            run.task.uncancel()
            run.cut = True
            run.cancelled = exc
        except Exception as exc:
            error = error_text(exc, data_secrets(ctx.data))
            run.exception = exc
        if ctx.abort_reason is not None and not run.cut and run.task.cancelling():
            run.task.uncancel()  # the handler swallowed our cancellation
        if ctx.abort_reason == "timeout":
            assert job.settings.timeout is not None
            return "timed-out", f"Timed out after {format_duration(job.settings.timeout)}"
        if ctx.abort_reason == "aborted":  # asked to (Scheduler.abort, the admin API)
            return "interrupted", error or "aborted on request"
        if ctx.abort_reason == "replaced":  # a later slot came due (overlap="replace")
            return "replaced", error or "replaced by a later slot"
        if run.cut and ctx.abort_reason is not None:
            return _ABORT_OUTCOMES[ctx.abort_reason], f"aborted: {ctx.abort_reason}"
        return ("failed", error) if error is not None else ("completed", None)

    def abort(self, run: Run, reason: AbortReason) -> None:
        """Tell a run to stop: ``ctx.abort_reason`` for everyone; an async handler is also
        cancelled, except on ``shutdown``, which lets it finish (see ``drain``). A timeout or a
        lost lease during the drain still cancels it."""
        told = run.ctx.abort_reason
        if run.finishing or run.task.done() or told not in (None, "shutdown"):
            return
        if told == "shutdown" and reason == "shutdown":
            return
        abort(run.ctx, reason)
        if run.is_async and reason != "shutdown" and not run.waiting:
            run.task.cancel()  # a thread cannot be cancelled: sync handlers watch abort_reason

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool,
        renewer: Renewer | None = None,
        record: Ending = None,
    ) -> None:
        """End a lease, retrying until it lands; with ``record``, the run's record is written
        with it (``LeaseBackend.release``), or queued for the history if it never lands.

        A lease left marked running looks like a dead runner's once it expires: another
        instance takes the slot over and runs it again, though this run may have completed. A
        release that lands after the expiry still ends the run as long as nobody took the
        slot over first (``LeaseBackend.release``), and the fleet looks for dead runners only
        every ``lease_ttl / 2``. So a failed release is retried, at short intervals
        (``release_delays``), until one ``lease_ttl`` after the lease is known to expire.

        ``renewer``, the run's, stops here: its failures must not end the release, and a
        renewal would not help it either (it needs the store the release needs, so it lands
        only where a release would have landed).
        """
        backend = self.backend
        assert isinstance(backend, LeaseBackend)
        ttl_ms = to_ms(backend.lease_ttl)
        if renewer is not None:
            renewer.cancel()
            expires_ms = renewer.expires_ms
        else:  # granted a moment ago
            expires_ms = self.clock.monotonic_ms() + ttl_ms
        retries = ReleaseRetries(self.clock, lease, handover, ttl_ms, expires_ms)
        if not handover:
            ended = self._ended
            ended[lease.job] = max(ended.get(lease.job, lease.slot_ms), lease.slot_ms)
        try:
            while True:
                try:
                    attempt = self._release_once(
                        lease, handover=handover, batched=not retries.tries, record=record
                    )
                    await self._within(attempt, release_attempt_s(ttl_ms), lease)
                except Exception as exc:
                    if await retries.wait_after(exc):
                        continue
                    self._record_anyway(record)
                    return
                retries.landed()
                if self.clock.monotonic_ms() < expires_ms and self.ended_here(lease):
                    del self._ended[lease.job]  # no take-over can have come first
                return
        except asyncio.CancelledError:
            retries.stopped()
            self._record_anyway(record)
            raise

    def _record_anyway(self, record: Ending) -> None:
        """A release that never landed (given up, or cut by the stop) leaves its record to the
        history's writer: the run happened. (Had it landed unanswered, the record is there
        twice.)"""
        if record is not None:
            self.recorder.put(*record)

    def ended_here(self, lease: Lease) -> bool:
        """Whether ``lease``'s slot was ended here (its run returned or failed for good, or it
        was skipped once claimed) but its release did not land before its lease expired: a
        take-over of it by this instance's own sweeper is no dead runner's (see ``Sweeper``).
        Only the latest such slot of each job is kept: the store offers no other (it takes
        over only a job's latest claimed slot)."""
        return self._ended.get(lease.job) == lease.slot_ms

    async def _within(
        self, attempt: Coroutine[Any, Any, None], seconds: float, lease: Lease
    ) -> None:
        """``attempt``, given up (``TimeoutError``) after ``seconds`` on this scheduler's
        clock: a release sent on a link that silently drops it waits for no answer until the
        backend's own bound (a third of lease_ttl), while a fresh one lands as soon as the
        link is back. One given up may still land later: harmless, it ends the same lease."""
        task = self.tasks.spawn(attempt, name=f"release:{lease.slot.key}", drained=False)
        expired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.clock.call_later(round(seconds * 1000), lambda: resolve(expired))
        try:
            with self.clock.blocking():
                await asyncio.wait({task, expired}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            timer.cancel()
        if not task.done():
            task.cancel()
            raise TimeoutError(f"no answer within {seconds:g}s")
        task.result()

    async def _release_once(
        self, lease: Lease, *, handover: bool, batched: bool, record: Ending
    ) -> None:
        assert isinstance(self.backend, LeaseBackend)
        if batched and not handover and self._releases.enabled:
            await self._releases.release(lease, record)  # with the others of this loop turn
        else:
            await self.backend.release(lease, handover=handover, record=record)

    # -- drain ---------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """Tell every run to stop (``shutdown``) and wait up to ``timeout_s`` for them, and for
        claims in flight, to finish: a run that returns meanwhile is recorded as it returned.
        Then async runs still going are cancelled (``interrupted``, handed over on a lease
        backend) and sync ones abandoned."""
        self.stopping = True
        self.missed.close()
        for run in list(self.runs):
            self.abort(run, "shutdown")
        await self.clock.wait(self.tasks.pending(), timeout_s)
        self.drained = True
        # drain_timeout is over: async handlers still going are cancelled; runs already past
        # their handler (releasing, recording) are left alone. Both get a grace to finish.
        graced = [run for run in self.runs if run.finishing or run.is_async]
        for run in graced:
            if not run.finishing:
                run.task.cancel()
        await self.clock.wait({run.task for run in graced}, _CUT_GRACE_S)
        # Sync handlers still in their thread are abandoned: all marked before any await, so
        # none of them records itself as well.
        abandoned = [run for run in self.runs if not run.task.done() and not run.finishing]
        for run in abandoned:
            run.abandoned = True
        for run in self.runs:
            if run.renewer is not None:
                run.renewer.cancel()  # the lease expires; the slot is then taken over
        before = set(self.tasks.pending())
        for run in abandoned:
            detail = f"abandoned: still running after drain_timeout ({timeout_s:g}s)"
            if run.lease is None:
                self.runlog.finished(run.job, run, "interrupted", detail)
            else:  # the lease is left to expire; the instance that takes the slot over records it
                detail += "; its lease expires and the slot is taken over"
                self.runlog.finished(run.job, run, "interrupted", detail, record=False)
        listeners = [task for task in self.tasks.pending() if task not in before]
        await self.clock.wait(listeners, _CUT_GRACE_S)
        # Renewals, releases and the fleet's calls; claims, records and listeners that did not
        # answer in time. The abandoned runs' tasks wait for their threads: they are left.
        left = {run.task for run in abandoned}
        cut = [task for task in self.tasks.pending() if task not in left]
        await self.tasks.cut([*self.tasks.background(), *cut], _CUT_GRACE_S)


def _ran(record: RunRecord) -> bool:
    """Whether ``record`` is a finished run's (not a missed slot's report)."""
    return record.finished_at is not None and record.outcome != "missed"

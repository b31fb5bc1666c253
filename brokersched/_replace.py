"""``overlap="replace"``: a slot that comes due while the run of an earlier slot of its job goes
on cuts that run, wherever it goes in the fleet, then runs.

The lease store refuses the slot's claim while the earlier run holds a live lease, as with
``overlap="skip"``: that refusal is what keeps two runs of the job from ever going at once. The
instance whose claim was refused tells the run in the way to stop (``replaced``): here at once,
elsewhere through the fleet's controls (an abort of the job's runs before the slot,
``ControlChange.replaces``), which every instance reads each heartbeat. It asks the claim again
as soon as the runs cut here end, else every ``POLL_MS``, until the store grants it: once the
cut run's lease is released with its record (``replaced``, written once, by its runner), or has
expired (a runner that died or hangs; its taker records it ``interrupted``). A slot that cannot
start within its ``max_late`` is skipped as ``overlap``, saying why.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ._clock import ms_to_datetime, resolve
from ._durations import format_duration
from ._fleetrecords import ControlChange, JobControl
from ._job import JobState, Run
from .abc import Lease, RunReason

if TYPE_CHECKING:
    from ._runner import Runner

__all__ = ["POLL_MS", "Replacer", "overlap_detail", "replaced_by", "replaces"]

logger = logging.getLogger("brokersched")

#: How often a claim blocked by a run elsewhere is asked again while that run is cut (its
#: instance reads the fleet's controls each heartbeat, then releases the lease).
POLL_MS = 250

#: What a claim answered (a lease, ``None``: a won claim, or a skip reason) and when it was
#: sent, on the monotonic clock (``Runner.claim_slot``).
Claimed = tuple[Lease | str | None, int]


def replaces(job: JobState, reason: RunReason) -> bool:
    """Whether a claim refused for overlap cuts the run in the way: a slot of the schedule of
    a job with ``overlap="replace"`` (a manual run, a catch-up or a boot run never cuts one)."""
    return job.settings.policy.overlap == "replace" and reason == "schedule"


def replaced_by(run: Run, slot_ms: int) -> bool:
    """Whether the job's slot at ``slot_ms`` replaces ``run``: a run of an earlier slot under
    the job's own lease, or under none (``claim=False``). A backfill holds a lease of its own
    beside the job's runs, and is left alone."""
    lease, job = run.lease, run.job
    own = lease is None or lease.job == job.settings.key
    return run.ctx.slot_ms < slot_ms and own and run.ctx.reason != "backfill"


def overlap_detail(job: JobState) -> str | None:
    """Why a slot of a job with ``overlap="replace"`` was skipped for overlap after all."""
    if job.settings.policy.overlap != "replace":
        return None
    max_late = format_duration(timedelta(milliseconds=job.settings.max_late_ms))
    return (
        f"the run it replaces did not end within max_late ({max_late}): never two runs of the "
        "job at once"
    )


#: Whether a slot still goes on to run (the runner's rule): ``(job, reason, slot_ms)``.
Wanted = Callable[[JobState, RunReason, int], bool]


class Replacer:
    """The replacements of one runner's slots: claimed (``Runner.claim_slot``), skipped and
    aborted as the runner does, while ``wanted`` says they still go on to run."""

    def __init__(self, runner: Runner, wanted: Wanted) -> None:
        self._runner, self._wanted = runner, wanted
        # job key -> the latest slot waiting here for the run it replaces to end (the earlier
        # slots waiting give way to it: the latest runs)
        self._waiting: dict[str, int] = {}

    async def replace(
        self, job: JobState, slot_ms: int, run_id: str, reason: RunReason
    ) -> Claimed | None:
        """The claim of the slot at ``slot_ms`` was refused for overlap: cut the run in the
        way and claim again until granted (see the module). What the last claim answered, or
        ``None``: skipped (said so), or no longer wanted (stopped, removed, paused)."""
        runner, key = self._runner, job.settings.key
        if not self._wanted(job, reason, slot_ms):
            return None  # nothing new starts, nothing is cut
        self._waiting[key] = max(self._waiting.get(key, slot_ms), slot_ms)
        self.cut_here(job, slot_ms)
        self._cut_in_fleet(job, slot_ms)
        try:
            while await self._wait_for_cut(job, slot_ms):
                if not self._wanted(job, reason, slot_ms):
                    return None
                if self._waiting[key] > slot_ms:
                    detail = "a later slot came due while it waited, and replaces it"
                    runner.skip(job, slot_ms, "overlap", detail=detail, run=reason)
                    return None
                claimed = await runner.claim_slot(job, slot_ms, run_id, reason, batched=False)
                if claimed is None or claimed[0] != "overlap":
                    return claimed
                self.cut_here(job, slot_ms)  # an earlier slot taken over here meanwhile
        finally:
            if self._waiting.get(key) == slot_ms:
                del self._waiting[key]
        runner.skip(job, slot_ms, "overlap", detail=overlap_detail(job), run=reason)
        return None

    async def ended_here(self, job: JobState, slot_ms: int) -> bool:
        """A job run on every instance (``claim=False``) with a run of it going here: whether
        the slot at ``slot_ms`` may start. ``allow``: at once; ``skip``: no; ``replace``: once
        the runs it cuts have ended, within ``max_late``."""
        overlap = job.settings.policy.overlap
        if overlap != "replace":
            return overlap == "allow"
        self.cut_here(job, slot_ms)
        while any(replaced_by(run, slot_ms) for run in job.runs.values()):
            if not await self._wait_for_cut(job, slot_ms):
                return False
        return True

    def cut_here(self, job: JobState, slot_ms: int) -> None:
        """Tell the runs here that the slot at ``slot_ms`` replaces (``replaced_by``) to stop:
        ``replaced`` (an async handler is cancelled at once)."""
        for run in list(job.runs.values()):
            if replaced_by(run, slot_ms):
                self._runner.abort(run, "replaced")

    def _cut_in_fleet(self, job: JobState, slot_ms: int) -> None:
        """Ask every instance to cut its runs of ``job`` that the slot at ``slot_ms`` replaces,
        written once per slot however many instances ask (``JobControl.apply``); applied here
        too once written (``FleetControls.apply``)."""
        runner = self._runner
        fleet = runner.fleet
        if fleet is None or not fleet.enabled:
            return  # no fleet records: a run elsewhere ends by itself, or its lease expires
        note = f"replaced by the slot at {ms_to_datetime(slot_ms).isoformat()}"
        actor = f"overlap=replace@{runner.instance_id}"
        change = ControlChange(
            job.settings.key, "abort", actor, runner.clock.now(), through_ms=slot_ms, note=note
        )
        fleet.change(job, change).add_done_callback(functools.partial(_asked, job, slot_ms))

    async def _wait_for_cut(self, job: JobState, slot_ms: int) -> bool:
        """Wait until this instance's cut runs of ``job`` have ended (released their lease),
        or ``POLL_MS`` for a run elsewhere; ``False`` when the slot would be late by then."""
        clock = self._runner.clock
        wait_ms = min(POLL_MS, slot_ms + job.settings.max_late_ms - clock.now_ms())
        if wait_ms <= 0:
            return False
        cut = {run.task for run in job.runs.values() if replaced_by(run, slot_ms)}
        waited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = clock.call_later(wait_ms, lambda: resolve(waited))
        try:
            with clock.blocking():  # a virtual clock: its timer or the cut runs wake it
                await asyncio.wait({*cut, waited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        return clock.now_ms() - slot_ms <= job.settings.max_late_ms  # not late by then


def _asked(job: JobState, slot_ms: int, written: asyncio.Future[JobControl]) -> None:
    """The fleet's answer to a replacement asked for the slot at ``slot_ms``: a failure is
    logged (the run elsewhere then ends by itself, or its lease expires)."""
    if not written.cancelled() and (exc := written.exception()) is not None:
        logger.warning(
            "could not ask the fleet to cut the runs of job %s before slot %d: %s",
            job.name,
            slot_ms,
            exc,
        )

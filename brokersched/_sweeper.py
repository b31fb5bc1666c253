"""Lease backends: catch-up at start, and the sweep that takes over the slots of dead runners."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from ._clock import Clock, Timer
from ._durations import to_ms
from ._job import JobState
from ._runner import Runner
from .abc import Lease, LeaseBackend

__all__ = ["Sweeper"]

logger = logging.getLogger("brokersched")

#: A missed slot is claimed this long after its jitter window closed: the fleet's last on-time
#: claim, sent as the window closes, lands first.
_CLAIM_GRACE_MS = 250


class Sweeper:
    """For one start of a scheduler on a lease backend: runs the latest missed slot of each job
    (catch-up, once its jitter window passed unclaimed), then looks for dead runners' slots
    every ``lease_ttl / 2`` (monotonic) and runs them again (``reason == "retry"``). The only
    owner of its timers."""

    def __init__(
        self,
        clock: Clock,
        backend: LeaseBackend,
        runner: Runner,
        *,
        jobs: Callable[[], list[JobState]],
        spawn: Callable[[Coroutine[Any, Any, Any], str], object],
    ) -> None:
        self._clock = clock
        self._backend = backend
        self._runner = runner
        self._jobs = jobs
        self._spawn = spawn
        self._timer: Timer | None = None
        self._waiting: list[Timer] = []  # catch-ups waiting for their slot's jitter window
        self._closed = False

    def start(self) -> None:
        self._catch_up()
        self._spawn(self._sweep(), "brokersched:take-over")  # hand-overs wait for no one
        self._schedule()

    def close(self) -> None:
        """No sweep nor catch-up from now on (the scheduler is stopping)."""
        self._closed = True
        for waiting in self._waiting:
            waiting.cancel()
        self._waiting.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def _catch_up(self) -> None:
        """The latest slot each job missed, claimed ``catch-up``, once the fleet had its
        chance at it: a slot still in its jitter window as this instance starts may be
        claimed on time by the others right now (an instance restarted just after a slot fell
        due would otherwise win it at once and call an on-time run a catch-up). It is missed
        only if that window passes unclaimed; a job without jitter has no such window."""
        now = self._clock.now_ms()
        for job in self._jobs():
            if not _catches_up(job):
                continue
            latest = job.schedule.latest_ms(now, job.settings.catch_up_ms)
            if latest is None:
                continue
            window_ms = job.settings.jitter_ms
            missed_ms = latest + window_ms + _CLAIM_GRACE_MS if window_ms else now
            if missed_ms <= now:
                self._run_catch_up(job, latest)
            else:
                self._waiting.append(
                    self._clock.call_at(missed_ms, functools.partial(self._missed, job, latest))
                )

    def _missed(self, job: JobState, slot_ms: int) -> None:
        """A slot's jitter window has passed since this start: caught up if still wanted (the
        claim says whether the fleet ran it meanwhile)."""
        if not self._closed and _catches_up(job):
            self._run_catch_up(job, slot_ms)

    def _run_catch_up(self, job: JobState, slot_ms: int) -> None:
        coro = self._runner.run_slot(job, slot_ms, "catch-up")
        self._spawn(coro, f"catch-up:{job.name}")

    def _schedule(self) -> None:
        period = max(to_ms(self._backend.lease_ttl) // 2, 50)

        def sweep() -> None:
            self._spawn(self._sweep(), "brokersched:take-over")
            self._schedule()

        if not self._closed:
            self._timer = self._clock.call_later(period, sweep)

    async def _sweep(self) -> None:
        jobs = [s for s in self._jobs() if s.settings.claim and not s.halted and s.spec.enabled]
        if not jobs:
            return
        # The leases it grants are counted on from here: one answered too late to run on is
        # handed back by the runner (``Runner.execute``), not run.
        leased_ms = self._clock.monotonic_ms()
        try:
            leases = await self._backend.take_over(
                [job.settings.policy for job in jobs], instance_id=self._runner.instance_id
            )
        except Exception as exc:
            logger.warning("take-over sweep failed: %s", exc)
            return
        by_key = {job.settings.key: job for job in self._jobs()}
        for lease in leases:
            if self._runner.ended_here(lease):
                # Ended here, but its release came after the lease expired (the store was
                # away): done, not run again. Taken over elsewhere, it would be (the README's
                # Limits). Released aside: the store may still be flaky, the others wait not.
                logger.info(
                    "took over %s, which ended here before its lease was released: "
                    "released as ended, not run again",
                    lease.slot.key,
                )
                release = self._runner.release(lease, handover=False)
                self._spawn(release, f"release:{lease.slot.key}")
                continue
            state = by_key.get(lease.job)  # leases are kept under the job's key
            if state is None or self._closed or _running_here(state, lease):
                # A sync handler whose lease was lost may still be running here: not twice.
                await self._runner.release(lease, handover=True)
                continue
            run = self._runner.execute(state, lease.slot_ms, lease, leased_ms=leased_ms)
            self._spawn(run, f"retry:{lease.job}")


def _catches_up(job: JobState) -> bool:
    """Whether ``job`` catches up a missed slot at start: claimed, with ``catch_up``, periodic
    (an ``at()`` instant is armed late, within ``max_late``, or was run), neither paused nor
    disabled, nor removed."""
    if not job.settings.claim or job.settings.catch_up_ms <= 0 or job.halted:
        return False
    return job.kind != "at" and job.spec.enabled and not job.removed


def _running_here(job: JobState, lease: Lease) -> bool:
    return any(run.ctx.slot_ms == lease.slot_ms for run in job.runs.values())

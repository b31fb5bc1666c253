"""Lease backends: catch-up at start, and the sweep that takes over the slots of dead runners."""

from __future__ import annotations

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


class Sweeper:
    """For one start of a scheduler on a lease backend: runs the latest missed slot of each job
    (catch-up), then looks for dead runners' slots every ``lease_ttl / 2`` (monotonic) and
    runs them again (``reason == "retry"``). The only owner of its timer."""

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
        self._closed = False

    def start(self) -> None:
        self._catch_up()
        self._spawn(self._sweep(), "brokersched:take-over")  # hand-overs wait for no one
        self._schedule()

    def close(self) -> None:
        """No sweep from now on (the scheduler is stopping)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def _catch_up(self) -> None:
        now = self._clock.now_ms()
        for job in self._jobs():
            if not job.settings.claim or job.settings.catch_up_ms <= 0 or job.halted:
                continue
            if job.kind == "at":
                continue  # its one instant is armed (late, within max_late) or was run
            if not job.spec.enabled:
                continue
            latest = job.schedule.latest_ms(now, job.settings.catch_up_ms)
            if latest is not None:
                coro = self._runner.run_slot(job, latest, "catch-up")
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


def _running_here(job: JobState, lease: Lease) -> bool:
    return any(run.ctx.slot_ms == lease.slot_ms for run in job.runs.values())

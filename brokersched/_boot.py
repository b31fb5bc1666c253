"""Boot runs: ``after(name, delay)`` and ``run_on_start=True``, run ``delay`` after ``start()``.

With ``claim=False`` a boot run is *per process*: every instance runs it (a cache warm-up).

With ``claim=True`` (the default) it is *per fleet*: instances that start together share one run
(a recovery sweep). They cannot agree on one instant, as they did not start at the same one, so
the run is claimed on a grid of boot windows (``BOOT_WINDOW_MS``, one minute, on every backend
and whatever its slot memory, so that instances configured differently still share a grid)
under the key ``<key>:start``: an instance whose boot run falls in window ``k`` claims window
``k - 1``, then window ``k``, and runs only if it won both. Two instances whose boot runs are
less than a window apart always compete for one window, so exactly one of them runs; an
instance whose boot run comes two windows or more after the last one runs it again (the next
deploy).

A window is named by its start on a lease backend (whose fencing orders the windows, and which
refuses slots far ahead of its clock), by its start plus two windows on a claim-only one (which
may refuse a slot that fell due before the fleet's first start); a claim-only backend remembers
boot claims for ``BOOT_MEMORY`` (three windows) whatever its ``slot_ttl``
(``ClaimBackend.claim_boot``). On a lease backend the second claim's lease is held (and
renewed) for the run, then released; a boot run is never retried on another instance. A job
with ``overlap="skip"`` holds its own lease instead, as a manual run does, so its boot run never
overlaps its slots (and, like a manual run, is retried elsewhere when its runner dies).
"""

from __future__ import annotations

import logging

from ._events import SkipReason
from ._exceptions import BackendError, ClockSkewError
from ._job import JobState
from ._runner import Runner
from .abc import (
    ClaimBackend,
    JobPolicy,
    Lease,
    LeaseBackend,
    RunReason,
    RunRecord,
    Slot,
    new_run_id,
)

__all__ = ["BOOT_WINDOW_MS", "boot_key", "run_boot"]

logger = logging.getLogger("brokersched")

BOOT_WINDOW_MS = 60_000  # BOOT_MEMORY (_slotmemory.py) is three of them
_MIN_CLAIM_TIMEOUT_S = 0.5


def boot_key(key: str) -> str:
    """What a job's fleet boot run is claimed under: no other job of the scheduler may have it
    as its key (their claims, fencing and take-overs would mix)."""
    return f"{key}:start"


async def run_boot(runner: Runner, job: JobState, boot_ms: int) -> RunRecord | None:
    """The boot run of ``job``, due at ``boot_ms`` (``ctx.reason == "start"``)."""
    if job.halted:
        runner.skip(job, boot_ms, "paused", run="start")
        return None
    if runner.stopping or job.removed:
        return None
    # Overlap is controlled where the job's other runs are (claim=False: this process; a lease
    # backend: the fleet); a claim-only backend lets runs of one job overlap.
    overlap_controlled = not job.settings.claim or isinstance(runner.backend, LeaseBackend)
    if overlap_controlled and job.settings.policy.exclusive and job.runs:
        runner.skip(job, boot_ms, "overlap", run="start")  # a run of the job is still going here
        return None
    if not job.settings.claim:
        return await runner.execute(job, boot_ms, None, reason="start")
    run_id = new_run_id()
    window = BOOT_WINDOW_MS
    cell = boot_ms - boot_ms % window
    if not isinstance(runner.backend, LeaseBackend):
        # A claim-only backend may refuse a slot that fell due before its fleet record was
        # made (a first start): name each window by an instant still to come instead.
        cell += 2 * window
    key = boot_key(job.settings.key)
    policy = JobPolicy(name=key, overlap="allow", max_attempts=1)
    lease: Lease | None = None
    leased_ms = None  # when the claim of the lease kept was sent (monotonic)
    for slot_ms in (cell - window, cell):
        if lease is not None:
            await runner.release(lease, handover=False)
        leased_ms = runner.clock.monotonic_ms()
        got = await _claim(runner, job, Slot(key, slot_ms), policy, run_id)
        if isinstance(got, str):
            runner.skip(job, boot_ms, got, run="start")
            return None
        lease = got
    # A claim-only window won as the stop began runs within the drain (nobody else can win it).
    if (runner.stopping and lease is not None) or runner.drained or job.removed:
        if lease is not None:
            await runner.release(lease, handover=False)
        return None
    if lease is not None and job.settings.policy.exclusive:
        # The windows' lease is not the job's: hold the job's own, as a manual run does, so the
        # boot run and the job's slots never overlap anywhere in the fleet.
        await runner.release(lease, handover=False)
        slot = Slot(job.settings.key, runner.clock.now_ms())
        leased_ms = runner.clock.monotonic_ms()
        got = await _claim(runner, job, slot, job.settings.policy, run_id, reason="manual")
        if isinstance(got, str):
            runner.skip(job, boot_ms, "overlap" if got == "not-acquired" else got, run="start")
            return None
        lease = got
    return await runner.execute(
        job, boot_ms, lease, reason="start", run_id=run_id, leased_ms=leased_ms
    )


async def _claim(
    runner: Runner,
    job: JobState,
    slot: Slot,
    policy: JobPolicy,
    run_id: str,
    reason: RunReason = "start",
) -> Lease | SkipReason | None:
    """A lease (lease backends), ``None`` (a won claim), or why the boot run is skipped."""
    backend = runner.backend
    timeout = runner.lease_bound(max(job.settings.max_late_ms / 1000, _MIN_CLAIM_TIMEOUT_S))
    try:
        async with runner.clock.timeout(timeout + 0.25):
            if isinstance(backend, LeaseBackend):
                lease = await backend.acquire(
                    slot,
                    policy=policy,
                    instance_id=runner.instance_id,
                    run_id=run_id,
                    reason=reason,
                    timeout=timeout,
                )
                return "not-acquired" if isinstance(lease, str) else lease
            assert isinstance(backend, ClaimBackend)
            won = await backend.claim_boot(
                slot, instance_id=runner.instance_id, run_id=run_id, timeout=timeout
            )
            return None if won else "not-acquired"
    except ClockSkewError:
        return "clock-skew"
    except (BackendError, TimeoutError):
        return "backend-error"
    except Exception:  # a backend bug must not stop the scheduler either
        logger.exception("boot claim of %s failed unexpectedly", slot.key)
        return "backend-error"

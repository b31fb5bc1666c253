"""Backfill: ``Scheduler.backfill(name, start, end)`` runs a job's slots of a past range
(``ctx.reason == "backfill"``), one after the other, each claimed like any slot, at most
``rate`` a second.

What keeps a slot from running twice:

* **The history.** A slot with a run recorded in the job's history (scheduled, caught up,
  retried or backfilled: not a manual or boot run) is not run again. The history keeps
  ``history_size`` runs (and ``history_ttl``): a slot whose record was trimmed looks never run.
* **The claim.** Every other slot is claimed first, so that two backfills (or a backfill and the
  fleet) never both run it. On a lease backend the claim is made under ``<key>:backfill``,
  fenced apart from the job's own slots (whose fence is past the range): slots are claimed in
  order, and a slot no later than one already backfilled is refused, for ever. As that claim is
  not the job's, a slot young enough for the fleet to still claim, run or record it
  (``settle_ms``) is skipped. On a claim-only backend the slot is claimed under the job's key,
  as the fleet claimed it when it fell due, so only while the backend remembers that claim
  (``slot_ttl``, less its margin): an older slot is not run, since nothing could tell whether
  another backfill ran it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal

from ._clock import Clock, datetime_to_ms, ms_to_datetime
from ._durations import format_duration, to_ms
from ._events import SkipEvent
from ._exceptions import ConfigurationError
from ._job import JobState
from .abc import Backend, ClaimBackend, JobPolicy, LeaseBackend, RunRecord, Slot

if TYPE_CHECKING:
    from ._runner import Runner

__all__ = [
    "MAX_SLOTS",
    "BackfillSlot",
    "Status",
    "backfill_claim",
    "backfill_key",
    "check_range",
    "check_rate",
    "run_backfill",
    "settle_ms",
]

#: The most slots one backfill takes on (every second for a day is 86 400).
MAX_SLOTS = 100_000
# How long another instance's record of a run may take to reach the backend.
_RECORD_SLACK_MS = 10_000
# History runs that count as a run of their slot (a manual or boot run is at its own instant).
_SLOT_RUNS = ("schedule", "catch-up", "retry", "backfill")

Status = Literal["ran", "already-run", "not-acquired", "skipped", "would-run", "stopped"]


@dataclass(frozen=True, slots=True)
class BackfillSlot:
    """One slot of a backfill: ``index`` of ``total``, what became of it, and the record of
    its run (``ran``; its ``outcome`` says how it went).

    ``status``: ``ran``; ``already-run`` (in the history); ``not-acquired`` (claimed by
    another instance or an earlier backfill); ``skipped`` (``detail`` says why: too old for a
    claim-only backend's memory, the backend failed); ``would-run`` (``dry_run``);
    ``stopped`` (the scheduler stopped first)."""

    at: datetime
    index: int
    total: int
    status: Status
    detail: str | None = None
    record: RunRecord | None = None


def backfill_key(key: str) -> str:
    """What a lease backend fences a job's backfilled slots under."""
    return f"{key}:backfill"


def backfill_claim(slot: Slot) -> tuple[Slot, JobPolicy]:
    """A lease backend's claim of a backfilled slot: under ``backfill_key``, its own fence."""
    key = backfill_key(slot.job)
    return Slot(key, slot.slot_ms), JobPolicy(name=key, overlap="allow", max_attempts=1)


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


def settle_ms(job: JobState, backend: Backend) -> int:
    """How old a slot must be before a backfill claims it apart from the job's own claims (on
    a lease backend, or unclaimed), so that nothing else of the fleet still runs it: its
    scheduled claim (``jitter + max_late``) or a catch-up (``catch_up``) may still come, its
    run (``timeout``, its retries) may still go, a dead runner's slot be taken over (within
    ``max(catch_up, max_late)`` of its lease's expiry, ``lease_ttl`` after its last renewal),
    and its record be on its way (``_RECORD_SLACK_MS``). A run without a ``timeout`` can last
    longer: see the README. 0 on a claim-only backend: the slot's own claim decides."""
    if isinstance(backend, ClaimBackend) and job.settings.claim:
        return 0
    settings = job.settings
    window = max(settings.max_late_ms, settings.catch_up_ms)
    run = timedelta(0) if settings.timeout is None else settings.timeout
    if settings.retry is not None:
        run = settings.retry.worst_case(settings.timeout)[0]
    lease_ms = to_ms(backend.lease_ttl) if isinstance(backend, LeaseBackend) else 0
    return settings.jitter_ms + 2 * window + to_ms(run) + 2 * lease_ms + _RECORD_SLACK_MS


def check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
        raise ConfigurationError(f"backfill: rate {rate!r} must be a number of slots a second")
    if rate <= 0:
        raise ConfigurationError(f"backfill: rate ({rate:g}/s) must be greater than 0")
    return float(rate)


async def run_backfill(
    runner: Runner,
    backend: Backend,
    job: JobState,
    slots: list[int],
    history: list[RunRecord],
    *,
    rate: float,
    dry_run: bool,
    spawn: Callable[[int], asyncio.Task[RunRecord | None]],
    progress: Callable[[BackfillSlot], object] | None,
) -> list[BackfillSlot]:
    """Take ``slots`` in order: skip those in ``history``, claim and run the others (``spawn``
    runs one through the runner), at most ``rate`` a second; ``progress`` is told each."""
    ran = {record.slot_ms for record in history if record.reason in _SLOT_RUNS}
    clock: Clock = runner.clock
    settle = settle_ms(job, backend)
    recent = (
        f"too recent: the fleet may still claim, run or record it (on this job, a backfill "
        f"takes slots at least {format_duration(timedelta(milliseconds=settle))} old)"
    )
    results: list[BackfillSlot] = []
    pace_ms, next_ms = round(1000 / rate), clock.monotonic_ms()
    for index, slot_ms in enumerate(slots, 1):
        status: Status
        detail, record = None, None
        if slot_ms in ran:
            status = "already-run"
        elif runner.stopping:
            status, detail = "stopped", "the scheduler stopped"
        elif (too_old := _too_old(backend, job, slot_ms, clock)) is not None:
            status, detail = "skipped", too_old
        elif settle and slot_ms > clock.now_ms() - settle:
            status, detail = "skipped", recent
        elif dry_run:
            status = "would-run"
        else:
            if (wait_ms := next_ms - clock.monotonic_ms()) > 0:
                await clock.sleep(wait_ms / 1000)
            next_ms = clock.monotonic_ms() + pace_ms
            status, detail, record = await _run(runner, job, slot_ms, spawn)
        step = BackfillSlot(ms_to_datetime(slot_ms), index, len(slots), status, detail, record)
        results.append(step)
        if progress is not None:
            progress(step)
    return results


async def _run(
    runner: Runner,
    job: JobState,
    slot_ms: int,
    spawn: Callable[[int], asyncio.Task[RunRecord | None]],
) -> tuple[Status, str | None, RunRecord | None]:
    """Claim and run one slot: what became of it, why it was skipped, its record."""
    if runner.stopping:
        return "stopped", "the scheduler stopped", None
    skips: list[str] = []

    def note(event: SkipEvent) -> None:
        if event.job == job.name and event.slot_ms == slot_ms and event.run == "backfill":
            said = event.detail if event.reason != "not-acquired" else None
            skips.append(said or event.reason)

    runner.events.on("skip", note)
    try:
        record = await asyncio.shield(spawn(slot_ms))
    finally:
        runner.events.off("skip", note)
    if record is not None:
        return "ran", None, record
    if runner.stopping:
        return "stopped", "the scheduler stopped", None
    if skips and skips[-1] != "not-acquired":
        return "skipped", skips[-1], None
    return "not-acquired", None, None


def _too_old(backend: Backend, job: JobState, slot_ms: int, clock: Clock) -> str | None:
    """Why a claim-only backend cannot claim ``slot_ms`` safely any more, if it cannot."""
    if not isinstance(backend, ClaimBackend) or not job.settings.claim:
        return None
    deadline = backend.claim_deadline_ms(Slot(job.settings.key, slot_ms))
    if deadline is None or clock.now_ms() < deadline:
        return None
    return (
        f"older than {backend.name}'s slot memory: a claim-only backend no longer knows "
        "whether it ran (a lease backend fences backfills for ever)"
    )

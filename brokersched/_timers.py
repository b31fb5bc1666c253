"""The timer heap: one timer for every job of a scheduler, and each job's boot run. The only
writer of the jobs' ``Arming``."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from ._clock import Clock, Timer
from ._job import JobState
from .triggers.after import AfterTrigger

__all__ = ["Timers"]

# A jittered slot fires up to a sixteenth of its jitter early (never before the slot itself),
# at most this much, with the slots due just before it: a fleet with jitter spreads the claims
# of one instant over the jitter, and slots fired in one turn of the loop are claimed in one
# batch (one statement, one write) for one wake-up, not one each. Moving a random delay a few
# ms earlier changes nothing for the fleet. Measured with bench/fleet.py, 3 processes x 20
# jobs every second, default jitter (250 ms), with NATS claim_many: CPU per run 1.85 -> ~1.4 ms.
_MAX_FIRE_EARLY_MS = 20


def _fire_early_ms(job: JobState) -> int:
    return min(job.settings.jitter_ms // 16, _MAX_FIRE_EARLY_MS)


class Timers:
    """Arms the next slot of every job on one timer (a heap of ``(due_ms, seq, slot_ms,
    job)``), and the boot run of ``after()`` and ``run_on_start`` jobs on a timer each.

    Nothing is armed until ``open()`` (a started scheduler that schedules) and after
    ``close()``. A slot that falls due goes to ``fire(job, slot_ms)``, a boot run to
    ``fire_boot(job, due_ms)``; the slots a frozen process passes over to ``passed``. Entries
    left behind by a pause, a removal or a re-arm are skipped when they come up, and dropped
    when the heap grows past twice the jobs.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        fire: Callable[[JobState, int], None],
        fire_boot: Callable[[JobState, int], None],
        job_count: Callable[[], int],
        passed: Callable[[JobState, int, int], None] | None = None,
    ) -> None:
        self._clock = clock
        self._fire = fire
        self._passed = passed
        self._fire_boot = fire_boot
        self._job_count = job_count
        self._random = clock.random()
        self._heap: list[tuple[int, int, int, JobState]] = []  # (due_ms, seq, slot_ms, job)
        self._seq = itertools.count()
        self._timer: Timer | None = None
        self._timer_ms: int | None = None
        self._open = False
        self._opened_ms: int | None = None  # never a slot from before this (see rearm)

    def reseed(self) -> None:
        """A fresh jitter (after a fork): pre-forked workers must not fire at one instant."""
        self._random = self._clock.random()  # seeded afresh from os.urandom

    @property
    def size(self) -> int:
        """Entries in the heap, stale ones included."""
        return len(self._heap)

    def open(self, started_ms: int) -> None:
        """Arm from now on (the scheduler started, and schedules)."""
        self._open, self._opened_ms = True, started_ms

    def close(self, jobs: list[JobState]) -> None:
        """Disarm everything: no slot and no boot run not yet due comes any more."""
        self._open = False
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_ms = None
        self._heap.clear()
        for job in jobs:
            arming = job.arming
            arming.armed_ms = None
            if arming.boot_timer is not None:  # a boot run not yet due never comes
                arming.boot_timer.cancel()
            arming.boot_ms = arming.boot_timer = None

    def disarm(self, job: JobState) -> None:
        """Stop waiting for ``job``'s next slot (paused, removed); its heap entry goes stale."""
        job.arming.armed_ms = None

    def arm_boot(self, job: JobState, since_ms: int) -> None:
        """Arm the boot run of an ``after()`` job, or of a ``run_on_start`` job."""
        if not self._open or job.removed or job.halted:
            return  # a job paused at start has no boot run (a CLI trigger pauses them all)
        if not job.spec.enabled:
            return
        if isinstance(job.schedule, AfterTrigger):
            delay_ms = job.schedule.delay_ms
        elif job.options.run_on_start:
            delay_ms = 0
        else:
            return
        arming = job.arming
        due = arming.boot_ms = since_ms + delay_ms

        def fire() -> None:
            arming.boot_ms = arming.boot_timer = None
            self._fire_boot(job, due)

        arming.boot_timer = self._clock.call_at(due, fire)

    def arm(self, job: JobState, after_ms: int | None = None) -> None:
        """Arm ``job``'s next slot after ``after_ms`` (default: now)."""
        if not self._open or job.halted or job.removed or not job.spec.enabled:
            return
        now = self._clock.now_ms()
        if after_ms is None:
            # An at() instant that passed less than max_late ago still runs, late (the slot's
            # life, step 3); the missed slots of a periodic job are catch-up's (lease backends).
            after_ms = now - job.settings.max_late_ms - 1 if job.kind == "at" else now
        slot = job.schedule.next_ms(after_ms)
        arming = job.arming
        arming.armed_ms = slot
        if slot is None:
            return
        jitter_ms = job.settings.jitter_ms
        jitter = self._random.randint(0, jitter_ms) if jitter_ms else 0
        if len(self._heap) > 2 * self._job_count() + 64:
            self._compact()
        arming.seq = next(self._seq)
        heapq.heappush(self._heap, (slot + jitter, arming.seq, slot, job))
        if self._timer_ms is None or slot + jitter < self._timer_ms:
            self._set_timer(slot + jitter)

    def rearm(self, job: JobState, *, since_ms: int | None = None, anew: bool = False) -> None:
        """Arm ``job`` again after ``update()`` or ``resume()``, keeping a slot whose jitter
        window is still open (the fleet may be claiming it right now) unless it fired here;
        with ``since_ms`` (a pause's end), its slots from that instant on too. ``anew``: its
        slots changed (a stored schedule's new version), the one it waited for may be none of
        them: armed again from its last fired slot, or from the one it waited for if that is
        due already."""
        arming = job.arming
        if arming.armed_ms is not None and not anew:
            after = arming.armed_ms - 1  # the slot it waited for has not fired yet
        else:
            after = self._clock.now_ms() - job.settings.jitter_ms - 1
            if since_ms is not None:
                after = min(after, since_ms - 1)
            if anew and arming.armed_ms is not None:
                # A slot due but not fired yet (the loop late, the new version handled before
                # the slot's timer) is kept if the new version has it: none other fires it here.
                after = min(after, arming.armed_ms - 1)
            if arming.fired_ms is not None:
                after = max(after, arming.fired_ms)
            if self._opened_ms is not None:  # never a slot from before this start
                after = max(after, self._opened_ms)
            if anew and self._passed is not None:
                # The new version's slots since the last one fired here that are passed over
                # (a version read late): their fate is unknown here, so they are watched.
                since = [ms for ms in (arming.fired_ms, self._opened_ms) if ms is not None]
                if since and max(since) < after:
                    self._passed(job, max(since), after)
        arming.armed_ms = None
        self.arm(job, after_ms=after)

    def _compact(self) -> None:
        """Drop the entries that pause/resume/remove left behind (they are skipped lazily)."""
        self._heap = [entry for entry in self._heap if _current(entry[3], entry[1])]
        heapq.heapify(self._heap)

    def _set_timer(self, when_ms: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_ms = when_ms
        self._timer = self._clock.call_at(when_ms, self._on_timer)

    def _on_timer(self) -> None:
        now = self._clock.now_ms()
        # While it fires, arm() sets no timer for a later slot: the timer is set once, below.
        self._timer, self._timer_ms = None, now
        while self._heap:
            due, seq, slot_ms, job = self._heap[0]
            if due > now and (slot_ms > now or due - now > _fire_early_ms(job)):
                break
            heapq.heappop(self._heap)
            if not _current(job, seq):
                continue  # disarmed (paused, removed, re-armed) since it was pushed
            job.arming.fired_ms = slot_ms
            self._fire(job, slot_ms)
            # A frozen process wakes to many past slots: skip straight to those still in time
            # (the ones passed over go to ``passed(job, after_ms, through_ms)``).
            in_time_ms = now - job.settings.max_late_ms
            if in_time_ms > slot_ms and self._passed is not None:
                self._passed(job, slot_ms, in_time_ms)
            self.arm(job, after_ms=max(slot_ms, in_time_ms))
        if self._heap:
            self._set_timer(self._heap[0][0])
        else:
            self._timer_ms = None


def _current(job: JobState, seq: int) -> bool:
    """Whether a heap entry is the job's current one (not left by pause/remove/re-arm)."""
    arming = job.arming
    return arming.seq == seq and arming.armed_ms is not None and not job.removed

"""The fleet simulator's ledger (``brokersched.testing.simulate``): what happened, as the
handlers and the events tell it, and the invariants it must keep, checked after every step.

* a slot of a key runs once on a claim-only backend; on a lease backend it runs again only
  after its run was cut short (killed, its lease lost, a drain's cut), at attempts within
  ``max_attempts``: a slot whose handler returned never runs again, and two runs of a slot
  never go on at once, whatever their reasons (a backfill's included). A ``retry`` after a
  failed attempt is no new run of the slot: it follows that attempt on the same instance
  (attempt + 1, within ``retry.attempts``); a slot whose last retry failed never runs again;
* runs of a key with ``overlap="skip"`` or ``"replace"`` never overlap (on the fleet's true
  time); a run cut by a later slot (``replace``) is recorded once: ``replaced`` (or
  ``interrupted`` by a taker, when its lease was lost first), never twice, and not at all only
  where its release never reached the store (``replaced``, at the end);
* at the end, every slot that some instance was refused as ``not-acquired`` was won by a claim
  (a slot that every instance lost to nobody is lost silently); on a claim-only backend,
  every slot won by an instance never killed ran, or that instance said why not (a skip
  event), or its job was paused, disabled or removed there near it, or a stop's drain cut its
  claim, answer lost;
* a job paused for the fleet (``Job.pause()`` on any instance, its write answered) runs no
  slot (scheduled, caught up, taken over, a boot run) whose read of the controls began after
  that answer, until it is resumed; a job disabled for the fleet (``Job.disable()``) runs
  nothing at all after it, a manual run and a backfill included, until it is enabled (a
  ``retry=`` attempt goes on with its run). Unless the store was away around that read (a read
  that failed, or hung, leaves the last known controls in force until the next one succeeds,
  within a heartbeat), or the instance's clock was stepped, or the job was registered there at run
time a moment before (it knows no control until its next read).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..abc import RunRecord
from ._sim_store import Wins

__all__ = [
    "CHECKED_FROM_MS",
    "CHECK_GIVE_UP_MS",
    "CLAIM_SPAN_MS",
    "LEASE_SKEW_MS",
    "Ledger",
    "Run",
    "origin_of",
]

CLAIM_SPAN_MS = 50_000  # a claim begins within jitter (4 s) and max_late (45 s) of its slot
LEASE_SKEW_MS = 5000  # the lease backends' default max_clock_skew
# Boot runs that fall less than a boot window apart (less the clocks' skew) share one run.
_BOOT_SHARED_MS = 60_000 - 1000
# A pause counts for the slots whose read of the controls began this long after its answer.
_PAUSE_MARGIN_MS = 100
# How long after an outage a read of the controls sent during it may still hang (the simulated
# stores' fleet calls time out after 2 s), and a second more.
_READ_HANGS_MS = 3000
# The schedulers' heartbeat (the default): the controls are read at least this often.
_HEARTBEAT_MS = 5000
# A backfill reads the controls within a second before each slot it runs.
_BACKFILL_READ_MS = 1000
# What a pause stops: the fleet's own runs of a slot (and boot runs); a disable, every run.
_PAUSED = ("schedule", "catch-up", "take-over", "start")
_DISABLED = (*_PAUSED, "manual", "backfill")
# What a skip(n) stops, and a pause(until=) judges by the slot's instant: the fleet's own slots.
_SKIPPABLE = ("schedule", "catch-up")


@dataclass
class Run:
    key: str
    slot_ms: int
    reason: str
    attempt: int
    instance: str
    overlap: str
    max_attempts: int
    start: int  # the fleet's true time, ms
    lease_ttl_ms: int = 0
    retries: int = 1  # the job's retry.attempts (1: no retry)
    origin: str = ""  # a failed attempt's retry: the reason of the first attempt; else reason
    leased: bool = False  # it began a lease of its own (a claim, a take-over), no retry= attempt
    ahead_ms: int = 0  # how far ahead of the fleet's true time its instance's clock was
    end: int | None = None
    # "returned", "failed" (raised), "timed-out" (cut by its timeout: a failed attempt that
    # retry= retries, but cut short), "cut" (cancelled: lease lost, drain, abort), "replaced"
    # (cut by a later slot of its job: overlap="replace"), "killed"
    how: str = ""
    run_id: str = ""

    @property
    def kind(self) -> str:
        """What began it: its reason, but ``take-over`` for a take-over (a retry under a new
        lease) and ``retry`` for a ``retry=`` attempt."""
        return "take-over" if self.reason == "retry" and self.leased else self.reason

    def live_at(self, at: int) -> bool:
        """Its handler was running at ``at`` (the fleet's true time)."""
        return self.start <= at and (self.end is None or at < self.end)

    def retried_by(self, later: Run) -> bool:
        """``later`` is the retry of this failed attempt, not a new run of the slot (such as
        its take-over, attempt + 1 too, by the same instance's sweep once the lease was lost
        while the retry waited)."""
        return (
            self.how in ("failed", "timed-out")
            and later.reason == "retry"
            and later.instance == self.instance
            and later.attempt == self.attempt + 1
            and not later.leased
        )


def origin_of(runs: list[Run], instance: str, key: str, ctx: Any, leased: bool) -> str:
    """Why the run a handler starts was claimed: a failed attempt's retry keeps its first
    attempt's reason (the retry of a manual run is no run of a slot at the same instant); a
    take-over (``leased``) is a retry of its own."""
    if ctx.reason == "retry" and not leased:
        for run in reversed(runs):
            mine = run.key in (key, f"{key}:start")
            if mine and run.instance == instance and run.slot_ms == ctx.slot_ms:
                if run.how in ("failed", "timed-out") and run.attempt == ctx.attempt - 1:
                    return run.origin
                break
    return str(ctx.reason)


def _chains(runs: list[Run]) -> list[list[Run]]:
    """A slot's runs as runs of its claim or lease: each a first attempt and its retries."""
    chains: list[list[Run]] = []
    for run in runs:
        if chains and chains[-1][-1].retried_by(run):
            chains[-1].append(run)
        else:
            chains.append([run])
    return chains


def _done(chain: list[Run]) -> Run | None:
    """The attempt that ended the run of a slot for good (returned, or failed with no retry
    left), or ``None``: cut short, it may run again on a lease backend."""
    last = chain[-1]
    if last.how in ("returned", "replaced") or (
        last.how == "failed" and len(chain) >= last.retries
    ):
        return last
    return None


@dataclass
class Ledger:
    """What happened, as the handlers and the events tell it; checked after every step."""

    lease: bool
    runs: list[Run] = field(default_factory=list)
    refused: dict[tuple[str, int], set[str]] = field(default_factory=dict)  # skip reasons
    found: list[str] = field(default_factory=list)
    killed: dict[str, int] = field(default_factory=dict)  # instance -> when (true time)
    stopped: dict[str, int] = field(default_factory=dict)  # instance -> its stop() returned
    released: set[tuple[str, int, str, int]] = field(default_factory=set)
    expiry: dict[tuple[str, int, str, int], int] = field(default_factory=dict)
    outages: list[tuple[int, int]] = field(default_factory=list)  # the store unreachable
    # job key -> [paused (its write answered), resumed (asked; None: still paused)], true time
    paused: dict[str, list[list[int | None]]] = field(default_factory=dict)
    # job key -> [disabled (its write answered), enabled (asked; None: still disabled)]
    disabled: dict[str, list[list[int | None]]] = field(default_factory=dict)
    # (job key, paused) -> the instant a pause(until=) ends: its slots from then on run
    pause_until: dict[tuple[str, int], int] = field(default_factory=dict)
    # job key -> skip(n)s: [answered, after_ms, through_ms, replaced (asked; None: in force)]
    skips: dict[str, list[list[int | None]]] = field(default_factory=dict)
    stepped: dict[str, list[int]] = field(default_factory=dict)  # instance -> clock steps
    skipped: set[tuple[str, int, str]] = field(default_factory=set)  # key, slot, instance
    removed: list[tuple[str, str, int]] = field(default_factory=list)  # key, instance, when
    added: list[tuple[str, str, int]] = field(default_factory=list)  # again, at run time
    # (key, slot) -> the instances that reported it missed, and when (true time)
    reported: dict[tuple[str, int], list[tuple[str, int]]] = field(default_factory=dict)
    # (key, slot) -> the instances that skipped it not knowing whether another one ran it,
    # each with when it has checked it once (true time), when it gives up checking, and
    # whether its job says overlap="skip" on a lease backend
    unknown: dict[tuple[str, int], dict[str, tuple[int, int, bool]]] = field(default_factory=dict)

    def _unreleased(self, run: Run, attempt: int) -> bool:
        """Its handler returned, but the release of its lease (granted as ``attempt``: a retry
        after a failed attempt runs under its chain's first attempt's lease) never reached the
        store, as the README's Limits allow: its runner was killed first; or it was stopped,
        the store out of its reach from the run's end until the stop gave the release up
        (drain_timeout and its grace over) but for less than one attempt's wait (at most a
        second) and the pause before the next (at most a second); or the store was out of its
        reach from the run's end until its lease expired, but for less than one attempt's wait
        (a third of lease_ttl) and the pause before the next (a tenth)."""
        lease = (run.key, run.slot_ms, run.instance, attempt)
        if lease in self.released or run.end is None:
            return False
        if run.instance in self.killed:
            return True
        stopped = self.stopped.get(run.instance)
        if stopped is not None and stopped >= run.end:
            reachable = stopped - run.end - _covered(self.outages, run.end, stopped)
            ttl = run.lease_ttl_ms
            if reachable < min(1000, ttl // 3) + min(1000, ttl // 10):
                return True
        expiry = self.expiry.get(lease)
        if expiry is None:
            return True
        reachable = expiry - run.end - _covered(self.outages, run.end, expiry)
        return reachable < run.lease_ttl_ms // 3 + run.lease_ttl_ms // 10

    def violations(self, now: int) -> list[str]:
        found: list[str] = []
        by_slot: dict[tuple[str, int, bool], list[Run]] = {}
        for run in self.runs:  # a manual run's instant is its own, even at a slot's instant
            by_slot.setdefault((run.key, run.slot_ms, run.origin == "manual"), []).append(run)
        for (key, slot, _), runs in by_slot.items():
            chains = _chains(runs)
            if len(chains) > 1 and not self.lease:
                found.append(f"slot {key}:{slot} ran {len(chains)} times: {_show(runs)}")
            for chain in chains:
                if len(chain) > chain[0].retries:
                    found.append(f"slot {key}:{slot} retried beyond its attempts: {_show(runs)}")
            for first, second in itertools.combinations(chains, 2):
                # On a lease backend too: a slot runs again only once its run is over.
                if self.lease and _until(first[-1], now) > second[0].start:
                    found.append(f"slot {key}:{slot} ran twice at once: {_show(runs)}")
                    break
            for before, after in itertools.pairwise(chains):
                done = _done(before)
                # an instance's own sweeper knows its run ended: never again there
                if done is not None and (
                    after[0].instance == done.instance
                    or not self._unreleased(done, before[0].attempt)
                ):
                    found.append(f"slot {key}:{slot} ran again after it ended: {_show(runs)}")
                    break
                if after[0].attempt > after[0].max_attempts:
                    found.append(f"slot {key}:{slot} started beyond max_attempts: {_show(runs)}")
        boots: dict[str, list[Run]] = {}
        for run in self.runs:
            if run.reason == "start":
                boots.setdefault(run.key, []).append(run)
        for key, runs in boots.items():
            runs.sort(key=lambda run: run.slot_ms)
            for earlier, later in itertools.pairwise(runs):
                if later.slot_ms - earlier.slot_ms < _BOOT_SHARED_MS:
                    found.append(f"boot runs of {key} a window apart both ran: {_show(runs)}")
        found += self._halted_runs()
        found += self._skipped_runs()
        found += self._misreported()
        by_key: dict[str, list[Run]] = {}
        for run in self.runs:
            if run.overlap in ("skip", "replace"):
                by_key.setdefault(run.key, []).append(run)
        for key, runs in by_key.items():
            runs.sort(key=lambda run: run.start)
            for earlier, later in itertools.pairwise(runs):
                if later.start < _until(earlier, now):
                    found.append(f"runs of {key} overlap: {_show([earlier, later])}")
        return found

    def _misreported(self) -> list[str]:
        """Missed slots reported twice, or reported though the fleet ran them: a run of the
        schedule, a take-over or a retry begun before the report. After it, a catch-up or a
        backfill may run a missed slot, and be taken over; so may an instance of a rolling
        deploy that raised max_late, later than the reporter's max_late (the documented
        limit: the slot is reported, and runs late)."""
        found = [
            f"slot {key}:{slot} reported missed {len(by)} times: {sorted(by)}"
            for (key, slot), by in self.reported.items()
            if len(by) > 1
        ]
        for (key, slot), by in self.reported.items():
            reported_at = by[0][1]
            ran = [
                run
                for run in self.runs
                if (run.key, run.slot_ms) == (key, slot)
                and run.origin in ("schedule", "retry")
                and run.start < reported_at
            ]
            if ran:
                found.append(
                    f"slot {key}:{slot} reported missed by {by[0][0]} but ran: {_show(ran)}"
                )
        return found

    def unreported(
        self,
        scheduled: Callable[[str, int], bool],
        claimed: set[str],
        troubled: list[tuple[int, int]],
        wins: Wins,
        memory_ms: int | None,
    ) -> list[str]:
        """Slots of a claimed job (``claimed``: their keys) that no instance ran, that an
        instance skipped not knowing whether another ran them and that it outlived by its
        check, the store reachable and untroubled all the while (``troubled``: the spans of
        the faults that fail a call, besides the outages), not paused, disabled, skipped nor
        removed near them: each must have been reported missed, once. A slot some claim won
        is left out: its winner knew, unless the answer was lost (the README's limit), and on
        a lease backend the taker of its lease records it. ``memory_ms``: on a claim-only
        backend, the shortest slot memory any instance had (a deploy, a deleted record shortens
        the fleet's): a check after it cannot tell, and says nothing (the README's limit)."""
        spans = [*self.outages, *troubled]
        ran = {(run.key, run.slot_ms) for run in self.runs if run.origin != "manual"}
        found = []
        for (key, slot), skippers in sorted(self.unknown.items()):
            if key not in claimed or (key, slot) in ran or (key, slot) in self.reported:
                continue
            if not scheduled(key, slot) or (key, slot) in wins:
                continue
            for instance, (check_from, give_up, skip_overlap) in skippers.items():
                # A skipper whose job says overlap="skip" finds the slot skipped on purpose
                # when an earlier slot's lease was live at it, which the ledger does not see (a
                # lease granted to a run that never began): it is not asked to report.
                if memory_ms is not None:
                    give_up = min(give_up, slot + memory_ms - CHECKED_FROM_MS)
                reached = _reachable(spans, check_from, give_up, CHECK_RETRY_MS + 1000)
                if skip_overlap or reached is None:
                    continue
                if self._halted_between(key, slot, reached) or not self._stayed(
                    instance, key, slot, reached
                ):
                    continue
                found.append(
                    f"slot {key}:{slot}: nobody ran it, {instance} skipped it and stayed, the "
                    "store reachable, yet it was never reported missed"
                )
                break
        return found

    def _halted_between(self, key: str, slot: int, checked_by: int) -> bool:
        """``key`` paused or disabled from a heartbeat before ``slot`` until its check, or
        skip(n) over it: its checker may find it stopped on purpose."""
        return self._halted(key, slot, slot - EFFECT_OF_CONTROLS_MS, checked_by)

    def _halted(self, key: str, slot: int, since: int, until: int) -> bool:
        """``key`` paused or disabled at some time from ``since`` to ``until``, or a skip(n)
        over ``slot``."""
        paused = [
            [start, _earlier(end, self.pause_until.get((key, start or 0)))]
            for start, end in self.paused.get(key, [])
        ]
        spans = [*paused, *self.disabled.get(key, [])]
        skipped = any(
            after is not None and through is not None and after < slot <= through
            for _, after, through, _ in self.skips.get(key, [])
        )
        return skipped or any(
            (start or 0) <= until and (end is None or end >= since) for start, end in spans
        )

    def _stayed(self, instance: str, key: str, slot: int, until: int) -> bool:
        """``instance`` ran, the job ``key`` registered, from ``slot`` until ``until``."""
        return (
            self.killed.get(instance, until + 1) > until
            and self.stopped.get(instance, until + 1) > until
            and not any(
                k == key and i == instance and slot - CLAIM_SPAN_MS <= at <= until
                for k, i, at in self.removed
            )
        )

    def replaced(self, records: Iterable[RunRecord]) -> list[str]:
        """The runs cut by a later slot of their job, against the records the store kept (by
        run id): one each, ``replaced``, or ``interrupted`` by the taker of a lease the run
        lost first; never two outcomes; the same twice only where a release landed unanswered
        and its record was then written apart (the README's Limits: the store away after the
        run); none only where the run's release never reached the store (``_unreleased``)."""
        kept: dict[str, list[str]] = {}
        for record in records:
            kept.setdefault(record.run_id, []).append(record.outcome)
        found = []
        for run in self.runs:
            if run.how != "replaced":
                continue
            outcomes = kept.get(run.run_id, [])
            if len(outcomes) > 1 and (len(set(outcomes)) > 1 or not self._away_after(run)):
                found.append(f"a replaced run was recorded {outcomes}: {_show([run])}")
            elif not outcomes and not self._unreleased(run, self._lease_attempt(run)):
                found.append(f"a replaced run was never recorded: {_show([run])}")
        return found

    def _away_after(self, run: Run) -> bool:
        """The store was out of reach while ``run``'s release was tried (from its end until a
        lease_ttl after its lease could expire)."""
        end = run.end if run.end is not None else 0
        return _covered(self.outages, end, end + 2 * run.lease_ttl_ms) > 0

    def _lease_attempt(self, run: Run) -> int:
        """The attempt ``run``'s lease was granted as: its own, or (a ``retry=`` attempt) that
        of the leased run of its slot on its instance before it."""
        if not run.leased:
            mine = (run.key, run.slot_ms, run.instance)
            for other in reversed(self.runs[: self.runs.index(run)]):
                if other.leased and (other.key, other.slot_ms, other.instance) == mine:
                    return other.attempt
        return run.attempt

    def _halted_runs(self) -> list[str]:
        """Runs of a paused or disabled key whose read of the controls began after the pause
        or the disable was answered, and before it was undone."""
        found = []
        for run in self.runs:
            key = run.key.removesuffix(":start")
            for what, stops, spans in (
                ("paused", _PAUSED, self.paused.get(key, ())),
                ("disabled", _DISABLED, self.disabled.get(key, ())),
            ):
                if run.kind not in stops:
                    continue
                read_from = self._read_from(run)
                for since, until in spans:
                    assert since is not None
                    if not since + _PAUSE_MARGIN_MS <= read_from or (
                        until is not None and run.start >= until
                    ):
                        continue
                    if what == "paused" and self._pause_ended(key, since, run):
                        continue
                    if self._stale_controls(run, read_from):
                        continue
                    found.append(
                        f"{run.key}:{run.slot_ms} ran while {what} ({what} at {since}, its read "
                        f"of the controls from {read_from}): {_show([run])}"
                    )
                    break
        return found

    def _pause_ended(self, key: str, since: int, run: Run) -> bool:
        """The pause of ``key`` answered at ``since`` was one ``until`` an instant, and ``run``
        is past it: a slot at or after it (the fleet's own slots are judged by their instant),
        or another run (a take-over, a boot run) started from then on."""
        until = self.pause_until.get((key, since))
        if until is None:
            return False
        return (run.slot_ms if run.kind in _SKIPPABLE else run.start) >= until

    def _skipped_runs(self) -> list[str]:
        """Runs of a slot that a skip(n) of its key covered, whose read of the controls began
        after the skip was answered and before another skip of the key was asked."""
        found = []
        for run in self.runs:
            if run.kind not in _SKIPPABLE:
                continue
            read_from = self._read_from(run)
            for answered, after, through, replaced in self.skips.get(run.key, ()):
                assert answered is not None and after is not None and through is not None
                if not (after < run.slot_ms <= through):
                    continue
                if read_from < answered + _PAUSE_MARGIN_MS or (
                    replaced is not None and read_from >= replaced
                ):
                    continue
                if self._stale_controls(run, read_from):
                    continue
                found.append(
                    f"{run.key}:{run.slot_ms} ran though skipped (skip of {after}..{through}"
                    f" answered at {answered}, its read of the controls from {read_from}):"
                    f" {_show([run])}"
                )
        return found

    @staticmethod
    def _read_from(run: Run) -> int:
        """When the read of the controls that let ``run`` start began at the latest (the
        fleet's true time): a slot's (scheduled, or a manual run's instant) at its instant on
        its instance's clock; a backfill's within a second before its run; the others' (a
        catch-up, a take-over, a boot run) at the last heartbeat."""
        if run.kind in ("schedule", "manual"):
            return run.slot_ms - run.ahead_ms
        if run.kind == "backfill":
            return run.start - _BACKFILL_READ_MS
        return run.start - _HEARTBEAT_MS - _BACKFILL_READ_MS

    def _stale_controls(self, run: Run, read_from: int) -> bool:
        """Whether ``run``'s instance may have gone on with older controls than those of its
        read from ``read_from``: the store was away near that read (a read that failed leaves
        the last known controls in force until one succeeds, within a heartbeat; a read sent
        while it was away may hang until its timeout after it is back), or the instance's clock
        was stepped meanwhile (its slots then fall elsewhere on the fleet's time)."""
        for begin, end in self.outages:
            if begin <= run.start and end + _READ_HANGS_MS + _HEARTBEAT_MS >= read_from:
                return True
        steps = self.stepped.get(run.instance, ())
        if any(read_from - 60_000 <= at <= run.start for at in steps):
            return True
        # A job registered at run time knows no control until the next read (within a
        # heartbeat): its take-overs and catch-ups meanwhile go by none.
        return any(
            key == run.key.removesuffix(":start") and instance == run.instance
            and at <= run.start <= at + _HEARTBEAT_MS + _BACKFILL_READ_MS
            for key, instance, at in self.added
        )  # fmt: skip

    def lost(self, wins: Wins, scheduled: Callable[[str, int], bool]) -> list[str]:
        """The scheduled slots (``scheduled(key, slot)``: not a boot run's or a manual run's
        instant) that every instance lost to a claim nobody won."""
        ran = {(run.key, run.slot_ms) for run in self.runs}

        def fenced(key: str, slot: int) -> bool:
            """Lease backends: a later slot of the key was won, ahead of the store's clock by no
            more than max_clock_skew (an instance whose clock is that fast claims its slots
            early), and fences this one."""
            return self.lease and any(
                k == key and s > slot and s - at <= LEASE_SKEW_MS
                for (k, s), (_, at) in wins.items()
            )

        return [
            f"slot {key}:{slot} was refused to every instance as not-acquired and nobody won it"
            for (key, slot), reasons in sorted(self.refused.items())
            if reasons == {"not-acquired"}
            and scheduled(key, slot)
            and (key, slot) not in ran
            and (key, slot) not in wins
            and not fenced(key, slot)
        ]

    def dropped(
        self, wins: Wins, cut: set[tuple[str, int]], scheduled: Callable[[str, int], bool]
    ) -> list[str]:
        """Claim-only backends: the scheduled slots won by an instance that was never killed,
        which it neither ran nor skipped (an event saying why), its key never paused: nobody
        else can win them, so they ran nowhere, silently. ``cut``: the claims a stop's drain
        cancelled after the store took them, their answers lost (documented)."""
        if self.lease:
            return []
        ran = {(run.key, run.slot_ms) for run in self.runs}
        return [
            f"slot {key}:{slot} was won by {winner} and ran nowhere, with no skip to say why"
            for (key, slot), (winner, _) in sorted(wins.items())
            if scheduled(key, slot)
            and (key, slot) not in ran
            and (key, slot) not in self.reported  # its check's claim: said as missed
            and winner not in self.killed
            and (key, slot) not in cut
            and (key, slot, winner) not in self.skipped
            and not self._paused_near(key, slot)
            and not self._removed_near(key, slot, winner)
        ]

    def _removed_near(self, key: str, slot: int, winner: str) -> bool:
        """The job removed on the winner while its claim may have been in flight: not run
        there (``Scheduler.remove``), said in a log line."""
        return any(
            k == key and instance == winner and abs(at - slot) <= CLAIM_SPAN_MS
            for k, instance, at in self.removed
        )

    def _paused_near(self, key: str, slot: int) -> bool:
        """A pause (or a disable) of ``key`` that may have reached the winner while its claim
        was in flight
        (within the longest max_late and jitter drawn of the slot): not run, and said only
        in a log line."""
        return self._halted(key, slot, slot - CLAIM_SPAN_MS, slot + CLAIM_SPAN_MS)


#: Past a slot's max_late, when an instance that skipped it with an unknown fate checks it: its
#: margins (the clocks' skew, twice LEASE_SKEW_MS, a claim's flight), then again every
#: CHECK_RETRY_MS while the check fails, until CHECK_GIVE_UP_MS after max_late.
CHECKED_FROM_MS = 15_000
CHECK_RETRY_MS = 5_000
CHECK_GIVE_UP_MS = 180_000
#: How late an instance may learn of a pause, a resume or a skip (a heartbeat).
EFFECT_OF_CONTROLS_MS = 5_000


def _reachable(spans: list[tuple[int, int]], start: int, end: int, length: int) -> int | None:
    """The end of the first ``length`` ms of ``start..end`` free of every span, or None."""
    free_from = start
    for since, until in sorted(spans):
        if until <= free_from:
            continue
        if min(since, end) - free_from >= length:
            return free_from + length
        free_from = max(free_from, until)
        if free_from >= end:
            return None
    return free_from + length if end - free_from >= length else None


def _earlier(end: int | None, until: int | None) -> int | None:
    """When a pause span ends: its resume, or the instant its pause(until=) ended at."""
    if end is None or until is None:
        return until if end is None else end
    return min(end, until)


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """How much of ``start..end`` the union of ``spans`` covers, in ms."""
    covered, reached = 0, start
    for since, until in sorted(spans):
        since, until = max(since, reached), min(until, end)
        if until > since:
            covered += until - since
            reached = until
    return covered


def _until(run: Run, now: int) -> int:
    """When ``run`` ended, or ``now`` when it goes on."""
    return run.end if run.end is not None else now


def _show(runs: list[Run]) -> str:
    return "; ".join(
        f"{run.instance} {run.reason} attempt {run.attempt} at {run.start}..{run.end} ({run.how})"
        for run in runs
    )

"""A job's timeline over a window: its runs on the lanes of the instances that ran them, and
what became of each slot of the schedule that no instance ran.

A slot nobody ran is not always a fault: it fell while a run of the job was still going
(``overlap='skip'`` on a lease backend: the design), the job was paused, or this instance
skipped it for a reason it knows (late, backend error). Only a slot with none of these is
``missed``, and so is a slot the fleet reported missed (a record with reason ``missed``: drawn
as the slot's mark, not as a run). A slot another instance won is simply on that instance's
lane. Two runs of one slot with the same attempt number are a ``double`` (a retry after a
dead runner is attempt 2, not a double)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from .._clock import datetime_to_ms
from .._events import SkipEvent, SkipReason
from .._json import shown_error
from .._scheduler import Job
from ..abc import JobControl, RunRecord

__all__ = ["MAX_SLOTS", "Pauses", "SlotState", "Window", "compact_run", "timeline"]

#: What became of a slot no instance ran: ``missed`` (nobody ran it), why this instance skipped
#: it, or ``double`` (it ran twice with the same attempt number).
SlotState = Literal["missed", SkipReason, "double"]

MAX_SLOTS = 2000  # slots classified per job and window: the newest ones
_NOT_SLOTS = ("manual", "start")  # runs that are no slot of the schedule: the rest are
_NOT_JUDGED = (*_NOT_SLOTS, "backfill")  # runs the schedule did not make
_ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class Window:
    from_ms: int
    to_ms: int

    def holds(self, ms: int) -> bool:
        return self.from_ms <= ms <= self.to_ms


class Pauses:
    """When jobs were paused, as far as this instance knows: through its admin API, and the
    changes kept in each job's fleet-wide control record (its latest 50)."""

    def __init__(self) -> None:
        self._spans: dict[str, list[list[int | None]]] = {}

    def paused(self, job: str, now_ms: int) -> None:
        spans = self._spans.setdefault(job, [])
        if not spans or spans[-1][1] is not None:
            spans.append([now_ms, None])
        del spans[:-50]

    def resumed(self, job: str, now_ms: int) -> None:
        spans = self._spans.get(job)
        if spans and spans[-1][1] is None:
            spans[-1][1] = now_ms

    def covers(self, job: Job, slot_ms: int, since_ms: int) -> bool:
        """Whether ``slot_ms`` fell in a known pause, or the job is paused now and the slot
        came after ``since_ms`` (its newest run: the pause began after it)."""
        for start, end in self._spans.get(job.name, ()):
            assert start is not None
            if start <= slot_ms and (end is None or slot_ms <= end):
                return True
        if job.control is not None and _halted_at(job.control, slot_ms):
            return True
        return job.paused and slot_ms > since_ms


def _halted_at(control: JobControl, ms: int) -> bool:
    """Whether the job's control changes made before ``ms`` stopped its slot at ``ms``:
    paused (before a pause's end), disabled, or skipped (what came before the oldest change
    kept is not known: not halted)."""
    then = JobControl(control.job)
    for change in control.changes:
        if datetime_to_ms(change.at) > ms:
            break
        then = then.apply(change)
    return then.stops(ms) is not None


def compact_run(record: RunRecord, job: Job | None) -> dict[str, Any]:
    """A run as the timelines draw it (the run page has the rest)."""
    started = datetime_to_ms(record.started_at)
    finished = datetime_to_ms(record.finished_at) if record.finished_at else None
    error = shown_error(record.error, job)[:_ERROR_CHARS] if record.error else None
    return {
        "run_id": record.run_id,
        "slot_ms": record.slot_ms,
        "started_ms": started,
        "finished_ms": finished,
        "instance_id": record.instance_id,
        "outcome": record.outcome,
        "reason": record.reason,
        "attempt": record.attempt,
        "late_ms": started - record.slot_ms,
        "error": error,
    }


def _busy_spans(records: Iterable[RunRecord], now_ms: int) -> list[tuple[int, int]]:
    return [
        (
            datetime_to_ms(r.started_at),
            datetime_to_ms(r.finished_at) if r.finished_at else now_ms,
        )
        for r in records
    ]


def _slots(job: Job, start_ms: int, until_ms: int) -> list[int]:
    """The schedule's slots in ``(start_ms, until_ms]``, the newest ``MAX_SLOTS``."""
    if (gap := job.schedule.min_gap()) is not None:
        gap_ms = max(1, gap // timedelta(milliseconds=1))
        start_ms = max(start_ms, until_ms - MAX_SLOTS * gap_ms)
    slots: list[int] = []
    slot = job.schedule.next_ms(start_ms)
    while slot is not None and slot <= until_ms:
        slots.append(slot)
        slot = job.schedule.next_ms(slot)
    return slots[-MAX_SLOTS:]


def _skip_detail(skip: SkipEvent, job: Job) -> str:
    return shown_error(skip.detail, job)[:_ERROR_CHARS] if skip.detail else ""


def timeline(
    job: Job,
    records: Sequence[RunRecord],
    *,
    window: Window,
    now_ms: int,
    here: str,
    skips: Sequence[SkipEvent],
    pauses: Pauses,
    overlap_skips: bool,
    read_limit: int,
) -> dict[str, Any]:
    """The job's lanes, runs and slot marks in ``window``. ``records``: newest first, as read
    (at most ``read_limit``); ``overlap_skips``: whether a slot falling during a run is skipped
    by design.

    Slots are judged from the oldest run the fleet made of its own on (before it, the job may
    not have existed: a backfill of an older range says nothing of the slots between);
    ``known_from_ms`` is the oldest record's slot when older records may have been trimmed (or
    not read), ``None`` when the records go back to the job's first run."""
    runs = [
        r
        for r in records
        if r.reason != "missed"  # a report, not a run: drawn as its slot's mark
        and (window.holds(r.slot_ms) or window.holds(datetime_to_ms(r.started_at)))
    ]
    lanes = sorted({here, *(r.instance_id for r in runs)})
    marks: list[dict[str, Any]] = []
    first = min((r.slot_ms for r in records), default=None)
    own = min((r.slot_ms for r in records if r.reason not in _NOT_JUDGED), default=None)
    if own is not None:
        marks = _slot_marks(job, records, window, now_ms, own, skips, pauses, overlap_skips)
    kept = min(read_limit, job.settings.policy.history_size)
    trimmed = len(records) >= kept or job.settings.policy.history_ttl is not None
    return {
        "job": job.name,
        "from_ms": window.from_ms,
        "to_ms": window.to_ms,
        "now_ms": now_ms,
        "here": here,
        "lanes": lanes,
        "first_ms": first,
        "known_from_ms": first if trimmed else None,
        "runs": [compact_run(r, job) for r in runs],
        "slots": marks,
    }


def _slot_marks(
    job: Job,
    records: Sequence[RunRecord],
    window: Window,
    now_ms: int,
    known_from: int,
    skips: Sequence[SkipEvent],
    pauses: Pauses,
    overlap_skips: bool,
) -> list[dict[str, Any]]:
    reported = {r.slot_ms: r for r in records if r.reason == "missed"}
    scheduled = [r for r in records if r.reason not in _NOT_SLOTS and r.reason != "missed"]
    ran = {r.slot_ms for r in scheduled}
    runs_of = Counter((r.slot_ms, r.attempt) for r in scheduled)
    doubles = sorted({slot for (slot, _), count in runs_of.items() if count > 1})
    newest = max((r.slot_ms for r in scheduled), default=known_from)
    skipped = {s.slot_ms: s for s in skips if s.run not in _NOT_SLOTS}
    busy = _busy_spans(scheduled, now_ms) if overlap_skips else []
    # A slot that fell during a run is skipped at once; any other is judged once max_late has
    # passed (until then an instance may still run it).
    due = now_ms - job.settings.max_late_ms
    marks: list[dict[str, Any]] = []
    for slot in _slots(job, max(window.from_ms, known_from) - 1, min(window.to_ms, now_ms)):
        if slot in ran:
            continue
        skip = skipped.get(slot)
        if (report := reported.get(slot)) is not None:
            mark = {"state": "missed", "detail": f"reported by {report.instance_id}: nobody ran it"}
        elif any(start <= slot <= end for start, end in busy):
            mark = {"state": "overlap", "detail": "a run of the job was still going"}
        elif slot > due:
            continue
        elif skip is not None and skip.reason != "not-acquired":
            mark = {"state": skip.reason, "detail": _skip_detail(skip, job)}
        elif pauses.covers(job, slot, newest):
            mark = {"state": "paused", "detail": "the job was paused"}
        elif skip is not None:  # another instance won its claim but recorded no run
            mark = {"state": "not-acquired", "detail": "claimed by another instance; no record"}
        else:
            mark = {"state": "missed", "detail": "no instance ran it"}
        marks.append({"slot_ms": slot, **mark})
    marks.extend(
        {"slot_ms": slot, "state": "double", "detail": "ran more than once"}
        for slot in doubles
        if window.holds(slot)
    )
    return marks

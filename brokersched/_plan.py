"""What a rolling deploy does to the slots of each job while instances of the old and the new
version of an application run side by side (``brokersched plan OLD NEW``).

The model. A slot runs once fleet-wide because every instance claims it under the same
identity: ``<key>:<slot_ms>``. During a rolling deploy the old instances claim the old
version's slots under the old key, the new instances the new version's under the new key, both
at once; so the fleet runs the *union* of the two versions' claims. For each job (matched by
name; else by key, a rename that kept its key; else by an identical schedule, a rename that
did not), in a window of time:

* a slot both versions have, claimed under two keys, runs twice while both versions run
  (``twice``, cause ``key``);
* a slot both versions have, claimed by one version and run unclaimed on every instance by
  the other (``claim``), runs on every instance of one version and once more on the other:
  its owner changes (``owner``, cause ``claim``);
* a schedule that moved (another time zone, cron expression, interval or offset) gives slots
  that only one version has. An old slot ``o`` stands for the same occurrence as the nearest
  new slot ``n``: a rollout between them runs that occurrence twice when ``o < n`` (the old
  instances ran ``o``, the new ones run ``n``) and never when ``n < o`` (the new instances
  started after ``n``, the old ones stopped before ``o``) (``twice``/``never``, cause
  ``schedule``). A schedule that only gains slots (``5m`` to ``1m``) or only loses some has no
  such pair: no occurrence runs twice or never;
* a new job that claims under a key an *other* job of the old version claims shares its
  slots: at an instant both have, the first claim wins and the other job's run never happens
  (``never``, cause ``shared-key``).

A job only one version has is no hazard (added, or removed: the old instances run it until
they stop). Jobs that claim nothing in either version run on every instance of each version
as they always did: no hazard. ``after()`` jobs have no slot on the clock and are not compared.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from ._durations import format_duration
from ._exceptions import ConfigurationError
from .triggers.base import Trigger
from .triggers.cron import CronTrigger
from .triggers.spec import trigger_from_spec, trigger_spec

__all__ = [
    "Hazard",
    "HazardSlot",
    "JobPlan",
    "PlannedJob",
    "plan_deploy",
]

HazardKind = Literal["twice", "never", "owner"]
Cause = Literal["key", "claim", "schedule", "shared-key"]

#: Slots of one job compared at most, per version: an every("10ms") job stops being compared
#: there rather than filling the memory (``JobPlan.compared_until_ms`` says where).
MAX_SLOTS = 300_000


@dataclass(frozen=True)
class PlannedJob:
    """One job of one version, as the plan compares it."""

    name: str
    key: str
    claim: bool
    enabled: bool
    spec: Mapping[str, Any]  # the trigger as data (``triggers.spec``)
    trigger: Trigger = field(compare=False)

    @property
    def schedule(self) -> str:
        return self.trigger.describe()

    @classmethod
    def of(cls, name: str, key: str, claim: bool, enabled: bool, trigger: Trigger) -> PlannedJob:
        return cls(name, key, claim, enabled, trigger_spec(trigger), trigger)

    @classmethod
    def from_listing(cls, row: Mapping[str, Any]) -> PlannedJob:
        """A job as ``brokersched jobs --json`` printed it; ``ConfigurationError`` when the row
        lacks what the plan needs (a listing saved by a version without ``trigger``)."""
        name = row.get("name")
        missing = [k for k in ("name", "key", "trigger", "claim", "enabled") if k not in row]
        if missing or not isinstance(name, str):
            raise ConfigurationError(
                f"job {name!r} of the listing lacks {', '.join(missing) or 'a name'}: save it "
                "again with this version's 'brokersched jobs APP --json'",
                option="listing",
            )
        spec = row["trigger"]
        if not isinstance(spec, Mapping):
            raise ConfigurationError(f"job '{name}': trigger {spec!r} is not an object")
        trigger = trigger_from_spec(spec)
        return cls(name, str(row["key"]), bool(row["claim"]), bool(row["enabled"]), spec, trigger)


@dataclass(frozen=True)
class HazardSlot:
    """One occurrence at risk: its slot in the old version and in the new one (the same
    instant for a changed key or claim, two for a moved schedule)."""

    old_ms: int
    new_ms: int


@dataclass(frozen=True)
class Hazard:
    """What may happen to the occurrences of ``slots``, why, and how to avoid it."""

    kind: HazardKind
    cause: Cause
    slots: tuple[HazardSlot, ...]
    advice: str


@dataclass(frozen=True)
class JobPlan:
    """A job of either version (or both), what changed, and the hazards of the window."""

    name: str
    old: PlannedJob | None
    new: PlannedJob | None
    changes: tuple[str, ...]
    hazards: tuple[Hazard, ...]
    compared_until_ms: int


def plan_deploy(
    old: Sequence[PlannedJob], new: Sequence[PlannedJob], start_ms: int, end_ms: int
) -> list[JobPlan]:
    """Every job of either version with its hazards for slots in ``[start_ms, end_ms)``, in
    the new version's order, then the jobs the new version removed."""
    return [_plan_pair(o, n, start_ms, end_ms, old) for o, n in _matched(old, new)]


def _same_name(old: PlannedJob, new: PlannedJob) -> bool:
    return old.name == new.name


def _same_key(old: PlannedJob, new: PlannedJob) -> bool:
    """Renamed, its key kept (``key=`` the old name): the same claims."""
    return old.key == new.key


def _same_schedule(old: PlannedJob, new: PlannedJob) -> bool:
    """Renamed with its key (the name by default): taken for the same job, since a job added
    on the very schedule of a job removed looks just like it (the safe guess for a gate)."""
    return old.claim and new.claim and old.spec == new.spec


def _matched(
    old: Sequence[PlannedJob], new: Sequence[PlannedJob]
) -> list[tuple[PlannedJob | None, PlannedJob | None]]:
    """Pairs of the same job in both versions (by name, then key, then schedule); a job of
    one version only is paired with ``None``."""
    left = list(old)
    partner: dict[int, PlannedJob] = {}
    for same in (_same_name, _same_key, _same_schedule):
        for index, job in enumerate(new):
            if index in partner:
                continue
            found = next((candidate for candidate in left if same(candidate, job)), None)
            if found is not None:
                left.remove(found)
                partner[index] = found
    pairs: list[tuple[PlannedJob | None, PlannedJob | None]] = [
        (partner.get(index), job) for index, job in enumerate(new)
    ]
    return pairs + [(job, None) for job in left]


def _plan_pair(
    old: PlannedJob | None,
    new: PlannedJob | None,
    start_ms: int,
    end_ms: int,
    old_jobs: Sequence[PlannedJob],
) -> JobPlan:
    if new is None:
        assert old is not None
        return JobPlan(old.name, old, None, (), (), end_ms)
    others = [job for job in old_jobs if job is not old]
    hazards = _shared_keys(new, others, start_ms, end_ms)
    if old is None:
        return JobPlan(new.name, None, new, (), tuple(hazards), end_ms)
    compared = _compare(old, new, start_ms, end_ms)
    changes = _changes(old, new)
    return JobPlan(new.name, old, new, changes, (*compared[0], *hazards), compared[1])


def _compare(
    old: PlannedJob, new: PlannedJob, start_ms: int, end_ms: int
) -> tuple[list[Hazard], int]:
    """The hazards of one job's two versions, and where the comparison stopped."""
    if not (old.claim or new.claim):
        return [], end_ms  # each instance runs its own version's slots, as always
    # Beyond the window too: an occurrence's other slot may lie just outside it.
    margin = min(
        end_ms - start_ms, _margin_ms(old, start_ms, end_ms), _margin_ms(new, start_ms, end_ms)
    )
    old_slots, old_end = _slots(old, start_ms - margin, end_ms + margin)
    new_slots, new_end = _slots(new, start_ms - margin, end_ms + margin)
    until = min(end_ms, old_end, new_end)
    common = [t for t in sorted(old_slots & new_slots) if start_ms <= t < until]
    hazards = _identity_hazards(old, new, common)
    hazards += _moved(old, new, old_slots, new_slots, start_ms, until)
    return hazards, until


def _margin_ms(job: PlannedJob, start_ms: int, end_ms: int) -> int:
    """How far past the window a job's slots are listed: a quarter of ``MAX_SLOTS`` of them
    at most, so that a dense job keeps most of its budget for the window itself. A cron job's
    gap is read in the window (its ``min_gap()`` starts from now: the plan would depend on
    when it is made)."""
    trigger = job.trigger
    if isinstance(trigger, CronTrigger):
        gap = trigger.min_gap_between(start_ms, end_ms)
    else:
        gap = trigger.min_gap()
    return _NO_LIMIT if gap is None else MAX_SLOTS // 4 * max(1, gap // _ONE_MS)


_NO_LIMIT = 2**62
_ONE_MS = timedelta(milliseconds=1)


def _slots(job: PlannedJob, start_ms: int, end_ms: int) -> tuple[set[int], int]:
    """The job's slots in ``[start_ms, end_ms)`` (none when disabled), and where the search
    stopped: ``end_ms``, or earlier after ``MAX_SLOTS``."""
    found: set[int] = set()
    if not job.enabled:
        return found, end_ms
    cursor = job.trigger.next_ms(start_ms - 1)
    while cursor is not None and cursor < end_ms:
        if len(found) >= MAX_SLOTS:
            return found, cursor
        found.add(cursor)
        cursor = job.trigger.next_ms(cursor)
    return found, end_ms


def _identity_hazards(old: PlannedJob, new: PlannedJob, common: list[int]) -> list[Hazard]:
    """The slots both versions have, claimed under another identity by each."""
    if not common:
        return []
    slots = tuple(HazardSlot(t, t) for t in common)
    hazards: list[Hazard] = []
    if old.claim and new.claim and old.key != new.key:
        hazards.append(Hazard("twice", "key", slots, _KEY_ADVICE.format(old=old, new=new)))
    if old.claim != new.claim:
        hazards.append(Hazard("owner", "claim", slots, _CLAIM_ADVICE.format(old=old, new=new)))
    return hazards


_KEY_ADVICE = (
    "old instances claim '{old.key}:<slot>', new ones '{new.key}:<slot>': both win. Keep "
    "key='{old.key}' on job '{new.name}' in the new version (a job's name may change, its key "
    "is its claim and its history), or change the key in a stop-the-world deploy (no old "
    "instance running when the first new one starts)"
)
_CLAIM_ADVICE = (
    "claim changes from {old.claim} to {new.claim}: while both versions run, the unclaimed "
    "version runs each slot on every one of its instances and the claimed version once more. "
    "Change claim in a stop-the-world deploy (no old instance running when the first new one "
    "starts), or make the handler idempotent for the overlap"
)


def _moved(
    old: PlannedJob,
    new: PlannedJob,
    old_slots: set[int],
    new_slots: set[int],
    start_ms: int,
    end_ms: int,
) -> list[Hazard]:
    """The occurrences a moved schedule runs twice or never (module docstring)."""
    old_only = sorted(old_slots - new_slots)
    new_only = sorted(new_slots - old_slots)
    if not old_only or not new_only:
        return []
    twice: list[HazardSlot] = []
    never: list[HazardSlot] = []
    for o in old_only:
        n = _nearest(new_only, o)
        if min(o, n) < end_ms and max(o, n) >= start_ms:
            (twice if o < n else never).append(HazardSlot(o, n))
    what = "; ".join(_changes(old, new)) or "the schedule"
    hazards = []
    if twice:
        advice = _TWICE_ADVICE.format(what=what)
        hazards.append(Hazard("twice", "schedule", tuple(twice), advice))
    if never:
        advice = _NEVER_ADVICE.format(what=what)
        hazards.append(Hazard("never", "schedule", tuple(never), advice))
    return hazards


_TWICE_ADVICE = (
    "{what}: a rollout between an old slot and its later new slot runs that occurrence twice "
    "(old instances run the first, new ones the second). Roll out when no such window is open "
    "(a quiet hour), or in a stop-the-world deploy (no old instance running when the first new "
    "one starts) at a time outside them"
)
_NEVER_ADVICE = (
    "{what}: a rollout between a new slot and its later old slot runs that occurrence never "
    "(new instances start after the first, old ones stop before the second). Roll out when no "
    "such window is open (a quiet hour), or run the occurrence by hand (brokersched trigger)"
)


def _nearest(sorted_slots: list[int], at_ms: int) -> int:
    """The slot nearest ``at_ms``; of two equally near, the later one."""
    index = bisect_left(sorted_slots, at_ms)
    after = sorted_slots[index] if index < len(sorted_slots) else None
    before = sorted_slots[index - 1] if index > 0 else None
    if before is None or (after is not None and after - at_ms <= at_ms - before):
        assert after is not None
        return after
    return before


def _shared_keys(
    new: PlannedJob, others: Iterable[PlannedJob], start_ms: int, end_ms: int
) -> list[Hazard]:
    """Slots of ``new`` that an other job of the old version claims under the same key."""
    if not new.claim:
        return []
    hazards = []
    for other in others:
        if not other.claim or other.key != new.key:
            continue
        new_slots, _ = _slots(new, start_ms, end_ms)
        other_slots, _ = _slots(other, start_ms, end_ms)
        common = sorted(new_slots & other_slots)
        if common:
            advice = _SHARED_ADVICE.format(new=new, other=other)
            slots = tuple(HazardSlot(t, t) for t in common)
            hazards.append(Hazard("never", "shared-key", slots, advice))
    return hazards


_SHARED_ADVICE = (
    "job '{new.name}' of the new version claims under key '{new.key}', which job '{other.name}' "
    "of the old version claims too: at each shared slot the first claim wins and the other "
    "job's run never happens. Give job '{new.name}' a key no job of the old version uses"
)


def _changes(old: PlannedJob, new: PlannedJob) -> tuple[str, ...]:
    """What differs between the two versions of a job, as a reader names it."""
    changes: list[str] = []
    if old.name != new.name:
        changes.append(f"renamed '{old.name}' to '{new.name}'")
    if old.key != new.key:
        changes.append(f"key '{old.key}' to '{new.key}'")
    if old.claim != new.claim:
        changes.append(f"claim {old.claim} to {new.claim}")
    if old.enabled != new.enabled:
        changes.append("enabled" if new.enabled else "disabled")
    changes += _schedule_changes(old.spec, new.spec)
    return tuple(changes)


_SCHEDULE_FIELDS = {
    "kind": "kind",
    "expression": "cron",
    "timezone": "time zone",
    "dst": "dst",
    "interval_ms": "interval",
    "offset_ms": "offset",
    "at": "instant",
}


def _schedule_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [
        f"{label} {_shown(name, old.get(name))} to {_shown(name, new.get(name))}"
        for name, label in _SCHEDULE_FIELDS.items()
        if old.get(name) != new.get(name)
    ]


def _shown(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if name.endswith("_ms"):
        return format_duration(timedelta(milliseconds=value))
    return repr(value) if isinstance(value, str) else str(value)

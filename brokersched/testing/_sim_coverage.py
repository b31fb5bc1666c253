"""What the fleet simulator reached (``brokersched.testing.simulate``): each operation of the
generator against each fault, counted as *interesting interleavings*, so that a gap shows.

The registries below are the generator's vocabulary: ``OPERATIONS`` (what users do),
``FAULTS`` (what the world does to them; a new fault kind is one line here, and the
``Simulation`` says when it injected one with ``Coverage.fault``), ``NOT_DRAWN`` (the public
API that is no operation, each with the reason) and ``UNREACHABLE`` (the pairs that cannot
happen, each with the reason). A test checks that every public method of ``Scheduler`` and
``Job`` and every command of the CLI is in one of them.

What is counted, per operation and fault:

* an operation has a span on the fleet's true time: a call from its start to its answer (a
  backfill's, a trigger's, a stop's whole drain), a run from its start to its end, and a change
  that the fleet learns later (a pause, a remove, an update, a deploy) until a heartbeat after
  it (``EFFECT_MS``: the other instances read the controls, the removed job's runs end, the
  updated job's next slot is armed);
* a fault has a span too: the store held, down, locked, shedding or its link flaky for as long
  as it lasts; a kill -9 until the dead instance's leases expire (its slots wait for a take-over);
  a clock step, an eviction, a deleted record, a stray queue for ``EFFECT_MS`` after it;
* ``(operation, fault)`` counts the operations whose span met a fault of that kind: a kill
  during a backfill, the store held during a pause's write, a clock step during a trigger;
* ``(operation, "none")`` counts the operations that met no fault but met the job live: the
  fleet's own run or claim of the same job during its span (for a backfill: a run of a slot of
  its range, or another backfill of the job at once; for an instance's start, deploy or stop:
  its runs and claims in flight), so the operation raced the fleet's own work; a run
  (``schedule``, ``retry``, and a run cut by a later slot as ``replace``) counts there when no
  fault met it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ._sim_ledger import Run

__all__ = [
    "EFFECT_MS",
    "FAULTS",
    "NONE",
    "NOT_DRAWN",
    "OPERATIONS",
    "UNREACHABLE",
    "Coverage",
    "format_table",
    "reachable",
    "to_json",
]

ALL = ("lease", "redis", "nats", "rabbitmq", "natslease")
LEASES = ("lease", "natslease")
CLAIMS = ("redis", "nats", "rabbitmq")
#: The runs counted as operations: by what began them, and (``replace``) how they ended.
_RUNS = ("schedule", "retry")
_RUN_OPS = (*_RUNS, "replace")
#: How long after it a change is still being taken up by the fleet (a heartbeat).
EFFECT_MS = 5000
NONE = "none"


@dataclass(frozen=True)
class Kind:
    """An operation or a fault: the backends it is drawn on, what it is, and for an operation
    the public API it exercises."""

    what: str
    backends: tuple[str, ...] = ALL
    calls: tuple[str, ...] = ()


OPERATIONS: dict[str, Kind] = {
    "start": Kind(
        "an instance starts (its boot runs, a fleet running)",
        calls=(
            "Scheduler.start",
            "Scheduler.__aenter__",
            "Scheduler.serve",
            "Scheduler.every",
            "Scheduler.cron",
            "Scheduler.at",
            "Scheduler.after",
            "Scheduler.on",
            "cli run",
        ),
    ),
    "deploy": Kind(
        "a rolling deploy: an instance replaced by one with other options (slot_ttl or "
        "lease_ttl, jitter, max_late, overlap, max_attempts, timeout, retry, catch_up, a renamed "
        "job behind its key, declare_ahead, drain_timeout, enabled=False)",
        calls=("Scheduler.add_overrides", "Scheduler.enabled"),
    ),
    "stop": Kind(
        "a graceful stop, runs and claims in flight",
        calls=(
            "Scheduler.stop",
            "Scheduler.__aexit__",
        ),
    ),
    "schedule": Kind("a scheduled run of a slot (every, cron, at, after, run_on_start)"),
    "retry": Kind("a retry= attempt after a failed one (or a timed out one)"),
    "replace": Kind(
        'a run cut by a later slot of its job (overlap="replace"), from its start to its end',
        LEASES,
    ),
    "trigger": Kind("a manual run", calls=("Job.trigger", "cli trigger")),
    "backfill": Kind(
        "a backfill: recent ranges ending now, ranges over live slots, old ones, fast and slow "
        "(0.1-50 slots/s), two at once on overlapping ranges",
        calls=("Scheduler.backfill", "cli backfill"),
    ),
    "pause": Kind(
        "Job.pause() (until an instant, or until resumed), the admin API's or the CLI's pause",
        calls=("Job.pause", "Scheduler.change_control", "cli pause"),
    ),
    "resume": Kind(
        "Job.resume(), the admin API's or the CLI's resume", calls=("Job.resume", "cli resume")
    ),
    "disable": Kind(
        "Job.disable(), the admin API's or the CLI's disable",
        calls=("Job.disable", "cli disable"),
    ),
    "enable": Kind(
        "Job.enable(), the admin API's or the CLI's enable", calls=("Job.enable", "cli enable")
    ),
    "skip": Kind(
        "Job.skip(n) or the CLI's skip (n from 0, a pending skip cancelled, to 3)",
        calls=("Job.skip", "cli skip"),
    ),
    "abort": Kind("an abort of a run going on in the fleet", calls=("Scheduler.abort",)),
    "remove": Kind("a job removed at run time (with abort or not)", calls=("Scheduler.remove",)),
    "add": Kind("a removed job registered again at run time"),
    "update": Kind(
        "Job.update() of jitter, max_late or timeout at run time", calls=("Job.update",)
    ),
    "schedule-put": Kind(
        "a stored schedule written or changed at run time (trigger, time zone, jitter, "
        "max_late, data) through an instance, some instances without its task",
        calls=("Scheduler.task", "cli schedules"),
    ),
    "schedule-delete": Kind("a stored schedule deleted at run time"),
}

FAULTS: dict[str, Kind] = {
    "kill -9": Kind("an instance killed: its leases left to expire, its claims unanswered"),
    "held": Kind("the store's answers held: late, or lost after the request applied"),
    "down": Kind("the store restarting: calls refused at once"),
    "locked": Kind("another process holds SQLite's write lock", ("lease",)),
    "flaky": Kind("the link to the NATS KV bucket flaky", ("natslease",)),
    "late answer": Kind(
        "a lease store applies each call at once and answers it later than a lease lasts",
        LEASES,
    ),
    "shed": Kind("the backend sheds: no new claim while its server is near its budget"),
    "clock step": Kind("an instance's clock stepped or skewed"),
    "store clock": Kind("the store's clock stepped back", LEASES),
    "evicted": Kind(
        "Redis's maxmemory-policy set to evict while the fleet runs (keys with a TTL go), or back",
        ("redis",),
    ),
    "record deleted": Kind("the fleet's slot memory record deleted", ("redis", "rabbitmq")),
    "stray queue": Kind("a claim queue made beforehand by someone else", ("rabbitmq",)),
}

#: The public API that the generator does not draw, and why.
NOT_DRAWN: dict[str, str] = {
    **{
        f"Scheduler.{name}": "reads only: what it answers changes nothing of the fleet"
        for name in (
            "get",
            "jobs",
            "check",
            "override_errors",
            "overdue",
            "instances",
            "runs_in_progress",
            "ready",
            "running",
            "stopping",
            "wait_stopped",
        )
    },
    **{
        f"Job.{name}": "reads only: what it answers changes nothing of the fleet"
        for name in (
            "name",
            "key",
            "kind",
            "schedule",
            "options",
            "settings",
            "next_run",
            "next_runs",
            "is_running",
            "enabled",
            "overrides",
            "paused",
            "disabled",
            "control",
            "history",
            "describe",
        )
    },
    "Scheduler.start_in_thread": "start() on a thread of its own: the simulator's fleet is one "
    "event loop on virtual time; the thread's hand-over is tested in tests/unit",
    **{
        f"cli {name}": "reads only: what it prints changes nothing of the fleet"
        for name in ("jobs", "next", "history", "instances", "check", "doctor")
    },
    "cli simulate": "the simulator itself, on the application's jobs: it touches no fleet "
    "nor server",
    "cli plan": "compares two versions of an application's jobs on paper: it touches no fleet "
    "nor server",
    "cli purge": "refused while the fleet's presence shows an instance alive or late (or cannot "
    "be read), which is all the time a simulated fleet runs; what it removes after the last "
    "stop is the backends' own business, tested against the real servers "
    "(tests/backends, tests/unit/test_cli_purge.py)",
}

#: Pairs that cannot happen, and why.
UNREACHABLE: dict[tuple[str, str], str] = {}


def reachable(backends: Iterable[str] = ALL) -> list[tuple[str, str]]:
    """The ``(operation, fault)`` pairs the generator can reach on ``backends``."""
    chosen = set(backends)
    pairs = []
    for op, kind in OPERATIONS.items():
        for fault, faulty in [*FAULTS.items(), (NONE, Kind(""))]:
            if not chosen & set(kind.backends) & set(faulty.backends):
                continue
            if (op, fault) not in UNREACHABLE:
                pairs.append((op, fault))
    return pairs


@dataclass
class Span:
    """An operation or a fault on the fleet's true time."""

    kind: str
    begin: int
    end: int | None = None  # None: still going
    instance: str = ""
    key: str = ""  # the job's key, for an operation on a job
    slots: tuple[int, int] | None = None  # a backfill's range
    live: bool = False  # it met the job live (see the module)

    def meets(self, other: Span, now: int) -> bool:
        end, other_end = _end(self, now), _end(other, now)
        return self.begin <= other_end and other.begin <= end


def _end(span: Span, now: int) -> int:
    return span.end if span.end is not None else now


@dataclass
class Coverage:
    """The operations and faults of one simulation, and the claims sent meanwhile."""

    ops: list[Span] = field(default_factory=list)
    faults: list[Span] = field(default_factory=list)
    claims: list[Span] = field(default_factory=list)  # key, instance, from sent to answered

    def op(self, kind: str, begin: int, *, end: int | None = None, **about: object) -> Span:
        assert kind in OPERATIONS, kind
        span = Span(kind, begin, end, **about)  # type: ignore[arg-type]
        self.ops.append(span)
        return span

    def claim(self, key: str, begin: int, instance: str) -> Span:
        span = Span("claim", begin, None, instance, key)
        self.claims.append(span)
        return span

    def fault(self, kind: str, begin: int, end: int, instance: str = "") -> None:
        assert kind in FAULTS, kind
        self.faults.append(Span(kind, begin, end, instance))

    def counts(self, runs: list[Run], now: int) -> Counter[tuple[str, str]]:
        """Each operation against each fault (see the module), the runs as operations too."""
        spans = [*self.ops, *(_run_span(run) for run in runs if run.kind in _RUNS)]
        spans += [replace(_run_span(run), kind="replace") for run in runs if run.how == "replaced"]
        found: Counter[tuple[str, str]] = Counter()
        for span in spans:
            met = {fault.kind for fault in self.faults if fault.meets(span, now)}
            for kind in met:
                found[span.kind, kind] += 1
            if not met and (span.kind in _RUN_OPS or self._live(span, runs, now)):
                found[span.kind, NONE] += 1
        return found

    def _live(self, span: Span, runs: list[Run], now: int) -> bool:
        """Whether the operation met its job live (see the module)."""
        if span.live:
            return True
        if span.slots is not None:  # a backfill: a run of a slot of its range, or another one
            first, last = span.slots
            return any(
                run.key == span.key and first <= run.slot_ms <= last and run.kind != "backfill"
                and _meets(run.start, _until(run, now), span, now)
                for run in runs
            ) or any(
                other is not span and other.kind == "backfill" and other.key == span.key
                and other.meets(span, now)
                for other in self.ops
            )  # fmt: skip
        if not span.key:  # an instance's start, deploy or stop: its runs and claims, any job
            return any(
                _meets(run.start, _until(run, now), span, now)
                for run in runs
                if run.instance == span.instance or span.kind == "start"
            ) or any(
                claim.instance == span.instance and claim.meets(span, now) for claim in self.claims
            )
        # A change of a job, a trigger: the fleet's own runs and claims of the job meanwhile.
        return any(
            run.key == span.key
            and run.kind != "manual"
            and _meets(run.start, _until(run, now), span, now)
            for run in runs
        ) or any(claim.key == span.key and claim.meets(span, now) for claim in self.claims)


def _meets(begin: int, end: int, span: Span, now: int) -> bool:
    return begin <= _end(span, now) and span.begin <= end


def _run_span(run: Run) -> Span:
    return Span(run.kind, run.start, run.end, run.instance, run.key)


def _until(run: Run, now: int) -> int:
    return run.end if run.end is not None else now


def format_table(counts: Counter[tuple[str, str]], pairs: list[tuple[str, str]]) -> str:
    """Rows: operations; columns: faults (``none`` first); ``-`` where the pair cannot be
    reached on the backends run, ``0`` where it could but was not."""
    faults = [NONE, *FAULTS]
    wanted = set(pairs)
    width = max(len(op) for op in OPERATIONS) + 1
    columns = [max(len(fault), 5) for fault in faults]
    lines = [
        " " * width + " ".join(f"{fault:>{w}}" for fault, w in zip(faults, columns, strict=True))
    ]
    for op in OPERATIONS:
        cells = []
        for fault, w in zip(faults, columns, strict=True):
            shown = str(counts[op, fault]) if (op, fault) in wanted else "-"
            cells.append(f"{shown:>{w}}")
        lines.append(f"{op:<{width}}" + " ".join(cells))
    missed = sorted(pair for pair in wanted if not counts[pair])
    lines.append(
        f"{len(wanted) - len(missed)} of {len(wanted)} reachable pairs reached"
        + (": not " + ", ".join(f"{op} x {fault}" for op, fault in missed) if missed else "")
    )
    return "\n".join(lines)


def to_json(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """The counts as ``{operation: {fault: count}}``."""
    table: dict[str, dict[str, int]] = {}
    for (op, fault), count in sorted(counts.items()):
        table.setdefault(op, {})[fault] = count
    return table

"""``brokersched simulate APP``: the application's own jobs through the fleet simulator.

The jobs are read from the application's scheduler as they are (schedule, key, options after any
``job.update()``, the overrides applied), and the backend's kind picks the model the fleet runs
on: the lease protocol for SQLite, PostgreSQL, Redis leases and MemoryBackend, each claim-only
backend's own model, and NATS KV's. Every instance of the simulated fleet registers the same
jobs, as a deploy of the application would; their handlers are timed stand-ins (runs short,
long, longer than the interval), or the application's own with ``real_handlers``, called in
virtual time. A ``claim=False`` job runs on every instance by design: its runs are counted, not
judged.

Everything else is the simulator's: instances started, killed (``kill -9``) and deployed again,
the store cut off, held, restarted, clocks skewed and stepped, manual runs, backfills, pauses,
and the ledger that checks every promise after each step. Time with nothing due (no run going
on, the next slot far off) is skipped to shortly before that slot, so that an hourly or daily
job is simulated over hours without the minutes between its slots.

What each seed broke is told per job: the slots that ran twice, never, or overlapped a run of
their job (``overlap="skip"``), or ran while the job was paused or disabled, each with the seed
that replays it.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, get_args

from .._clock import datetime_to_ms
from .._durations import to_ms
from .._jobhandle import state_of
from .._options import Kind
from .._registry import TriggerMaker
from ..abc import RunReason
from .simulate import START, Deploy, Instance, Result, Simulation, run_seeded

if TYPE_CHECKING:
    from .._job import Handler
    from .._scheduler import Scheduler
    from ..triggers.base import Trigger

__all__ = [
    "START",
    "App",
    "AppJob",
    "AppReport",
    "AppSimulation",
    "Finding",
    "read_app",
    "simulate_app",
]

#: The model of each built-in backend (by class name, so that no backend's driver is imported).
MODELS = {
    "MemoryBackend": "lease",
    "SQLiteBackend": "lease",
    "PostgresBackend": "lease",
    "RedisLeaseBackend": "lease",
    "NATSLeaseBackend": "natslease",
    "RedisBackend": "redis",
    "NATSBackend": "nats",
    "RabbitMQBackend": "rabbitmq",
}
#: The longest a stand-in handler works.
_LONGEST_MS = 15 * 60_000
#: How long before a slot a skip over idle time stops, and what idle time is worth skipping.
_LEAD_MS = 20_000
#: A bound on the steps of one seed, whatever ``hours``.
_MAX_STEPS = 100_000


@dataclass(frozen=True)
class AppJob:
    """One of the application's jobs, as the simulated fleet registers it."""

    name: str
    key: str
    kind: Kind
    schedule: Trigger
    given: Any  # the schedule as registered: interval, cron expression, instant or delay
    options: Mapping[str, Any]  # as registered, before overrides
    overrides: Mapping[str, Any]  # as applied
    handler: Handler
    overlap: str
    max_attempts: int
    retry: Any
    claimed: bool  # False: ``claim=False``, run by every instance, which the ledger cannot judge

    @property
    def gap_ms(self) -> int | None:
        gap = self.schedule.min_gap()
        return None if gap is None else to_ms(gap)


@dataclass(frozen=True)
class App:
    """What the simulator needs of an application: its jobs, its backend's model and the
    backend's slot memory (``slot_ttl``) or ``lease_ttl``, its scheduler's defaults."""

    jobs: tuple[AppJob, ...]
    model: str
    backend: str  # the backend's class, as shown
    memory_ms: int
    declare_ahead: bool
    options: Mapping[str, Any]


def read_app(scheduler: Scheduler[Any]) -> App:
    """The application's jobs and backend; a ``ValueError`` naming what cannot be simulated."""
    backend = scheduler.backend
    names = [cls.__name__ for cls in type(backend).__mro__]
    model = next((MODELS[name] for name in names if name in MODELS), None)
    if model is None:
        raise ValueError(
            f"backend {type(backend).__name__} has no model in the simulator; it models "
            f"{', '.join(MODELS)}"
        )
    states = [state_of(job) for job in scheduler.jobs()]
    if not states:
        raise ValueError("the application registers no job: there is nothing to simulate")
    jobs = tuple(_app_job(state) for state in states)
    ttl = getattr(backend, "lease_ttl" if model in ("lease", "natslease") else "slot_ttl")
    options = scheduler.options
    return App(
        jobs=jobs,
        model=model,
        backend=type(backend).__name__,
        memory_ms=to_ms(ttl),
        declare_ahead=bool(getattr(backend, "declare_ahead", True)),  # RabbitMQ's option
        options={
            "jitter": options.jitter,
            "max_late": options.max_late,
            "timezone": options.timezone,
            "heartbeat": options.heartbeat,
            "overrides": {job.name: job.overrides for job in jobs if job.overrides},
        },
    )


def _app_job(state: Any) -> AppJob:
    spec, settings = state.spec, state.settings
    maker, _ = spec.origin
    if not isinstance(maker, TriggerMaker):
        raise ValueError(
            f"job '{spec.name}' was not registered by every(), cron(), at() or after()"
        )
    return AppJob(
        name=spec.name,
        key=settings.key,
        kind=spec.kind,
        schedule=spec.schedule,
        given=maker.schedule,
        # As they are now: a job.update() since registration is the application's too.
        options=spec.options.model_dump(exclude_unset=True),
        overrides=dict(spec.overrides),
        handler=state.handler,
        overlap=settings.policy.overlap,
        max_attempts=settings.policy.max_attempts,
        retry=settings.retry,
        claimed=settings.claim,
    )


class AppSimulation(Simulation):
    """The simulator's fleet running the application's jobs for ``hours`` of virtual time, on
    at most ``instances`` instances at once (none but its own: no stored schedule of the
    simulator's is added to it)."""

    stored_schedules = False

    def __init__(
        self,
        app: App,
        seed: int,
        *,
        hours: float,
        instances: int,
        real_handlers: bool = False,
        start: datetime | str = START,
    ) -> None:
        self.app = app
        self.real_handlers = real_handlers
        self._by_key = {job.key: job for job in app.jobs}
        super().__init__(seed, backend=app.model, steps=_MAX_STEPS, start=start)
        self.max_instances = instances
        self.operated = tuple(self._by_key)
        self.leased_keys = tuple(job.key for job in app.jobs if job.claimed)
        self.until_ms = self.fleet.now_ms() + round(hours * 3_600_000)
        self.cut_short = False  # the step bound came before the hours

    # -- the application in place of the simulator's own jobs ------------------------------

    def draw_jobs(self) -> dict[str, Any]:
        """How long each job's stand-in works: short, a fair part of its interval, or longer
        than it (the overlap rules then decide), never beyond ``_LONGEST_MS``."""
        rng = self.rng
        work = {}
        for job in self.app.jobs:
            gap = job.gap_ms or 30_000
            drawn = rng.choice((100, 2000, gap // 2, gap * 3 // 2))
            work[job.key] = max(10, min(drawn, _LONGEST_MS))
        return {"work": work, "fail_rate": rng.choice((0.0, 0.1, 0.3))}

    def draw_deploy(self, base: Deploy | None = None) -> Deploy:
        """A deploy of the application as it is: its backend's ``slot_ttl`` or ``lease_ttl``
        and its own job options (the simulator's draws of them are unused)."""
        drawn = super().draw_deploy(base)
        return replace(
            drawn,
            memory_ms=self.app.memory_ms,
            declare_ahead=self.app.declare_ahead,
            renamed=False,
            timeout_ms=None,
            retry=True,
        )

    def shortened(self, deploy: Deploy) -> Deploy:
        """The application's own ``slot_ttl``: the record deleted by hand, the same deployed."""
        return deploy

    def scheduler_options(self) -> dict[str, Any]:
        return dict(self.app.options)

    def registrations(self, instance: Instance) -> dict[str, Callable[[], object]]:
        return {job.key: _registered(self, instance, job) for job in self.app.jobs}

    def work_ms(self, key: str) -> int:
        return int(self._jobs["work"][key])

    def gap_ms(self, key: str) -> int | None:
        return self._by_key[key].gap_ms

    def slot_after(self, key: str, after_ms: int) -> int:
        return self._by_key[key].schedule.next_ms(after_ms) or after_ms + 3_600_000

    def next_instant(self, after_ms: int) -> int:
        due = self._next_due(after_ms)
        return after_ms + 3_600_000 if due is None else due

    def _next_due(self, after_ms: int) -> int | None:
        """The first slot of any job after ``after_ms`` (``None``: none falls again)."""
        due = [job.schedule.next_ms(after_ms) for job in self.app.jobs]
        return min((at for at in due if at is not None), default=None)

    async def work(self, key: str, ctx: Any, fail_rate: float) -> None:
        if not self.real_handlers:
            await super().work(key, ctx, fail_rate)
            return
        result = self._by_key[key].handler(ctx)  # a sync one runs here, in virtual time
        if inspect.isawaitable(result):  # a sync one may return a value: not awaited
            await result

    def scheduled(self, key: str, slot_ms: int) -> bool:
        job = self._by_key.get(key)
        if job is None or job.kind == "after" or not job.claimed:
            return False
        return job.schedule.next_ms(slot_ms - 1) == slot_ms

    # -- time --------------------------------------------------------------------------------

    def going_on(self, steps: int) -> bool:
        if self.fleet.now_ms() >= self.until_ms:
            return False
        self.cut_short = steps >= self.steps
        return not self.cut_short

    async def advance(self, ms: int) -> None:
        """The step's time, then, when nothing goes on, on to shortly before the next slot."""
        await self.fleet.advance(timedelta(milliseconds=ms))
        now = self.fleet.now_ms()
        if any(run.end is None for run in self.ledger.runs) or self._driven():
            return
        upcoming = self._next_due(now)
        target = min(self.until_ms if upcoming is None else upcoming, self.until_ms) - _LEAD_MS
        if target - now > _LEAD_MS:
            self.log.append(f"nothing due: on to {target}")
            await self.fleet.advance(timedelta(milliseconds=target - now))

    def _driven(self) -> bool:
        """A start, stop, trigger or backfill of the driver's still going on."""
        return any(not task.done() for instance in self.instances for task in instance.driven)


def _registered(sim: AppSimulation, instance: Instance, job: AppJob) -> Callable[[], object]:
    """What registers ``job`` on ``instance``, with its stand-in handler."""
    options: dict[str, Any] = {"retry": job.retry}
    if sim.lease:
        options.update(overlap=job.overlap, max_attempts=job.max_attempts)

    def register() -> object:
        add = getattr(instance.scheduler, job.kind)  # every, cron, at or after
        handler = sim.stand_in(instance, job.key, options) if job.claimed else unclaimed
        return add(job.name, job.given, handler, **job.options)

    async def unclaimed(ctx: Any) -> None:
        """A run of a ``claim=False`` job: every instance runs its slots, so it is counted,
        not judged."""
        sim.unledgered[job.key, ctx.reason] += 1
        try:
            await sim.work(job.key, ctx, 0.0)
        except Exception:
            sim.unledgered_failed[job.key] += 1
            raise

    return register


# -- what each seed broke, per job --------------------------------------------------------------

KINDS = ("ran twice", "never ran", "overlapped", "ran while halted")
_KEYED = [
    (re.compile(r"slot (?P<key>\S+):\d+ ran twice at once"), "ran twice"),
    (re.compile(r"runs of (?P<key>\S+) overlap"), "overlapped"),
    (re.compile(r"slot (?P<key>\S+):\d+ (ran \d+ times|ran again|retried beyond|started beyond)"),
     "ran twice"),
    (re.compile(r"boot runs of (?P<key>\S+) a window apart both ran"), "ran twice"),
    (re.compile(r"\S+ started (?P<key>\S+):\d+ attempt \d+ at \d+ on a lease that expired"),
     "ran twice"),
    (re.compile(r"slot (?P<key>\S+):\d+ was (refused to every instance|won by)"), "never ran"),
    (re.compile(r"(?P<key>\S+):\d+ ran while (paused|disabled)"), "ran while halted"),
]  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """A broken promise: of which job (its key; ``None``: the fleet's), of what kind, what the
    ledger said."""

    key: str | None
    kind: str
    text: str


def classify(violation: str) -> Finding:
    """What the ledger's words say broke, and for which job."""
    text = re.sub(r"^after step \d+: ", "", violation)
    for pattern, kind in _KEYED:
        if (found := pattern.search(text)) is not None:
            return Finding(found["key"].removesuffix(":start"), kind, text)
    return Finding(None, "other", text)


@dataclass
class AppReport:
    """What the seeds of one application reached and broke."""

    app: App
    instances: int
    hours: float
    start: datetime
    seeds: list[int] = field(default_factory=list)
    runs: Counter[tuple[str, str]] = field(default_factory=Counter)  # by (key, reason)
    failed: Counter[str] = field(default_factory=Counter)  # failed or timed-out runs, by key
    #: (key or None, kind) -> the seeds that broke it, in order
    broken: dict[tuple[str | None, str], list[int]] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)  # seed -> what the ledger said
    cut: list[int] = field(default_factory=list)  # seeds stopped by the step bound
    steps: dict[int, list[str]] = field(default_factory=dict)  # seed -> its steps, if kept

    @property
    def ok(self) -> bool:
        return not self.broken

    def due(self, job: AppJob) -> int:
        """How many slots of ``job`` fall within the simulated hours (the same every seed)."""
        begin = datetime_to_ms(self.start)
        end, count = begin + round(self.hours * 3_600_000), 0
        at = job.schedule.next_ms(begin - 1) if job.kind != "after" else None
        while at is not None and at <= end and count < 1_000_000:
            count += 1
            at = job.schedule.next_ms(at)
        return count

    def add(self, seed: int, result: Result, *, cut: bool, keep_steps: bool = False) -> None:
        self.seeds.append(seed)
        self.runs.update(result.ran)
        self.failed.update(result.failed)
        for finding in map(classify, result.violations):
            seeds = self.broken.setdefault((finding.key, finding.kind), [])
            if seed not in seeds:
                seeds.append(seed)
        if result.violations:
            self.texts[seed] = result.violations
        if cut:
            self.cut.append(seed)
        if keep_steps:
            self.steps[seed] = result.log

    def to_json(self) -> dict[str, Any]:
        jobs = {}
        for job in self.app.jobs:
            found = {kind: self.broken.get((job.key, kind), []) for kind in KINDS}
            jobs[job.name] = {
                "key": job.key,
                "schedule": job.schedule.describe(),
                "claimed": job.claimed,
                "due_per_seed": self.due(job),
                "runs": {
                    reason: count for (key, reason), count in self.runs.items() if key == job.key
                },
                "failed": self.failed[job.key],
                **{kind.replace(" ", "_"): seeds for kind, seeds in found.items()},
            }
        return {
            "backend": self.app.backend,
            "model": self.app.model,
            "instances": self.instances,
            "hours": self.hours,
            "start": self.start.isoformat(),
            "seeds": self.seeds,
            "ok": self.ok,
            "jobs": jobs,
            "fleet": self.broken.get((None, "other"), []),
            "violations": {str(seed): texts for seed, texts in self.texts.items()},
            "cut_short": self.cut,
            **({"steps": {str(k): v for k, v in self.steps.items()}} if self.steps else {}),
        }


def simulate_app(
    app: App,
    seeds: Iterable[int],
    *,
    hours: float,
    instances: int,
    real_handlers: bool = False,
    start: datetime | str = START,
    keep_steps: bool = False,
    each: Callable[[int, list[str], list[str]], None] | None = None,
) -> AppReport:
    """Run each seed from ``start``; ``each(seed, violations, log)`` is told of each as it
    ends; ``keep_steps``: the report keeps each seed's steps."""
    when = start if isinstance(start, datetime) else datetime.fromisoformat(start)
    report = AppReport(app, instances, hours, when)
    for seed in seeds:
        made: list[AppSimulation] = []

        def make(seed: int = seed, made: list[AppSimulation] = made) -> AppSimulation:
            simulation = AppSimulation(
                app, seed, hours=hours, instances=instances, real_handlers=real_handlers,
                start=when,
            )  # fmt: skip
            made.append(simulation)
            return simulation

        result = run_seeded(seed, make)
        report.add(seed, result, cut=made[-1].cut_short, keep_steps=keep_steps)
        if each is not None:
            each(seed, result.violations, result.log)
    return report


# -- the report, as the CLI prints it ----------------------------------------------------------

_REASONS = get_args(RunReason)  # the order the runs of a job are shown in


def progress(app: str, *, verbose: bool) -> Callable[[int, list[str], list[str]], None]:
    """What the CLI says of each seed as it ends (``verbose``: its steps first), on stderr."""
    import click

    def say(seed: int, violations: list[str], log: list[str]) -> None:
        if verbose:
            click.echo("\n".join(log), err=True)
        verdict = "ok" if not violations else f"BROKEN ({len(violations)})"
        click.echo(f"seed {seed}: {verdict}", err=True)
        for violation in violations:
            click.echo(f"  {classify(violation).text}", err=True)

    return say


def table(report: AppReport, app: str) -> Any:
    """The per-job table: what ran, and the seeds that broke each promise."""
    from rich.table import Table

    title = (
        f"{app} on {report.app.backend} (model: {report.app.model}), {report.instances} "
        f"instances, {report.hours:g} h from {report.start.isoformat()}, "
        f"{len(report.seeds)} seeds"
    )
    found = Table(title=title, title_justify="left")
    for column in ("job", "schedule", "due a seed", "runs", *KINDS):
        found.add_column(column, overflow="fold")
    for job in report.app.jobs:
        found.add_row(
            job.name, job.schedule.describe(), _due(report, job), _runs(report, job),
            *(_seeds(report.broken.get((job.key, kind), [])) if job.claimed else "not judged"
              for kind in KINDS),
        )  # fmt: skip
    if (None, "other") in report.broken:
        other = _seeds(report.broken[None, "other"])
        found.add_row("(the fleet)", "", "", "", "", "", "", f"other: {other}")
    return found


def _due(report: AppReport, job: AppJob) -> str:
    due = report.due(job)
    if job.kind == "after":
        return "at each start"
    if due == 0:
        return "[yellow]0: no slot in the simulated hours (--start, --hours)[/]"
    return str(due)


def _runs(report: AppReport, job: AppJob) -> str:
    runs = {reason: n for (key, reason), n in report.runs.items() if key == job.key}
    order = sorted(runs, key=lambda r: (*_REASONS, r).index(r))
    shown = ", ".join(f"{runs[reason]} {reason}" for reason in order) or "none"
    if failed := report.failed[job.key]:
        shown += f"; {failed} failed"
    return shown if job.claimed else f"{shown} (claim=False: on every instance)"


def summary(report: AppReport, app: str) -> str:
    seeds = len(report.seeds)
    cut = ""
    if report.cut:
        cut = (
            f"\n{len(report.cut)} seed(s) stopped at the bound of {_MAX_STEPS} steps before "
            f"the hours ran out: {', '.join(map(str, report.cut[:5]))} (lower --hours)"
        )
    if report.ok:
        return f"{seeds} seed{'s' if seeds > 1 else ''}: every promise held{cut}"
    broken = sorted({seed for found in report.broken.values() for seed in found})
    return (
        f"{len(broken)} of {seeds} seeds broke a promise (a seed stops at the first, so its "
        f"jobs ran less); replay one with its steps: brokersched simulate {app} "
        f"--seed {broken[0]}{cut}"
    )


def _seeds(seeds: list[int]) -> str:
    if not seeds:
        return "-"
    shown = ", ".join(map(str, seeds[:5]))
    return f"[red]seed {shown}{' ...' if len(seeds) > 5 else ''}[/]"

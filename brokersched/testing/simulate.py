"""The fleet simulator: a whole fleet of schedulers in one process, on virtual time, driven by a
seeded generator of operations and faults, with the invariants checked after every step.

In the spirit of FoundationDB's simulation testing and TigerBeetle's VOPR: the schedulers,
runners, boot runs and claim rules are the real code; the stores are models of each backend's
memory (``_sim_store`` and a module a backend: ``_sim_lease``, ``_sim_redis``, ``_sim_nats``,
``_sim_rabbitmq``); everything that happens is drawn from one seed, so a failure is
replayed by running its seed again::

    python -m brokersched.testing.simulate --seeds 200        # or: make simulate SEEDS=200
    python -m brokersched.testing.simulate --seed 1234 -v     # or: make simulate SEED=1234

What a seed draws: the backend (the lease protocol with SQLite's lock and PostgreSQL's restarts,
Redis claims, NATS claims, RabbitMQ claims), the jobs (``every``, ``cron``, ``at``, ``after``,
``run_on_start``, overlap, max_attempts, ``retry`` with handlers that fail), and a sequence of
steps: instances started, rolling
deploys that change ``slot_ttl`` or ``lease_ttl``, jitter, ``max_late``, a job's name behind a
kept ``key``, ``declare_ahead``; kill -9, graceful stops, manual triggers, backfills of recent
and older ranges; clocks skewed or
stepped on instances and on the store; the store held, cut, restarted, locked, its fleet record
deleted, its maxmemory-policy set to evict (keys evicted) and back; a lease store answering later
than a lease lasts (from a generator of its own: ``late_answers=False`` runs a seed as before it
was drawn).

What users do is drawn too, at the shapes they do it (``_sim_operations``): backfills fast and
slow over ranges that end now, straddle live slots or lie long ago, two at once; jobs disabled
and enabled, removed and added again, updated, their runs aborted; faults drawn to fall within
an operation just begun (``_sim_faults``), the backend shedding new claims near its budget
among them.

The invariants, after every step, are the ledger's (``_sim_ledger``). What the seeds reached,
each operation against each fault, is counted (``_sim_coverage``) and printed as a table after
a run of several seeds (``--coverage``; ``--json`` for a machine).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .._backfill import BackfillSlot
from .._clock import datetime_to_ms, ms_to_datetime
from .._events import MissedEvent, SkipEvent
from .._exceptions import BackendError, ConfigurationError
from .._fleetrecords import ControlAction
from .._retry import Retry
from .._scheduler import Scheduler
from .._tasks import Tracked, track
from ..abc import Backend, RunRecord
from ..backends.memory import MemoryStore
from ._clock import FleetClock, InstanceClock
from ._sim_coverage import EFFECT_MS, Coverage
from ._sim_faults import Faults
from ._sim_jobs import Deploy, OwnJobs
from ._sim_lease import SimLeaseBackend
from ._sim_ledger import LEASE_SKEW_MS, Ledger, Run, origin_of
from ._sim_missed import note_report, note_skip, unreported
from ._sim_nats import SimNATS, nats_bucket, sim_nats_lease
from ._sim_operations import Operator, cli_change
from ._sim_rabbitmq import SimRabbitMQ
from ._sim_redis import RedisData, sim_redis
from ._sim_store import Store
from ._sim_stored import StoredOps

__all__ = [
    "BACKENDS",
    "START",
    "Deploy",
    "Instance",
    "Result",
    "Simulation",
    "run_seeded",
    "simulate",
]

BACKENDS = ("lease", "redis", "nats", "rabbitmq", "natslease")
#: What a seed draws when no backend is given: the backends before ``natslease`` (chosen with
#: ``--backend natslease``), so that every seed replays on the backend it drew before.
_DRAWN = BACKENDS[:4]
#: The lease backends: ``lease`` (the protocol itself, as SQLite, PostgreSQL and Redis keep
#: it) and ``natslease`` (the real ``NATSLeaseBackend`` over a model of its KV bucket).
_LEASES = ("lease", "natslease")
START = "2027-03-01T08:00:00+00:00"
_MAX_INSTANCES = 4


async def _quietly(change: Any) -> Any:
    """A pause's or a resume's answer; ``None`` when the store did not take it."""
    try:
        return await change
    except Exception:
        return None


@dataclass
class Instance:
    name: str
    deploy: Deploy
    clock: InstanceClock
    backend: Any
    scheduler: Scheduler[Any]
    link: Any  # what a kill cuts: the model of the store, or the modelled backend (``dead``)
    stopping: asyncio.Task[None] | None = None
    driven: Tracked = field(default_factory=dict)  # started by the driver

    def drive(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """A call of the driver's (start, stop, trigger): not the scheduler's own work, which
        the fleet's clock waits for, but killed with the instance."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{name}:{self.name}")
        track(self.driven, task)
        return task

    def kill(self) -> None:
        self.clock.kill()
        self.link.dead = True
        for task in list(self.driven):
            task.cancel()

    @property
    def alive(self) -> bool:
        return not self.clock.dead and self.stopping is None


@dataclass
class Result:
    seed: int
    backend: str
    steps: int
    violations: list[str]
    log: list[str]
    runs: int
    #: (operation, fault) -> how many interesting interleavings (``_sim_coverage``)
    coverage: Counter[tuple[str, str]] = field(default_factory=Counter)
    ran: Counter[tuple[str, str]] = field(default_factory=Counter)  # runs by (job key, reason)
    failed: Counter[str] = field(default_factory=Counter)  # failed or timed-out runs by job key
    missed: int = 0  # slots reported missed (each once, or it is a violation)
    unknown: int = 0  # slots an instance skipped not knowing whether another one ran them

    @property
    def ok(self) -> bool:
        return not self.violations


class Simulation(OwnJobs):
    #: Whether the fleet also runs stored schedules of its own (``_sim_stored``).
    stored_schedules = True

    def __init__(
        self,
        seed: int,
        *,
        backend: str | None = None,
        steps: int = 120,
        pauses: bool = True,
        late_answers: bool = True,
        start: datetime | str = START,
        richer_controls: bool = True,
    ) -> None:
        """``pauses=False``: the generator as it was before the fleet's controls (no pause,
        nor any operation drawn since: the seeds found then replay as they were).
        ``richer_controls=False``: no pause until an instant, skip, nor change made the CLI's
        way (likewise). ``start``: the fleet's true time when the first instance starts."""
        self.seed = seed
        self.rng = random.Random(seed)
        # Pauses and resumes are drawn apart, so that without them a seed runs as before they
        # were added (the seeds pinned in the tests among them). So are late
        # answers.
        self._pause_rng = random.Random(seed + 4) if pauses else None
        self.late_rng = random.Random(seed + 6) if late_answers else None
        self.kind = backend or self.rng.choice(_DRAWN)
        self.lease = self.kind in _LEASES
        self.steps = steps
        self.fleet = FleetClock(start, seed=seed)
        self.store = Store(self.fleet, self.fleet.instance(), random.Random(seed + 1))
        self.store.evicting = self.kind == "redis" and self.rng.random() < 0.3
        self.ledger = Ledger(
            lease=self.lease, released=self.store.released, expiry=self.store.expiry
        )
        self.instances: list[Instance] = []
        #: Runs of jobs the ledger does not judge (``claim=False``: every instance runs them).
        self.unledgered: Counter[tuple[str, str]] = Counter()
        self.unledgered_failed: Counter[str] = Counter()
        self.max_instances = _MAX_INSTANCES
        #: The jobs (by key) that operators trigger, pause, disable, remove and update.
        self.operated: tuple[str, ...] = ("tick", "cron")
        #: The jobs whose slots hold a lease a killed runner leaves to expire.
        self.leased_keys: tuple[str, ...] = ("tick", "cron", "once", "slow")
        self.log: list[str] = []
        self._names = 0
        self._rows = MemoryStore()
        makers: dict[str, Callable[[Store], Any]] = {
            "redis": RedisData, "nats": SimNATS.stream, "rabbitmq": SimRabbitMQ.broker,
            "natslease": nats_bucket,
        }  # fmt: skip
        self.data: Any = makers[self.kind](self.store) if self.kind in makers else None
        # What later releases added to the draws (retries, backfills, catch_up) comes from an
        # RNG of its own, so that the steps a seed drew before stay the same.
        self.more = random.Random(seed + 3)
        # overlap="replace" is drawn apart too, and only with late answers and pauses: a seed
        # replayed as it was found before them runs as before.
        self.replace_rng = random.Random(seed + 8) if pauses and late_answers else None
        self._jobs = self.draw_jobs()
        self._failures = random.Random(seed + 2)  # which attempts fail
        self.faults = Faults(self)
        self._instance_steps: dict[str, list[int]] = self.ledger.stepped
        self._pauses = 0  # pause and resume requests so far
        self._began = self.fleet.now()
        self.coverage = Coverage()
        # What users do, drawn since the coverage table, from an RNG of its own again.
        more = random.Random(seed + 7) if pauses and richer_controls else None
        self.operator = Operator(self, random.Random(seed + 5), more) if pauses else None
        if self.operator is not None:
            self.operator.draw_jobs(self._jobs)
        stored = more is not None and self.stored_schedules
        self.stored = StoredOps(self, random.Random(seed + 9)) if stored else None

    # -- instances ---------------------------------------------------------------------------

    def _backend(self, deploy: Deploy, name: str) -> tuple[Backend, Any]:
        """The instance's backend, and what a kill cuts: the model of the store it talks
        through, or the modelled backend itself (each has a ``dead`` flag)."""
        memory = timedelta(milliseconds=deploy.memory_ms)
        backend: Backend
        model: Any
        if self.kind == "redis":
            backend, model = sim_redis(self.store, self.data, slot_ttl=memory, prefix="sim")
        elif self.kind == "natslease":
            backend, model = sim_nats_lease(self.store, self.data, lease_ttl=memory, instance=name)
        elif self.kind == "lease":
            backend = model = SimLeaseBackend(
                self.store, self._rows, lease_ttl=memory, instance=name
            )
        elif self.kind == "nats":
            backend = model = SimNATS(self.store, self.data, slot_ttl=memory)
        else:
            backend = model = SimRabbitMQ(
                self.store, self.data, slot_ttl=memory, declare_ahead=deploy.declare_ahead
            )
        self._watch_claims(backend, name)
        return backend, model

    def _watch_claims(self, backend: Backend, instance: str) -> None:
        """Note each claim's span for the coverage (a claim in flight), and refuse new claims
        while the backend sheds (``Store.shed_until``): as the real backends do near their
        server's budget (``backends/_budget.py``), before asking the store anything."""
        store, fleet = self.store, self.fleet

        def shedding(what: str) -> BackendError | None:
            if fleet.monotonic_ms() >= store.shed_until:
                return None
            return BackendError(f"{backend.name}: shedding: {what} is not made (simulated)")

        def watched(name: str, many: bool) -> None:
            call = getattr(backend, name, None)
            if call is None:
                return

            async def claim(*args: Any, **kwargs: Any) -> Any:
                slots = [c.slot for c in args[0]] if many else [args[0]]
                if (error := shedding(f"the claim of {slots[0].key}")) is not None:
                    if many:
                        return [error for _ in slots]
                    raise error
                spans = [self.coverage.claim(slot.key, fleet.now_ms(), instance) for slot in slots]
                try:
                    return await call(*args, **kwargs)
                finally:
                    for span in spans:
                        span.end = fleet.now_ms()

            setattr(backend, name, claim)

        for name in ("acquire", "claim", "claim_boot"):
            watched(name, many=False)
        for name in ("acquire_many", "claim_many"):
            watched(name, many=True)

    async def start_instance(self, deploy: Deploy, ahead_ms: int = 0) -> None:
        self._names += 1
        name = f"i{self._names}"
        clock = self.fleet.instance(ahead_ms)
        backend, link = self._backend(deploy, name)
        scheduler: Scheduler[Any] = Scheduler(
            backend, clock=clock, instance_id=name, drain_timeout=f"{deploy.drain_s}s",
            enabled=deploy.schedules, **self.scheduler_options(),
        )  # fmt: skip
        instance = Instance(name, deploy, clock, backend, scheduler, link)
        try:
            self._register(instance)
        except ConfigurationError as exc:  # the generator draws configurations the README allows
            self.ledger.found.append(f"{name} refused a valid configuration {deploy}: {exc}")
            return
        self.instances.append(instance)
        self.log.append(f"start {name} {deploy}")
        now = self.fleet.now_ms()
        self.coverage.op("start", now, end=now + EFFECT_MS, instance=name)
        instance.drive(self._start(instance), "start")
        await self.fleet.settle()

    async def _start(self, instance: Instance) -> None:
        try:
            await instance.scheduler.start()
        except Exception as exc:  # the store refused it: the instance is gone
            self.log.append(f"{instance.name} did not start: {exc!r}")
            instance.kill()

    def scheduler_options(self) -> dict[str, Any]:
        """Each instance's ``Scheduler(...)`` options beyond the deploy's: the defaults."""
        return {}

    def _register(self, instance: Instance) -> None:
        """The application's jobs, the same in every version; the scheduler's own defaults
        (jitter 2 s, max_late 60 s) apply to the boot job alone."""
        for register in self.registrations(instance).values():
            register()
        if self.stored is not None:
            self.stored.register(instance)
        instance.scheduler.on("skip", lambda event: self._skipped(event, instance))
        instance.scheduler.on("missed", lambda event: self._missed(event, instance))

    def job(self, instance: Instance, key: str) -> Any:
        """The job of ``key`` on ``instance`` (whatever its name there), or ``None`` (removed)."""
        for job in instance.scheduler.jobs():
            if job.key == key:
                return job
        return None

    def _skipped(self, event: SkipEvent, instance: Instance) -> None:
        if event.reason == "clock-skew":
            self._check_blame(event, instance)
        key = "tick" if event.job == "tick.v2" else event.job
        self.ledger.skipped.add((key, event.slot_ms, instance.name))
        if event.run == "schedule":  # not a boot run's nor a manual run's instant
            self.ledger.refused.setdefault((key, event.slot_ms), set()).add(event.reason)
            job = self.job(instance, key)
            if job is not None:
                note_skip(
                    self.ledger, event, key, instance, job.settings, self.lease,
                    store_ahead_ms=self.store.clock.ahead_ms,
                )  # fmt: skip

    def _missed(self, event: MissedEvent, instance: Instance) -> None:
        key = "tick" if event.job == "tick.v2" else event.job
        note_report(self.ledger, event, key, instance.name, self.fleet.now_ms())
        self.log.append(f"{instance.name} reports {key}:{event.slot_ms} missed")

    def stand_in(self, instance: Instance, key: str, options: dict[str, Any]) -> Callable[..., Any]:
        """The handler of job ``key`` on ``instance``: each run is noted in the ledger, then
        works (``work``); ``options``: the job's overlap, max_attempts and retry, as the ledger
        judges its runs by them."""
        ledger, fleet, store = self.ledger, self.fleet, self.store
        retry: Retry | None = options.get("retry")
        fail_rate = self._jobs.get("fail_rate", 0.0) if retry is not None else 0.0

        async def handler(ctx: Any) -> None:
            leased = ctx.run_id in store.leased
            expired = store.run_expiry.get(ctx.run_id, fleet.now_ms() + 1)
            if fleet.now_ms() >= expired:  # another instance may have taken the slot over
                ledger.found.append(
                    f"{instance.name} started {key}:{ctx.slot_ms} attempt {ctx.attempt} at "
                    f"{fleet.now_ms()} on a lease that expired at {expired}"
                )
            origin = origin_of(ledger.runs, instance.name, key, ctx, leased)
            run = Run(
                key=f"{key}:start" if origin == "start" else key,
                slot_ms=ctx.slot_ms, reason=ctx.reason, attempt=ctx.attempt,
                instance=instance.name,
                # A backfill holds a lease of its own: it may overlap the job's runs (README).
                overlap="allow" if origin == "backfill" else options.get("overlap", "allow"),
                max_attempts=options.get("max_attempts", 3) if ctx.reason != "start" else 99,
                start=fleet.now_ms(), lease_ttl_ms=instance.deploy.memory_ms,
                retries=retry.attempts if retry is not None else 1, origin=origin,
                ahead_ms=instance.clock.ahead_ms, leased=leased, run_id=ctx.run_id,
            )  # fmt: skip
            if origin == "start" and options.get("overlap") in ("skip", "replace"):
                run.key = key  # holds the job's own lease: it never overlaps the job's slots
            ledger.runs.append(run)
            how = "cut"
            try:
                await self.work(key, ctx, fail_rate)
                how = "returned"
            except Exception:
                how = "failed"
                raise
            finally:
                run.end = fleet.now_ms()
                if ctx.abort_reason == "timeout":  # a failed attempt (retry= catches it)
                    how = "timed-out"
                elif ctx.abort_reason == "replaced":  # recorded so, however it ended
                    how = "replaced"
                run.how = "killed" if instance.clock.dead else how

        return handler

    # -- steps -------------------------------------------------------------------------------

    def _live(self) -> list[Instance]:
        return [instance for instance in self.instances if instance.alive]

    async def step(self) -> None:
        """One operation (most often none), then time moves on a little."""
        rng, live = self.rng, self._live()
        roll = rng.random()
        short = not live or (len(live) < min(2, self.max_instances) and rng.random() < 0.7)
        if short or (roll < 0.06 and len(live) < self.max_instances):
            await self.start_instance(self.draw_deploy(), self._skew())
        elif roll < 0.12:  # a rolling deploy: one instance replaced by one of the next version
            old = rng.choice(live)
            now = self.fleet.now_ms()
            self.coverage.op("deploy", now, end=now + EFFECT_MS, instance=old.name)
            if not self.lease and self.more.random() < 0.3:
                self.faults.stop_as_claims_stall(old)
            else:
                self.stop(old)
            others = [instance for instance in live if instance is not old]
            if others and rng.random() < 0.3:  # a job run by hand as the deploy hands over
                chosen, index, after_s = rng.choice(others), self._one(), rng.choice((1, 3, 4))
                self._trigger_later(chosen, self.operated[index], after_s * 1000)
            await self.start_instance(self.draw_deploy(old.deploy), old.clock.ahead_ms)
        elif roll < 0.16:
            victim = rng.choice(live)
            if self.lease:  # often one that runs a slot: its lease is left to expire
                running = [instance for instance in live if self._expiring(instance)]
                if running and rng.random() < 0.5:
                    victim = rng.choice(running)
            self.faults.kill(victim)
            others = [instance for instance in live if instance is not victim]
            if others and rng.random() < 0.5:  # an operator runs the job by hand meanwhile
                chosen, key = rng.choice(others), self.operated[self._one()]
                after_ms = rng.choice((1, 5, 12)) * 1000
                expiring = self._expiring(victim) if self.lease else None
                if expiring is not None and rng.random() < 0.5:
                    key, after_ms = expiring  # ... as the dead runner's lease expires
                self._trigger_later(chosen, key, after_ms)
        elif roll < 0.18:
            self.stop(rng.choice(live))
        elif roll < 0.26:
            instance = rng.choice(live)
            self.trigger(instance, self.operated[self._one()])
        elif roll < 0.31:
            self.faults.step_clock(rng.choice(live), self._skew())
        elif roll < 0.37:
            self.faults.draw(rng.random())
        elif roll < 0.39 and self.kind in ("redis", "rabbitmq"):
            # The README's way to lower slot_ttl, done early: the record deleted while instances
            # with the longer slot_ttl still run, and one with the shorter started.
            self.faults.delete_record()
            await self.start_instance(self.shortened(self.draw_deploy()), self._skew())
        elif roll < 0.42:
            self._backfill(self.more.choice(live))
        pauses, live = self._pause_rng, self._live()
        if pauses is not None and live and pauses.random() < 0.04:
            self._pause_or_resume(pauses.choice(live))
        if self.operator is not None and (live := self._live()):
            await self.operator.step(live)
        if self.stored is not None:
            self.stored.step(live)
        await self.advance(rng.choice((47, 310, 730, 1530, 3470)))

    def _one(self) -> int:
        """One of the operated jobs, by its index."""
        return self.rng.randrange(len(self.operated))

    async def advance(self, ms: int) -> None:
        """The time between two steps."""
        await self.fleet.advance(timedelta(milliseconds=ms))

    def _pause_or_resume(self, instance: Instance) -> None:
        """Pause the first operated job for the fleet, or resume it, through one instance."""
        key = self.operated[0]
        job = self.job(instance, key)  # tick (or tick.v2: the same key); None: removed
        if not instance.scheduler.running or job is None:
            return
        spans = self.ledger.paused.setdefault(key, [])
        self._pauses += 1
        asked, now = self._pauses, self.fleet.now_ms()
        resume = bool(spans) and spans[-1][1] is None
        op = self.coverage.op("resume" if resume else "pause", now, instance=instance.name, key=key)
        until: datetime | None = None
        more = self.operator.more if self.operator is not None else None
        if not resume and more is not None and more.random() < 0.35:
            # A pause that ends by itself, a little or a minute later (the instance's clock).
            until = ms_to_datetime(instance.clock.now_ms() + more.choice((2000, 15_000, 60_000)))
        action: ControlAction = "resume" if resume else "pause"
        cli = more is not None and more.random() < 0.2
        if resume:
            spans[-1][1] = now  # from the moment it is asked
        if cli:  # brokersched pause|resume: written through the backend by another process
            written = cli_change(instance, job.key, action, until=until)
            change: Any = instance.scheduler.backend.change_control(written)
        elif resume:
            change = job.resume(by=instance.name)
        else:
            change = job.pause(by=instance.name, until=until, note="simulated")

        async def changed() -> None:
            try:
                control = await _quietly(change)
            finally:
                op.end = max(self.fleet.now_ms(), now + EFFECT_MS)
            if not resume and control is not None and control.paused and asked == self._pauses:
                answered = self.fleet.now_ms()
                spans.append([answered, None])  # answered: in the store now
                if until is not None:
                    self.ledger.pause_until[key, answered] = datetime_to_ms(until)

        instance.drive(changed(), action)
        said = f" until {datetime_to_ms(until)}" if until is not None else ""
        said += " (cli)" if cli else ""
        self.log.append(f"{action} {key}{said} through {instance.name}")

    def _expiring(self, victim: Instance) -> tuple[str, int] | None:
        """The job (its key) of the latest slot a killed instance held a lease of, and how
        long until that lease expires, plus a moment: a manual run then is granted before the
        fleet's next sweep finds the slot dead (a sweep that restarted it beside the manual run
        would run the slot twice)."""
        now, held = self.fleet.now_ms(), []
        for lease, expiry in self.store.expiry.items():
            key, slot, instance, _ = lease
            if key not in self.leased_keys:  # a boot window's lease
                continue
            if instance == victim.name and expiry > now and lease not in self.store.released:
                held.append((slot, key, expiry))
        if not held:
            return None
        _, key, expiry = max(held)
        return key, expiry - now + 10

    def _backfill(self, instance: Instance) -> None:
        """An operator backfills a past range of a job, recent or older, on one instance: as
        drawn before the operator's shapes (``pauses=False``), else reshaped by it."""
        scheduler, rng = instance.scheduler, self.more
        names = [job.name for job in scheduler.jobs() if job.kind in ("every", "cron")]
        if not scheduler.running or not names:
            return
        name = rng.choice(names)
        end_ms = instance.clock.now_ms() - rng.choice((0, 2000, 10_000, 40_000))
        if rng.random() < 0.3:  # long before the fleet started: slots nobody ran
            end_ms = datetime_to_ms(self._began) - rng.choice((0, 12)) * 60_000
        start_ms = end_ms - rng.choice((3000, 10_000))
        rate = rng.choice((5.0, 50.0))
        if self.operator is not None:
            start_ms, end_ms = self.operator.shape_backfill(instance, start_ms, end_ms)
            rate = self.operator.rng.choice((0.1, 0.5, 1.0, rate))
        self.backfill(instance, name, start_ms, end_ms, rate)

    def backfill(
        self, instance: Instance, name: str, start_ms: int, end_ms: int, rate: float
    ) -> None:
        """``scheduler.backfill(name, start, end, rate=rate)`` on ``instance``."""
        scheduler = instance.scheduler
        job = scheduler.get(name)
        key = job.key if job is not None else name
        op = self.coverage.op(
            "backfill", self.fleet.now_ms(), instance=instance.name, key=key,
            slots=(start_ms, end_ms),
        )  # fmt: skip

        def said(step: BackfillSlot) -> None:
            """A slot the backfill did not run, and said why (its claim won, answer lost, say)."""
            if step.status != "ran":
                self.ledger.skipped.add((key, datetime_to_ms(step.at), instance.name))

        async def backfill() -> None:
            try:
                steps = await scheduler.backfill(
                    name, ms_to_datetime(start_ms), ms_to_datetime(end_ms), rate=rate,
                    progress=said,
                )  # fmt: skip
            except Exception as exc:  # a stop meanwhile, a refused range
                self.log.append(f"backfill {name} on {instance.name}: {exc!r}")
                return
            finally:
                op.end = self.fleet.now_ms()
            done = Counter(step.status for step in steps)
            self.log.append(f"backfill {name} on {instance.name} done: {dict(done)}")

        instance.drive(backfill(), "backfill")
        self.log.append(f"backfill {name} {start_ms}..{end_ms} at {rate:g}/s on {instance.name}")

    def trigger(self, instance: Instance, key: str) -> None:
        """A manual run of job ``key`` on ``instance``."""
        job = self.job(instance, key)
        if job is None or not instance.alive or not instance.scheduler.running:
            return
        op = self.coverage.op("trigger", self.fleet.now_ms(), instance=instance.name, key=key)

        async def trigger() -> None:
            try:
                await job.trigger()
            finally:
                op.end = self.fleet.now_ms()

        instance.drive(trigger(), "trigger")
        self.log.append(f"trigger {job.name} on {instance.name}")

    def _trigger_later(self, instance: Instance, key: str, after_ms: int) -> None:
        self.fleet.call_later(after_ms, lambda: self.trigger(instance, key))

    def live(self) -> list[Instance]:
        return self._live()

    @property
    def began(self) -> datetime:
        return self._began

    @property
    def jobs(self) -> dict[str, Any]:
        return self._jobs

    def _skew(self) -> int:
        """An instance's clock, ahead or behind: within the claim backends' bound (1 s between
        any two); lease backends refuse a clock too fast, so any step may come."""
        if self.lease and self.rng.random() < 0.2:
            return self.rng.randint(-30_000, 30_000)
        return self.rng.randint(-500, 500)

    def _check_blame(self, event: SkipEvent, instance: Instance) -> None:
        """A clock-skew refusal after the store's clock stepped back by more than
        max_clock_skew, while this instance's did not move, never blames this instance's clock
        alone (a warning that told the operator to fix the instance would mislead). It names
        the store's, or says it cannot tell (no reading of this instance's had both clocks
        agree)."""
        accepted = self.store.accepted.get(instance.name)
        if accepted is None:
            return
        now = self.fleet.now_ms()
        stepped = any(accepted < at <= now for at in self._instance_steps.get(instance.name, []))
        back = sum(delta for at, delta in self.faults.store_steps if accepted < at <= now)
        detail = event.detail or ""
        blames = "this instance's clock is fast:" in detail or "instance's clock stepped" in detail
        if not stepped and back < -LEASE_SKEW_MS and blames:
            self.ledger.found.append(
                f"{instance.name} blamed the wrong clock after the store's stepped back "
                f"{-back}ms: {event.detail}"
            )

    def stop(self, instance: Instance) -> None:
        op = self.coverage.op("stop", self.fleet.now_ms(), instance=instance.name)

        async def stop() -> None:
            try:
                await instance.scheduler.stop()
            finally:  # the process exits: a release that has not landed never will
                self.ledger.stopped[instance.name] = op.end = self.fleet.now_ms()

        instance.stopping = instance.drive(stop(), "stop")
        self.log.append(f"stop {instance.name}")

    # -- the whole run -----------------------------------------------------------------------

    def _records(self) -> list[RunRecord]:
        """Every run record a lease store kept (the claim backends' runs are never cut)."""
        if self.kind == "lease":
            return [record for kept in self._rows.history.values() for record in kept]
        if self.kind == "natslease":
            return [record for kept in self.data.history.values() for record in kept]
        return []

    def going_on(self, steps: int) -> bool:
        """Whether to take another step after ``steps``."""
        return steps < self.steps

    async def run(self) -> Result:
        violations: list[str] = []
        n = 0
        while self.going_on(n):
            await self.step()
            found = self.ledger.found + self.ledger.violations(self.fleet.now_ms())
            if found:
                violations = [f"after step {n}: {v}" for v in found]
                break
            n += 1
        if not violations:
            if self.stored is not None:
                await self.stored.read(self._live())
            for instance in self._live():
                self.stop(instance)
            await self.fleet.advance("20s")
            violations = self.ledger.violations(self.fleet.now_ms())
            violations += self.ledger.lost(self.store.wins, self.scheduled)
            violations += self.ledger.dropped(self.store.wins, self.store.cut, self.scheduled)
            violations += unreported(self)
            violations += self.ledger.replaced(self._records())
            violations += self.stored.violations() if self.stored is not None else []
        for instance in self.instances:
            instance.kill()
        await self.fleet.settle()
        coverage = self.coverage.counts(self.ledger.runs, self.fleet.now_ms())
        ran = Counter((run.key.removesuffix(":start"), run.reason) for run in self.ledger.runs)
        failed = Counter(run.key.removesuffix(":start") for run in self.ledger.runs
                         if run.how in ("failed", "timed-out"))  # fmt: skip
        return Result(
            self.seed, self.kind, self.steps, violations, self.log, len(self.ledger.runs),
            coverage, ran + self.unledgered, failed + self.unledgered_failed,
            missed=len(self.ledger.reported), unknown=len(self.ledger.unknown),
        )  # fmt: skip


def simulate(
    seed: int,
    *,
    backend: str | None = None,
    steps: int = 120,
    pauses: bool = True,
    late_answers: bool = True,
    richer_controls: bool = True,
) -> Result:
    """Run one seed; the result lists the invariants it broke (none: ``result.ok``) and what
    it reached (``result.coverage``). ``pauses=False``: no fleet-wide pause or resume is drawn,
    nor any operation added since; ``late_answers=False``: no lease store answers later than a
    lease; ``richer_controls=False``: no pause until an instant, skip, nor change made the
    CLI's way (the seed runs as before each was added to the generator)."""
    return run_seeded(
        seed,
        lambda: Simulation(
            seed,
            backend=backend,
            steps=steps,
            pauses=pauses,
            late_answers=late_answers,
            richer_controls=richer_controls,
        ),
    )


def run_seeded(seed: int, make: Callable[[], Simulation]) -> Result:
    """Run the simulation ``make`` makes, of ``seed``, in a loop of its own, the library's
    logs silenced."""
    logger = logging.getLogger("brokersched")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    # The library's own draws from the module-level generator (a retry's jitter, the chunks of
    # a batch of claims) come from the seed too: else a seed replays otherwise in a process
    # whose earlier work drew other numbers (seen: a seed run late in a pytest session).
    state = random.getstate()
    random.seed(f"brokersched.simulate:{seed}")
    try:
        return asyncio.run(make().run())
    finally:
        random.setstate(state)
        logger.setLevel(level)


if __name__ == "__main__":  # the command line is _sim_main's (which imports this module)
    sys.exit(importlib.import_module("brokersched.testing._sim_main").main())

"""The fleet simulator's own application (``brokersched.testing.simulate``): the jobs a seed
draws (an ``every`` tick, a 3-second cron, an ``at``, an ``after`` boot job, and on lease
backends a job slower than the take-over sweep), their options within the README's rules, the
deploys that change them, how long their runs work and when their slots fall. ``Simulation``
is made of it; ``_sim_app.AppSimulation`` puts an application's own jobs in its place."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .._retry import Retry

if TYPE_CHECKING:
    from ._sim_operations import Operator
    from .simulate import Instance

__all__ = ["Deploy", "OwnJobs"]


@dataclass(frozen=True)
class Deploy:
    """What one instance runs: the application's settings, as a deploy may change them."""

    memory_ms: int  # slot_ttl (claim-only) or lease_ttl (lease)
    jitter_ms: int
    max_late_ms: int
    overlap: str
    max_attempts: int
    renamed: bool  # the tick job runs under another name, its key kept
    declare_ahead: bool
    drain_s: int = 3
    catch_up_ms: int | None = None  # lease: None is the default (5m)
    timeout_ms: int | None = None  # the jobs' timeout
    retry: bool = True  # the jobs' retry= (when the seed drew one)
    schedules: bool = True  # Scheduler(enabled=False): registered, runs only what it is asked


class OwnJobs:
    """The simulator's jobs and deploys, drawn from the seed's generators."""

    rng: random.Random
    more: random.Random
    replace_rng: random.Random | None  # overlap="replace", drawn apart (see Simulation)
    lease: bool
    kind: str
    operator: Operator | None
    _jobs: dict[str, Any]
    _began: datetime
    _failures: random.Random

    def stand_in(self, instance: Instance, key: str, options: dict[str, Any]) -> Callable[..., Any]:
        """The handler of job ``key`` on ``instance`` (the simulation's)."""
        raise NotImplementedError

    def draw_jobs(self) -> dict[str, Any]:
        rng = self.rng
        jobs: dict[str, Any] = {
            "tick_s": rng.choice((1, 2, 5)),
            "work_ms": rng.choice((100, 800, 2500, 6000)),  # tick, once, boot
            "cron_work_ms": rng.choice((100, 4000, 9000)),  # often longer than its 3 s
            "at_s": rng.randint(-10, 40),
            "after_s": rng.choice((1, 3)) if rng.random() < 0.6 else None,  # a boot job?
            "run_on_start": rng.random() < 0.5,
        }
        if self.lease:  # a job slower than the take-over sweep, as most real ones
            jobs["slow_s"], jobs["slow_work_ms"] = rng.choice((20, 30)), rng.choice((800, 6000))
        more = self.more
        if more.random() < 0.35:  # handlers that fail, and a retry= for them
            jobs["fail_rate"] = more.choice((0.3, 0.6, 1.0))
            jobs["retry"] = Retry(
                attempts=more.choice((2, 3, 4)),
                backoff=f"{more.choice((50, 300, 1500))}ms",
                jitter=f"{more.choice((0, 200))}ms",
            )
        return jobs

    def retry_options(
        self, options: dict[str, Any], gap_ms: int | None, deploy: Deploy
    ) -> dict[str, Any]:
        """The job's ``retry=`` and ``timeout``, unless the retry's worst case would reach the
        next slot with ``overlap="skip"`` (registration refuses that)."""
        timeout = None if deploy.timeout_ms is None else timedelta(milliseconds=deploy.timeout_ms)
        chosen: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        retry: Retry | None = self._jobs.get("retry")
        if retry is None or not deploy.retry:
            return chosen
        skip = gap_ms is not None and options.get("overlap") == "skip"
        if skip and retry.worst_case(timeout)[0] >= timedelta(milliseconds=gap_ms or 0):
            return chosen
        return {**chosen, "retry": retry}

    def draw_deploy(self, base: Deploy | None = None) -> Deploy:
        rng, lease = self.rng, self.lease
        memory = rng.choice((3000, 10_000, 30_000) if lease else (3000, 8000, 20_000, 60_000))
        if base is None and not lease and rng.random() < 0.5:
            memory = 3000  # a fleet that starts short, for deploys to raise
        elif base is not None and not lease and rng.random() < 0.3:
            memory = rng.choice((20_000, 60_000))  # the rolling deploy that raises slot_ttl
        elif base is not None and rng.random() < 0.5:
            memory = base.memory_ms  # a deploy that changes something else
        deploy = Deploy(
            memory_ms=memory,
            jitter_ms=rng.choice((0, 100, 250, 900, 4000)),
            max_late_ms=rng.choice((500, 2000, 10_000, 45_000)),
            overlap=rng.choice(("skip", "allow")) if lease else "allow",
            max_attempts=rng.choice((1, 2, 3)),
            renamed=rng.random() < 0.2,
            declare_ahead=rng.random() < 0.7,
            drain_s=rng.choice((1, 3)),
            catch_up_ms=self.more.choice((None, None, 0, 3000)),
        )
        drawn = self.replace_rng
        if deploy.overlap == "skip" and drawn is not None and drawn.random() < 0.5:
            deploy = replace(deploy, overlap="replace")  # never two runs at once, either way
        return deploy if self.operator is None else self.operator.draw_deploy(deploy)

    def timing(self, deploy: Deploy, gap_ms: int | None) -> dict[str, Any]:
        """A job's jitter and max_late from the deploy's, within the README's rules: jitter
        under half the gap, max_late above it, and on a claim-only backend both (and the
        claims' margin) within slot_ttl."""
        jitter = deploy.jitter_ms if gap_ms is None else min(deploy.jitter_ms, gap_ms // 2 - 1)
        max_late = deploy.max_late_ms
        if not self.lease:
            lead = min(750, deploy.memory_ms // 4) if self.kind == "rabbitmq" else 0
            margin = 1000 + min(250, deploy.memory_ms // 8) + lead
            jitter = max(0, min(jitter, deploy.memory_ms - margin - 100, deploy.memory_ms // 3))
            max_late = min(max_late, deploy.memory_ms - jitter - 100)
        max_late = max(max_late, jitter + 50)
        return {"jitter": f"{jitter}ms", "max_late": f"{max_late}ms"}

    def registrations(self, instance: Instance) -> dict[str, Callable[[], object]]:
        """Each job of the application (by key), registered on ``instance`` when called."""
        sched, deploy, jobs = instance.scheduler, instance.deploy, self._jobs
        lease = self.lease
        options: dict[str, Any] = {}
        if lease:
            options = {"overlap": deploy.overlap, "max_attempts": deploy.max_attempts}
            if deploy.catch_up_ms is not None:
                options["catch_up"] = f"{deploy.catch_up_ms}ms"
        found: dict[str, Callable[[], object]] = {}
        name = "tick.v2" if deploy.renamed else "tick"
        tick_ms = jobs["tick_s"] * 1000
        tick = {**options, **self.retry_options(options, tick_ms, deploy)}
        found["tick"] = lambda: sched.every(
            name, f"{tick_ms}ms", self.stand_in(instance, "tick", tick), key="tick",
            run_on_start=jobs["run_on_start"], **tick, **self.timing(deploy, tick_ms),
        )  # fmt: skip
        cron = {**options, **self.retry_options(options, 3000, deploy)}
        found["cron"] = lambda: sched.cron(
            "cron", "*/3 * * * * *", self.stand_in(instance, "cron", cron), **cron,
            **self.timing(deploy, 3000),
        )  # fmt: skip
        at = self._began + timedelta(seconds=jobs["at_s"])  # one instant for the whole fleet
        once: dict[str, Any] = {"max_attempts": deploy.max_attempts} if lease else {}
        once.update(self.retry_options(once, None, deploy))
        found["once"] = lambda: sched.at(
            "once", at, self.stand_in(instance, "once", once), **once,
            **self.timing(deploy, None),
        )  # fmt: skip
        if jobs["after_s"] is not None:
            found["boot"] = lambda: sched.after(
                "boot", f"{jobs['after_s']}s", self.stand_in(instance, "boot", {})
            )
        if lease:  # its slot stays the job's latest while a dead runner's lease expires
            slow_ms = jobs["slow_s"] * 1000
            slow = {**options, **self.retry_options(options, slow_ms, deploy)}
            found["slow"] = lambda: sched.every(
                "slow", f"{slow_ms}ms", self.stand_in(instance, "slow", slow), **slow,
                **self.timing(deploy, slow_ms),
            )  # fmt: skip
        return found

    def work_ms(self, key: str) -> int:
        """How long a run of job ``key`` works."""
        return int(self._jobs[{"cron": "cron_work_ms", "slow": "slow_work_ms"}.get(key, "work_ms")])

    def gap_ms(self, key: str) -> int | None:
        """The time between two slots of job ``key`` (``None``: one slot)."""
        return self._jobs["tick_s"] * 1000 if key == "tick" else 3000

    def shortened(self, deploy: Deploy) -> Deploy:
        """``deploy`` with the shorter ``slot_ttl`` a deleted fleet record lets in."""
        return replace(deploy, memory_ms=3000)

    def slot_after(self, key: str, after_ms: int) -> int:
        """The first slot of job ``key`` (tick, here) after ``after_ms``."""
        tick: int = self._jobs["tick_s"] * 1000
        return after_ms - after_ms % tick + tick

    def next_instant(self, after_ms: int) -> int:
        """The first instant after ``after_ms`` on the grid of every job's slots."""
        grid = 1000 * math.gcd(self._jobs["tick_s"], 3)
        return (after_ms // grid + 1) * grid

    async def work(self, key: str, ctx: Any, fail_rate: float) -> None:
        """A run's work: it lasts ``work_ms(key)`` unless aborted, and fails at ``fail_rate``."""
        aborted = await ctx.wait_aborted(self.work_ms(key) / 1000)
        if not aborted and self._failures.random() < fail_rate:
            raise RuntimeError("the handler failed (simulated)")

    def scheduled(self, key: str, slot_ms: int) -> bool:
        every = {
            "tick": self._jobs["tick_s"] * 1000, "cron": 3000,
            "slow": self._jobs.get("slow_s", 0) * 1000,
        }.get(key)  # fmt: skip
        return every is not None and slot_ms % every == 0

"""What users do to a running fleet, for the fleet simulator (``brokersched.testing.simulate``),
drawn at the shapes they do it, from an RNG of its own (so that the draws a seed made before
these operations existed stay as they were):

* backfills as operators run them: slow (0.1 to 1 slot a second) as often as fast, over
  ranges that end now (their last slots still running, or held by a lease), that straddle the
  live slots, that lie long ago; now and then a second one at once on another instance over an
  overlapping range;
* the fleet's controls: a job disabled, enabled (``Job.disable()``, or the admin API's
  ``Scheduler.change_control``);
* a job removed at run time (its runs aborted or not), and registered again a while later;
* ``Job.update()`` of its jitter, max_late and timeout;
* an abort of a run going on somewhere in the fleet (``Scheduler.abort``);
* a fault of any kind within an operation just begun (``Faults.during``: the backend shedding
  new claims near its server's budget among them);
* in the deploys: ``timeout``, ``retry=`` on or off, an instance that schedules nothing
  (``enabled=False``); in the jobs: runs far longer than a backfill's settle delay.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from .._clock import datetime_to_ms
from .._controls import control_change
from .._fleetrecords import ControlAction, ControlChange, asked
from ._sim_coverage import EFFECT_MS

if TYPE_CHECKING:
    from .simulate import Deploy, Instance, Simulation

__all__ = ["Operator", "cli_change"]

_RATES = (0.1, 0.25, 0.5, 1.0, 1.0, 5.0, 50.0)  # slots a second


def cli_change(
    instance: Instance,
    key: str,
    action: ControlAction,
    *,
    until: datetime | None = None,
    count: int | None = None,
    schedule: Any = None,
) -> ControlChange:
    """The change ``brokersched ACTION`` writes (see ``brokersched.cli._controls``): made on
    its own clock (the instance's here), the next slots of a skip found from the schedule."""
    now = instance.clock.now()
    extra = asked(action, now=now, note="simulated", until=until, count=count)
    return control_change(key, key, schedule, action, "cli:ops", now, extra)


def _written(instance: Instance, change: ControlChange) -> Any:
    """The CLI's write of ``change`` through the backend of ``instance``'s process (the
    scheduler there learns it at its next read of the controls)."""
    return instance.scheduler.backend.change_control(change)


async def _answer(change: Any) -> Any:
    """A change's answer; ``None`` when the store did not take it."""
    try:
        return await change
    except Exception:
        return None


class Operator:
    """The operations of ``Simulation`` drawn since the coverage table."""

    def __init__(
        self, sim: Simulation, rng: random.Random, more: random.Random | None = None
    ) -> None:
        """``more``: the draws added since (pause until, skip, the CLI's way), from an RNG of
        their own, so that a seed's other draws stay as they were; ``None``: none of them."""
        self.sim = sim
        self.rng = rng
        self.more = more
        self._asked: Counter[tuple[str, str]] = Counter()  # (paused|disabled, key): requests

    # -- what the seed's jobs and deploys draw ---------------------------------------------

    def draw_jobs(self, jobs: dict[str, Any]) -> None:
        if self.rng.random() < 0.3:  # a job whose runs outlast a backfill's settle delay
            jobs["cron_work_ms"] = self.rng.choice((20_000, 40_000))

    def draw_deploy(self, deploy: Deploy) -> Deploy:
        rng = self.rng
        return replace(
            deploy,
            timeout_ms=rng.choice((None, None, None, 1500, 5000, 30_000)),
            retry=rng.random() < 0.8,
            schedules=rng.random() < 0.9,
        )

    # -- one step ----------------------------------------------------------------------------

    async def step(self, live: list[Instance]) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.05:
            self.backfill(rng.choice(live))
        elif roll < 0.08:
            key = rng.choice(self.sim.operated)
            spans = self.sim.ledger.disabled.get(key, [])
            action = "enable" if spans and spans[-1][1] is None else "disable"
            instance, admin = rng.choice(live), rng.random() < 0.3
            cli = not admin and self.more is not None and self.more.random() < 0.3
            self.control(instance, key, action, admin=admin, cli=cli)
        elif roll < 0.10:
            self.remove(rng.choice(live), rng.choice(self.sim.operated))
        elif roll < 0.12:
            self.update(rng.choice(live), rng.choice(self.sim.operated))
        elif roll < 0.14:
            self.abort(rng.choice(live))
        elif roll < 0.16:
            self.sim.faults.during(rng)  # the backend sheds, say, as nothing else happens
        if roll < 0.14 and rng.random() < 0.3:  # a fault within the operation just begun
            after = rng.choice((0, 300, 1500))
            self.sim.fleet.call_later(after, lambda: self.sim.faults.during(rng))
        more = self.more
        if more is not None and more.random() < 0.02:  # a skip, drawn apart (see __init__)
            self.skip(more.choice(live), more.choice(self.sim.operated), cli=more.random() < 0.3)
            if more.random() < 0.3:
                self.sim.fleet.call_later(
                    more.choice((0, 300)), lambda: self.sim.faults.during(more)
                )

    # -- backfill ----------------------------------------------------------------------------

    def shape_backfill(self, instance: Instance, start_ms: int, end_ms: int) -> tuple[int, int]:
        """The range of a backfill as operators draw it (see the module): ending now, a little
        before, or as drawn before (``start_ms``, ``end_ms``)."""
        rng, now = self.rng, instance.clock.now_ms()
        roll = rng.random()
        if roll < 0.45:  # up to now: its last slots still running, or held by their lease
            return now - rng.choice((5000, 20_000, 60_000)), now
        if roll < 0.7:  # over the live slots, ending a little before now
            end = now - rng.choice((1000, 3000, 8000))
            return end - rng.choice((5000, 20_000, 60_000)), end
        return start_ms, end_ms

    def backfill(
        self, instance: Instance, *, span: tuple[int, int] | None = None, name: str = ""
    ) -> None:
        """A backfill of a job on ``instance`` as operators run them, and now and then a second
        one at once on another instance over an overlapping range."""
        sim, rng = self.sim, self.rng
        names = [job.name for job in instance.scheduler.jobs() if job.kind in ("every", "cron")]
        if not instance.scheduler.running or not names:
            return
        name = name if name in names else rng.choice(names)
        # Else: long before the fleet started, slots nobody ran.
        end_ms = datetime_to_ms(sim.began) - rng.choice((0, 12)) * 60_000
        start_ms, end_ms = span or self.shape_backfill(instance, end_ms - 10_000, end_ms)
        sim.backfill(instance, name, start_ms, end_ms, rng.choice(_RATES))
        others = [other for other in sim.live() if other is not instance]
        if span is None and others and rng.random() < 0.3:
            other = rng.choice(others)
            shift = rng.randint(-(end_ms - start_ms) // 2, (end_ms - start_ms) // 2)
            end = min(end_ms + shift, other.clock.now_ms())
            self.backfill(other, span=(start_ms + shift, end), name=name)

    # -- the fleet's controls ----------------------------------------------------------------

    def control(
        self, instance: Instance, key: str, action: str, *, admin: bool = False, cli: bool = False
    ) -> None:
        """``action`` (pause, resume, disable, enable) of job ``key`` for the fleet, through
        ``instance`` (``admin``: the admin API's way, ``Scheduler.change_control``; ``cli``:
        the CLI's, the change written through the backend by another process)."""
        sim = self.sim
        job = sim.job(instance, key)
        if job is None or not instance.scheduler.running:
            return
        what = "paused" if action in ("pause", "resume") else "disabled"
        spans = getattr(sim.ledger, what).setdefault(key, [])
        self._asked[what, key] += 1
        asked, now = self._asked[what, key], sim.fleet.now_ms()
        op = sim.coverage.op(action, now, instance=instance.name, key=key)
        undo = action in ("resume", "enable")
        if undo and spans and spans[-1][1] is None:
            spans[-1][1] = now  # from the moment it is asked
        # The admin API's change is sent by its task (a coroutine); Job's applies here at once.
        applied: Any = None if admin or cli else getattr(job, action)(by=instance.name)

        async def changed() -> None:
            change = applied
            if cli:
                change = _written(
                    instance, cli_change(instance, job.key, cast(ControlAction, action))
                )
            elif change is None:
                change = instance.scheduler.change_control(job.name, action, by=instance.name)  # type: ignore[arg-type]
            try:
                control = await _answer(change)
            finally:
                op.end = max(sim.fleet.now_ms(), now + EFFECT_MS)
            done = control is not None and getattr(control, what)
            if not undo and done and asked == self._asked[what, key]:
                spans.append([sim.fleet.now_ms(), None])  # answered: in the store now

        instance.drive(changed(), action)
        way = " (admin)" if admin else " (cli)" if cli else ""
        sim.log.append(f"{action} {key} through {instance.name}{way}")

    def skip(self, instance: Instance, key: str, *, cli: bool) -> None:
        """``Job.skip(n)`` of job ``key`` through ``instance`` (``cli``: ``brokersched skip``,
        the change written through the backend by another process), n from 0 (a pending skip
        cancelled) to 3. A skip is judged only when no other skip of the key was asked while
        it was on its way: the store keeps whichever landed last."""
        sim, rng = self.sim, self.rng
        job = sim.job(instance, key)
        if job is None or not instance.scheduler.running:
            return
        count, now = rng.choice((0, 1, 1, 2, 3)), sim.fleet.now_ms()
        self._asked["skip", key] += 1
        asked = self._asked["skip", key]
        windows = sim.ledger.skips.setdefault(key, [])
        if windows and windows[-1][3] is None:
            windows[-1][3] = now  # replaced from the moment it is asked
        op = sim.coverage.op("skip", now, instance=instance.name, key=key)
        try:
            if cli:
                change = cli_change(instance, job.key, "skip", count=count, schedule=job.schedule)
            else:
                applied = job.skip(count, by=instance.name, note="simulated")
        except ValueError as exc:  # no slot left: refused, nothing changed
            op.end = now
            sim.log.append(f"skip {count} {key} through {instance.name} refused: {exc}")
            return

        async def changed() -> None:
            try:
                written = _written(instance, change) if cli else applied
                control = await _answer(written)
            finally:
                op.end = max(sim.fleet.now_ms(), now + EFFECT_MS)
            window = getattr(control, "skip", None)
            if window is not None and asked == self._asked["skip", key]:
                windows.append([sim.fleet.now_ms(), window.after_ms, window.through_ms, None])

        instance.drive(changed(), "skip")
        way = " (cli)" if cli else ""
        sim.log.append(f"skip {count} {key} through {instance.name}{way}")

    # -- jobs changed at run time ------------------------------------------------------------

    def remove(self, instance: Instance, key: str) -> None:
        """Job ``key`` removed on ``instance`` (its runs there aborted or not), and registered
        again a while later."""
        sim, rng = self.sim, self.rng
        job = sim.job(instance, key)
        if job is None or not instance.scheduler.running:
            return
        abort = rng.random() < 0.5
        now = sim.fleet.now_ms()
        instance.scheduler.remove(job.name, abort=abort)
        sim.ledger.removed.append((key, instance.name, now))
        sim.coverage.op("remove", now, end=now + EFFECT_MS, instance=instance.name, key=key)
        sim.log.append(f"remove {job.name} on {instance.name}" + (" (abort)" if abort else ""))

        def add() -> None:
            if not instance.alive or not instance.scheduler.running:
                return
            if sim.job(instance, key) is None:
                sim.registrations(instance)[key]()
                at = sim.fleet.now_ms()
                sim.ledger.added.append((key, instance.name, at))
                sim.coverage.op("add", at, end=at + EFFECT_MS, instance=instance.name, key=key)
                sim.log.append(f"add {key} again on {instance.name}")

        sim.fleet.call_later(rng.choice((2000, 8000, 20_000)), add)

    def update(self, instance: Instance, key: str) -> None:
        """``Job.update()`` of job ``key``'s jitter, max_late and timeout on ``instance``, within
        the README's rules (a refused one changes nothing, as documented)."""
        sim, rng = self.sim, self.rng
        job = sim.job(instance, key)
        if job is None or not instance.scheduler.running:
            return
        deploy = replace(
            instance.deploy,
            jitter_ms=rng.choice((0, 100, 900, 4000)),
            max_late_ms=rng.choice((500, 2000, 10_000, 45_000)),
        )
        options: dict[str, Any] = sim.timing(deploy, sim.gap_ms(key))
        if rng.random() < 0.5:
            options["timeout"] = f"{rng.choice((1500, 5000, 30_000))}ms"
        now = sim.fleet.now_ms()
        sim.coverage.op("update", now, end=now + EFFECT_MS, instance=instance.name, key=key)
        try:
            job.update(**options)
        except Exception as exc:  # refused: nothing changed
            sim.log.append(f"update {job.name} on {instance.name} refused: {exc}")
            return
        sim.log.append(f"update {job.name} on {instance.name}: {options}")

    def abort(self, instance: Instance) -> None:
        """An abort, through ``instance``, of a run going on somewhere in the fleet."""
        sim = self.sim
        going = [run for run in sim.ledger.runs if run.end is None and run.run_id]
        if not going or not instance.scheduler.running:
            return
        run = self.rng.choice(going)
        now = sim.fleet.now_ms()
        op = sim.coverage.op(
            "abort", now, instance=instance.name, key=run.key.removesuffix(":start"), live=True
        )

        async def abort() -> None:
            try:
                await _answer(instance.scheduler.abort(run.run_id, by=instance.name))
            finally:
                op.end = max(sim.fleet.now_ms(), now + EFFECT_MS)

        instance.drive(abort(), "abort")
        sim.log.append(f"abort {run.key}:{run.slot_ms} on {run.instance} through {instance.name}")

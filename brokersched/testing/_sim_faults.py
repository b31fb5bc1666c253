"""The faults of the fleet simulator (``brokersched.testing.simulate``): what the world does to
a fleet, drawn from the seed's own RNG (``Faults.draw``): the store held (answers late or lost),
down (restarting), locked (SQLite's write lock), its link flaky (the NATS KV bucket), its clock
stepped back (lease stores), or its answers later than a lease lasts (lease stores, from a
generator of their own: ``Simulation.late_rng``); Redis evicting keys, the fleet's slot memory
record deleted, a
RabbitMQ claim queue made beforehand; kill -9 of an instance; and the store away exactly as a
run completes or as an instance stops with claims in flight.

Each fault injected says so to the coverage (``Coverage.fault``, with the span it is in force);
a new kind of fault is one line of ``_sim_coverage.FAULTS`` and one branch of ``draw``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._sim_coverage import EFFECT_MS, FAULTS

if TYPE_CHECKING:
    from .simulate import Instance, Simulation

__all__ = ["Faults"]


class Faults:
    """The faults of one ``Simulation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.store_steps: list[tuple[int, int]] = []  # (when, by how much): the store's clock

    def kill(self, victim: Instance) -> None:
        """kill -9: its leases are left to expire, its claims unanswered."""
        victim.kill()
        now = self.sim.fleet.now_ms()
        self.sim.ledger.killed[victim.name] = now
        self.sim.coverage.fault("kill -9", now, now + victim.deploy.memory_ms, victim.name)
        self.sim.log.append(f"kill -9 {victim.name}")

    def delete_record(self) -> None:
        if self.sim.kind == "redis":
            self.sim.data.keys.pop("sim:slot-memory", None)
        else:
            self.sim.data.record = None
        self.instant("record deleted", "fleet record deleted")

    def instant(self, kind: str, said: str) -> None:
        now = self.sim.fleet.now_ms()
        self.sim.coverage.fault(kind, now, now + EFFECT_MS)
        self.sim.log.append(said)

    def away(self, how: str, span_ms: int, said: str, *, extend: bool = False) -> None:
        """The store away for ``span_ms`` from now: ``held``, ``down``, ``locked`` (an
        outage of the fleet's calls too) or ``flaky`` (the NATS KV bucket's link); ``extend``:
        an earlier span that lasts longer stands."""
        mono, now = self.sim.fleet.monotonic_ms(), self.sim.fleet.now_ms()
        owner = self.sim.data if how == "flaky" else self.sim.store
        until = f"{how}_until"
        longer = getattr(owner, until) if extend else -1
        setattr(owner, until, max(longer, mono + span_ms))
        # The fleet's calls are refused too (held, down, locked), or a release sent meanwhile
        # is out of reach (late: the README's Limits).
        if how in ("held", "down", "locked", "late"):
            self.sim.ledger.outages.append((now, now + span_ms))
        self.sim.coverage.fault("late answer" if how == "late" else how, now, now + span_ms)
        self.sim.log.append(said.format(until=getattr(owner, until)))

    def draw(self, roll: float) -> None:
        """The fault of a step (``roll``: the seed's draw), on the seed's own RNG."""
        rng, kind, lease = self.sim.rng, self.sim.kind, self.sim.lease
        late = self.sim.late_rng
        if lease and late is not None and late.random() < 0.3:
            self.late_answers(late)  # besides the fault drawn below, which draws as before
        if roll < (0.2 if lease else 0.35):
            self.held(rng)
        elif roll < 0.35:  # a lease store: the next run's end
            self.blip_as_a_run_completes(rng.choice(self.blips()))
        elif roll < 0.55:
            self.down(rng)
        elif roll < 0.7 and kind == "natslease":
            self.flaky(rng)
        elif roll < 0.7 and kind == "lease":
            self.locked(rng)
        elif roll < 0.85 and lease:
            self.store_clock(rng)
        elif kind == "redis" and self.sim.store.evicting and roll < 0.92:
            self.evicted(rng)
        elif kind == "redis":
            self.delete_record()
        elif kind == "rabbitmq" and roll < 0.92:
            self.stray_queue(rng)
        elif kind == "rabbitmq":
            self.delete_record()
        elif lease:
            self.blip_as_a_run_completes(rng.choice(self.blips()))

    def during(self, rng: random.Random) -> None:
        """A fault drawn to fall within an operation just begun: any kind this backend has."""
        kinds = [kind for kind in _INJECT if self.sim.kind in FAULTS[kind].backends]
        _INJECT[rng.choice(kinds)](self, rng)

    # -- each kind ---------------------------------------------------------------------------

    def held(self, rng: random.Random) -> None:
        self.away("held", rng.choice((200, 900, 2500, 6000)), "store held until {until}")

    def down(self, rng: random.Random) -> None:
        self.away("down", rng.choice((500, 2000, 8000)), "store down until {until}")

    def flaky(self, rng: random.Random) -> None:
        self.away("flaky", rng.choice((1000, 4000, 10_000)), "bucket link flaky until {until}")

    def locked(self, rng: random.Random) -> None:
        self.away("locked", rng.choice((500, 2000, 5000)), "store locked until {until}")

    def late_answers(self, rng: random.Random) -> None:
        """For a moment, the lease store applies every call at once and answers it later than
        a lease lasts (a link that delays or drops answers): a claim or a take-over may come
        back with a lease that has expired, and its slot taken over by another instance."""
        span = rng.choice((500, 2000, 5000))
        self.sim.store.late_ms = late_ms = rng.choice((3500, 12_000, 35_000))
        self.away("late", span, f"store answers {late_ms}ms late until {{until}}", extend=True)

    def store_clock(self, rng: random.Random) -> None:
        # Backwards only: a forward step shortens every live lease by the step (the README's
        # Clocks section: a store's clock is slewed, not stepped forward).
        delta = rng.choice((-10_000, -2000, -500))
        self.sim.store.clock.step(delta)
        self.store_steps.append((self.sim.fleet.now_ms(), delta))
        self.instant("store clock", f"store clock stepped {delta}ms")

    def evicted(self, rng: random.Random) -> None:
        self.instant("evicted", self.sim.data.evict(rng))

    def stray_queue(self, rng: random.Random) -> None:
        key, slot = self.sim.operated[0], self.sim.fleet.now_ms()
        for _ in range(rng.randint(1, 3)):
            slot = self.sim.slot_after(key, slot)
        self.sim.data.stray(f"{key}:{slot}")
        self.instant("stray queue", f"a queue made beforehand for {key}:{slot}")

    def step_clock(self, instance: Instance, ahead_ms: int) -> None:
        """``instance``'s clock stepped to ``ahead_ms`` ahead of the fleet's true time."""
        instance.clock.step(ahead_ms - instance.clock.ahead_ms)
        now = self.sim.fleet.now_ms()
        self.sim.ledger.stepped.setdefault(instance.name, []).append(now)
        self.sim.coverage.fault("clock step", now, now + EFFECT_MS, instance.name)
        self.sim.log.append(f"{instance.name} clock now {instance.clock.ahead_ms}ms ahead")

    def _kill_one(self, rng: random.Random) -> None:
        live = self.sim.live()
        if len(live) > 1:
            self.kill(rng.choice(live))

    def _step_one(self, rng: random.Random) -> None:
        if live := self.sim.live():
            far = self.sim.lease and rng.random() < 0.2
            self.step_clock(
                rng.choice(live), rng.randint(*(-30_000, 30_000) if far else (-500, 500))
            )

    def _shed(self, rng: random.Random) -> None:
        span = rng.choice((1000, 5000, 20_000))
        self.away("shed", span, f"the backend sheds for {span}ms", extend=True)

    def blips(self) -> tuple[str, ...]:
        """How a lease store can be away as a run completes (a KV bucket has no write lock)."""
        return ("held", "down", "locked") if self.sim.kind == "lease" else ("held", "down")

    def stop_as_claims_stall(self, instance: Instance) -> None:
        """The store's answers stall from just before the next slot of every job's grid (a
        few seconds: cron's 3 s, tick's) and ``instance`` stops just after it: its claims are
        in flight as its drain begins and answered within it (claim-only backends)."""
        now = self.sim.fleet.now_ms()
        instant = self.sim.next_instant(now)
        span = self.sim.more.choice((300, 800))

        def stall() -> None:
            self.away(
                "held", span, f"store stalls for {span}ms from the slot at {instant}", extend=True
            )

        def stop() -> None:
            if instance.alive:  # not killed nor stopped by another step meanwhile
                self.sim.stop(instance)

        self.sim.fleet.call_later(instant - now - 50, stall)
        self.sim.fleet.call_later(instant - now + 20, stop)

    def blip_as_a_run_completes(self, how: str) -> None:
        """The store away (``how``: held, down or locked) from just before the next run's end
        for less than lease_ttl (a release given up there let the completed slot run again)."""
        now = self.sim.fleet.now_ms()
        ends = [
            (run.key != "slow", run.start + self.sim.work_ms(run.key) - now)
            for run in self.sim.ledger.runs
            if run.end is None and run.key in self.sim.leased_keys
        ]
        ahead = [left for _, left in sorted(ends) if left > 100][:1]  # the slow job's first
        if not ahead:
            return
        span = self.sim.rng.choice((1500, 2400))

        def blip() -> None:
            self.away(how, span, f"store {how} for {span}ms as a run completes", extend=True)

        self.sim.fleet.call_later(ahead[0] - 100, blip)


#: How to inject each kind of fault of ``_sim_coverage.FAULTS`` now, on a given RNG (kinds a
#: fleet cannot meet while it runs, as an evicting Redis that no instance starts on, apart).
_INJECT: dict[str, Callable[[Faults, random.Random], None]] = {
    "kill -9": Faults._kill_one,
    "held": Faults.held,
    "down": Faults.down,
    "locked": Faults.locked,
    "flaky": Faults.flaky,
    "late answer": Faults.late_answers,
    "shed": Faults._shed,
    "clock step": Faults._step_one,
    "store clock": Faults.store_clock,
    "record deleted": lambda faults, _: faults.delete_record(),
    "stray queue": Faults.stray_queue,
}

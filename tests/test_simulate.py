"""The fleet simulator in CI: a fixed set of seeds, every backend, the invariants after every
step (``brokersched.testing.simulate``). ``make simulate SEEDS=N`` runs a longer soak; a seed
that fails here is replayed with ``make simulate SEED=<n>``."""

from __future__ import annotations

import pytest

from brokersched.testing.simulate import BACKENDS, simulate

# About 0.6 s a seed on this repository's idle 2-core machine (several times that under load):
# 4 x 12 seeds stay within CI's minute. One test a seed, so that a slow machine never runs one
# test past its timeout, and a failure names its seed.
SEEDS = range(12)


@pytest.mark.slow  # half a minute: `make test` runs it, `make test-fast` leaves it
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fleet_keeps_its_invariants(backend: str, seed: int) -> None:
    result = simulate(seed, backend=backend)
    replay = f"replay: make simulate SEED={seed} BACKEND={backend}"
    assert result.ok, "\n".join([*result.violations[:3], replay])


def test_a_seed_replays_the_same_run() -> None:
    first, again = simulate(7, backend="lease"), simulate(7, backend="lease")
    assert (first.log, first.runs) == (again.log, again.runs)
    assert first.runs > 20  # it does run jobs


def test_a_broken_invariant_is_reported_with_the_run() -> None:
    from brokersched.testing.simulate import Ledger, Run

    ledger = Ledger(lease=False)
    for instance in ("a", "b"):
        ledger.runs.append(Run("tick", 1000, "schedule", 1, instance, "allow", 1, 5, end=9))
    [found] = ledger.violations(now=10)
    assert found.startswith("slot tick:1000 ran 2 times")

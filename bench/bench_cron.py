"""How long the cron trigger takes to produce 10,000 fire times.

Run by hand: ``.venv/bin/python bench/bench_cron.py``. Each round builds a fresh trigger and
times ``next_runs(10_000, after)``; the best of three rounds is printed. A zone's transitions
are cached per process, so only the first round pays for finding them.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from brokersched.triggers.cron import parse_cron

FIRES = 10_000
ROUNDS = 3
AFTER = datetime(2027, 1, 1, tzinfo=UTC)
CASES = [
    ("* * * * *", "UTC"),
    ("*/5 * * * *", "Europe/Paris"),
    ("0 8 * * MON-FRI", "Europe/Paris"),
    ("0 0 L * *", "UTC"),
    ("*/10 * * * * *", "UTC"),
]


def best_seconds(expression: str, zone: str) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        trigger = parse_cron(expression, zone)
        started = time.perf_counter()
        runs = trigger.next_runs(FIRES, AFTER)
        best = min(best, time.perf_counter() - started)
        assert len(runs) == FIRES
    return best


def main() -> None:
    print(f"next_runs({FIRES:,}) after {AFTER.isoformat()}, best of {ROUNDS}")
    print(f"{'expression':<20} {'zone':<14} {'total ms':>10} {'µs/fire':>9}")
    for expression, zone in CASES:
        seconds = best_seconds(expression, zone)
        per_fire = seconds / FIRES * 1e6
        print(f"{expression:<20} {zone:<14} {seconds * 1e3:>10.1f} {per_fire:>9.2f}")


if __name__ == "__main__":
    main()

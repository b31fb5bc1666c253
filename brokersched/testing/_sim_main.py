"""``python -m brokersched.testing.simulate``: seeds run from the command line, their failures
and the coverage table printed (``Simulation`` and ``simulate`` are ``simulate``'s)."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from datetime import timedelta

from .._durations import format_duration
from ._sim_coverage import format_table, reachable, to_json
from .simulate import BACKENDS, simulate

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m brokersched.testing.simulate")
    parser.add_argument("--seed", type=int, help="replay one seed")
    parser.add_argument("--seeds", type=int, default=100, help="run seeds 0..N-1")
    parser.add_argument("--first", type=int, default=0, help="the first seed of --seeds")
    parser.add_argument("--backend", choices=BACKENDS, help="only this backend")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("-v", "--verbose", action="store_true", help="print each step")
    parser.add_argument(
        "--coverage", action=argparse.BooleanOptionalAction, default=None,
        help="print the coverage table, summed over the seeds (default: with --seeds)",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true", help="print the failures and the coverage as JSON"
    )
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    began, failed = time.monotonic(), []
    coverage: Counter[tuple[str, str]] = Counter()
    backends: set[str] = set()
    missed = unknown = 0
    say = (lambda _: None) if args.json else print
    for seed in seeds:
        result = simulate(seed, backend=args.backend, steps=args.steps)
        coverage.update(result.coverage)
        backends.add(result.backend)
        missed, unknown = missed + result.missed, unknown + result.unknown
        if args.verbose:
            say("\n".join(result.log))
        if not result.ok:
            failed.append(
                {"seed": seed, "backend": result.backend, "violations": result.violations}
            )
            say(f"seed {seed} ({result.backend}): FAILED")
            for violation in result.violations:
                say(f"  {violation}")
            say(f"  replay: make simulate SEED={seed}" + _flag(args.backend, args.steps))
    spent = format_duration(timedelta(seconds=round(time.monotonic() - began)))
    say(f"{len(seeds)} seeds, {len(failed)} failed, in {spent}")
    if args.json:
        print(json.dumps({"seeds": len(seeds), "failed": failed, "coverage": to_json(coverage)}))
    elif args.coverage or (args.coverage is None and args.seed is None):
        print(
            f"\ninteresting interleavings (operation x fault), over {', '.join(sorted(backends))}:"
        )
        print(format_table(coverage, reachable(backends)))
        print(
            f"missed slots: {missed} reported, each once, none that ran; {unknown} skipped by "
            "an instance that could not tell whether another one ran them"
        )
    return 1 if failed else 0


def _flag(backend: str | None, steps: int) -> str:
    flags = f" BACKEND={backend}" if backend else ""
    return flags + (f" STEPS={steps}" if steps != 120 else "")

"""A rolling deploy that changes a job's interval, as the README's Kubernetes section says it
goes: while old and new instances overlap both grids run; an instant on both runs once; a
lease backend's fencing does not stop it; nested grids add no run. Virtual time."""

from __future__ import annotations

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock


async def overlap(old: str, new: str) -> list[tuple[str, int]]:
    """(version, second of the minute) of each run while both versions run for 24 s."""
    clock = TestClock("2027-01-15T08:00:00+00:00")
    backend = MemoryBackend()  # a lease backend: claims are fenced
    runs: list[tuple[str, int]] = []

    def sync(ctx: JobContext) -> None:
        runs.append((ctx.instance_id, ctx.scheduled_at.second))

    before = Scheduler(backend, clock=clock, jitter=0, instance_id="old")
    after = Scheduler(backend, clock=clock, jitter=0, instance_id="new")
    before.every("sync", old, sync)
    after.every("sync", new, sync)
    async with before, after:
        await clock.advance("24s")
    return runs


async def test_both_grids_run_during_the_overlap() -> None:
    runs = await overlap("4s", "6s")
    assert runs == [
        ("old", 4), ("new", 6), ("old", 8),  # 3 runs in 4 s
        ("new", 12),  # on both grids: claimed once
        ("old", 16), ("new", 18), ("old", 20), ("new", 24),
    ]  # fmt: skip


async def test_nested_grids_keep_the_finer_rhythm() -> None:
    runs = await overlap("4s", "8s")
    assert [second for _, second in runs] == [4, 8, 12, 16, 20, 24]

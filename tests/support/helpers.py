"""Test doubles of the backend *contracts* (not of any broker) and small helpers."""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import IO, NoReturn

import pytest
from hypothesis import settings

from brokersched import JobContext, MemoryBackend
from brokersched._clock import Clock
from brokersched.abc import Capabilities, ClaimBackend, JobPolicy, RunRecord, Slot

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def missing(message: str) -> NoReturn:
    """Something a test needs is not installed: a failure in CI (it never skips), a skip
    elsewhere."""
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def faketime() -> str:
    """libfaketime's ``faketime`` command (``.ci/run`` installs it)."""
    found = shutil.which("faketime")
    if found is None:
        missing("faketime is needed: apt-get install faketime")
    return found


class DictClaimBackend(ClaimBackend):
    """The claim contract over a dict shared by a "fleet"; optionally slow or failing."""

    def __init__(
        self,
        claims: dict[str, str] | None = None,
        *,
        slot_ttl: timedelta = timedelta(minutes=5),
        claim_delay_s: float = 0.0,
        fail: Exception | None = None,
    ) -> None:
        super().__init__()
        self.claims = claims if claims is not None else {}
        self.records: dict[str, list[RunRecord]] = {}
        self.slot_ttl = slot_ttl
        self.claim_delay_s = claim_delay_s
        self.fail = fail
        self.prepared: list[str] = []
        self.timeouts: list[float] = []  # the deadline of every claim, as the scheduler gave it
        self._clock: Clock | None = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            leases=False, slot_memory=self.slot_ttl, history_ttl=False, history_size_per_job=True
        )

    async def _open(self, clock: Clock) -> None:
        self._clock = clock

    async def _close(self) -> None:
        self._clock = None

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        self.prepared += [job.name for job in jobs]

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        self.timeouts.append(timeout)
        if self.claim_delay_s and self._clock is not None:
            await self._clock.sleep(self.claim_delay_s)
        if self.fail is not None:
            raise self.fail
        if slot.key in self.claims:
            return False
        self.claims[slot.key] = instance_id
        return True

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        self.records.setdefault(job.name, []).insert(0, record)
        del self.records[job.name][job.history_size :]

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return self.records.get(job.name, [])[:limit]


class BatchNotingMemory(MemoryBackend):
    """A MemoryBackend for the tests of a batch call (``acquire_many``, ``release_many``) that
    its subclass overrides: ``batches``, the jobs of each batch call; ``singles``, the job of
    each call of its one-lease twin; ``fail``, the job whose part of a batch fails; ``down``,
    every batch call fails."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []
        self.singles: list[str] = []
        self.fail: str | None = None
        self.down = False


def read_until(stream: IO[str], text: str, *, timeout: float) -> str:
    """Read ``stream`` (a child's output) line by line until a line holds ``text``; return what
    was read. Fails, with the output so far, if the stream ends or ``timeout`` passes first."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
            if text in line:
                return
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise AssertionError(f"{text!r} not seen within {timeout}s:\n{''.join(seen)}") from None
        if line is None:
            raise AssertionError(f"output ended before {text!r}:\n{''.join(seen)}")
        seen.append(line)
        if text in line:
            return "".join(seen)


class Runs:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, datetime]] = []  # (instance, job, reason, slot)

    async def __call__(self, ctx: JobContext) -> None:
        self.seen.append((ctx.instance_id, ctx.job, ctx.reason, ctx.scheduled_at))

    def of(self, job: str) -> list[tuple[str, str, datetime]]:
        return [(i, r, at) for i, j, r, at in self.seen if j == job]


class SlotRuns:
    """A handler noting (instance, job, slot) of each run."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []  # (instance, job, slot)

    async def __call__(self, ctx: JobContext) -> None:
        self.seen.append((ctx.instance_id, ctx.job, ctx.slot_ms))


def examples(count: int) -> int:
    """A property test's ``max_examples``, scaled by the Hypothesis profile in force: ``count``
    under the default and CI profiles (100 examples), a fifth under ``make test-fast``'s."""
    return max(10, count * settings.default.max_examples // 100)

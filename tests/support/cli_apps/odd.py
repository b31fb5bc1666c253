"""Things that are not what the CLI needs, and a factory that is."""

from __future__ import annotations

from brokersched import MemoryBackend, Scheduler

answer = 42


def make_scheduler() -> Scheduler[MemoryBackend]:
    return Scheduler(jitter=0)


def needs_settings(settings: dict[str, str]) -> Scheduler[MemoryBackend]:
    return Scheduler(jitter=0)


def broken_factory() -> Scheduler[MemoryBackend]:
    return Scheduler(jitter="soon")  # ConfigurationError when called, not at import

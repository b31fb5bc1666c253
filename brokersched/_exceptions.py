"""The exceptions brokersched raises.

    BrokerschedError
    ├── ConfigurationError (also a ValueError)   bad options, names, schedules: at registration
    ├── BackendError                             a backend could not answer
    │   ├── BackendUnavailableError              ... because it cannot be reached
    │   └── ClockSkewError                       ... or refused a slot ahead of its clock

Client exceptions (aio-pika, nats-py, redis-py, asyncpg, aiosqlite) are translated at one
boundary in each backend, by its table for ``backends/_errors.py``, and chained with ``raise ...
from exc``; an exception no table names (a bug) is raised unchanged.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "BrokerschedError",
    "ClockSkewError",
    "ConfigurationError",
]


class BrokerschedError(Exception):
    """The root of every error brokersched raises on purpose."""


class ConfigurationError(BrokerschedError, ValueError):
    """A job, schedule or option that cannot work as given.

    ``option`` names the offending option (or ``None`` for the schedule itself), ``backend`` the
    backend class that refused it (or ``None`` when no backend is involved), ``job`` the job name.
    """

    def __init__(
        self,
        message: str,
        *,
        option: str | None = None,
        backend: str | None = None,
        job: str | None = None,
    ) -> None:
        super().__init__(message)
        self.option = option
        self.backend = backend
        self.job = job
        # every problem found with the same job, this one first (see Scheduler.check())
        self.all_errors: list[ConfigurationError] = [self]


class BackendError(BrokerschedError):
    """The backend failed to answer a request; the scheduler fails closed (skips the slot)."""


class BackendUnavailableError(BackendError):
    """The backend cannot be reached (connection refused, lost, or timed out)."""


class ClockSkewError(BackendError):
    """A lease backend refused a claim for a slot further ahead of its own clock (the store's:
    the database's, Redis's, the host's for SQLite) than ``max_clock_skew``. The slot is
    skipped (``clock-skew``).

    ``moved`` says which clock the instance found had moved since its last accepted claim:
    ``"instance"`` (its own wall clock stepped forward), ``"store"`` (the store's clock stepped
    back while this instance's kept time), or ``None`` when it cannot tell; the message says
    the same in words.
    """

    def __init__(
        self,
        message: str,
        *,
        slot_ms: int,
        ahead_ms: int,
        moved: Literal["instance", "store"] | None = None,
    ) -> None:
        super().__init__(message)
        self.slot_ms = slot_ms
        self.ahead_ms = ahead_ms
        self.moved = moved

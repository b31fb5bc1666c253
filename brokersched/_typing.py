"""The keyword options of ``every``/``cron``/``at``, per kind of backend, for type checkers.

``Scheduler`` overloads its registration methods on its backend type: a lease backend accepts
``LeaseEveryOptions``, any other backend only ``ClaimEveryOptions``, so mypy and pyright refuse
``overlap=`` on a ``Scheduler[RabbitMQBackend]`` before the code runs. At run time the same rules
are checked again from the backend's capabilities.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from ._durations import Duration
from ._retry import Retry

__all__ = [
    "AfterOptions",
    "ClaimAtOptions",
    "ClaimCronOptions",
    "ClaimEveryOptions",
    "LeaseAtOptions",
    "LeaseCronOptions",
    "LeaseEveryOptions",
]


class ClaimAtOptions(TypedDict, total=False):
    """Options every backend accepts."""

    jitter: Duration
    max_late: Duration
    timeout: Duration
    history_size: int
    history_ttl: Duration
    data: Any
    claim: bool
    key: str
    retry: Retry


class ClaimEveryOptions(ClaimAtOptions, total=False):
    offset: Duration
    run_on_start: bool


class ClaimCronOptions(ClaimAtOptions, total=False):
    timezone: str
    dst: Literal["skip", "run-once", "run-twice"]
    run_on_start: bool


class AfterOptions(TypedDict, total=False):
    """``after()`` on any backend: it runs once, so no jitter, lateness or lease options."""

    timeout: Duration
    history_size: int
    history_ttl: Duration
    data: Any
    claim: bool
    key: str
    retry: Retry


class LeaseAtOptions(ClaimAtOptions, total=False):
    """``at()`` on a lease backend: no ``overlap``, a one-off job has no previous run."""

    max_attempts: int
    catch_up: Duration


class LeaseEveryOptions(LeaseAtOptions, total=False):
    overlap: Literal["skip", "allow", "replace"]
    offset: Duration
    run_on_start: bool


class LeaseCronOptions(LeaseAtOptions, total=False):
    overlap: Literal["skip", "allow", "replace"]
    timezone: str
    dst: Literal["skip", "run-once", "run-twice"]
    run_on_start: bool

"""brokersched: scheduled jobs on every instance, each slot run on exactly one.

The network backends are imported on first use, so that ``import brokersched`` needs none of the
optional extras (aio-pika, nats-py, redis-py, asyncpg, aiosqlite).
"""

from typing import TYPE_CHECKING

from ._clock import Clock, SystemClock, Timer
from ._context import JobContext
from ._durations import parse_duration
from ._events import (
    ClaimEvent,
    MissedEvent,
    RecordDroppedEvent,
    RunEvent,
    SkipEvent,
    StartEvent,
)
from ._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ClockSkewError,
    ConfigurationError,
)
from ._options import JobOptions, JobSettings
from ._retry import Retry
from ._scheduler import Job, Scheduler
from ._scheduler import use_default_backend as _use_default_backend
from ._schedules import ScheduleConflictError, Schedules
from ._stored import StoredSchedule
from ._thread import SchedulerThread
from .abc import ControlChange, Instance, JobControl, RunInProgress, RunRecord
from .backends.memory import MemoryBackend
from .triggers.cron import parse_cron

if TYPE_CHECKING:
    from ._metrics import PrometheusMetrics
    from .backends.nats import NATSBackend, NATSLeaseBackend
    from .backends.postgres import PostgresBackend
    from .backends.rabbitmq import RabbitMQBackend
    from .backends.redis import RedisBackend, RedisLeaseBackend
    from .backends.sqlite import SQLiteBackend

__version__ = "0.1.0.dev0"

# The public layer's choice: Scheduler() without a backend runs on the embedded MemoryBackend.
_use_default_backend(MemoryBackend)

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "BrokerschedError",
    "ClaimEvent",
    "Clock",
    "ClockSkewError",
    "ConfigurationError",
    "ControlChange",
    "Instance",
    "Job",
    "JobContext",
    "JobControl",
    "JobOptions",
    "JobSettings",
    "MemoryBackend",
    "MissedEvent",
    "NATSBackend",
    "NATSLeaseBackend",
    "PostgresBackend",
    "PrometheusMetrics",
    "RabbitMQBackend",
    "RecordDroppedEvent",
    "RedisBackend",
    "RedisLeaseBackend",
    "Retry",
    "RunEvent",
    "RunInProgress",
    "RunRecord",
    "SQLiteBackend",
    "ScheduleConflictError",
    "Scheduler",
    "SchedulerThread",
    "Schedules",
    "SkipEvent",
    "StartEvent",
    "StoredSchedule",
    "SystemClock",
    "Timer",
    "parse_cron",
    "parse_duration",
]

_LAZY = {
    "NATSBackend": ".backends.nats",
    "NATSLeaseBackend": ".backends.nats",
    "PostgresBackend": ".backends.postgres",
    "PrometheusMetrics": "._metrics",
    "RabbitMQBackend": ".backends.rabbitmq",
    "RedisBackend": ".backends.redis",
    "RedisLeaseBackend": ".backends.redis",
    "SQLiteBackend": ".backends.sqlite",
}


def __getattr__(name: str) -> object:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'brokersched' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module, __name__), name)
    value.__module__ = __name__
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


# Public objects say where users import them from: brokersched.Scheduler, not
# brokersched._scheduler.Scheduler (in reprs, tracebacks and documentation).
for _name in __all__:
    if _name not in _LAZY:
        globals()[_name].__module__ = __name__
del TYPE_CHECKING, _name, _use_default_backend

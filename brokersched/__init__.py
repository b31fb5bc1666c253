"""brokersched: scheduled jobs on every instance, each slot run on exactly one.

The network backends are imported on first use, so that ``import brokersched`` needs none of the
optional extras (aio-pika, nats-py, asyncpg, aiosqlite).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._context import JobContext
from ._durations import parse_duration
from ._events import RunEvent, SkipEvent, StartEvent
from ._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ConfigurationError,
    LeaseLostError,
)
from ._job import Job
from ._scheduler import Scheduler
from .abc import RunRecord
from .backends.memory import MemoryBackend
from .triggers.cron import parse_cron

if TYPE_CHECKING:
    from ._metrics import PrometheusMetrics
    from .backends.nats import NATSBackend
    from .backends.postgres import PostgresBackend
    from .backends.rabbitmq import RabbitMQBackend
    from .backends.sqlite import SQLiteBackend

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "BrokerschedError",
    "ConfigurationError",
    "Job",
    "JobContext",
    "LeaseLostError",
    "MemoryBackend",
    "NATSBackend",
    "PostgresBackend",
    "PrometheusMetrics",
    "RabbitMQBackend",
    "RunEvent",
    "RunRecord",
    "SQLiteBackend",
    "Scheduler",
    "SkipEvent",
    "StartEvent",
    "parse_cron",
    "parse_duration",
]

_LAZY = {
    "NATSBackend": ".backends.nats",
    "PostgresBackend": ".backends.postgres",
    "PrometheusMetrics": "._metrics",
    "RabbitMQBackend": ".backends.rabbitmq",
    "SQLiteBackend": ".backends.sqlite",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'brokersched' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)

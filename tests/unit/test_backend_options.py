"""Every backend's options are one declared model, checked in one call at construction: a
value the model refuses reads the same on every backend, and a check of a backend's own keeps
its message; constructing never connects."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from brokersched import ConfigurationError
from brokersched.backends.memory import MemoryBackend
from brokersched.backends.nats import NATSBackend, NATSLeaseBackend
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.rabbitmq import RabbitMQBackend
from brokersched.backends.redis import RedisBackend, RedisLeaseBackend
from brokersched.backends.sqlite import SQLiteBackend

# Nothing listens on port 9: a constructor that connected would fail or hang.
_NOWHERE = {
    RabbitMQBackend: "amqp://guest:s3cret@127.0.0.1:9/",
    NATSBackend: "nats://127.0.0.1:9",
    NATSLeaseBackend: "nats://127.0.0.1:9",
    RedisBackend: "redis://:s3cret@127.0.0.1:9/0",
    RedisLeaseBackend: "redis://:s3cret@127.0.0.1:9/0",
    PostgresBackend: "postgresql://u:s3cret@127.0.0.1:9/db",
}


def _make(cls: type, tmp_path: Path, **options: Any) -> Any:
    if cls is MemoryBackend:
        return cls(**options)
    if cls is SQLiteBackend:
        return cls(tmp_path / "x.db", **options)
    return cls(_NOWHERE[cls], **options)


@pytest.mark.parametrize(
    ("cls", "option", "value", "reason"),
    [
        (RabbitMQBackend, "channels", 0, "greater than or equal to 1"),
        (RabbitMQBackend, "channels", True, "a valid integer"),
        (NATSBackend, "replicas", 6, "less than or equal to 5"),
        (NATSLeaseBackend, "replicas", "3", "a valid integer"),
        (PostgresBackend, "min_size", "one", "a valid integer"),
    ],
    ids=lambda v: getattr(v, "__name__", repr(v)),
)
def test_a_value_the_model_refuses_reads_the_same_on_every_backend(
    cls: type, option: str, value: object, reason: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _make(cls, tmp_path, **{option: value})
    message = str(caught.value)
    assert message.startswith(f"{cls.__name__}: option '{option}' = {value!r} is invalid: ")
    assert reason in message
    assert (caught.value.option, caught.value.backend) == (option, cls.__name__)


BACKENDS = [
    MemoryBackend,
    SQLiteBackend,
    PostgresBackend,
    RedisBackend,
    RedisLeaseBackend,
    NATSBackend,
    NATSLeaseBackend,
    RabbitMQBackend,
]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("option", ["ttl", "max_clock_skew"])
def test_the_shared_options_are_checked_alike(cls: type, option: str, tmp_path: Path) -> None:
    if option == "ttl":
        option = "lease_ttl" if "lease_ttl" in inspect.signature(cls).parameters else "slot_ttl"
    with pytest.raises(ConfigurationError) as caught:
        _make(cls, tmp_path, **{option: "soon"})
    assert str(caught.value).startswith(f"{option} 'soon' is not a duration")
    assert str(caught.value).endswith(f"({cls.__name__})")
    assert (caught.value.option, caught.value.backend) == (option, cls.__name__)


@pytest.mark.parametrize(
    ("cls", "option", "value"),
    [
        (RabbitMQBackend, "prefix", "my.app"),
        (RedisBackend, "prefix", "a b"),
        (NATSBackend, "prefix", "a.b"),
        (NATSLeaseBackend, "bucket", "a.b"),
        (SQLiteBackend, "table_prefix", "1x"),
        (PostgresBackend, "schema", "no-dashes"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_a_name_is_refused_naming_the_value_and_the_backend(
    cls: type, option: str, value: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _make(cls, tmp_path, **{option: value})
    assert str(caught.value).startswith(f"{option} {value!r} of {cls.__name__} must be ")
    assert (caught.value.option, caught.value.backend) == (option, cls.__name__)


def test_the_checked_values_are_the_backends() -> None:
    backend = NATSBackend(_NOWHERE[NATSBackend], replicas=3, budget_interval=None)
    assert backend.capabilities.slot_memory is not None
    assert RabbitMQBackend(_NOWHERE[RabbitMQBackend], slot_ttl=90).slot_ttl.total_seconds() == 90

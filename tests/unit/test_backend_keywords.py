"""Every backend's constructor refuses an unknown keyword at construction, with a did-you-mean
among its own options and those its client library accepts; constructing never connects."""

from __future__ import annotations

import sys
from collections.abc import Callable
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
    "RabbitMQBackend": "amqp://guest:s3cret@127.0.0.1:9/",
    "NATSBackend": "nats://127.0.0.1:9",
    "NATSLeaseBackend": "nats://127.0.0.1:9",
    "RedisBackend": "redis://:s3cret@127.0.0.1:9/0",
    "RedisLeaseBackend": "redis://:s3cret@127.0.0.1:9/0",
    "PostgresBackend": "postgresql://u:s3cret@127.0.0.1:9/db",
}


def _make(cls: type, tmp_path: Path, **options: Any) -> Any:
    if cls is MemoryBackend:
        return cls(**options)
    if cls is SQLiteBackend:
        return cls(tmp_path / "x.db", **options)
    return cls(_NOWHERE[cls.__name__], **options)


OWN_TYPOS: list[tuple[type, str, str]] = [
    (RabbitMQBackend, "slot_tll", "slot_ttl"),
    (NATSBackend, "slot_tll", "slot_ttl"),
    (NATSLeaseBackend, "bukket", "bucket"),
    (RedisBackend, "prefx", "prefix"),
    (RedisLeaseBackend, "lease_tll", "lease_ttl"),
    (PostgresBackend, "lease_tll", "lease_ttl"),
    (SQLiteBackend, "busy_timout", "busy_timeout"),
    (MemoryBackend, "lease_tll", "lease_ttl"),
]


@pytest.mark.parametrize(
    ("cls", "typo", "meant"), OWN_TYPOS, ids=lambda v: getattr(v, "__name__", v)
)
def test_a_misspelt_option_is_refused_with_a_did_you_mean(
    cls: type, typo: str, meant: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _make(cls, tmp_path, **{typo: "10m"})
    message = str(caught.value)
    assert message.startswith(f"{cls.__name__}: unknown keyword '{typo}'"), message
    assert f"did you mean '{meant}'?" in message
    assert caught.value.backend == cls.__name__
    assert caught.value.option == typo
    assert "s3cret" not in message and "10m" not in message  # neither a secret nor the value


PASS_THROUGH_TYPOS: list[tuple[type, str, str, dict[str, Any]]] = [
    (RabbitMQBackend, "reconect_interval", "reconnect_interval", {"reconnect_interval": 2}),
    (RabbitMQBackend, "heartbaet", "heartbeat", {"heartbeat": 5, "ssl_context": None}),
    (NATSBackend, "reconect_time_wait", "reconnect_time_wait", {"reconnect_time_wait": 1}),
    (NATSBackend, "user_credential", "user_credentials", {"user_credentials": "x.creds"}),
    (NATSLeaseBackend, "reconect_time_wait", "reconnect_time_wait", {"reconnect_time_wait": 1}),
    (RedisBackend, "max_conections", "max_connections", {"max_connections": 3}),
    (RedisLeaseBackend, "ssl_ca_cert", "ssl_ca_certs", {"ssl_ca_certs": "ca.pem"}),
]


@pytest.mark.parametrize(
    ("cls", "typo", "meant", "valid"), PASS_THROUGH_TYPOS, ids=lambda v: getattr(v, "__name__", v)
)
def test_a_misspelt_client_keyword_is_refused_and_a_real_one_accepted(
    cls: type, typo: str, meant: str, valid: dict[str, Any], tmp_path: Path
) -> None:
    _make(cls, tmp_path, **valid)  # what the client library accepts passes, unconnected
    with pytest.raises(ConfigurationError) as caught:
        _make(cls, tmp_path, **{typo: 1})
    assert f"did you mean '{meant}'?" in str(caught.value)
    assert "must be ones it accepts" in str(caught.value)


def test_redis_cluster_keywords_are_the_cluster_clients() -> None:
    RedisBackend("redis://127.0.0.1:9", cluster=True, read_from_replicas=True)
    with pytest.raises(ConfigurationError, match="did you mean 'read_from_replicas'"):
        RedisBackend("redis://127.0.0.1:9", cluster=True, read_from_replica=True)
    with pytest.raises(ConfigurationError, match="unknown keyword 'read_from_replicas'"):
        RedisBackend("redis://127.0.0.1:9", read_from_replicas=True)  # Redis has no replicas


@pytest.mark.parametrize(
    ("make", "keyword"),
    [
        (lambda: RabbitMQBackend(connection_class=object), "connection_class"),
    ],
)
def test_a_keyword_the_backend_sets_itself_is_refused(
    make: Callable[[], object], keyword: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"keyword '{keyword}' cannot be given"):
        make()


def test_without_the_client_library_its_keywords_wait_for_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "aio_pika", None)  # import aio_pika -> ImportError
    RabbitMQBackend("amqp://127.0.0.1:9/", heartbeat=5)
    with pytest.raises(ConfigurationError, match="did you mean 'slot_ttl'"):
        RabbitMQBackend("amqp://127.0.0.1:9/", slot_tll="10m")  # its own are still checked


@pytest.mark.parametrize(
    "keyword",
    ["connection_class", "parser_class", "encoder_class", "socket_type", "path", "timeout"],
)
def test_redis_keywords_handed_on_to_its_pool_and_connections_are_accepted(keyword: str) -> None:
    """``Redis.from_url`` hands keywords it does not name to its connection pool and
    connection class: they worked before keywords were checked, and must still."""
    import redis.asyncio

    value: object = redis.asyncio.SSLConnection if keyword == "connection_class" else None
    from brokersched import RedisBackend, RedisLeaseBackend

    RedisBackend("redis://127.0.0.1", **{keyword: value})
    RedisLeaseBackend("redis://127.0.0.1", **{keyword: value})

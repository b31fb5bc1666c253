"""The fixtures of the RabbitMQ backend tests: a prefix of the test's own, the queues it
touched (deleted afterwards), ``make`` (an unstarted backend) and ``fleet`` (a started one); the
private nodes (``private_rabbitmq_of_run``: one of the run's broker's line)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from brokersched.backends.rabbitmq import (
    RabbitMQBackend,
)
from tests.support.names import unique
from tests.support.private_rabbitmq import (
    private_rabbitmq,
    private_rabbitmq4,
    private_rabbitmq_of_run,
)
from tests.support.rabbitmq_helpers import (
    CLOCK,
    TrackedBackend,
    delete_queues,
)

__all__ = ["private_rabbitmq", "private_rabbitmq4", "private_rabbitmq_of_run"]


@pytest.fixture
def prefix() -> str:
    return unique("t")


@pytest.fixture
async def touched(amqp_url: str) -> AsyncIterator[set[str]]:
    names: set[str] = set()
    yield names
    await delete_queues(amqp_url, names)


@pytest.fixture
def make(amqp_url: str, prefix: str, touched: set[str]) -> Callable[..., RabbitMQBackend]:
    """``make(**options)``: a new unstarted backend of this test's fleet."""

    def factory(url: str | None = None, **options: Any) -> RabbitMQBackend:
        options.setdefault("prefix", prefix)
        options.setdefault("slot_ttl", "1m")
        return TrackedBackend(url or amqp_url, touched=touched, **options)

    return factory


@pytest.fixture
async def fleet(make: Callable[..., RabbitMQBackend]) -> AsyncIterator[Callable[..., Any]]:
    """``await fleet(**options)``: a started backend, stopped after the test."""
    started: list[RabbitMQBackend] = []

    async def start(url: str | None = None, **options: Any) -> RabbitMQBackend:
        backend = make(url, **options)
        await backend.start(CLOCK)
        started.append(backend)
        return backend

    yield start
    await asyncio.gather(*(backend.stop() for backend in started))

"""RabbitMQBackend passes the public claim conformance suite against the real broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched._clock import Clock
from brokersched.backends.rabbitmq import RabbitMQBackend
from brokersched.testing import TestClock
from brokersched.testing.conformance import SLOT, ClaimBackendSuite
from tests.support.conformance import in_run
from tests.support.rabbitmq_helpers import TrackedBackend, delete_queues


class TestRabbitMQConformance(ClaimBackendSuite[RabbitMQBackend]):
    @pytest.fixture(autouse=True)
    async def _broker(self, amqp_url: str) -> AsyncIterator[None]:
        # AMQP cannot list queues: the backends note the names they touch, deleted after
        self._url = amqp_url
        self._touched: set[str] = set()
        yield
        await delete_queues(amqp_url, self._touched)

    def make_clock(self) -> Clock:
        # The suite's slots fell due in 2023; RabbitMQBackend refuses a claim older than its
        # slot memory (the broker may have forgotten it): claim them when they are fresh.
        return TestClock(datetime.fromtimestamp(SLOT / 1000, UTC))

    def make_backend(self, namespace: str, **options: Any) -> RabbitMQBackend:
        # Claims racing on a loaded machine wait for a free channel longer than the default
        # claim_timeout's quarter, which sheds them (tested in test_rabbitmq_backend.py): here
        # only the claims' outcomes are judged.
        options.setdefault("claim_timeout", "20s")
        return TrackedBackend(self._url, prefix=in_run(namespace), touched=self._touched, **options)

"""The claim-contract double the scheduler tests use (``tests.support.helpers.DictClaimBackend``)
is held to the same claim conformance suite as RabbitMQ and NATS, so that what it proves holds
for them."""

from __future__ import annotations

from typing import Any, ClassVar

from brokersched import Clock
from brokersched.testing import TestClock
from brokersched.testing.conformance import ClaimBackendSuite
from tests.support.helpers import DictClaimBackend


class TestDictClaimBackend(ClaimBackendSuite[DictClaimBackend]):
    claims: ClassVar[dict[str, dict[str, str]]] = {}

    def make_backend(self, namespace: str, **options: Any) -> DictClaimBackend:
        return DictClaimBackend(self.claims.setdefault(namespace, {}), **options)

    def make_clock(self) -> Clock:
        return TestClock()

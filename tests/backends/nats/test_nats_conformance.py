"""NATSBackend passes the public claim-backend conformance suite on the real NATS server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from brokersched.backends.nats import NATSBackend
from brokersched.testing.conformance import ClaimBackendSuite
from tests.support.conformance import in_run
from tests.support.nats_helpers import delete_streams

# Against both NATS servers, 2.9 and the current one (tests/support/servers.py).
pytestmark = pytest.mark.nats_servers


class TestNATSBackend(ClaimBackendSuite[NATSBackend]):
    url = ""
    namespaces: set[str]

    @pytest_asyncio.fixture(autouse=True)
    async def _server(self, nats_url: str) -> AsyncIterator[None]:
        """Remember the server for make_backend; remove the test's streams afterwards."""
        self.url, self.namespaces = nats_url, set()
        yield
        for namespace in self.namespaces:
            await delete_streams(nats_url, namespace)

    def make_backend(self, namespace: str, **options: Any) -> NATSBackend:
        namespace = in_run(namespace)
        self.namespaces.add(namespace)
        return NATSBackend(self.url, prefix=namespace, **options)

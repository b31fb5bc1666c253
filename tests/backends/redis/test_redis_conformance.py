"""RedisBackend and RedisLeaseBackend pass the public conformance suites, on the Redis server
of ``redis_url`` and on a 3-master Redis Cluster started for the session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import pytest_asyncio

from brokersched.backends.redis import RedisBackend, RedisLeaseBackend
from brokersched.testing.conformance import ClaimBackendSuite, LeaseBackendSuite
from tests.support.conformance import StoreClockElapse, in_run
from tests.support.redis_helpers import delete_keys, redis_cluster_url

__all__ = ["redis_cluster_url"]  # the session fixture, used here


class _OnServer:
    url = ""
    cluster = False
    prefixes: set[str]

    @pytest_asyncio.fixture(autouse=True)
    async def _server(self, redis_url: str) -> AsyncIterator[None]:
        """Remember the server for make_backend; delete the test's keys afterwards."""
        self.url, self.prefixes = redis_url, set()
        yield
        for prefix in self.prefixes:
            await delete_keys(self.url, prefix, cluster=self.cluster)


class _OnCluster(_OnServer):
    cluster = True

    @pytest_asyncio.fixture(autouse=True)
    async def _server(self, redis_cluster_url: str) -> AsyncIterator[None]:  # type: ignore[override]
        self.url, self.prefixes = redis_cluster_url, set()
        yield
        for prefix in self.prefixes:
            await delete_keys(self.url, prefix, cluster=True)


class TestRedisClaims(_OnServer, ClaimBackendSuite[RedisBackend]):
    def make_backend(self, namespace: str, **options: Any) -> RedisBackend:
        namespace = in_run(namespace)
        self.prefixes.add(namespace)
        return RedisBackend(self.url, prefix=namespace, cluster=self.cluster, **options)


class TestRedisLeases(StoreClockElapse, _OnServer, LeaseBackendSuite[RedisLeaseBackend]):
    def make_backend(self, namespace: str, **options: Any) -> RedisLeaseBackend:
        namespace = in_run(namespace)
        self.prefixes.add(namespace)
        backend = RedisLeaseBackend(self.url, prefix=namespace, cluster=self.cluster, **options)
        return self.built(backend)  # type: ignore[no-any-return]

    async def set_store_time(self, backends: Sequence[RedisLeaseBackend], now_ms: int) -> None:
        for backend in backends:
            backend.store_time = now_ms


class TestRedisClusterClaims(_OnCluster, TestRedisClaims):
    pass


class TestRedisClusterLeases(_OnCluster, TestRedisLeases):
    # The random programs run a hundred examples on a 3-master cluster: about a minute, over
    # the suite's 120 s (a bound for hangs) on a machine under CPU stress.
    pytestmark = pytest.mark.timeout(600)

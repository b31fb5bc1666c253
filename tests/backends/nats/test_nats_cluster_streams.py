"""``replicas`` against the server and an existing stream, on the machine's
single NATS server: a replicated stream it cannot have fails ``start()`` with one
``ConfigurationError`` naming the stream, both counts and what to do. Raising an existing
stream's count on a real cluster is in tests/cluster/test_nats_cluster.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from brokersched import ConfigurationError
from brokersched._clock import SystemClock
from brokersched.backends.nats import NATSBackend
from brokersched.backends.nats._names import Names
from brokersched.backends.nats._stream_settings import claims_config
from tests.support.names import unique
from tests.support.nats_helpers import create_stream, delete_streams, stream_config

# Against both NATS servers, 2.9 and the current one (tests/support/servers.py).
pytestmark = pytest.mark.nats_servers

CLOCK = SystemClock()


@pytest.fixture
async def prefix(nats_url: str) -> AsyncIterator[str]:
    name = unique()
    yield name
    await delete_streams(nats_url, name)


async def test_replicas_a_single_server_cannot_have_are_refused_at_start(
    nats_url: str, prefix: str
) -> None:
    backend = NATSBackend(nats_url, prefix=prefix, replicas=3)
    with pytest.raises(ConfigurationError) as caught:
        await backend.start(CLOCK)
    message = str(caught.value)
    assert caught.value.option == "replicas"
    assert f"'{prefix}-claims' with 3 replicas" in message
    assert "non-clustered" in message  # NATS's own answer
    assert "at least 3 JetStream servers" in message and "pass replicas=1" in message


async def test_an_existing_stream_with_fewer_replicas_is_refused_when_it_cannot_grow(
    nats_url: str, prefix: str
) -> None:
    from datetime import timedelta

    await create_stream(nats_url, claims_config(Names(prefix), timedelta(minutes=5), 1))
    backend = NATSBackend(nats_url, prefix=prefix, replicas=3)
    with pytest.raises(ConfigurationError) as caught:
        await backend.start(CLOCK)
    message = str(caught.value)
    assert caught.value.option == "replicas"
    assert f"'{prefix}-claims' has num_replicas 1, fewer than replicas=3" in message
    assert f"nats stream edit {prefix}-claims --replicas 3" in message
    assert "pass replicas=1" in message
    assert (await stream_config(nats_url, f"{prefix}-claims")).num_replicas == 1
    # What the message says to do on one server works:
    fixed = NATSBackend(nats_url, prefix=prefix, replicas=1)
    await fixed.start(CLOCK)
    await fixed.stop()

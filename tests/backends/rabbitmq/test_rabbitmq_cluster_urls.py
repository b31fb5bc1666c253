"""RabbitMQBackend given the URLs of several nodes: it starts on the first node that
answers and, once connected, moves to the next node when its connection is lost. Here the
"nodes" are TCP proxies in front of the one local broker, so a node can be cut off in one step;
tests/cluster/test_rabbitmq_cluster.py does the same on a real cluster. Both behaviour tests
fail on a backend that takes one URL (or keeps reconnecting to the first).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from brokersched import ConfigurationError
from brokersched.abc import Slot
from tests.support.rabbitmq_helpers import SLOT, claim, resumed, via
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import until

# The single-broker tests' fixtures: a started backend of a fresh prefix, stopped after the test.


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ([], "an empty list"),
        ("not-a-url", "'not-a-url'"),
        (["amqp://a/", "http://b/"], "'http://b/'"),
        (["amqp://a/", 5], "5"),
        (5, "int"),
    ],
)
def test_bad_url_lists_are_refused_naming_the_value(url: Any, named: str) -> None:
    from brokersched import RabbitMQBackend

    with pytest.raises(ConfigurationError, match="url") as caught:
        RabbitMQBackend(url)
    assert named in str(caught.value)
    assert caught.value.option == "url"


def test_the_repr_shows_every_node_without_passwords() -> None:
    from brokersched import RabbitMQBackend

    backend = RabbitMQBackend(["amqp://u:secret@n1/", "amqp://u:secret@n2/"])
    assert "n1" in repr(backend) and "n2" in repr(backend)
    assert "secret" not in repr(backend)


async def test_start_uses_the_first_node_that_answers(
    fleet: Callable[..., Any], amqp_url: str
) -> None:
    backend = await fleet([via(amqp_url, closed_port()), amqp_url])
    assert await claim(backend, Slot("job", SLOT)) is True


async def test_a_lost_connection_moves_to_the_next_node(
    fleet: Callable[..., Any], amqp_url: str
) -> None:
    parts = urlsplit(amqp_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5672
    async with TcpProxy(host, port) as one, TcpProxy(host, port) as two:
        backend = await fleet([via(amqp_url, one.port), via(amqp_url, two.port)])
        assert await claim(backend, Slot("job", SLOT)) is True
        assert two.accepted == 0
        await one.cut()  # node 1 gone for good: resets every link, refuses new ones
        took = await until(resumed(backend), timeout=10, what="claims through node 2")
        assert two.accepted >= 1
        print(f"claims resumed through the next node {took:.1f} s after the cut")

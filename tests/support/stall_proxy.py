"""A TCP proxy on 127.0.0.1 whose links can be *stalled*: a partition, not a failure.

    async with StallProxy(5432) as proxy:
        dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/test"
        ...
        proxy.stall()    # what either side sends is held: nothing delivered, no reset
        proxy.resume()   # what was held is delivered (a slow link, not a lost one)

Unlike ``TcpProxy.cut()`` (a reset the client sees at once), a stall is what a dropped packet
path looks like: the client's socket stays open and its reads wait for ever. New connections
are accepted during a stall (their bytes are held too), like a SYN that gets through. The
stalling is ``TcpProxy``'s (``stall_after_downstream`` too).
"""

from __future__ import annotations

from tests.support.tcp_proxy import TcpProxy

__all__ = ["StallProxy"]


class StallProxy(TcpProxy):
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:target_port``."""

    def __init__(self, target_port: int) -> None:
        super().__init__("127.0.0.1", target_port)

"""A TCP proxy on 127.0.0.1 whose links can be *stalled*: a partition, not a failure.

    async with StallProxy(5432) as proxy:
        dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/test"
        ...
        proxy.stall()    # what either side sends is held: nothing delivered, no reset
        proxy.resume()   # what was held is delivered (a slow link, not a lost one)

Unlike ``TcpProxy.cut()`` (a reset the client sees at once), a stall is what a dropped packet
path looks like: the client's socket stays open and its reads wait for ever. New connections
are accepted during a stall (their bytes are held too), like a SYN that gets through.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["StallProxy"]

_CHUNK = 65536


class StallProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:target_port``."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = 0
        self._running = asyncio.Event()
        self._running.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> StallProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    def stall(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        for source, sink in ((reader, server_writer), (server_reader, writer)):
            pump = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_CHUNK):
                await self._running.wait()  # held while stalled: no delivery, no reset
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.transport.abort()  # one side ended: end the other, as without a proxy

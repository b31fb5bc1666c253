"""A TCP proxy on 127.0.0.1 that tests use to cut a client off its server, and restore it, or
to stall its links.

    async with TcpProxy("127.0.0.1", 5672) as proxy:
        url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
        ...                       # the client connects through the proxy
        await proxy.cut()         # every link is reset; new connections are refused
        proxy.restore()           # connections are accepted again
        proxy.stall()             # what either side sends is held: nothing delivered, no reset
        proxy.resume()            # what was held is delivered (a slow link, not a lost one)

Fault injection without touching the shared server (a ``stop_app`` would disturb every other
test running at the time). Optional TLS termination (``ssl=``) lets a test reach a plain-text
server through ``amqps://``/``tls://``. ``cut_when_downstream(predicate)`` cuts the link at an
exact moment of the protocol: the chunk from the server that matches is never delivered;
``stall_after_downstream(predicate)`` stalls right after delivering it. A stall is a partition,
not a failure (``tests/support/stall_proxy.py`` says more). ``hold_answers_after(predicate)``
and ``hold_answers_from(predicate)`` hold only what the server sends, from a request that matches
(delivered) or from an answer that matches (held with the rest): the requests land, their answers
come late (at ``resume()``), as on a link that drops or delays answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

__all__ = ["TcpProxy"]

_CHUNK = 65536


class _Link:
    """One client connection and its twin to the server."""

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        # abort() rather than close(): the peer sees a reset at once, as with a network failure
        for writer in (self.client, self.server):
            writer.transport.abort()


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port``."""

    def __init__(
        self, target_host: str, target_port: int, *, ssl: ssl.SSLContext | None = None
    ) -> None:
        if target_host not in {"127.0.0.1", "localhost", "::1"}:
            raise ValueError(f"TcpProxy only forwards to this machine, not {target_host!r}")
        self.target = (target_host, target_port)
        self._ssl = ssl
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self._connecting: set[asyncio.Task[Any]] = set()  # accepted, connecting to the target
        self._accepting = True
        self._cut_when: Callable[[bytes], bool] | None = None
        self._cut_up_when: Callable[[bytes], bool] | None = None
        self._stall_after: Callable[[bytes], bool] | None = None
        self._hold_after: Callable[[bytes], bool] | None = None
        self._hold_from: Callable[[bytes], bool] | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._answering = asyncio.Event()  # cleared while the server's answers are held
        self._answering.set()
        self.stalled = asyncio.Event()  # set while the links are stalled
        self.answers_held = asyncio.Event()  # set while the server's answers are held
        self.port = 0
        self.accepted = 0  # connections forwarded so far

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1 (``self.port``)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self._ssl)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and reset every link."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await asyncio.gather(*self._reset(), *self._pumps, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    @property
    def links(self) -> int:
        """Connections currently forwarded."""
        return len(self._links)

    async def cut(self) -> None:
        """Reset every link and refuse new connections until ``restore()``."""
        await asyncio.gather(*self._reset(), return_exceptions=True)

    def restore(self) -> None:
        """Accept and forward connections again."""
        self._cut_when = self._cut_up_when = None
        self._accepting = True

    def cut_when_downstream(self, predicate: Callable[[bytes], bool]) -> None:
        """Cut (as ``cut()``) as soon as a chunk from the server matches ``predicate``; that
        chunk is dropped, so the client never sees it."""
        self._cut_when = predicate

    def cut_when_upstream(self, predicate: Callable[[bytes], bool]) -> None:
        """Cut (as ``cut()``) as soon as a chunk from the client matches ``predicate``; that
        chunk is dropped, so the server never sees it (the client died as it sent it)."""
        self._cut_up_when = predicate

    def stall(self) -> None:
        """Hold what either side sends from now on, on every link (new ones too), until
        ``resume()``: nothing is delivered, nothing is reset."""
        self._flowing.clear()
        self.stalled.set()

    def resume(self) -> None:
        """Deliver what was held, and all that follows."""
        self.stalled.clear()
        self._flowing.set()
        self.answers_held.clear()
        self._answering.set()

    def hold_answers_after(self, predicate: Callable[[bytes], bool]) -> None:
        """Once a chunk from the client that matches ``predicate`` is delivered to the server,
        hold everything the server sends, on every link, until ``resume()``; the clients'
        requests still reach the server (they land, unanswered); once."""
        self._hold_after = predicate

    def hold_answers_from(self, predicate: Callable[[bytes], bool]) -> None:
        """As ``hold_answers_after``, from a chunk from the server that matches ``predicate``:
        that answer is held too; once."""
        self._hold_from = predicate

    def _hold_answers(self) -> None:
        self._hold_after = self._hold_from = None
        self._answering.clear()
        self.answers_held.set()

    def stall_after_downstream(self, predicate: Callable[[bytes], bool]) -> None:
        """Stall (as ``stall()``) right after delivering a chunk from the server that matches
        ``predicate``: the client has its answer, and what it sends next is held (a slow link,
        a paused VM); once."""
        self._stall_after = predicate

    def _reset(self) -> list[asyncio.Task[Any]]:
        """Refuse new connections and reset every link, at once (no await: nothing can slip
        in between), those still connecting to the target too; returns the tasks to wait for."""
        self._accepting = False
        self._cut_when = self._cut_up_when = None
        links, self._links = list(self._links), set()
        current = asyncio.current_task()
        tasks = [task for link in links for task in link.tasks if task is not current]
        tasks += self._connecting
        for link in links:
            link.abort()
        for task in tasks:
            task.cancel()
        return tasks

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._accepting:
            writer.transport.abort()
            return
        connecting = asyncio.current_task()
        assert connecting is not None
        self._connecting.add(connecting)
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        except asyncio.CancelledError:
            # Cut or stopped meanwhile (the proxy is this task's only canceller): the client is
            # not left open. Not raised: asyncio 3.11 logs a handler's cancellation as an error.
            writer.transport.abort()
            return
        finally:
            self._connecting.discard(connecting)
        link = _Link(writer, server_writer)
        self._links.add(link)
        self.accepted += 1
        link.tasks = [
            self._spawn(self._pump(reader, server_writer, link, downstream=False)),
            self._spawn(self._pump(server_reader, writer, link, downstream=True)),
        ]

    def _spawn(self, pump: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(pump)
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return task

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        downstream: bool,
    ) -> None:
        try:
            while data := await reader.read(_CHUNK):
                if downstream and self._hold_from is not None and self._hold_from(data):
                    self._hold_answers()
                await self._flowing.wait()  # held while stalled: no delivery, no reset
                if downstream:
                    await self._answering.wait()
                cut_when = self._cut_when if downstream else self._cut_up_when
                if cut_when is not None and cut_when(data):
                    self._reset()
                    return
                writer.write(data)
                if not downstream and self._hold_after is not None and self._hold_after(data):
                    self._hold_answers()  # before any await: its answer cannot slip through
                await writer.drain()
                if downstream and self._stall_after is not None and self._stall_after(data):
                    self._stall_after = None
                    self.stall()
        except (ConnectionError, OSError, ssl.SSLError):
            pass
        finally:
            # one side ended: end the other, so the peer notices as it would without a proxy
            with contextlib.suppress(Exception):
                writer.transport.abort()
            self._links.discard(link)

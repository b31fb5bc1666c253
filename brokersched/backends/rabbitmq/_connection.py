"""The connection to the broker and the channels on it: a robust connection that moves to the
next node of a cluster, a pool of confirm channels that backs off from a broker that stops
answering, and the client libraries' log lines of an initial connect kept quiet."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from ..._exceptions import BackendUnavailableError
from ..._tasks import to_the_end
from .._keywords import parameter_names

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractRobustConnection

__all__ = [
    "CONNECT_DEFAULTS",
    "OPERATION_TIMEOUT_S",
    "RESERVED_CONNECT",
    "ChannelPool",
    "Overloaded",
    "close_for_good",
    "close_quietly",
    "connect_keywords",
    "connect_robust",
    "open_channel",
    "quieted",
    "retrieve",
    "server_properties",
]

OPERATION_TIMEOUT_S = 10.0  # record(), history() and prepare(): not time-critical, but bounded
_CHANNEL_OPEN_S = 10.0  # a channel the broker has not opened by then is given up (backing off)
_BACKOFF_FIRST_S = 0.5
_CLOSE_STUCK_S = 1.0  # a channel close unanswered this long counts against new opens
_BACKOFF_MAX_S = 10.0
_CONNECT_SETTLE_S = 1.0  # a cancelled start() lets a connection attempt end this long (_abandon)
CONNECT_DEFAULTS: Mapping[str, Any] = {
    "timeout": 10,  # seconds for one connection attempt
    "reconnect_interval": 1,  # aio-pika waits 5 s by default; claims should resume sooner
}


# The URL query keys aiormq reads (aiormq/connection.py; aio-pika's "URL parameters" docs):
# aio-pika puts every keyword it does not take itself into the URL's query.
_AIORMQ_URL_KEYS = (
    "auth",
    "cafile",
    "capath",
    "cadata",
    "certfile",
    "keyfile",
    "no_verify_ssl",
    "heartbeat",
    "name",
    "timeout",
)
RESERVED_CONNECT = {"connection_class": "RabbitMQBackend connects with its own class"}


def connect_keywords() -> set[str]:
    """The keywords ``aio_pika.connect_robust`` really accepts: its own, those of the
    connection classes, their ``PARAMETERS`` and the URL query keys aiormq reads."""
    import aio_pika

    names = parameter_names(
        aio_pika.connect_robust, aio_pika.RobustConnection.__init__, aio_pika.Connection.__init__
    )
    names |= {parameter.name for parameter in aio_pika.RobustConnection.PARAMETERS}
    return (names | set(_AIORMQ_URL_KEYS)) - {"url"}


class _Quiet:
    """Whether the client logs of one initial connect are being dropped (see ``quieted``)."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = True


# Context variables are copied into the tasks aio-pika and aiormq create during the connect
# (the reconnection loop among them): they share this object, and see it turn inactive once
# the first connection is made, so reconnections later on are logged as usual.
_QUIET: contextvars.ContextVar[_Quiet | None] = contextvars.ContextVar(
    "brokersched_rabbitmq_quiet", default=None
)


class _InitialConnectFilter(logging.Filter):
    """Drops aio-pika's and aiormq's INFO+ records about an initial connect in progress: a
    failure there is raised by ``start()`` as one clear error, and aio-pika would first log it
    (ERROR "error when creating transport", INFO "Reconnecting after 1 seconds") although
    ``fail_fast`` means it will not reconnect. aio-pika has no option for this (its issue #601)."""

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = _QUIET.get()
        return quiet is None or not quiet.active or record.levelno <= logging.DEBUG


_FILTER = _InitialConnectFilter()


@contextlib.contextmanager
def quieted() -> Generator[_Quiet, None, None]:
    """Drop the client libraries' INFO+ log records in this context until the caller sets
    ``active = False`` (once connected); after a failure they stay dropped for that connection.

    A logger's filters see only the records logged on it, not those of its children: the filter
    goes on every aio-pika/aiormq logger, which exist once those modules are imported.
    """
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in {"aio_pika", "aiormq"}:
            client = logging.getLogger(name)
            if _FILTER not in client.filters:
                client.addFilter(_FILTER)
    quiet = _Quiet()
    token = _QUIET.set(quiet)
    try:
        yield quiet
    finally:
        _QUIET.reset(token)


class Overloaded(Exception):
    """No channel of the pool came free in time: claims arrive faster than the broker answers."""

    def __init__(self, size: int, waiting: int) -> None:
        super().__init__(size, waiting)
        self.size, self.waiting = size, waiting


class ChannelPool:
    """A fixed number of confirm channels, each lent to one operation at a time.

    A channel comes back to the pool only when the operation finished cleanly. Any failure
    (a broker channel error, a dropped connection, a timeout that cancelled an RPC half-way)
    may leave it closed or out of step, so it is closed and a fresh one is opened on next use.
    The channels are plain ones, not robust: a robust channel reopens itself in the background
    after an error, racing with this replacement, and would restore what it declared.

    A broker that hangs (accepts frames, answers none: a node out of file handles) must not
    get a new channel for every timed-out operation (measured: +3.8 channels/s per instance).
    So an open runs as a task of its own that outlives the operation waiting for it: a caller
    that times out leaves it in its place in the pool, and the next caller waits for the same
    open instead of starting another. At most ``size`` opens are in flight, and while ``size``
    closes have gone unanswered for a second no channel is opened. An open that fails or gets
    no answer within ``_CHANNEL_OPEN_S`` makes the pool back off (0.5 s, doubling to 10 s) and
    then open one channel at a time until one opens: operations fail at once meanwhile
    (``BackendUnavailableError``) instead of adding to the broker's backlog. A reconnection
    (the robust connection's next node, or the same one back) ends the back-off.
    """

    def __init__(self, connection: AbstractRobustConnection, size: int, name: str) -> None:
        self._connection = connection
        self.size = size
        self._name = name
        self.waiting = 0  # operations waiting for a free channel
        self._idle: asyncio.Queue[_Place] = asyncio.Queue()
        for _ in range(size):
            self._idle.put_nowait(None)  # opened on first use
        self._closing: dict[asyncio.Task[None], float] = {}  # close in flight: when it began
        self._backoff_s = 0.0  # > 0: the last open failed
        self._retry_at = 0.0  # loop time: no open before it (after a failed one)
        self._opens = 0  # opens in flight
        self._failed_on: object = None  # the connection's transport when an open last failed

    @contextlib.asynccontextmanager
    async def channel(self, wait: float | None = None) -> AsyncGenerator[AbstractChannel, None]:
        """A channel for one operation; ``wait``: give up (``Overloaded``) if none is free
        within that many seconds."""
        self.waiting += 1
        try:
            async with _maybe_timeout(wait) as window:
                held = await self._idle.get()
        except TimeoutError:
            if window is None or not window.expired():
                raise
            raise Overloaded(self.size, self.waiting) from None
        finally:
            self.waiting -= 1
        healthy = False
        try:
            channel = self._usable(held)
            if channel is None:
                held = self._opening(held)
                # Shielded: a caller cancelled (its timeout) leaves the open running, in its
                # place in the pool, for the next caller.
                channel = await asyncio.shield(held)
            held = channel
            yield channel
            healthy = True
        finally:
            if not healthy:
                if isinstance(held, asyncio.Task):
                    if held.done():
                        self._discard(_result(held))
                        held = None
                    # else: an open still in flight stays in the pool
                else:
                    self._discard(held)
                    held = None
            self._idle.put_nowait(held)

    def _usable(self, held: _Place) -> AbstractChannel | None:
        """The open channel ``held`` stands for, if there is one."""
        if isinstance(held, asyncio.Task):
            if not held.done():
                return None
            held = _result(held)
        if held is not None and not held.is_closed:
            return held
        return None

    def _opening(self, held: _Place) -> asyncio.Task[AbstractChannel]:
        """The open to wait for: the one in flight in this place, else a new one, if the
        broker is answering."""
        if isinstance(held, asyncio.Task) and not held.done():
            return held
        if isinstance(held, asyncio.Task):
            held = _result(held)
        self._discard(held)  # a closed channel: let it go
        loop = asyncio.get_running_loop()
        if self._backoff_s and self._connection.transport is not self._failed_on:
            # Reconnected (another node, or the same one back) since: a fresh start.
            self._backoff_s, self._retry_at = 0.0, 0.0
        if loop.time() < self._retry_at:
            raise BackendUnavailableError(
                f"{self._name}: the broker did not open a channel in time; not asking again"
                f" for {self._retry_at - loop.time():.1f} s (backing off)"
            )
        if self._backoff_s and self._opens:
            raise BackendUnavailableError(
                f"{self._name}: the broker did not open a channel in time; waiting for the one"
                " being opened before asking for another"
            )
        stuck = sum(1 for began in self._closing.values() if loop.time() - began > _CLOSE_STUCK_S)
        if stuck >= self.size:
            raise BackendUnavailableError(
                f"{self._name}: the broker has not answered the close of {stuck} channels; no"
                " new channel until it does"
            )
        task = loop.create_task(self._open())
        task.add_done_callback(retrieve)
        return task

    async def _open(self) -> AbstractChannel:
        loop = asyncio.get_running_loop()
        self._opens += 1
        try:
            async with asyncio.timeout(_CHANNEL_OPEN_S):
                channel = await open_channel(self._connection, confirms=True)
        except BaseException:
            self._backoff_s = min(max(2 * self._backoff_s, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
            self._retry_at = loop.time() + self._backoff_s
            self._failed_on = self._connection.transport
            raise
        finally:
            self._opens -= 1
        self._backoff_s = 0.0
        return channel

    def _discard(self, channel: AbstractChannel | None) -> None:
        """Close ``channel`` in the background: the caller may be in its cancellation path."""
        if channel is None:
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(close_quietly(channel))
        self._closing[task] = loop.time()
        task.add_done_callback(self._forget_close)

    def _forget_close(self, task: asyncio.Task[None]) -> None:
        self._closing.pop(task, None)

    async def close(self) -> None:
        while not self._idle.empty():
            held = self._idle.get_nowait()
            if isinstance(held, asyncio.Task):
                held.cancel()
                await asyncio.gather(held, return_exceptions=True)
                held = _result(held)
            self._discard(held)
        await asyncio.gather(*self._closing, return_exceptions=True)


# A place in the pool: nothing yet, a channel, or its open in flight.
_Place: TypeAlias = "AbstractChannel | asyncio.Task[AbstractChannel] | None"


def _result(task: asyncio.Task[AbstractChannel]) -> AbstractChannel | None:
    """The channel a finished open made; ``None`` when it failed or was cancelled."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()


async def open_channel(connection: AbstractRobustConnection, *, confirms: bool) -> AbstractChannel:
    from aio_pika import Channel

    await connection.ready()  # a robust connection may be between two attempts
    channel = Channel(connection, publisher_confirms=confirms, on_return_raises=confirms)
    await channel
    return channel


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background task's exception as seen: whoever awaited it has it already."""
    if not task.cancelled():
        task.exception()


@contextlib.asynccontextmanager
async def _maybe_timeout(seconds: float | None) -> AsyncGenerator[asyncio.Timeout | None, None]:
    if seconds is None:
        yield None
    else:
        async with asyncio.timeout(seconds) as window:
            yield window


async def close_quietly(channel: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await channel.close()


async def connect_robust(
    urls: Sequence[str], start: int, options: Mapping[str, Any]
) -> AbstractRobustConnection:
    """``aio_pika.connect_robust`` to ``urls[start]``, leaving nothing running when it fails or
    is cancelled; once connected, every reconnection attempt goes to the next URL (round robin).

    Its connection starts tasks before it is returned (the reconnection loop, then aiormq's
    reader, writer and heartbeat): a call that is cancelled (an outer timeout, Ctrl-C) or fails
    would leave them running, reconnecting for ever. The class passed notes the connection so
    that it can be closed; ``connect_robust`` itself is kept for how it reads its options.

    aio-pika connects to one URL only (its issue #141). Each of its attempts, the first and
    every reconnection, starts by clearing ``transport`` and then connects to ``url``: the
    setter below moves ``url`` to the next node there, so a lost node is left at once and a
    node that refuses is followed by the next one, ``reconnect_interval`` apart.
    """
    import aio_pika
    from yarl import URL

    made: list[AbstractRobustConnection] = []
    nodes = [URL(url) for url in urls]

    class RobustConnection(aio_pika.RobustConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._node = start
            self._attempts = -1  # __init__ clears transport too: that is not an attempt
            super().__init__(*args, **kwargs)
            made.append(self)

        @property
        def transport(self) -> Any:
            return self.__dict__.get("_transport")

        @transport.setter
        def transport(self, value: Any) -> None:
            if value is None:
                self._attempts += 1
                if self._attempts > 1:  # the first attempt keeps urls[start]
                    self._node = (self._node + 1) % len(nodes)
                    self.url = nodes[self._node]
            self.__dict__["_transport"] = value

    connecting: asyncio.Task[AbstractRobustConnection] = asyncio.create_task(
        aio_pika.connect_robust(urls[start], connection_class=RobustConnection, **options)
    )
    try:
        return await asyncio.shield(connecting)
    except BaseException:
        await to_the_end(_abandon(connecting, made))
        raise


async def _abandon(
    connecting: asyncio.Task[AbstractRobustConnection], made: list[AbstractRobustConnection]
) -> None:
    """Close what a failed or cancelled ``connect_robust`` made.

    The attempt in flight gets a moment to end first: closing a robust connection cancels its
    reconnection loop, and when that lands just as aiormq has finished connecting, aio-pika
    drops the new aiormq connection unclosed (its reader, writer and heartbeat run on). An
    attempt that is still going after the moment is waiting for the network, not finishing.
    """
    await asyncio.wait([connecting], timeout=_CONNECT_SETTLE_S)
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    for connection in made:
        await close_for_good(connection)


async def close_for_good(connection: AbstractRobustConnection) -> None:
    """Close ``connection`` (its reconnection loop first), bounded, raising nothing."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await connection.close()


def server_properties(connection: AbstractRobustConnection) -> dict[str, Any]:
    """What the broker told of itself in ``Connection.Start`` (version, product...)."""
    transport = connection.transport
    underlay = transport.connection if transport is not None else None
    properties = getattr(underlay, "server_properties", None)
    return dict(properties) if isinstance(properties, dict) else {}

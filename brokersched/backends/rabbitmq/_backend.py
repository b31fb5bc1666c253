"""``RabbitMQBackend``: its configuration and its life (connect, prepare, close); the claims
are ``_claims``'s, the fleet's slot memory ``_slotmemory``'s, the history ``_history``'s, the
fleet's records ``_fleet``'s."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from ... import _redact
from ..._clock import Clock, host_time_ms
from ..._durations import Duration, format_duration, to_ms
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ..._slotmemory import BOOT_MEMORY, DEFAULT_CLAIM_SKEW
from ..._tasks import cancel_requests, raise_if_cancelled_since, to_the_end
from ...abc import (
    BrokerBudget,
    Finding,
    FleetKind,
    Inventory,
    JobPolicy,
    RunRecord,
    Slot,
)
from .._errors import ErrorMap
from .._keywords import own_options, refuse_unknown
from . import _ops
from ._budget import budget_watch
from ._claims import ClaimQueues
from ._connection import (
    CONNECT_DEFAULTS,
    OPERATION_TIMEOUT_S,
    RESERVED_CONNECT,
    ChannelPool,
    close_for_good,
    close_quietly,
    connect_keywords,
    connect_robust,
    open_channel,
    quieted,
    server_properties,
)
from ._errors import (
    check_parsable,
    describe,
    error_rows,
    login_refused,
    refused_vhost,
    url_vhost,
    vhost_refused,
)
from ._fleet import FleetRecords, fleet_lock_name, fleet_queue_name
from ._history import History
from ._names import (
    check_prefix,
    claim_queue_name,
    fence_exchange_name,
    history_queue_name,
    history_stream_name,
    lock_queue_name,
    record_queue_name,
)
from ._options import RabbitMQOptions
from ._slotmemory import SlotMemory, memory_of, shown

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractRobustConnection

__all__ = ["RabbitMQBackend"]

_log = logging.getLogger("brokersched.backends.rabbitmq")
T = TypeVar("T")

_INSTALL_HINT = "pip install 'brokersched[rabbitmq]'"


class RabbitMQBackend(ClaimQueues):
    """Claims slots through RabbitMQ (classic queues, publisher confirms).

    ``url``: ``amqp://`` or ``amqps://``, or a list of such URLs, one per node of a cluster:
    the backend connects to the first that answers and, when its connection is lost, to the
    next one (round robin, ``reconnect_interval`` apart); options in the first URL's query
    apply to all. ``slot_ttl``: how long a claimed slot is remembered
    (``jitter + max_late`` of every job must stay below it). ``prefix``: the start of every
    queue name (letters, digits, ``_`` and ``-``: no ``.``, which separates the parts).
    ``channels``: claims in flight at once. ``claim_timeout``: the longest a claim waits for
    the broker (the scheduler's own deadline applies when shorter). ``declare_ahead``: the
    winner of a job's slot declares the claim queue of its next slot half a second before it
    (``prepare_claims``): the claims of a busy instant then find their queues (measured:
    3 instances x 20 jobs at one instant, lateness p99 71 -> 38 ms); the slots due within that
    half second of a ``slot_ttl`` raise then fail closed (skipped, never twice).
    ``management_url``: the management plugin's API (``http://user:password@host:15672/``),
    read by ``brokersched purge`` (to list every queue of the prefix and see running
    instances), ``brokersched doctor`` (open files by the node's version and the limit the
    jobs need, partitions, policies) and, while the
    backend runs, every ``budget_interval`` for the broker's budget (``budget``): from 60 % of
    it claim queues are no longer declared ahead, from 80 % (or under a memory or disk alarm)
    no new claim queue is declared, and slots whose queue does not exist yet are skipped
    (``budget_interval=None``: the budget is not watched). Other keyword arguments go to
    ``aio_pika.connect_robust`` (``ssl_context``, ``timeout``,
    ``reconnect_interval``, ``client_properties``...) and are never logged; one that it does
    not accept (a misspelt option) is refused at construction.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "amqp://guest:guest@127.0.0.1/",
        *,
        slot_ttl: Duration = "5m",
        prefix: str = "brokersched",
        channels: int = 8,
        claim_timeout: Duration = "2s",
        declare_ahead: bool = True,
        max_clock_skew: Duration = DEFAULT_CLAIM_SKEW,
        management_url: str | None = None,
        budget_interval: Duration | None = "30s",
        **connect_options: Any,
    ) -> None:
        options = RabbitMQOptions.parse(self.name, locals())
        super().__init__()
        refuse_unknown(
            self.name,
            connect_options,
            own=own_options(RabbitMQBackend),
            library="aio_pika.connect_robust",
            accepted=connect_keywords,
            reserved=RESERVED_CONNECT,
        )
        self._set_memory(options)
        self._urls, self._prefix = options.url, options.prefix
        self._management = (
            None
            if management_url is None
            else _ops.Management(management_url, url_vhost(self._urls[0]))
        )
        period = options.budget_interval
        self._budget = (
            None
            if self._management is None or period is None
            else budget_watch(self.name, self._management, period=period)
        )
        self._url = self._urls[0]  # the one named in messages about the login or the vhost
        self._secrets = _redact.connection_secrets(self._urls, connect_options, ("password",))
        self._errors = ErrorMap(
            functools.partial(error_rows, self.name, self._secrets), self._secrets
        )
        self._claim_timeout, self._channel_count = options.claim_timeout, options.channels
        self._declare_ahead = options.declare_ahead
        # A claim waits this long for a free channel, then is skipped: under a load the broker
        # cannot carry, slots are skipped (backend-error, "overloaded") instead of piling up.
        self._channel_wait = self._claim_timeout.total_seconds() / 4
        in_url = parse_qs(urlsplit(self._url).query)  # the URL may carry its own timeout etc.
        defaults = {key: value for key, value in CONNECT_DEFAULTS.items() if key not in in_url}
        self._connect_options = {**defaults, **connect_options}
        self._connect_options.setdefault(
            "client_properties", {"connection_name": f"brokersched ({self._prefix})"}
        )
        self._connection: AbstractRobustConnection | None = None
        self._pool: ChannelPool | None = None
        self._clock: Clock | None = None
        self._memory = SlotMemory(
            self.name,
            self._prefix,
            self._slot_ttl,
            self._skew_ms,
            channels=self._side_channel,
            errors=self._client_errors,
            describe=self._describe,
            secrets=self._secrets,
        )
        self._records = FleetRecords(
            self.name,
            self._prefix,
            channels=self._side_channel,
            errors=self._client_errors,
            clock=lambda: self._clock,
        )
        self._history = History(
            self.name,
            self._prefix,
            pool=self._require_pool,
            channels=self._side_channel,
            errors=self._client_errors,
            describe=self._describe,
        )

    def __repr__(self) -> str:
        urls = [_redact.redact_url(url) for url in self._urls]
        url = urls[0] if len(urls) == 1 else urls
        slot_ttl = format_duration(self._slot_ttl)
        return f"{self.name}({url!r}, slot_ttl={slot_ttl!r}, prefix={self._prefix!r})"

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def declare_ahead(self) -> bool:
        """Whether claim queues are declared ahead of their slots (the option, as given)."""
        return self._declare_ahead

    @property
    def fleet_slot_memory(self) -> timedelta | None:
        """How long the broker remembers a claimed slot for the whole fleet of this prefix (the
        longest ``slot_ttl`` among its instances that claim), as last read; ``None`` before
        ``start()``."""
        memory = self._memory.memory_ms
        return None if memory is None else timedelta(milliseconds=memory)

    @property
    def budget(self) -> BrokerBudget | None:
        """The broker's budget as last read (``management_url`` given, started): the fullest
        node's share of its open files by the rule of its version (``_files``: 3.x the quorum
        queues its limit holds, or its sockets; 4.x the files it holds, each live claim queue
        one). From 60 % claim queues are no longer declared ahead, from 80 % (or under an
        alarm) none is declared (slots whose queue does not exist are skipped)."""
        return None if self._budget is None else self._budget.reading

    # -- lifecycle -------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        try:
            import aio_pika  # noqa: F401 (imported here to name the missing extra)
        except ImportError as exc:
            raise ConfigurationError(
                f"{self.name} needs aio-pika: {_INSTALL_HINT}", backend=self.name
            ) from exc
        from aiormq.exceptions import InvalidFrameError, ProbableAuthenticationError

        for url in self._urls:
            check_parsable(url, self.name)
        nodes = ", ".join(_redact.redact_url(url) for url in self._urls)
        action = f"connecting to {nodes}"
        cancels = cancel_requests()
        with self._client_errors(action), quieted() as quiet:
            try:
                connection = await self._connect_first()
            except ValueError as exc:  # aio-pika refused an option (the URL's query, a keyword)
                raise ConfigurationError(
                    f"{self.name}: {action}: {self._describe(exc)}", backend=self.name
                ) from _redact.chainable(exc, self._secrets)
            except ProbableAuthenticationError as exc:
                raise BackendUnavailableError(
                    login_refused(self.name, self._url)
                ) from _redact.chainable(exc, self._secrets)
            except InvalidFrameError as exc:
                if not refused_vhost(exc):
                    raise
                raise BackendUnavailableError(
                    vhost_refused(self.name, self._url)
                ) from _redact.chainable(exc, self._secrets)
            quiet.active = False
        self._connection = connection
        self._pool = ChannelPool(connection, self._channel_count, self.name)
        self._history.open()
        self._memory.open(clock)
        self._clock = clock
        _log.debug("%s connected to %s", self.name, connection)
        try:
            await self._memory.read(write=False)
            if self._budget is not None:
                await self._budget.start(clock)
            raise_if_cancelled_since(cancels)
        except BaseException:
            await to_the_end(self._close())
            raise
        seen_ms = self._memory.seen_ms
        if self._memory.view is None and seen_ms is not None:
            _log.info(
                "%s: the fleet of prefix %r remembers claimed slots for %s, shorter than this"
                " instance's slot_ttl %s: raised to it when this instance's scheduler starts"
                " (or at its first claim)",
                self.name,
                self._prefix,
                shown(seen_ms),
                format_duration(self._slot_ttl),
            )

    async def _connect_first(self) -> AbstractRobustConnection:
        """A connection to the first node that answers, in the order given; the error of the
        last one when none does. A refused login or vhost is not a node being down: raised."""
        from aiormq.exceptions import AMQPConnectionError, ProbableAuthenticationError

        for start in range(len(self._urls)):
            try:
                return await connect_robust(self._urls, start, self._connect_options)
            except ProbableAuthenticationError:
                raise
            except (ConnectionError, OSError, TimeoutError, AMQPConnectionError) as exc:
                if start == len(self._urls) - 1:
                    raise
                _log.warning(
                    "%s: node %s does not answer (%s); trying the next one",
                    self.name,
                    _redact.redact_url(self._urls[start]),
                    self._describe(exc),
                )
        raise AssertionError("unreachable: the last node's error is raised")

    async def _close(self) -> None:
        pool, connection = self._pool, self._connection
        self._pool = self._connection = None
        self._refusals_checked.clear()
        if self._budget is not None:
            await self._budget.close()
        self._history.close()
        await self._memory.close()
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.close()
        if connection is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await connection.close()

    def _require_pool(self) -> ChannelPool:
        if self._pool is None:
            raise BackendUnavailableError(f"{self.name} is not started; call start() first")
        return self._pool

    @contextlib.asynccontextmanager
    async def _side_channel(
        self, *, confirms: bool = False
    ) -> AsyncGenerator[AbstractChannel, None]:
        """A short-lived channel off the pool, for declares that may fail and for reads."""
        if self._connection is None:
            raise BackendUnavailableError(f"{self.name} is not started; call start() first")
        channel = await open_channel(self._connection, confirms=confirms)
        try:
            yield channel
        finally:
            await asyncio.shield(close_quietly(channel))

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        """Raise the fleet's slot memory to this ``slot_ttl`` if it is shorter, before the
        scheduler arms anything: no slot of this instance then falls due before its raise. Then
        declare the history stream now, so a mismatch is reported at start; best effort: a
        failure is logged and ``record()`` tries again."""
        if self._connection is None:
            return
        if jobs and self._memory.view is None:
            await self._memory.refresh(None)
        if jobs:
            await self._history.prepare()

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self._history.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await self._history.history(job, limit)

    # -- the fleet's records: one queue of the prefix, under a lock ---------------------------

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._records.read(kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._records.put(kind, key, value, ttl=ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._records.swap(kind, key, old, new)

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    _NAMES = _ops.Names(
        record=record_queue_name,
        lock=lock_queue_name,
        fence=fence_exchange_name,
        history=history_queue_name,
        stream=history_stream_name,
        claim=claim_queue_name,
        fleet=fleet_queue_name,
        fleet_lock=fleet_lock_name,
    )

    async def inventory(
        self,
        *,
        namespace: str | None = None,
        jobs: Sequence[str] = (),
        slots: Sequence[Slot] = (),
    ) -> Inventory:
        """The prefix's queues and exchanges: listed with ``management_url``; otherwise those
        named from ``jobs`` and ``slots`` and the slot memory record, each checked by a passive
        declare (the answer says what was not enumerated). Live: a claim of a slot of the last
        minute; with ``management_url``, a connection named ``brokersched (<prefix>)``."""
        prefix = self._prefix if namespace is None else check_prefix(namespace, self.name)
        memories = [to_ms(self._slot_ttl), to_ms(BOOT_MEMORY)]

        async def call(channels: _ops.Channels, _: dict[str, Any]) -> Inventory:
            return await _ops.inventory(
                channels,
                self._NAMES,
                prefix,
                jobs=jobs,
                slots=slots,
                memories_ms=memories,
                parse=memory_of,
                management=self._management,
                now_ms=host_time_ms(),
            )

        return await self._operation("listing its queues", call)

    async def _presence_records(self, namespace: str | None) -> list[str]:
        """The records of ``<prefix>.fleet``, read under its lock, declaring nothing."""
        prefix = self._prefix if namespace is None else check_prefix(namespace, self.name)

        async def call(channels: _ops.Channels, _: dict[str, Any]) -> list[str]:
            return await _ops.read_presence(channels, self._NAMES, prefix, host_time_ms())

        return await self._operation("reading the fleet's presence", call)

    async def _control_records(self) -> list[str]:
        """The control records of ``<prefix>.fleet``, read as the presence is."""

        async def call(channels: _ops.Channels, _: dict[str, Any]) -> list[str]:
            return await _ops.read_controls(channels, self._NAMES, self._prefix)

        return await self._operation("reading the jobs' controls", call)

    async def purge(self, inventory: Inventory) -> Inventory:
        """Delete the queues and exchanges of ``inventory``; what is left of them (listed
        again with ``management_url``)."""

        async def call(channels: _ops.Channels, _: dict[str, Any]) -> Inventory:
            await _ops.purge(channels, inventory, self._NAMES)
            return await _ops.left(channels, inventory, self._NAMES, self._management)

        return await self._operation("deleting its queues", call)

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        """The checks of ``brokersched doctor``; with ``slots`` (the application's claimed
        slots of one slot memory) it names the open-files limit the node needs for them."""

        async def call(channels: _ops.Channels, properties: dict[str, Any]) -> list[Finding]:
            instances = 1
            if slots:  # a connection per instance: the running ones, or this one
                with contextlib.suppress(BackendError):
                    found = await _ops.read_presence(
                        channels, self._NAMES, self._prefix, host_time_ms()
                    )
                    instances = max(1, len(found))
            return await _ops.doctor(
                channels,
                properties,
                self._NAMES,
                self._prefix,
                slot_ttl=self._slot_ttl,
                parse=memory_of,
                management=self._management,
                slots=slots,
                instances=instances,
            )

        return await self._operation("checking the broker", call)

    async def _operation(
        self,
        action: str,
        call: Callable[[_ops.Channels, dict[str, Any]], Awaitable[T]],
    ) -> T:
        """``call(channels, server properties)`` on a connection of its own, named
        ``brokersched-ops`` (the backend need not be started; nothing is declared)."""
        try:
            import aio_pika  # noqa: F401 (imported here to name the missing extra)
        except ImportError as exc:
            raise ConfigurationError(
                f"{self.name} needs aio-pika: {_INSTALL_HINT}", backend=self.name
            ) from exc
        options = {
            **self._connect_options,
            "client_properties": {"connection_name": "brokersched-ops"},
        }
        nodes = ", ".join(_redact.redact_url(url) for url in self._urls)
        with self._client_errors(f"{action} on {nodes}"), quieted() as quiet:
            connection = await connect_robust(self._urls, 0, options)
            quiet.active = False
            try:

                @contextlib.asynccontextmanager
                async def channels() -> AsyncGenerator[AbstractChannel, None]:
                    channel = await open_channel(connection, confirms=False)
                    try:
                        yield channel
                    finally:
                        await asyncio.shield(close_quietly(channel))

                async with asyncio.timeout(OPERATION_TIMEOUT_S * 6):
                    return await call(channels, server_properties(connection))
            finally:
                await to_the_end(close_for_good(connection))

    # -- errors ----------------------------------------------------------------------------

    def _client_errors(self, action: str) -> AbstractContextManager[None]:
        """aio-pika's and aiormq's errors become ``BackendError``; no secret reaches a message."""
        return self._errors(action)

    def _describe(self, exc: BaseException) -> str:
        return describe(exc, self._secrets)

"""What both NATS backends (``NATSBackend``, ``NATSLeaseBackend``) do alike with their client:
connect within a bound, hand ``start()``'s connection to their calls, run an operation
(``brokersched purge``, ``doctor``) on a connection of its own, watch the JetStream account's
budget, and keep the fleet's records in key-value buckets made on first use (``_fleet``)."""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ... import _redact
from ..._clock import Clock
from ..._exceptions import BackendUnavailableError
from ..._tasks import cancel_requests, raise_if_cancelled_since, to_the_end
from ...abc import BrokerBudget, FleetKind
from .._budget import BudgetWatch
from .._ops import NamespaceInventory
from ._budget import nats_budget_watch
from ._errors import (
    CONNECT_DEFAULTS,
    SECRET_OPTIONS,
    Translated,
    close_client,
    describe,
    import_nats,
)
from ._fleet import FleetBuckets
from ._options import ServerOptions

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js import JetStreamContext

__all__ = ["API_TIMEOUT_S", "NATSClientBase", "server_version"]

T = TypeVar("T")

API_TIMEOUT_S = 5.0


def server_version(nc: NATSClient) -> str | None:
    """The version of the server ``nc`` is connected to (``2.10.22``), if it said."""
    version = nc.connected_server_version
    return None if version is None else f"{version.major}.{version.minor}.{version.patch}"


class NATSClientBase(NamespaceInventory):
    """A NATS backend's client: its settings (``_keep_client``), its connection while started
    (``_client``) and its account's budget (``budget``)."""

    #: The name messages give the backend (its class's, which a subclass keeps).
    _backend: ClassVar[str]
    #: Why the last attempt to connect failed, as nats-py's error callback told it (``None``:
    #: the exception raised says it).
    _last_error: str | None = None
    _fleet_buckets: FleetBuckets | None = None

    def _keep_client(self, options: ServerOptions, connect_options: dict[str, Any]) -> None:
        """Keep the connection's settings (in a constructor: nothing connects)."""
        self._servers, self._replicas = options.servers, options.replicas
        self._connect_options = dict(connect_options)
        self._secrets = _redact.connection_secrets(
            self._servers, self._connect_options, SECRET_OPTIONS
        )
        self._shown_servers = ", ".join(_redact.redact_url(s) for s in self._servers)
        self._nc: NATSClient | None = None
        self._js: JetStreamContext | None = None
        self._budget_period = options.budget_interval
        self._budget: BudgetWatch | None = None

    @property
    def budget(self) -> BrokerBudget | None:
        """The JetStream account's budget as last read while started (``_budget``); ``None``
        before, or with ``budget_interval=None``."""
        return None if self._budget is None else self._budget.reading

    def _callbacks(self) -> dict[str, Callable[..., Awaitable[None]]]:
        """The backend's connection callbacks, given to ``nats.connect`` over the caller's."""
        return {}

    async def _connect(self, cancels: int | None = None) -> NATSClient:
        """A connection to ``servers`` within twice ``connect_timeout`` per server;
        ``cancels``: the cancellation requests of the task when its call began (a
        cancellation that nats-py swallowed is raised again)."""
        nats = import_nats(self._backend)
        options: dict[str, Any] = {**CONNECT_DEFAULTS, **self._connect_options, **self._callbacks()}
        budget = 2 * float(options["connect_timeout"]) * len(self._servers)
        nc: NATSClient = nats.NATS()
        cancels = cancel_requests() if cancels is None else cancels
        self._last_error = None
        try:
            async with asyncio.timeout(budget):
                await nc.connect(self._servers, **options)
            raise_if_cancelled_since(cancels)  # swallowed by nats-py's wait_for (3.11)
        except BaseException as exc:
            await to_the_end(close_client(nc))
            if not isinstance(exc, Exception):
                raise
            cause = self._last_error or describe(exc, self._secrets)
            raise BackendUnavailableError(
                f"{self._backend}: cannot connect to NATS at {self._shown_servers} within "
                f"{budget:g}s ({cause})"
            ) from _redact.chainable(exc, self._secrets)
        return nc

    def _client(self) -> tuple[NATSClient, JetStreamContext]:
        if self._nc is None or self._js is None:
            raise BackendUnavailableError(f"{self._backend} is not started (call start() first)")
        return self._nc, self._js

    def _jetstream(self) -> JetStreamContext:
        return self._client()[1]

    def _translated(self, *what: str) -> Translated:
        return Translated(*what, secrets=self._secrets, backend=self._backend)

    async def _start_budget(self, clock: Clock, cancels: int) -> None:
        """Read the account's budget now and every ``budget_interval`` (never with ``None``);
        a start cancelled meanwhile closes the backend."""
        if self._budget_period is None:
            return
        self._budget = nats_budget_watch(
            self._backend, self._client, self._secrets, self._budget_period
        )
        try:
            await self._budget.start(clock)
            raise_if_cancelled_since(cancels)  # one nats-py swallowed (Python 3.11)
        except BaseException:  # cancelled
            await to_the_end(self._close())
            raise

    async def _stop_budget(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            await budget.close()

    async def _operation(
        self,
        action: str,
        call: Callable[..., Awaitable[T]],
        *args: Any,
        with_client: bool = False,
    ) -> T:
        """``call(js, *args)`` (``call(js, nc)``) on a connection of its own."""
        nc = await self._connect()
        try:
            js = nc.jetstream(timeout=API_TIMEOUT_S)  # pyright: ignore[reportUnknownMemberType]
            with self._translated(action):
                return await (call(js, nc) if with_client else call(js, *args))
        finally:
            await to_the_end(close_client(nc))

    # -- the fleet's records: key-value buckets ``<prefix>-fleet-instance`` and
    # ``<prefix>-fleet-control``, opened (or made) on the connection's first use -------------

    @property
    @abstractmethod
    def _fleet_prefix(self) -> str:
        """What the fleet's buckets are named after."""

    def _buckets(self) -> FleetBuckets:
        if self._fleet_buckets is None:
            self._fleet_buckets = FleetBuckets(
                self._fleet_prefix, self._replicas, self._secrets, self._jetstream
            )
        return self._fleet_buckets

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._buckets().read(kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._buckets().put(kind, key, value, ttl=ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._buckets().swap(kind, key, old, new)

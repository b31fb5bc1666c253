"""What both NATS backends (``NATSBackend``, ``NATSLeaseBackend``) do alike with their client:
connect within a bound, hand ``start()``'s connection to their calls, run an operation
(``brokersched purge``, ``doctor``) on a connection of its own, watch the JetStream account's
budget, and keep the fleet's records in key-value buckets made on first use (``_fleet``); and
``OwnBucket``, ``NATSLeaseBackend``'s own ``KVLink`` (``_link``): its bucket, history stream and
fleet's records over that client."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ... import _redact
from ..._clock import Clock, datetime_to_ms
from ..._durations import to_ms
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ..._tasks import cancel_requests, raise_if_cancelled_since, to_the_end
from ...abc import BrokerBudget, FleetKind, JobPolicy, RunRecord, Slot
from .._budget import BudgetWatch
from .._ops import NamespaceInventory
from . import _ops
from ._bucket import (
    BACKEND,
    MSG_TTL,
    OPERATION_TIMEOUT_S,
    SERIAL_CAS,
    KVTable,
    bucket_problems,
    kv_stream,
)
from ._budget import nats_budget_watch
from ._errors import (
    CONNECT_DEFAULTS,
    MSG_ID,
    SECRET_OPTIONS,
    Translated,
    close_client,
    describe,
    import_nats,
)
from ._fleet import FleetBuckets, presence
from ._history import read_last
from ._names import Names
from ._options import ServerOptions
from ._rows import Table
from ._stream_settings import history_config, history_problems

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["API_TIMEOUT_S", "NATSClientBase", "OwnBucket", "server_version"]

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

    @abstractmethod
    def _namespace(self, namespace: str | None) -> str:
        """``namespace`` checked as this backend's (a prefix, a bucket), or its own (``None``):
        what its streams and the fleet's buckets are named after."""

    def _buckets(self) -> FleetBuckets:
        if self._fleet_buckets is None:
            self._fleet_buckets = FleetBuckets(
                self._namespace(None), self._replicas, self._secrets, self._jetstream
            )
        return self._fleet_buckets

    async def _presence_records(self, namespace: str | None) -> list[str]:
        """The presence bucket ``<namespace>-fleet-instance``, read only."""
        own = self._namespace(namespace)
        return await self._operation("read the fleet's presence", presence, own)

    async def _control_records(self) -> list[str]:
        """The control bucket ``<namespace>-fleet-control``, read only."""
        own = self._namespace(None)
        return await self._operation("read the jobs' controls", presence, own, "control")

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._buckets().read(kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._buckets().put(kind, key, value, ttl=ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._buckets().swap(kind, key, old, new)


class OwnBucket:
    """The real ``KVLink`` (``_link``): the bucket and the history stream of one
    ``NATSLeaseBackend`` over the backend's own NATS connection (``NATSClientBase``: its
    settings, its connection while started, its errors, its budget and the fleet's buckets)."""

    monotonic = staticmethod(time.monotonic)
    sleep = staticmethod(asyncio.sleep)

    def __init__(
        self,
        client: NATSClientBase,
        bucket: str,
        *,
        replicas: int,
        store_time: Callable[[], int | None],
    ) -> None:
        """``store_time``: the backend's override of the server's clock, for tests."""
        self._client, self._bucket, self._names = client, bucket, Names(bucket)
        self._replicas, self._store_time = replicas, store_time
        self._nc: NATSClient | None = None
        self._clock: Clock | None = None
        self._history_size = 0  # max_msgs_per_subject known to be in place
        self._history_lock = asyncio.Lock()
        self._msg_ttl = False  # the history stream drops runs by their own TTL

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self, clock: Clock) -> Table:
        client = self._client
        self._history_lock = asyncio.Lock()
        self._history_size, self._msg_ttl = 0, False
        cancels = cancel_requests()
        nc = await client._connect(cancels)
        try:
            js = nc.jetstream(timeout=API_TIMEOUT_S)  # pyright: ignore[reportUnknownMemberType]
            with client._translated("preparing the bucket"):
                self._check_replicas(self._replicas, nc)
                kv = await self._bucket_kv(js, nc)
                await self._check_history_stream(js)
        except BaseException:
            await to_the_end(close_client(nc))
            raise
        client._nc, client._js, self._nc, self._clock = nc, js, nc, clock
        table = KVTable(
            js,
            kv,
            bucket=self._bucket,
            translated=client._translated,
            store_time=self._store_time,
        )
        await client._start_budget(clock, cancels)
        return table

    async def close(self) -> None:
        client = self._client
        await client._stop_budget()
        nc, client._nc, client._js, self._nc, self._clock = client._nc, None, None, None, None
        client._fleet_buckets = None  # opened again on the next connection's first use
        if nc is not None:
            await close_client(nc)

    def _check_replicas(self, replicas: int, nc: NATSClient) -> None:
        """Refuse a replicated bucket on a server that does not serialize compare-and-sets.

        Before nats-server 2.11 a clustered stream checked ``Nats-Expected-Last-Subject-
        Sequence`` before the write's Raft proposal, not within it: two writes made from one
        revision at the same moment could both land (nats-io/nats-server#4320, #5644), so two
        instances could both be granted a slot. Seen here: a slot ran twice on a 3-node 2.9.10
        cluster whose bucket leader was killed. A single server serializes them."""
        if replicas <= 1:
            return
        version = nc.connected_server_version
        if version is not None and (version.major, version.minor) >= SERIAL_CAS:
            return
        shown = "unknown" if version is None else f"{version.major}.{version.minor}"
        raise ConfigurationError(
            f"{BACKEND}: a bucket with {replicas} replicas needs nats-server "
            f"{SERIAL_CAS[0]}.{SERIAL_CAS[1]} or later (connected to {shown}): before it, a "
            "clustered stream lets two compare-and-set writes from one revision both land "
            "(nats-io/nats-server#4320, #5644), and a slot could run twice; upgrade the "
            "servers, or use replicas=1 (one server)",
            option="replicas",
            backend=BACKEND,
        )

    async def _bucket_kv(self, js: JetStreamContext, nc: NATSClient) -> KeyValue:
        """The bucket, created when missing (file storage, one revision per key, no TTL: a
        row holds the job's fences for ever; read from the leader only)."""
        import nats.js.errors
        from nats.js.api import StorageType

        for _ in range(3):
            try:
                # Checked first: nats-py refuses some of what is checked (an unlimited
                # history) with a less telling error of its own.
                await self._check_bucket(js, nc)
                return await js.key_value(self._bucket)
            except nats.js.errors.NotFoundError:  # the bucket's stream, or the bucket
                pass
            try:
                return await js.create_key_value(  # pyright: ignore[reportUnknownMemberType]
                    bucket=self._bucket,
                    description="brokersched leases (a row per job)",
                    history=1,
                    storage=StorageType.FILE,
                    replicas=self._replicas,
                    direct=False,
                )
            except nats.js.errors.BadRequestError:
                continue  # created by another instance meanwhile: take it
        raise BackendError(f"{BACKEND}: bucket {self._bucket!r} keeps changing")

    async def _check_bucket(self, js: JetStreamContext, nc: NATSClient) -> None:
        config = (await js.stream_info(kv_stream(self._bucket))).config
        self._check_replicas(config.num_replicas or 1, nc)
        problems = bucket_problems(config, nc.max_payload)
        if problems:
            raise ConfigurationError(
                f"{BACKEND}: the existing KV bucket {self._bucket!r} cannot be used: "
                + "; ".join(problems),
                option="bucket",
                backend=BACKEND,
            )

    # -- history -----------------------------------------------------------------------------

    async def prepare(self, history_size: int) -> None:
        js = self._client._jetstream()
        with self._client._translated("preparing the history stream"):
            await self._ensure_history(js, history_size)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        js = self._client._jetstream()
        with self._client._translated(f"recording a run of {job.name!r}"):
            await self._ensure_history(js, job.history_size)
            headers = {MSG_ID: f"{Slot(record.job, record.slot_ms).key}:{record.run_id}"}
            ttl = None
            if self._msg_ttl and job.history_ttl is not None:
                ttl = max(1, math.ceil(job.history_ttl.total_seconds()))
            async with asyncio.timeout(OPERATION_TIMEOUT_S):
                await js.publish(
                    self._names.history_subject(job.name),
                    record.to_json().encode(),
                    headers=headers,
                    msg_ttl=ttl,
                )

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        js = self._client._jetstream()
        subject = self._names.history_subject(job.name)
        count = min(limit, job.history_size)
        with self._client._translated(f"reading the history of {job.name!r}"):
            async with asyncio.timeout(OPERATION_TIMEOUT_S):
                bodies = await read_last(js, self._names.history, subject, count)
        records = [RunRecord.from_json(body) for body in reversed(bodies)]
        if job.history_ttl is not None:  # 2.9, 2.10: no per-message TTL (and TTLs are whole s)
            oldest = self._instance_now() - to_ms(job.history_ttl)
            records = [r for r in records if datetime_to_ms(r.started_at) >= oldest]
        return records

    def _instance_now(self) -> int:
        """The scheduler's clock, which history times are on (as on every backend)."""
        if self._clock is None:
            raise BackendUnavailableError(f"{BACKEND} is not started (call start() first)")
        return self._clock.now_ms()

    async def _check_history_stream(self, js: JetStreamContext) -> None:
        info = await _ops.stream_info_or_none(js, self._names.history)
        if info is not None:
            self._raise_problems(history_problems(info.config, self._names))

    def _raise_problems(self, problems: list[str]) -> None:
        if problems:
            raise ConfigurationError(
                f"{BACKEND}: the existing JetStream stream {self._names.history!r} cannot be "
                "used: " + "; ".join(problems),
                option="bucket",
                backend=BACKEND,
            )

    async def _ensure_history(self, js: JetStreamContext, size: int) -> None:
        """Create the history stream, or grow it to keep ``size`` runs per job (never shrunk:
        another instance may keep more)."""
        import nats.js.errors

        if size <= self._history_size:
            return
        async with self._history_lock:
            if size <= self._history_size:
                return
            for _ in range(3):
                try:
                    info = await js.stream_info(self._names.history)
                except nats.js.errors.NotFoundError:
                    config = history_config(self._names, size, self._replicas)
                    config.allow_msg_ttl = self._server_has_msg_ttl() or None
                    try:
                        info = await js.add_stream(config)  # pyright: ignore[reportUnknownMemberType]
                    except nats.js.errors.BadRequestError:
                        continue  # created by another instance meanwhile
                else:
                    config = info.config
                    self._raise_problems(history_problems(config, self._names, size))
                    if (config.max_msgs_per_subject or 0) < size:
                        grown = dataclasses.replace(config, max_msgs_per_subject=size)
                        info = await js.update_stream(grown)  # pyright: ignore[reportUnknownMemberType]
                self._msg_ttl = bool(info.config.allow_msg_ttl)
                self._history_size = size
                return
            raise BackendError(f"{BACKEND}: stream {self._names.history} keeps changing")

    def _server_has_msg_ttl(self) -> bool:
        version = self._nc.connected_server_version if self._nc is not None else None
        return version is not None and (version.major, version.minor) >= MSG_TTL

    # -- the fleet's records: the backend's key-value buckets (``_fleet``) ---------------------

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._client._buckets().read(kind)

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._client._buckets().put(kind, key, value, ttl=ttl)

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._client._buckets().swap(kind, key, old, new)

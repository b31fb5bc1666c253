"""``NATSLeaseBackend``: leases on a NATS JetStream key-value bucket.

Layout (``B`` the bucket)::

    KV bucket B (stream KV_B)    key job.<job>: the job's row (fences, the leases by slot),
                                 JSON; key clock: the probe of the server's clock
    stream B-history             subject B.history.<job>: the runs, newest last

Every transition (acquire, renew, release, take-over) reads the job's row and the server's
clock, applies the lease protocol (``_lease.decide``) and writes the new row with
``kv.update(key, value, last=revision)`` (``kv.create`` for the first): a compare-and-set on the
entry's revision, so concurrent decisions on a job are serialized by the bucket's stream
leader, and a lost race reads again (``_rows``). Rows are read from the leader, never from a
replica (the bucket has no direct gets): a stale row would only lose its compare-and-set, but
a renewal read from a replica that had not seen the lease yet would abort a healthy run.

Time: the server's clock, read as the timestamp JetStream stores with a message (a probe
written to the bucket's ``clock`` key and read back: two round trips, shared by the decisions
that start while one is in flight; it works on nats-server 2.9). Lease expiry and
``max_clock_skew`` are judged on it, as PostgreSQL's ``clock_timestamp()`` is.

History: one stream, a subject per job, ``max_msgs_per_subject`` the largest ``history_size``
of the jobs (reads are trimmed to each job's own). ``history_ttl``: on nats-server 2.11+ each
run is published with a per-message TTL (``Nats-TTL``, on a stream created with
``allow_msg_ttl``) and the server drops it; on 2.9 and 2.10 runs older than the TTL are left
out of every read, and leave the stream when ``history_size`` pushes them out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self

from ..._clock import Clock
from ..._durations import Duration
from ..._exceptions import BackendError, BackendUnavailableError
from ...abc import (
    Claim,
    Finding,
    FleetKind,
    Inventory,
    JobPolicy,
    Lease,
    LeaseState,
    RunRecord,
    Slot,
)
from .._keywords import own_options, refuse_unknown
from .._lease import (
    DEFAULT_MAX_CLOCK_SKEW,
    Acquire,
    Answer,
    ClockName,
    Ending,
    Granted,
    LeaseBackendBase,
    Release,
    Renew,
    Request,
    TakenOver,
    TakeOver,
    new_token,
)
from .._ops import server_finding
from . import _ops
from ._bucket import (
    BACKEND,
    MSG_TTL,
    OPERATION_TIMEOUT_S,
    SERIAL_CAS,
    bucket_problems,
    check_bucket,
    kv_stream,
)
from ._connection import NATSClientBase, OwnBucket, server_version
from ._errors import (
    connect_keywords,
    describe,
    logger,
)
from ._fleet import bucket_streams
from ._link import KVLink
from ._names import Names
from ._options import NATSLeaseOptions
from ._rows import Rows
from ._stream_settings import history_problems

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js import JetStreamContext

__all__ = ["NATSLeaseBackend"]


#: NATSBackend's options that a user moving to leases may pass, and what to pass instead.
_NOT_HERE = {
    "prefix": "NATSLeaseBackend names what it makes after bucket= (the KV bucket, and the "
    "stream <bucket>-history)",
    "slot_ttl": "a lease backend remembers every claimed slot (fencing); its option is lease_ttl",
}


class NATSLeaseBackend(NATSClientBase, LeaseBackendBase):
    """Leases on a NATS JetStream key-value bucket: occurrence fencing, overlap control,
    take-over of dead runners, catch-up and manual runs, judged on the NATS server's clock.

    ``servers``: one URL or a list (as for ``NATSBackend``). ``bucket``: the KV bucket (and
    the prefix of the history stream, ``<bucket>-history``); 1-64 letters, digits, ``_`` or
    ``-``. ``lease_ttl``: how long a lease lives unless renewed. ``replicas``: of the bucket
    and the history stream, in a cluster. ``max_clock_skew``: how far ahead of the server's
    clock a claimed slot may be. ``budget_interval``: as for ``NATSBackend`` (while shedding
    no new lease is taken; renewals and releases go on). Other keywords go to
    ``nats.connect`` (never logged).
    """

    clock_name = ClockName("the NATS server's clock", "the NATS server")
    _log = logger
    _backend = BACKEND

    def __init__(
        self,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        *,
        bucket: str = "brokersched-leases",
        lease_ttl: Duration = "30s",
        replicas: int = 1,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
        budget_interval: Duration | None = "30s",
        **connect_options: Any,
    ) -> None:
        options = NATSLeaseOptions.parse(BACKEND, locals())
        super().__init__(options)
        refuse_unknown(
            BACKEND,
            connect_options,
            own=own_options(NATSLeaseBackend),
            library="nats.connect",
            accepted=connect_keywords,
            reserved=_NOT_HERE,
        )
        self._keep_client(options, connect_options)
        self._bucket, self._names = options.bucket, Names(options.bucket)
        self._clock: Clock | None = None
        self._rows: Rows | None = None
        #: For tests: decisions judge time as if the server's clock read this (ms); ``None``
        #: (always, in production): the server's clock.
        self.store_time: int | None = None
        self._link: KVLink = OwnBucket(
            self, self._bucket, replicas=options.replicas, store_time=lambda: self.store_time
        )

    @classmethod
    def over(
        cls,
        link: KVLink,
        *,
        lease_ttl: Duration = "30s",
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
    ) -> Self:
        """A backend whose bucket, history stream and fleet's records are ``link``'s instead
        of its own connection's: the fleet simulator makes the real backend over its model
        of a bucket this way (``_link``). ``inventory()``, ``purge()`` and ``doctor()`` still
        connect to the default server."""
        backend = cls(lease_ttl=lease_ttl, max_clock_skew=max_clock_skew)
        backend._link = link
        return backend

    def __repr__(self) -> str:
        return f"{BACKEND}({self._shown_servers!r}, bucket={self._bucket!r})"

    @property
    def bucket(self) -> str:
        return self._bucket

    # -- lifecycle ---------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        table = await self._link.open(clock)
        self._clock = clock
        self._rows = Rows(
            table,
            BACKEND,
            self._link.monotonic,
            self._link.sleep,
            blocking=clock.blocking,
            bound=clock.timeout,
        )

    def _callbacks(self) -> dict[str, Callable[..., Awaitable[None]]]:
        """Logging nats-py's errors, unless the caller gave an ``error_cb``."""
        return {} if "error_cb" in self._connect_options else {"error_cb": self._on_error}

    async def _on_error(self, exc: Exception) -> None:
        connected = self._nc is not None and self._nc.is_connected
        logger.log(
            logging.WARNING if connected else logging.DEBUG,
            "%s: NATS error: %s",
            BACKEND,
            describe(exc, self._secrets),
        )

    async def _close(self) -> None:
        await self._link.close()
        self._clock, self._rows = None, None

    def _namespace(self, namespace: str | None) -> str:
        return self._bucket if namespace is None else check_bucket(namespace, BACKEND)

    def _lease_rows(self) -> Rows:
        if self._rows is None:
            raise BackendUnavailableError(f"{BACKEND} is not started (call start() first)")
        return self._rows

    # -- leases ------------------------------------------------------------------------------

    async def _decide(
        self, job: str, request: Request, timeout: float, *what: str
    ) -> tuple[Answer, int]:
        """The lease protocol's answer to ``request`` on the job's row (``Rows.decide``), and
        the server's clock it was decided at; ``what`` names the call in errors."""
        rows = self._lease_rows()
        with self._translated(*what):
            return await rows.decide(
                job, request, ttl_ms=self._ttl_ms, skew_ms=self._skew_ms, timeout=timeout
            )

    async def _acquire(self, claim: Claim, instance_id: str, timeout: float) -> Granted:
        slot = claim.slot
        if self._budget is not None:  # no new lease near the account's limits
            self._budget.refuse_if_shedding(f"the lease of {slot.key} is not taken")
        request = Acquire(
            slot.slot_ms, claim.reason, claim.policy.overlap, new_token(), claim.run_id,
            instance_id, self._instance_now(),
        )  # fmt: skip
        answer, now = await self._decide(slot.job, request, timeout, "claim", slot.key)
        granted = isinstance(answer, Lease)
        self._check_slot_time(slot, now, self._clock, granted=granted)  # raises when too far
        assert isinstance(answer, Lease) or answer in ("overlap", "not-acquired")
        return answer

    async def renew(self, lease: Lease) -> bool:
        """Answers within a third of ``lease_ttl``."""
        renew = Renew(lease.slot_ms, lease.token)
        answer, _ = await self._decide(
            lease.job, renew, self._renew_timeout, "renew", lease.slot.key
        )
        return answer is True

    async def _end_lease(self, lease: Lease, handover: bool, record: Ending) -> None:
        """The run's record first (a stream beside the bucket: no write spans both): its
        message id makes a retried release write it once."""
        self._lease_rows()  # not started: no record either
        if record is not None:
            await self.record(*record)
        release = Release(lease.slot_ms, lease.token, handover)
        await self._decide(lease.job, release, self._renew_timeout, "release", lease.slot.key)

    async def lease_state(self, job: str) -> LeaseState:
        rows = self._lease_rows()
        with self._translated("read the leases of", repr(job)):
            return await rows.read_at(job, OPERATION_TIMEOUT_S)

    async def _take_over_job(self, policy: JobPolicy, instance_id: str) -> list[Lease]:
        """With a lease in the job's row: the lease protocol's take-over, one
        compare-and-set; the dead attempts are recorded after it landed."""
        rows, what = self._lease_rows(), ("take over the slots of", repr(policy.name))
        with self._translated(*what):
            if not (await rows.read(policy.name, OPERATION_TIMEOUT_S)).leases:
                return []  # nothing runs nor waits: no need of the server's clock
        request = TakeOver(policy, instance_id, self._instance_now())
        taken, _ = await self._decide(policy.name, request, OPERATION_TIMEOUT_S, *what)
        assert isinstance(taken, TakenOver)
        for record in taken.records:
            try:
                await self.record(policy, record)
            except BackendError:
                logger.warning(
                    "%s: the interrupted run %s of %s could not be recorded",
                    BACKEND, record.run_id, Slot(record.job, record.slot_ms).key, exc_info=True,
                )  # fmt: skip
        return taken.leases

    def _instance_now(self) -> int:
        """The scheduler's clock, which history times are on (as on every backend)."""
        if self._clock is None:
            raise BackendUnavailableError(f"{BACKEND} is not started (call start() first)")
        return self._clock.now_ms()

    # -- history -----------------------------------------------------------------------------

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        if jobs:
            await self._link.prepare(max(job.history_size for job in jobs))

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self._link.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await self._link.history(job, limit)

    # -- the fleet's records -----------------------------------------------------------------

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await self._link.fleet_read(kind)

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await self._link.fleet_put(kind, key, value, ttl=ttl)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await self._link.fleet_swap(kind, key, old, new)

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    async def _inventory(self, namespace: str | None) -> Inventory:
        """The bucket's stream and the history stream. Live: a message stored in the last
        minute (every decision writes the clock probe)."""
        bucket = self._namespace(namespace)
        return await self._operation("list its streams", _stream_inventory, bucket)

    async def purge(self, inventory: Inventory) -> Inventory:
        async def purge(js: JetStreamContext, found: Inventory) -> Inventory:
            await _ops.delete_streams(js, found, _streams(found.namespace))
            return await _stream_inventory(js, found.namespace)

        return await self._operation("delete its streams", purge, inventory)

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        async def check(js: JetStreamContext, nc: NATSClient) -> list[Finding]:
            version, shown = nc.connected_server_version, server_version(nc)
            findings = [server_finding("nats-server", shown, _ops.MIN_VERSION)]
            stream = kv_stream(self._bucket)
            info = await _ops.stream_info_or_none(js, stream)
            if info is None:
                findings.append(
                    Finding(
                        "ok", "bucket", f"no bucket {self._bucket} yet: the first start makes it"
                    )
                )
            else:
                findings += _ops.problem_findings(
                    stream, bucket_problems(info.config, nc.max_payload)
                )
                findings.append(_ops.replicas_finding(stream, info, self._replicas))
                replicas = info.config.num_replicas or 1
                old = version is not None and (version.major, version.minor) < SERIAL_CAS
                if replicas > 1 and old:
                    findings.append(
                        Finding(
                            "error",
                            f"stream {stream} replicas",
                            f"{replicas} replicas on nats-server {shown}",
                            "its compare-and-sets are not serialized: a slot can run twice "
                            "(nats-io/nats-server#4320)",
                            "upgrade the servers to 2.11 or later, or use one replica",
                        )
                    )
            history = await _ops.stream_info_or_none(js, self._names.history)
            if history is not None:
                problems = history_problems(history.config, self._names)
                findings += _ops.problem_findings(self._names.history, problems)
            if version is not None and (version.major, version.minor) < MSG_TTL:
                findings.append(
                    Finding(
                        "ok",
                        "history_ttl",
                        f"nats-server {shown} has no per-message TTL",
                        "runs older than a job's history_ttl are left out of reads, and stay "
                        "stored until history_size pushes them out",
                        "nats-server 2.11+ drops them (a history stream created there)",
                    )
                )
            return findings

        return await self._operation("check its bucket", check, with_client=True)


def _streams(bucket: str) -> tuple[str, ...]:
    return kv_stream(bucket), Names(bucket).history, *bucket_streams(bucket)


async def _stream_inventory(js: JetStreamContext, bucket: str) -> Inventory:
    return await _ops.streams_inventory(js, BACKEND, bucket, _streams(bucket))

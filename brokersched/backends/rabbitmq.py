"""RabbitMQ: a claim-only backend on the broker the application already has.

How a claim works
    Every slot gets its own durable classic queue ``<prefix>.claim.<job>.<slot_ms>`` declared
    with ``x-max-length=1``, ``x-overflow=reject-publish`` and ``x-expires`` = the fleet's slot
    memory (below). A claim publishes one persistent message to it through the default
    exchange, ``mandatory=True``, on a channel in publisher-confirm mode. The broker acks the
    first message (won) and nacks every later one while the queue holds it (lost). So a claim
    publishes *first*: a nack is the whole of a losing claim (one publish; no declare, which
    for a durable queue is a metadata transaction across a cluster), but for the first loss of
    a job and then one a minute, which declares the queue to check that brokersched made it
    (``_check_refusal``: a queue made beforehand by something else, holding a message, would
    refuse every claim of its slot, and nobody would say why). A publish that comes back
    unrouted (no queue yet, or its node is down) makes the claim check the fleet's fence
    exchange, declare the queue and publish again; one acked by an existing empty queue (its
    maker's publish still on the way) is checked with a declare of the queue (``406`` when it
    was made under another memory, or no message in it when it was deleted since: fail
    closed; an outdated view is read again and the check made under the new one, so a raise
    costs no run). The queue expires when nobody has declared
    it for the slot memory, so the slot is remembered that long after the claim that made it.
    Nothing ever consumes a claim queue: a message taken out of it would let the next publish
    in. The instance that won a job's slot declares the queue of the job's next slot half a
    second before it (``prepare_claims``, at most 750 ms before): the claims of the instant,
    often made all at once by every instance, then find it, and the broker creates no queue
    while they wait (a queue declared under a memory that changed before the instant makes its
    claims fail closed, as above; ``declare_ahead=False`` turns it off).

One slot memory per fleet (issue 18)
    A claim queue keeps the ``x-expires`` of whoever declared it first. Were that each
    instance's own ``slot_ttl``, an instance with 2s would win a slot, its queue would vanish
    after 2s, and an instance with 20s, later by jitter but within its larger ``max_late``,
    would win the slot again. So every instance of a prefix uses the *fleet's* slot memory:

    * The record: a durable queue ``<prefix>.slot-memory`` holding one JSON message, the slot
      memory (the longest ``slot_ttl`` seen since the record was created), when the record was
      created and when it was raised from what. It is read and written only under a lock, an
      exclusive consumer on ``<prefix>.slot-memory.lock`` (released when its channel closes,
      also when the holder's connection dies): instances starting together queue up.
    * ``start()`` adopts the record when its ``slot_ttl`` is not longer (a longer memory is
      always safe), and makes it when there is none. A longer ``slot_ttl`` raises the record,
      but only once the instance will claim: in ``prepare()`` (the scheduler calls it with its
      jobs before it arms any), else at its first claim. A script that only reads history
      with the default ``slot_ttl`` never raises a fleet's memory.
    * The fence: a durable exchange ``<prefix>.slot-memory.<ms>ms`` per slot memory, bound to
      the record queue (auto-delete: deleting the record queue deletes every fence). A raise
      creates the new fence and deletes the old one before it writes the record. Every claim
      checks its view's fence first (a passive declare, after the slot's instant): an instance
      whose view was overtaken gets ``404`` before it declares anything, reads the record
      again and claims with the new memory. A rolling deploy that raises ``slot_ttl`` needs
      no downtime and no operator step.
    * Why that is enough: a claim made under memory ``m`` saw the fence of ``m`` after the
      slot's instant, so that slot fell due before ``m`` was raised. The record keeps the
      recent raises; an instance claims a slot that fell due before a raise from ``m`` at most
      ``m`` late (a little less), and a slot that fell due before the record was (re)created
      not at all when late: while a queue made under ``m`` can still exist it sees it
      (declaring with another ``x-expires`` gets ``406``; a queue that holds a claim is a
      loss, an empty one fails closed), and later it does not claim. So two claims of a slot
      never both win, however the instances' starts interleave with the raise. (This holds
      for claims made at or after the slot's instant, as the scheduler makes them, on clocks
      that agree, as the scheduler already requires.)
    * No claim of a slot the broker may have forgotten: a claim queue may expire once the slot
      is the fleet's memory old, and a claim then would win a slot that already ran. So every
      claim, ``claim()`` called directly included, must be done (its declare and publish) before
      the slot is the memory minus 1 s old, else it is refused (``BackendError``: the
      scheduler skips the slot with ``backend-error``). The scheduler itself never claims that
      late: ``jitter + max_late`` stay below ``slot_ttl`` and its claims stop 1 s before.
    * Lowering: an instance with a shorter ``slot_ttl`` keeps the fleet's longer memory. To
      lower it, deploy the shorter ``slot_ttl`` everywhere, then delete the record queue
      (``rabbitmqctl delete_queue <prefix>.slot-memory``): every fence goes with it, the
      next claims find no fence, and the record is made again from the ``slot_ttl`` of the
      instances still running (the longest wins again). Slots falling due around that moment
      may be skipped (``backend-error``), never run twice.
    * Instances of brokersched before this scheme know nothing of the record or the fences:
      change ``slot_ttl`` only once every instance runs a version that does.

Why each detail (measured on RabbitMQ 3.10)
    * Classic, never quorum: quorum queues do not enforce ``reject-publish`` exactly and let
      two or more claims of one slot win. ``x-queue-type`` is set explicitly because a vhost may
      default to quorum queues.
    * Durable queue, persistent message: a transient queue vanishes with a broker restart, after
      which a late claimer would win a slot that already ran. The record, the lock and the
      fences are durable too; a broker that loses its definitions loses every claim anyway.
    * No ``x-message-ttl``: a late claimer would win once the message expired.
    * Nothing reads the message in a claim queue, not even to put it back: a queue's cap counts
      ready messages, so while one is out (a ``basic.get`` before its reject) the next claim's
      publish is acked, and that claim wins the slot a second time (measured on 3.10).
      Brokersched tells its own queues from others by their arguments (a declare), never by
      what they hold.
    * A ``406`` names the first argument that differs: ``x-expires`` set on both sides is
      another slot memory (a fleet in a raise, or an older brokersched); anything else means
      brokersched did not make the queue, and the claim fails closed saying what differs.
    * ``mandatory=True``: without it a publish to a queue that does not exist (or expired
      between the declare and the publish) is acked, a false win. A returned message makes the
      claim declare the queue.
    * Plain channels on the robust connection, never robust channels: a robust channel would
      re-declare every slot queue it ever saw after a reconnect (a leak, and a way to
      resurrect a forgotten slot); a plain channel remembers nothing (the ``robust=False``
      declare of the issue, for every declare).
    * A pool of channels, each used by one operation at a time: synchronous AMQP methods
      serialise per channel, and a channel error (``404`` from a fence that is gone, ``406``
      from a claim queue declared with another memory) closes only the channel it happened
      on, which the pool then replaces.

Failures
    A claim that gets no definite answer within its deadline, or whose connection drops after
    the publish left and before the confirm came back, raises ``BackendError``: the scheduler
    skips the slot (``backend-error``). An ambiguous claim may have won on the broker, in which
    case nobody runs the slot; it is never run twice. The connection is robust: it reconnects by
    itself and claims resume.

History
    One stream ``<prefix>.history`` per prefix (``x-queue-type: stream``, 16 MiB kept in 1 MiB
    segments), every job's records in it with the job in a header: replicated, so a cluster
    keeps recording and reading it while a node is down, and it costs the broker no handle of
    its file-handle cache (a quorum queue per job held 3, and a 3.x node with the Debian
    open-files limit of 1024 stopped answering at ~310 of them: issue 28). A read finds the
    end with a marker it appends and steps back from there until it has the job's newest
    ``min(limit, history_size)`` records (see ``_read_stream``); records are trimmed by count
    only, so ``history_ttl`` is refused. The per-job quorum history queue of an earlier
    brokersched is still read, merged with the stream, and reported once per job.

Broker cost
    One live queue per job per slot claimed within the fleet's slot memory: a job running every
    ``interval`` keeps about ``memory / interval + 1`` claim queues alive, each costing roughly
    30-37 KB of broker memory (measured on 3.10). Per prefix: the record and lock queues, one
    fence exchange and the history stream. Broker CPU (3.10, ``bench/bench_rabbitmq.py
    --cpu``): 4-5 ms per winning claim and 1.1-1.4 ms for its queue's expiry later, 0.35 ms
    per losing claim.

Overload
    A claim waits for one of the pool's ``channels``; one that finds none free within a quarter
    of ``claim_timeout`` is skipped (``BackendError``, "overloaded"): past what the broker can
    answer, slots are skipped at once instead of piling up and running late.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import random
import re
import shlex
import uuid
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar
from urllib.parse import parse_qs, urlsplit

from .. import _redact
from .._clock import Clock, host_time_ms
from .._durations import Duration, format_duration, positive_duration, to_ms
from .._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ConfigurationError,
)
from .._tasks import cancel_requests, raise_if_cancelled_since, to_the_end
from ..abc import Capabilities, ClaimBackend, Finding, Inventory, JobPolicy, RunRecord, Slot
from . import _rabbitmq_ops
from ._claims import BOOT_MEMORY, DEFAULT_CLAIM_SKEW, FleetMemory, margin_ms
from ._keywords import own_options, parameter_names, refuse_unknown
from ._lease import check_max_clock_skew

if TYPE_CHECKING:
    from aio_pika.abc import (
        AbstractChannel,
        AbstractIncomingMessage,
        AbstractMessage,
        AbstractQueue,
        AbstractRobustConnection,
    )
    from pamqp.common import FieldTable

__all__ = [
    "RabbitMQBackend",
    "claim_margin_ms",
    "claim_queue_name",
    "fence_exchange_name",
    "history_queue_name",
    "history_stream_name",
    "lock_queue_name",
    "record_queue_name",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

_INSTALL_HINT = "pip install 'brokersched[rabbitmq]'"
_MAX_QUEUE_NAME = 255  # bytes, an AMQP short string
_SLOT_WIDTH = 20  # characters of the widest slot_ms (a signed 64-bit integer)
_HASH_HEX = 32  # 128 bits of SHA-256: names of over-long jobs stay collision-free
_NAME_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
# No '.' in a prefix: '.' separates the parts of a queue name, and a prefix holding one would
# make ``P`` + job ``claim.x`` and ``P.claim`` + job ``x`` share a queue.
_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,99}")
_LONGEST_KIND = ".history."
_DECLARE_ATTEMPTS = 3  # a claim queue can expire between declare and publish; rarely twice
_OPERATION_TIMEOUT_S = 10.0  # record(), history() and prepare(): not time-critical, but bounded
_READER_RETRY_S = 0.05  # another history reader holds the exclusive consumer
# The history stream (one per prefix): its retention, whole segments dropped oldest first. A
# record takes ~520 bytes in it (measured on 3.10): 16 MiB hold ~32k records, what a read may
# step back over (_HISTORY_SCAN_MAX) at ~0.15 ms of broker CPU and ~3k records a second each.
_HISTORY_STREAM_BYTES = 16 * 1024 * 1024
_HISTORY_SEGMENT_BYTES = 1024 * 1024
_HISTORY_SCAN_MAX = 32_000
_HISTORY_READ_S = 30.0
_HISTORY_PREFETCH = 1000  # stream deliveries in flight to a reader (acked by halves)
_HISTORY_STEP = 256  # a read steps back at least this many offsets at a time
_NO_LOCAL_REPLICA = "does not have a replica on the local node"  # a stream's replica starting
_REPLICA_RETRY_S = 0.05
_JOB_HEADER = "bs-job"  # a history record's job
_MARK_HEADER = "bs-mark"  # a reader's end marker (no record): skipped by every reader
_MAX_PREFETCH = 65535  # AMQP's prefetch count is 16 bits
_CHANNEL_OPEN_S = 10.0  # a channel the broker has not opened by then is given up (backing off)
_BACKOFF_FIRST_S = 0.5
_CLOSE_STUCK_S = 1.0  # a channel close unanswered this long counts against new opens
_BACKOFF_MAX_S = 10.0
_LOCK_RETRY_S = (0.01, 0.1)  # another instance holds the slot-memory lock: wait this long
_VIEW_ATTEMPTS = 4  # a claim reads the record again at most this often (raises are rare)
_DEFAULT_SKEW_MS = to_ms(DEFAULT_CLAIM_SKEW)
# A boot window's claim queue (claim_boot): the fleet's memory does not apply to it.
_BOOT_QUEUE: FieldTable = {
    "x-queue-type": "classic",
    "x-max-length": 1,
    "x-overflow": "reject-publish",
    "x-expires": to_ms(BOOT_MEMORY),
}
# prepare_claims() declares a slot's claim queue at most this long (or a quarter of the slot
# memory) before the slot: the queue then expires at least memory minus that after the slot if
# its winner dies before its check renews it, so claims stop that much earlier too.
_PREPARED_AHEAD_MS = 750
# A claim refused at its first publish checks that the queue refusing it is brokersched's at most
# this often per job (see _check_refusal): the first loss of a job, then one a minute.
_REFUSAL_CHECK_EVERY_MS = 60_000


def _prepared_ahead_ms(memory_ms: int) -> int:
    return min(_PREPARED_AHEAD_MS, memory_ms // 4)


def claim_margin_ms(memory_ms: int, skew_ms: int = _DEFAULT_SKEW_MS) -> int:
    """How long before a slot is ``memory_ms`` (the memory that applies to it) old its claims
    are refused: the clocks' skew, a claim's flight and how long before its slot a claim queue
    may have been declared (``_claims.margin_ms``); 2 s with a memory of 8 s or more."""
    return margin_ms(memory_ms, skew_ms=skew_ms, lead_ms=_prepared_ahead_ms(memory_ms))


_RECORD_VERSION = 1
_HOME_NODE = re.compile(r"home node '([^']+)'")  # RabbitMQ's 404 for a queue on a down node
_PLAIN: FieldTable = {"x-queue-type": "classic"}  # a vhost may default to quorum queues
_CONNECT_SETTLE_S = 1.0  # a cancelled start() lets a connection attempt end this long (_abandon)
_CONNECT_DEFAULTS: Mapping[str, Any] = {
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
_RESERVED_CONNECT = {"connection_class": "RabbitMQBackend connects with its own class"}


def _connect_keywords() -> set[str]:
    """The keywords ``aio_pika.connect_robust`` really accepts: its own, those of the
    connection classes, their ``PARAMETERS`` and the URL query keys aiormq reads."""
    import aio_pika

    names = parameter_names(
        aio_pika.connect_robust, aio_pika.RobustConnection.__init__, aio_pika.Connection.__init__
    )
    names |= {parameter.name for parameter in aio_pika.RobustConnection.PARAMETERS}
    return (names | set(_AIORMQ_URL_KEYS)) - {"url"}


class _Quiet:
    """Whether the client logs of one initial connect are being dropped (see ``_quieted``)."""

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
def _quieted() -> Generator[_Quiet, None, None]:
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


def _escape(job: str) -> str:
    """Keep ``[A-Za-z0-9_.-]``; every other character becomes ``+XX`` per UTF-8 byte.

    Queue names may only use ``[A-Za-z0-9-_.:@#,/+ ]`` (pamqp refuses others, ``$`` among
    them). The result is injective (``+`` itself is escaped) and plain ASCII. ``.`` stays
    readable: names cannot collide through it because the prefix holds no ``.`` (so it is the
    first segment and the kind the second) and the slot is always the last, all-digit segment.
    ``:`` is escaped so that a queue name never looks like a slot key.
    """
    return "".join(
        char if char in _NAME_SAFE else "".join(f"+{byte:02X}" for byte in char.encode())
        for char in job
    )


def _job_segment(prefix: str, job: str) -> str:
    """The part of a queue name that stands for ``job``, sized so every name fits 255 bytes.

    A job whose escaped name is too long keeps a readable head and ends with ``@`` and a hash
    of the whole name: ``@`` never survives escaping, so shortened names cannot collide with
    whole ones, nor (short of a SHA-256 collision) with each other.
    """
    escaped = _escape(job)
    budget = _MAX_QUEUE_NAME - len(prefix) - len(_LONGEST_KIND) - 1 - _SLOT_WIDTH
    if len(escaped) <= budget:
        return escaped
    head = escaped[: budget - 1 - _HASH_HEX]
    if "+" in head[-2:]:  # do not cut an escape in two
        head = head[: head.rindex("+")]
    return f"{head}@{hashlib.sha256(job.encode()).hexdigest()[:_HASH_HEX]}"


def claim_queue_name(prefix: str, slot: Slot) -> str:
    """``<prefix>.claim.<escaped job>.<slot_ms>``, at most 255 bytes."""
    return f"{prefix}.claim.{_job_segment(prefix, slot.job)}.{slot.slot_ms}"


def history_queue_name(prefix: str, job: str) -> str:
    """``<prefix>.history.<escaped job>``, at most 255 bytes: the per-job quorum history queue
    of brokersched before the history stream, still read when it exists (migration)."""
    return f"{prefix}.history.{_job_segment(prefix, job)}"


def history_stream_name(prefix: str) -> str:
    """``<prefix>.history``: the stream holding the run history of every job of the prefix."""
    return f"{prefix}.history"


def record_queue_name(prefix: str) -> str:
    """``<prefix>.slot-memory``: the queue holding the fleet's slot memory record."""
    return f"{prefix}.slot-memory"


def lock_queue_name(prefix: str) -> str:
    return f"{prefix}.slot-memory.lock"


def fence_exchange_name(prefix: str, memory_ms: int) -> str:
    """``<prefix>.slot-memory.<ms>ms``: exists while ``memory_ms`` is the fleet's slot memory."""
    return f"{prefix}.slot-memory.{memory_ms}ms"


# The fleet's slot memory record (``backends/_claims.py``), kept as one JSON message.
_FleetRecord = FleetMemory


def _record_json(record: FleetMemory) -> bytes:
    return json.dumps(
        {"version": _RECORD_VERSION, **record.to_dict()}, separators=(",", ":")
    ).encode()


def _record_from_json(body: bytes) -> FleetMemory:
    """Raises ``ValueError`` for what is not a record, ``_NewerRecord`` for a record of a later
    version."""
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    version = data.get("version")
    if version != _RECORD_VERSION:
        if isinstance(version, int) and version > _RECORD_VERSION:
            raise _NewerRecord(version)
        raise ValueError(f"unknown version {version!r}")
    return FleetMemory.from_dict(data)


class _NewerRecord(Exception):
    """The record was written by a later brokersched (its format version)."""


@dataclass(frozen=True, slots=True)
class _View:
    """What this instance believes the fleet's slot memory is, and the fence that proves it."""

    record: _FleetRecord
    fence: str
    claim_arguments: FieldTable


class _StaleView(Exception):
    """The view's fence is gone: the record changed since this instance read it. ``acked``:
    this claim's message is in the claim queue already (an empty queue took it)."""

    def __init__(self, *, acked: bool = False) -> None:
        super().__init__(acked)
        self.acked = acked


class _Overloaded(Exception):
    """No channel of the pool came free in time: claims arrive faster than the broker answers."""

    def __init__(self, size: int, waiting: int) -> None:
        super().__init__(size, waiting)
        self.size, self.waiting = size, waiting


class _OtherMemory(Exception):
    """The claim queue exists with another ``x-expires`` (``406``); the broker's reply."""


# What a claim queue holds of the claim that declares it: "in-it" (an empty queue took this
# claim), "refused" (the queue refused it: it held a message already), "not-yet" (no queue
# took it: the claim declares the queue before it publishes again).
_Holds = Literal["in-it", "refused", "not-yet"]

# RabbitMQ's 406 for a declare that does not match the queue (rabbit_misc, 3.x and 4.x). It names
# the first argument that differs in its own order (durable, then x-expires before the others),
# quoting each side as 'v', "the value 'v' of type 't'", or none (not set).
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<argument>[^']+)' for queue '[^']*' in vhost '.*': received"
    r" (?P<ours>.+) but current is (?P<theirs>.+?)\s*$"
)
_QUOTED = re.compile(r"(?:the value )?'(?P<value>.*?)'(?: of type '[^']*')?")


@dataclass(frozen=True, slots=True)
class _Inequivalent:
    """The difference a ``406`` names: ``ours`` what brokersched declared, ``theirs`` what the
    queue has (``None``: not set)."""

    argument: str
    ours: str | None
    theirs: str | None

    @classmethod
    def parse(cls, reply: str) -> _Inequivalent | None:
        found = _INEQUIVALENT.search(reply)
        if found is None:
            return None
        return cls(found["argument"], _unquoted(found["ours"]), _unquoted(found["theirs"]))

    @property
    def other_memory(self) -> bool:
        """Only ``x-expires`` differs so far, and both sides set it: a queue of another slot
        memory, as an instance with another view (or an older brokersched) declares it."""
        return self.argument == "x-expires" and None not in (self.ours, self.theirs)

    def __str__(self) -> str:
        theirs = "not set there" if self.theirs is None else f"{self.theirs!r} there"
        ours = (
            "brokersched does not set it"
            if self.ours is None
            else f"brokersched's is {self.ours!r}"
        )
        return f"{self.argument} is {theirs}, {ours}"


def _unquoted(value: str) -> str | None:
    if value == "none":
        return None
    found = _QUOTED.fullmatch(value)
    return found["value"] if found else value


@dataclass(slots=True)
class _ClaimAttempt:
    """``unconfirmed`` while a claim's publish may have reached the broker without its confirm
    reaching us: a failure then is ambiguous."""

    unconfirmed: bool = False


class _ChannelPool:
    """A fixed number of confirm channels, each lent to one operation at a time.

    A channel comes back to the pool only when the operation finished cleanly. Any failure
    (a broker channel error, a dropped connection, a timeout that cancelled an RPC half-way)
    may leave it closed or out of step, so it is closed and a fresh one is opened on next use.
    The channels are plain ones, not robust: a robust channel reopens itself in the background
    after an error, racing with this replacement, and would restore what it declared.

    A broker that hangs (accepts frames, answers none: a node out of file handles) must not
    get a new channel for every timed-out operation (issue 28: +3.8 channels/s per instance).
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
        """A channel for one operation; ``wait``: give up (``_Overloaded``) if none is free
        within that many seconds."""
        self.waiting += 1
        try:
            async with _maybe_timeout(wait) as window:
                held = await self._idle.get()
        except TimeoutError:
            if window is None or not window.expired():
                raise
            raise _Overloaded(self.size, self.waiting) from None
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
        task.add_done_callback(_retrieve)
        return task

    async def _open(self) -> AbstractChannel:
        loop = asyncio.get_running_loop()
        self._opens += 1
        try:
            async with asyncio.timeout(_CHANNEL_OPEN_S):
                channel = await _open_channel(self._connection, confirms=True)
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
        task = loop.create_task(_close_quietly(channel))
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


async def _open_channel(connection: AbstractRobustConnection, *, confirms: bool) -> AbstractChannel:
    from aio_pika import Channel

    await connection.ready()  # a robust connection may be between two attempts
    channel = Channel(connection, publisher_confirms=confirms, on_return_raises=confirms)
    await channel
    return channel


def _retrieve(task: asyncio.Task[Any]) -> None:
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


async def _close_quietly(channel: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await channel.close()


async def _connect_robust(
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
    """Close what a failed or cancelled ``_connect_robust`` made.

    The attempt in flight gets a moment to end first: closing a robust connection cancels its
    reconnection loop, and when that lands just as aiormq has finished connecting, aio-pika
    drops the new aiormq connection unclosed (its reader, writer and heartbeat run on). An
    attempt that is still going after the moment is waiting for the network, not finishing.
    """
    await asyncio.wait([connecting], timeout=_CONNECT_SETTLE_S)
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    for connection in made:
        await _close_for_good(connection)


async def _close_for_good(connection: AbstractRobustConnection) -> None:
    """Close ``connection`` (its reconnection loop first), bounded, raising nothing."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await connection.close()


class _StreamReads:
    """History reads of the stream asked for together share one scan (``_read_stream``).

    A page that lists every job's last run reads them all at once, and a job that never ran
    (or ran long ago) makes its read step back over the whole stream: alone, each read would
    cost the broker that scan. A read joins the batch that gathers while no scan runs, or the
    next one while one does; a reader that gives up (its timeout) leaves the scan to the
    others."""

    def __init__(
        self, scan: Callable[[Mapping[str, int]], Awaitable[dict[str, list[bytes]]]]
    ) -> None:
        self._scan = scan
        self._waiting: dict[str, list[tuple[int, asyncio.Future[list[bytes]]]]] = {}
        self._running: asyncio.Task[None] | None = None

    async def read(self, job: str, want: int) -> list[bytes]:
        """The newest ``want`` records of ``job``, newest first."""
        future: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job, []).append((want, future))
        if self._running is None:
            self._running = asyncio.create_task(self._drain(), name="brokersched-history-read")
        return await future

    async def _drain(self) -> None:
        batch: dict[str, list[tuple[int, asyncio.Future[list[bytes]]]]] = {}
        try:
            await asyncio.sleep(0)  # the reads asked for in the same turn join this batch
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                wants = {job: max(want for want, _ in readers) for job, readers in batch.items()}
                try:
                    found = await self._scan(wants)
                except Exception as exc:  # each reader raises it (translated by its caller)
                    _settle(batch, exc)
                    continue
                for job, readers in batch.items():
                    for want, future in readers:
                        if not future.done():
                            future.set_result(found[job][:want])
        finally:
            self._running = None
            closed = BackendError("the history read was cut short: the backend is closing")
            _settle(batch, closed)  # cancelled (the backend closing): nobody scans for them
            _settle(self._waiting, closed)
            self._waiting = {}

    def close(self) -> None:
        if self._running is not None:
            self._running.cancel()


def _settle(
    batch: Mapping[str, list[tuple[int, asyncio.Future[list[bytes]]]]], exc: Exception
) -> None:
    """End every reader of ``batch`` still waiting with ``exc``."""
    for readers in batch.values():
        for _, future in readers:
            if not future.done():
                future.set_exception(exc)


class RabbitMQBackend(ClaimBackend):
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
    read only by ``brokersched purge`` (to list every queue of the prefix and see running
    instances) and ``brokersched doctor`` (file descriptors, partitions, policies). Other keyword
    arguments go to ``aio_pika.connect_robust`` (``ssl_context``, ``timeout``,
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
        **connect_options: Any,
    ) -> None:
        super().__init__()
        refuse_unknown(
            self.name,
            connect_options,
            own=own_options(RabbitMQBackend),
            library="aio_pika.connect_robust",
            accepted=_connect_keywords,
            reserved=_RESERVED_CONNECT,
        )
        self._skew_ms = to_ms(check_max_clock_skew(max_clock_skew, backend=self.name))
        self._urls = _check_urls(url, self.name)
        self._management = (
            None
            if management_url is None
            else _rabbitmq_ops.Management(management_url, _url_vhost(self._urls[0]))
        )
        self._url = self._urls[0]  # the one named in messages about the login or the vhost
        self._secrets = _redact.connection_secrets(self._urls, connect_options, ("password",))
        self._slot_ttl = positive_duration(slot_ttl, option="slot_ttl", backend=self.name)
        self._claim_timeout = positive_duration(
            claim_timeout, option="claim_timeout", backend=self.name
        )
        self._prefix = _check_prefix(prefix, self.name)
        self._declare_ahead = declare_ahead
        self._channel_count = _check_channels(channels, self.name)
        # A claim waits this long for a free channel, then is skipped: under a load the broker
        # cannot carry, slots are skipped (backend-error, "overloaded") instead of piling up.
        self._channel_wait = self._claim_timeout.total_seconds() / 4
        in_url = parse_qs(urlsplit(self._url).query)  # the URL may carry its own timeout etc.
        defaults = {key: value for key, value in _CONNECT_DEFAULTS.items() if key not in in_url}
        self._connect_options = {**defaults, **connect_options}
        self._connect_options.setdefault(
            "client_properties", {"connection_name": f"brokersched ({prefix})"}
        )
        self._connection: AbstractRobustConnection | None = None
        self._pool: _ChannelPool | None = None
        self._history_ready = False  # the history stream declared on this connection
        self._old_history_warned: set[str] = set()  # jobs whose pre-stream queue was reported
        self._stream_reads = _StreamReads(self._read_stream)  # reads asked together, one scan
        self._clock: Clock | None = None
        self._view: _View | None = None  # the fleet's slot memory, as read at start or since
        self._seen_ms: int | None = None  # the record's memory when it could not be adopted
        self._refreshing: asyncio.Task[_View] | None = None
        # Per job key: when a queue that refused a claim of the job was last found brokersched's.
        self._refusals_checked: dict[str, int] = {}

    def __repr__(self) -> str:
        urls = [_redact.redact_url(url) for url in self._urls]
        shown = urls[0] if len(urls) == 1 else urls
        slot_ttl = format_duration(self._slot_ttl)
        return f"{self.name}({shown!r}, slot_ttl={slot_ttl!r}, prefix={self._prefix!r})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            leases=False,
            slot_memory=self._slot_ttl,
            history_ttl=False,
            history_size_per_job=True,
            claim_margin=timedelta(
                milliseconds=claim_margin_ms(to_ms(self._slot_ttl), self._skew_ms)
            ),
        )

    @property
    def slot_ttl(self) -> timedelta:
        return self._slot_ttl

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def fleet_slot_memory(self) -> timedelta | None:
        """How long the broker remembers a claimed slot for the whole fleet of this prefix (the
        longest ``slot_ttl`` among its instances that claim), as last read; ``None`` before
        ``start()``."""
        memory = self._view.record.memory_ms if self._view is not None else self._seen_ms
        return None if memory is None else timedelta(milliseconds=memory)

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
            self._check_parsable(url)
        shown = ", ".join(_redact.redact_url(url) for url in self._urls)
        action = f"connecting to {shown}"
        cancels = cancel_requests()
        with self._client_errors(action), _quieted() as quiet:
            try:
                connection = await self._connect_first()
            except ValueError as exc:  # aio-pika refused an option (the URL's query, a keyword)
                raise ConfigurationError(
                    f"{self.name}: {action}: {self._describe(exc)}", backend=self.name
                ) from _redact.chainable(exc, self._secrets)
            except ProbableAuthenticationError as exc:
                raise BackendUnavailableError(self._login_refused()) from _redact.chainable(
                    exc, self._secrets
                )
            except InvalidFrameError as exc:
                if not _refused_vhost(exc):
                    raise
                raise BackendUnavailableError(self._vhost_refused()) from _redact.chainable(
                    exc, self._secrets
                )
            quiet.active = False
        self._connection = connection
        self._pool = _ChannelPool(connection, self._channel_count, self.name)
        self._history_ready = False
        self._clock = clock
        _log.debug("%s connected to %s", self.name, connection)
        try:
            await self._read_record(write=False)
            raise_if_cancelled_since(cancels)
        except BaseException:
            await to_the_end(self._close())
            raise
        if self._view is None and self._seen_ms is not None:
            _log.info(
                "%s: the fleet of prefix %r remembers claimed slots for %s, shorter than this"
                " instance's slot_ttl %s: raised to it when this instance's scheduler starts"
                " (or at its first claim)",
                self.name,
                self._prefix,
                self._shown(self._seen_ms),
                format_duration(self._slot_ttl),
            )

    async def _connect_first(self) -> AbstractRobustConnection:
        """A connection to the first node that answers, in the order given; the error of the
        last one when none does. A refused login or vhost is not a node being down: raised."""
        from aiormq.exceptions import AMQPConnectionError, ProbableAuthenticationError

        for start in range(len(self._urls)):
            try:
                return await _connect_robust(self._urls, start, self._connect_options)
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
        pool, connection, refreshing = self._pool, self._connection, self._refreshing
        self._pool = self._connection = self._view = self._refreshing = None
        self._seen_ms = None
        self._refusals_checked.clear()
        self._stream_reads.close()
        if refreshing is not None and not refreshing.done():
            refreshing.cancel()
            await asyncio.gather(refreshing, return_exceptions=True)
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.close()
        if connection is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await connection.close()

    def _login_refused(self) -> str:
        user = _url_user(self._url)
        return (
            f"{self.name}: the broker at {_redact.redact_url(self._url)} refused the login of user"
            f" {user!r} (ACCESS_REFUSED): check the user name and password in the URL (with"
            " reserved characters percent-encoded), or create the user (rabbitmqctl add_user);"
            " RabbitMQ's 'guest' user may only log in from localhost"
        )

    def _vhost_refused(self) -> str:
        vhost, user = _url_vhost(self._url), _url_user(self._url)
        quoted = shlex.quote(vhost)
        return (
            f"{self.name}: the broker at {_redact.redact_url(self._url)} refused virtual host"
            f" {vhost!r}:"
            f" it does not exist, or user {user!r} has no access to it; create it and grant"
            f" access (rabbitmqctl add_vhost {quoted}; rabbitmqctl set_permissions -p {quoted}"
            f" {shlex.quote(user)} '.*' '.*' '.*'), or name an existing vhost in the URL's path"
            " (amqp://host/ is the default vhost '/')"
        )

    def _check_parsable(self, url: str) -> None:
        """Refuse a URL that aio-pika cannot parse, without the parser's message: it may quote
        a piece of a password that was cut at an unescaped ``#``, ``/`` or ``?``."""
        from yarl import URL

        try:
            URL(url).port  # noqa: B018 (older yarl checks the port when it is read)
        except ValueError:
            pass
        else:
            return
        # Raised here, outside the except block: no parser error chained to it.
        raise ConfigurationError(
            f"url {_redact.redact_url(url)!r} of {self.name} cannot be parsed: is the port a"
            " number, and are the reserved characters of the user name and password"
            " percent-encoded (@ : / ? # [ ] % as %40 %3A %2F %3F %23 %5B %5D %25)?",
            option="url",
            backend=self.name,
        )

    def _require_pool(self) -> _ChannelPool:
        if self._pool is None:
            raise BackendUnavailableError(f"{self.name} is not started; call start() first")
        return self._pool

    # -- claims ----------------------------------------------------------------------------

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        """See ``ClaimBackend.claim``. Across a change of the fleet's slot memory, two claims
        of a slot never both win as long as claims are made at or after the slot's instant
        (as the scheduler makes them); see the module's docstring."""
        pool = self._require_pool()
        queue = claim_queue_name(self._prefix, slot)
        body = json.dumps({"instance_id": instance_id, "run_id": run_id}).encode()
        deadline = min(timeout, self._claim_timeout.total_seconds())
        attempt = _ClaimAttempt()
        try:
            with self._client_errors(f"claim of slot {slot.key}"):
                async with asyncio.timeout(deadline):
                    return await self._claim_in_view(pool, queue, slot, body, attempt)
        except BackendError as exc:
            if not attempt.unconfirmed:
                raise
            _log.warning(
                "claim of slot %s is ambiguous (no confirm from the broker): treated as not won,"
                " the slot is skipped",
                slot.key,
            )
            raise BackendError(
                f"{self.name}: claim of slot {slot.key} is ambiguous (the publish left but no"
                " confirm came back); the slot is not run"
            ) from exc

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        """A fleet boot window's claim: a claim queue of its own whose ``x-expires`` is
        ``BOOT_MEMORY`` whatever the fleet's slot memory (every instance declares it alike), so
        neither the fleet's record nor its fence is involved: the first message the queue takes
        wins, every later one is nacked."""
        from aio_pika import DeliveryMode, Message

        pool = self._require_pool()
        queue = claim_queue_name(self._prefix, slot)
        body = json.dumps({"instance_id": instance_id, "run_id": run_id}).encode()
        message = Message(
            body,
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=slot.key,
        )
        attempt = _ClaimAttempt()
        deadline = min(timeout, self._claim_timeout.total_seconds())
        try:
            with self._client_errors(f"boot claim of {slot.key}"):
                async with asyncio.timeout(deadline), pool.channel(self._channel_wait) as channel:
                    for _ in range(_DECLARE_ATTEMPTS):
                        won = await self._publish(channel, queue, message, attempt)
                        if won is not None:
                            return won
                        await channel.declare_queue(queue, durable=True, arguments=_BOOT_QUEUE)
        except _Overloaded as busy:
            raise BackendError(self._overloaded(slot, busy)) from None
        raise BackendError(f"{self.name}: boot claim queue {queue!r} kept vanishing")

    async def prepare_claims(self, slots: Sequence[Slot]) -> None:
        """Declare the claim queues of ``slots`` due within the next 750 ms (others are left to
        their claims), one after the other on one channel, if one is free: claims come first."""
        if not self._declare_ahead:
            return
        pool, view = self._require_pool(), await self._require_view()
        assert self._clock is not None
        now = self._clock.now_ms()
        queues = [
            claim_queue_name(self._prefix, slot)
            for slot in slots
            if 0 < slot.slot_ms - now <= _prepared_ahead_ms(view.record.memory_ms)
        ]
        if queues:
            with self._client_errors(f"preparing the claims of {len(queues)} slots"):
                async with asyncio.timeout(_OPERATION_TIMEOUT_S), pool.channel(0) as channel:
                    for queue in queues:
                        await channel.declare_queue(
                            queue, durable=True, arguments=view.claim_arguments
                        )

    async def _claim_in_view(
        self, pool: _ChannelPool, queue: str, slot: Slot, body: bytes, attempt: _ClaimAttempt
    ) -> bool:
        """Claim under the current view; read the record again when the view proves stale."""
        acked = False  # this claim is in the queue, taken under a view that proved stale
        for _ in range(_VIEW_ATTEMPTS):
            view = await self._require_view()
            window = asyncio.timeout(self._claim_budget(view, slot))
            try:
                async with window, pool.channel(self._channel_wait) as channel:
                    return await self._claim_on(
                        channel, queue, slot, body, attempt, view, acked=acked
                    )
            except _Overloaded as busy:
                raise BackendError(self._overloaded(slot, busy)) from None
            except _StaleView as stale:
                acked = acked or stale.acked
                await self._refresh(view)
            except _OtherMemory as other:
                if await self._refresh(view) != view:
                    continue  # ours was the stale view: claim again under the new one
                if await self._held(pool, queue):
                    return False  # another instance's claim is in it: the slot is taken
                raise BackendError(
                    f"{self.name}: claim queue {queue!r} was declared with another slot memory"
                    f" ({other}); this instance uses the fleet's"
                    f" {self._shown(view.record.memory_ms)} (its own slot_ttl is"
                    f" {format_duration(self._slot_ttl)}). An instance with an outdated view"
                    " switches at its next claim; one of a brokersched version without the"
                    " fleet record must be upgraded before slot_ttl changes. The slot is not"
                    " run here"
                ) from None
            except TimeoutError:
                if not window.expired():
                    raise
                raise BackendError(self._too_late(view, slot)) from None
        raise BackendError(
            f"{self.name}: the fleet's slot memory kept changing during the claim of slot"
            f" {slot.key}; the slot is not run here"
        )

    def _overloaded(self, slot: Slot, busy: _Overloaded) -> str:
        return (
            f"{self.name}: overloaded: the claim of slot {slot.key} found none of the"
            f" {busy.size} channels free within {self._channel_wait * 1000:.0f} ms (a quarter"
            f" of claim_timeout; {busy.waiting} claims waiting): claims come faster than the"
            " broker answers, and this one is skipped rather than run late. See the README's"
            " 'Broker cost and sizing (RabbitMQ)'"
        )

    def _claim_limit_ms(self, view: _View, slot: Slot) -> int:
        """How late after its instant ``slot`` may still be claimed: the fleet's slot memory,
        or the shorter memory that may have applied to it (``FleetMemory.limit_ms``)."""
        return view.record.limit_ms(slot.slot_ms, self._skew_ms)

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        view = self._view
        if view is None:
            return super().claim_deadline_ms(slot)
        limit = self._claim_limit_ms(view, slot)
        return slot.slot_ms + limit - claim_margin_ms(limit, self._skew_ms)

    def _claim_budget(self, view: _View, slot: Slot) -> float:
        """Seconds left to claim ``slot`` safely: until it is the claim limit old, less a margin
        (the broker expires a claim queue on its own timer, not ours). Past that, the claim
        queue of an earlier claim may be gone, and this claim could win a slot that already ran:
        refused. The scheduler never claims that late (``jitter + max_late`` stay below
        ``slot_ttl``); this guards ``claim()`` called directly, and a claim held up in flight."""
        assert self._clock is not None
        limit_ms = self._claim_limit_ms(view, slot)
        left_ms = slot.slot_ms + limit_ms - claim_margin_ms(limit_ms, self._skew_ms)
        budget = (left_ms - self._clock.now_ms()) / 1000
        if budget <= 0:
            raise BackendError(self._too_late(view, slot))
        return budget

    def _too_late(self, view: _View, slot: Slot) -> str:
        assert self._clock is not None
        age = self._shown(max(self._clock.now_ms() - slot.slot_ms, 0))
        limit = self._claim_limit_ms(view, slot)
        memory_ms = view.record.memory_ms
        margin = claim_margin_ms(memory_ms, self._skew_ms)
        old = self._clock.now_ms() - slot.slot_ms >= memory_ms - margin
        if old or limit == memory_ms:
            return (
                f"{self.name}: slot {slot.key} is {age} old, too late to claim safely: the"
                f" fleet's slot memory is {self._shown(memory_ms)}, and a claim queue may expire"
                f" from then on (this refuses claims from the memory minus a"
                f" {margin}ms margin), after which a claim could win a slot that"
                " already ran; the slot is not run here. The scheduler never claims this late"
                " (jitter + max_late stay below slot_ttl): a claim made by hand, or held up"
                " in flight"
            )
        if slot.slot_ms < view.record.created_ms:
            why = "the fleet's slot memory record was made after the slot fell due"
        else:
            why = (
                f"the fleet's slot memory was {self._shown(limit)} when it fell due (raised to"
                f" {self._shown(memory_ms)} since)"
            )
        return (
            f"{self.name}: slot {slot.key} is {age} old, too late to claim safely: {why}, so an"
            " instance may have claimed it under a shorter memory that has already forgotten"
            " it; the slot is not run here"
        )

    async def _claim_on(
        self,
        channel: AbstractChannel,
        queue: str,
        slot: Slot,
        body: bytes,
        attempt: _ClaimAttempt,
        view: _View,
        *,
        acked: bool,
    ) -> bool:
        """``acked``: the claim is in the queue already (taken under a view that proved stale):
        only its check, under this view, is left."""
        from aio_pika import DeliveryMode, Message
        from aio_pika.exceptions import ChannelNotFoundEntity

        message = Message(
            body,
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=slot.key,
        )
        # Publish first: a claim queue that exists answers by itself, so a losing claim costs
        # the broker one publish, not the declare of a durable queue (a metadata transaction
        # across the cluster). Only a claim finding no queue declares it.
        # A queue on a cluster node that is down returns the publish (NO_ROUTE, measured on
        # 3.10) like a missing one: the declare below then fails closed, naming the node.
        first = True if acked else await self._publish(channel, queue, message, attempt)
        if first is False:  # refused by the queue (reject-publish): it holds a message
            await self._check_refusal(channel, queue, slot, view)
            return False
        try:  # after the slot's instant: this view's memory was the fleet's when it fell due
            await channel.declare_exchange(view.fence, passive=True)
        except ChannelNotFoundEntity as exc:
            # Stale. A claim that an empty queue took is checked again under the new view: a
            # queue of the new memory holds it as it would hold a claim made under that view.
            raise _StaleView(acked=first is True) from exc
        if first is True:  # an empty queue took it: one made under this view's memory?
            await self._declare_claim_queue(channel, queue, slot, view, holds="in-it")
            return True
        for _ in range(_DECLARE_ATTEMPTS):  # no queue yet: the first claim of the slot
            await self._declare_claim_queue(channel, queue, slot, view, holds="not-yet")
            won = await self._publish(channel, queue, message, attempt)
            if won is not None:
                return won
        raise BackendError(
            f"{self.name}: claim queue {queue!r} vanished {_DECLARE_ATTEMPTS} times between"
            " declare and publish"
        )

    async def _publish(
        self,
        channel: AbstractChannel,
        queue: str,
        message: AbstractMessage,
        attempt: _ClaimAttempt,
    ) -> bool | None:
        """Publish a claim: ``True`` acked (in the queue), ``False`` nacked (the queue holds
        another claim), ``None`` returned unrouted (no such queue, or its node is down)."""
        from aio_pika.exceptions import DeliveryError, PublishError

        attempt.unconfirmed = True
        try:
            await channel.default_exchange.publish(message, queue, mandatory=True)
        except PublishError:  # returned unrouted (a subclass of DeliveryError: first)
            attempt.unconfirmed = False
            return None
        except DeliveryError:  # nacked
            attempt.unconfirmed = False
            return False
        attempt.unconfirmed = False
        return True

    async def _check_refusal(
        self, channel: AbstractChannel, queue: str, slot: Slot, view: _View
    ) -> None:
        """The queue refused this claim: it held a message already. Check, for the first such
        loss of the job and then at most once a minute, that brokersched made the queue.

        Brokersched declares every claim queue with the same arguments (only ``x-expires``, the
        slot memory, varies), and only a claim is ever published to one. A queue made beforehand
        by something else (by hand or by another tool, capped by its arguments or by a policy)
        and holding a message refuses every claim of the slot: unchecked, every instance would
        lose, and nobody would run the slot or say why. A declare with this view's arguments
        tells: ``406`` when the queue was made otherwise (``_declare_claim_queue`` fails closed,
        naming the difference), none when it is brokersched's.

        Why not look at the message instead: a message taken out of a claim queue, even for a
        moment, lets the next publish in (its count is of ready messages; measured on 3.10), and
        that claim, made by any instance of the fleet, older versions included, would win the
        slot a second time. A declare takes nothing and decides nothing; it renews the queue's
        expiry, which only makes the slot remembered longer.

        Why not at every loss: a loss is one refused publish, and the declare adds two thirds
        to its cost on the broker (measured on 3.10, 2000 losses: 0.26-0.32 ms of broker CPU
        each, 0.43-0.54 ms checked) and halves the losses it answers per second. Something that
        makes claim queues beforehand goes on doing it, so one check a minute per job finds it,
        and a job running less often than once a minute has each of its losses checked. A queue
        made with brokersched's very arguments and a foreign message in it passes for a claim
        (the README's Limits).
        """
        assert self._clock is not None
        now_ms = self._clock.monotonic_ms()
        last_ms = self._refusals_checked.get(slot.job)
        if last_ms is not None and now_ms - last_ms < _REFUSAL_CHECK_EVERY_MS:
            return
        # _OtherMemory: brokersched's, made under another memory; a loss (the fence is not read)
        with contextlib.suppress(_OtherMemory):
            await self._declare_claim_queue(channel, queue, slot, view, holds="refused")
        self._refusals_checked[slot.job] = now_ms  # a queue found foreign is checked again

    async def _declare_claim_queue(
        self, channel: AbstractChannel, queue: str, slot: Slot, view: _View, *, holds: _Holds
    ) -> None:
        """Declare (or check) the claim queue with this view's arguments. ``holds``: whether
        this claim is in it already; if so and the queue was made under another memory, that
        claim cannot stand, and nobody else's can either: fail closed."""
        from aio_pika.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed

        try:
            declared = await channel.declare_queue(
                queue, durable=True, arguments=view.claim_arguments
            )
        except ChannelPreconditionFailed as exc:
            reply = self._describe(exc)
            found = _Inequivalent.parse(str(exc))
            # A reply this backend cannot read is taken for another memory, as before: both
            # fail closed, and that keeps a raise of slot_ttl working on such a server.
            if found is not None and not found.other_memory:
                raise BackendError(self._other_settings(queue, slot, found, holds)) from exc
            if holds != "in-it":
                raise _OtherMemory(reply) from exc
            raise BackendError(
                f"{self.name}: claim queue {queue!r} was declared with another slot memory"
                f" ({reply}); this instance uses the fleet's"
                f" {self._shown(view.record.memory_ms)} (its own slot_ttl is"
                f" {format_duration(self._slot_ttl)}). This claim is in it, so no other claim"
                " of the slot wins, and the slot is not run here. An instance with an outdated"
                " view switches at its next claim; one of a brokersched version without the"
                " fleet record must be upgraded before slot_ttl changes"
            ) from exc
        except ChannelNotFoundEntity as exc:
            raise BackendError(self._home_down(queue, slot, exc)) from exc
        if holds == "in-it" and not declared.declaration_result.message_count:
            # The queue that took this claim was deleted (by hand, or with a lost node) before
            # the check, whose declare made a new, empty one: a later claim would win that too.
            raise BackendError(
                f"{self.name}: claim queue {queue!r} was gone right after it took the claim of"
                f" slot {slot.key} (deleted meanwhile): the slot may already be claimed"
                " elsewhere, so it is not run here"
            )

    def _other_settings(self, queue: str, slot: Slot, found: _Inequivalent, holds: _Holds) -> str:
        """A claim queue that brokersched did not make: every version declares the arguments it
        does now, with only x-expires varying."""
        if holds == "in-it":
            held = (
                "This claim went into it, so no other claim of the slot can stand either, and"
                " the slot is not run here"
            )
        elif holds == "refused":
            held = (
                "It holds a message that refuses every claim of the slot (whatever put it"
                " there): no instance runs the slot"
            )
        else:
            held = "A claim in it could not be trusted, so the slot is not run here"
        return (
            f"{self.name}: claim queue {queue!r} of slot {slot.key} was made with other"
            f" settings than brokersched's ({found}; RabbitMQ names the first difference), so"
            f" not by brokersched. {held}. To fix: rabbitmqctl delete_queue {queue}, and find"
            f" what makes queues named {self._prefix}.claim.* beforehand (a script, another"
            " tool, a definitions import) or publishes into them"
        )

    def _home_down(self, queue: str, slot: Slot, exc: BaseException) -> str:
        """A claim queue on a cluster node that is down: it may hold a claim (fail closed)."""
        found = _HOME_NODE.search(str(exc))
        node = repr(found[1]) if found else "(unnamed)"
        return (
            f"{self.name}: claim queue {queue!r} of slot {slot.key} lives on node {node}, which"
            " is down or unreachable: it may hold another instance's claim, so the slot is not"
            f" run here ({self._describe(exc)})"
        )

    async def _held(self, pool: _ChannelPool, queue: str) -> bool:
        """Whether ``queue`` holds a claim (a passive declare; it does not change the queue's
        arguments, and a queue that vanished meanwhile holds none)."""
        from aio_pika.exceptions import ChannelNotFoundEntity

        try:
            async with pool.channel() as channel:
                declared = await channel.declare_queue(queue, passive=True)
        except ChannelNotFoundEntity:
            return False
        return bool(declared.declaration_result.message_count)

    async def _require_view(self) -> _View:
        """The current view; the record is raised by the first claim of an instance whose
        ``prepare()`` did not already raise it."""
        return self._view if self._view is not None else await self._refresh(None)

    @staticmethod
    def _shown(memory_ms: int) -> str:
        return format_duration(timedelta(milliseconds=memory_ms))

    # -- the fleet's slot memory ---------------------------------------------------------

    async def _refresh(self, seen: _View | None) -> _View:
        """The view after reading the record again, unless it changed since ``seen`` (then the
        current one). One reading at a time per backend; a claim that stops waiting (its
        deadline) does not cut it short: a reading cut half-way could leave a raise undone."""
        if self._view is not seen and self._view is not None:
            return self._view
        task = self._refreshing
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._settled())
            task.add_done_callback(_retrieve)
            self._refreshing = task
        return await asyncio.shield(task)

    async def _settled(self) -> _View:
        view = await self._read_record(write=True)
        assert view is not None
        return view

    async def _read_record(self, *, write: bool) -> _View | None:
        """Read the record, or make it if there is none: the view, or ``None`` while the record
        is shorter than this ``slot_ttl``. Only with ``write`` is it raised: an instance that
        only reads history, say, never raises the fleet's memory."""
        action = (
            f"reading the fleet's slot memory (queue {self._record_name!r}, under the lock"
            f" {lock_queue_name(self._prefix)!r} that instances take in turn)"
        )
        from aio_pika.exceptions import ChannelPreconditionFailed

        with self._client_errors(action):
            try:
                async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                    view = await self._settle(write=write)
            except ChannelPreconditionFailed as exc:
                raise BackendError(
                    f"{self.name}: {action} failed: a queue of it exists with other arguments"
                    f" ({self._describe(exc)}), made by something other than brokersched (a"
                    " policy does not do this). Delete it (rabbitmqctl delete_queue NAME):"
                    " brokersched makes it again, and the fleet's slot memory from the"
                    " instances' slot_ttl"
                ) from _redact.chainable(exc, self._secrets)
        if view is None:
            return None
        if view == self._view:
            return self._view  # unchanged: claims in flight keep a view that is still current
        if self._pool is not None:  # not stopped meanwhile
            self._view = view
        return view

    @property
    def _record_name(self) -> str:
        return record_queue_name(self._prefix)

    async def _settle(self, *, write: bool) -> _View | None:
        """Under the lock: read the record; adopt it, raise it to this ``slot_ttl``, or make it."""
        own = to_ms(self._slot_ttl)
        async with self._fleet_lock() as channel:
            records = await channel.declare_queue(self._record_name, durable=True, arguments=_PLAIN)
            count = records.declaration_result.message_count or 0
            message = await records.get(no_ack=False, fail=False) if count else None
            record = self._parse_record(message.body if message else None, count)
            self._seen_ms = None if record is None else record.memory_ms
            if message is None or record is None:  # none yet, or unusable
                record = await self._make_record(channel, own)
            elif record.memory_ms >= own:
                await self._put_fence(channel, records, record.memory_ms)  # back if deleted
                await self._put_back(channel, message)
                self._log_adopted(record)
            elif not write:
                await self._put_back(channel, message)
                return None
            else:
                record = await self._raise(channel, records, message, record, own)
        return self._view_of(record)

    async def _make_record(self, channel: AbstractChannel, own_ms: int) -> _FleetRecord:
        """A new record of this ``slot_ttl``, with no fence left over from before (deleting the
        record queue deletes them all)."""
        assert self._clock is not None
        await channel.queue_delete(self._record_name)
        records = await channel.declare_queue(self._record_name, durable=True, arguments=_PLAIN)
        record = FleetMemory(own_ms, self._clock.now_ms())  # after every old fence went
        await self._put_fence(channel, records, own_ms)
        await self._write_record(channel, record)
        return record

    async def _put_back(self, channel: AbstractChannel, message: AbstractIncomingMessage) -> None:
        await message.reject(requeue=True)
        # A queue answers in order: once this passive declare returns, the record is back in
        # its queue, before the lock goes with the channel.
        await channel.declare_queue(self._record_name, passive=True)

    async def _raise(
        self,
        channel: AbstractChannel,
        records: AbstractQueue,
        message: AbstractIncomingMessage,
        record: _FleetRecord,
        own_ms: int,
    ) -> _FleetRecord:
        assert self._clock is not None
        await self._put_fence(channel, records, own_ms)
        # From here on no claim under the old memory passes its fence: a slot falling due now
        # or later can only be claimed under the new one. The record keeps when this was.
        await channel.exchange_delete(fence_exchange_name(self._prefix, record.memory_ms))
        raised = record.raised(own_ms, self._clock.now_ms(), self._skew_ms)
        await message.ack()  # a crash before the write leaves no record: the next one resets
        await self._write_record(channel, raised)
        self._log_raised(record.memory_ms)
        return raised

    async def _write_record(self, channel: AbstractChannel, record: _FleetRecord) -> None:
        from aio_pika import DeliveryMode, Message

        message = Message(
            _record_json(record),
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
        )
        await channel.default_exchange.publish(message, self._record_name, mandatory=True)

    def _parse_record(self, body: bytes | None, count: int) -> _FleetRecord | None:
        if body is None:
            return None
        try:
            record = _record_from_json(body)
        except _NewerRecord as exc:
            raise BackendError(
                f"{self.name}: queue {self._record_name!r} holds a slot memory record of format"
                f" version {exc.args[0]}, written by a later brokersched: upgrade this instance"
            ) from None
        except (ValueError, TypeError, KeyError, IndexError):
            _log.warning(
                "queue %r holds a message that is not a slot memory record: made again",
                self._record_name,
            )
            return None
        if count > 1:
            _log.warning("queue %r holds %d records: made again", self._record_name, count)
            return None
        return record

    async def _put_fence(
        self, channel: AbstractChannel, records: AbstractQueue, memory_ms: int
    ) -> None:
        from aio_pika import ExchangeType

        fence = await channel.declare_exchange(
            fence_exchange_name(self._prefix, memory_ms),
            ExchangeType.DIRECT,
            durable=True,
            auto_delete=True,  # goes with the record queue's binding
        )
        await records.bind(fence, routing_key=self._record_name)

    def _view_of(self, record: _FleetRecord) -> _View:
        arguments: FieldTable = {
            "x-queue-type": "classic",
            "x-max-length": 1,
            "x-overflow": "reject-publish",
            "x-expires": record.memory_ms,
        }
        return _View(record, fence_exchange_name(self._prefix, record.memory_ms), arguments)

    def _log_adopted(self, record: _FleetRecord) -> None:
        previous = self._view.record.memory_ms if self._view is not None else None
        own = to_ms(self._slot_ttl)
        if record.memory_ms == own or record.memory_ms == previous:
            return
        _log.info(
            "%s: the fleet of prefix %r remembers claimed slots for %s (its record, queue %r),"
            " longer than this instance's slot_ttl %s: claims here use %s too (safe, it only"
            " keeps more claim queues alive). To lower it: give every instance the shorter"
            " slot_ttl, then delete the record (rabbitmqctl delete_queue %s)",
            self.name,
            self._prefix,
            self._shown(record.memory_ms),
            self._record_name,
            format_duration(self._slot_ttl),
            self._shown(record.memory_ms),
            self._record_name,
        )

    def _log_raised(self, previous_ms: int) -> None:
        _log.warning(
            "%s: raised the slot memory of the fleet of prefix %r from %s to %s (this"
            " instance's slot_ttl): instances still on %s switch at their next claim, and a"
            " slot that fell due before now is claimed at most %s late. Claim queues now live"
            " %s (broker memory grows with it); to lower it again: give every instance the"
            " shorter slot_ttl, then delete the record (rabbitmqctl delete_queue %s)",
            self.name,
            self._prefix,
            self._shown(previous_ms),
            format_duration(self._slot_ttl),
            self._shown(previous_ms),
            self._shown(previous_ms),
            format_duration(self._slot_ttl),
            self._record_name,
        )

    @contextlib.asynccontextmanager
    async def _fleet_lock(self) -> AsyncGenerator[AbstractChannel, None]:
        """A confirm channel holding the exclusive consumer of the lock queue; the lock goes
        when the channel closes (or its connection dies). Waits while another instance holds it
        (the caller's deadline bounds the wait)."""
        from aiormq.exceptions import ChannelAccessRefused

        async def ignore(message: AbstractIncomingMessage) -> None:
            """Nothing is ever published to the lock queue."""

        name = lock_queue_name(self._prefix)
        while True:
            async with self._side_channel(confirms=True) as channel:
                lock = await channel.declare_queue(name, durable=True, arguments=_PLAIN)
                if not lock.declaration_result.consumer_count:
                    try:
                        await lock.consume(ignore, exclusive=True)
                    except ChannelAccessRefused:  # another instance got there first
                        pass
                    else:
                        yield channel
                        return
            await asyncio.sleep(random.uniform(*_LOCK_RETRY_S))

    # -- history ---------------------------------------------------------------------------

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        """Raise the fleet's slot memory to this ``slot_ttl`` if it is shorter, before the
        scheduler arms anything: no slot of this instance then falls due before its raise. Then
        declare the history stream now, so a mismatch is reported at start; best effort: a
        failure is logged and ``record()`` tries again."""
        if self._connection is None:
            return
        if jobs and self._view is None:
            await self._refresh(None)
        if not jobs:
            return
        try:
            with self._client_errors("declaring the history stream"):
                async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                    await self._declare_history()
        except BackendError as exc:
            _log.warning("%s", exc)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        from aio_pika import DeliveryMode, Message
        from aio_pika.exceptions import PublishError

        pool = self._require_pool()
        stream = history_stream_name(self._prefix)
        message = Message(
            record.to_json().encode(),
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=record.run_id,
            headers={_JOB_HEADER: job.name},
        )
        with self._client_errors(f"recording run {record.run_id} of job {job.name!r}"):
            async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                for _ in range(2):
                    if not self._history_ready:
                        await self._declare_history()
                    try:
                        async with pool.channel() as channel:
                            await channel.default_exchange.publish(message, stream, mandatory=True)
                        return
                    except PublishError:  # deleted since we declared it: declare again
                        self._history_ready = False
                raise BackendError(f"{self.name}: history stream {stream!r} keeps disappearing")

    async def _declare_history(self) -> None:
        """Declare the prefix's history stream on a channel of its own (a 406 closes the
        channel it happens on)."""
        from aio_pika.exceptions import ChannelPreconditionFailed

        stream = history_stream_name(self._prefix)
        arguments: FieldTable = {
            "x-queue-type": "stream",  # replicated: history survives the loss of a node
            "x-max-length-bytes": _HISTORY_STREAM_BYTES,
            "x-stream-max-segment-size-bytes": _HISTORY_SEGMENT_BYTES,
        }
        try:
            async with self._side_channel() as channel:
                await channel.declare_queue(stream, durable=True, arguments=arguments)
        except ChannelPreconditionFailed as exc:
            # Made with other settings (by hand, or a policy-free declare with other bytes):
            # it is still a stream of this prefix's records. Keep using it, as it is.
            _log.warning(
                "history stream %r exists with other arguments (%s); records go to it as it"
                " is. To have it made again with brokersched's retention: rabbitmqctl"
                " delete_queue %s (every job's records go with it)",
                stream,
                self._describe(exc),
                stream,
            )
        self._history_ready = True

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        limit = min(limit, job.history_size)
        if limit <= 0:
            return []
        self._require_pool()
        with self._client_errors(f"reading the history of job {job.name!r}"):
            async with asyncio.timeout(_HISTORY_READ_S):
                bodies = await self._stream_reads.read(job.name, limit)
                bodies.extend(await self._read_old_queue(job.name))
        records: list[RunRecord] = []
        for body in bodies:
            try:
                records.append(RunRecord.from_json(body))
            except (ValueError, TypeError, KeyError):  # not written by brokersched: skip it
                _log.warning(
                    "the history of job %r holds a message that is not a run record", job.name
                )
        # Newest first by the stream's order, kept for equal times (a stable sort); records of
        # an old per-job queue (migration) are merged by their times.
        records.sort(key=lambda record: record.finished_at or record.started_at, reverse=True)
        return records[:limit]

    async def _read_stream(self, wants: Mapping[str, int]) -> dict[str, list[bytes]]:
        """The newest ``wants[job]`` records of each job in the history stream (fewer when the
        stream holds fewer), newest first: one scan for every job of the batch
        (``_StreamReads``: the reads asked for together, as a page listing every job's last
        run does, share it).

        The end: a stream consumer over AMQP 0-9-1 is never told it has caught up, so the
        reader attaches at the stream's last chunk and then appends a marker (an empty message
        with a header of its own, skipped by every reader): reaching its own marker is reaching
        the end as it was when the read began. Then it steps back: it reads the window
        ``[start - step, start)`` (the step doubling each time) until it has every job's
        records, or the broker starts it past where it asked (the stream's first retained
        record is within the window: nothing older exists), or it has stepped back
        ``_HISTORY_SCAN_MAX`` offsets (each message read costs the broker ~0.15 ms of CPU).
        """
        newest: dict[str, list[bytes]] = {job: [] for job in wants}  # newest first
        window = await self._read_window(newest.keys(), None, None)
        if window is None:  # a read declares nothing: no stream yet, no record
            return newest

        def short() -> bool:
            return any(len(newest[job]) < want for job, want in wants.items())

        def add(found: dict[str, list[bytes]]) -> None:
            for job, bodies in found.items():
                newest[job].extend(reversed(bodies))

        found, start, at_first = window
        add(found)
        step = max(_HISTORY_STEP, 4 * max(wants.values()))
        floor = max(0, start - _HISTORY_SCAN_MAX)  # a read's bound on the broker's work
        while short() and not at_first and start > floor:
            wanted = [job for job, want in wants.items() if len(newest[job]) < want]
            window = await self._read_window(wanted, max(floor, start - step), start)
            if window is None:
                break
            found, start, at_first = window
            add(found)
            step *= 2
        return {job: newest[job][:want] for job, want in wants.items()}

    async def _read_window(
        self, jobs: Iterable[str], begin: int | None, stop: int | None
    ) -> tuple[dict[str, list[bytes]], int, bool] | None:
        """The records of ``jobs`` (by job, oldest first) at offsets ``[begin, stop)``, where
        the read began, and whether that is the stream's first retained record.
        ``begin=None``: from the last chunk to a marker appended now. ``None`` when the stream
        is empty or gone.

        A stream just made (by another instance's first record), or whose replica on this node
        is still starting (a node back in its cluster), refuses consumers for a moment ("does
        not have a replica on the local node"): the read is tried again, on a new channel (the
        refusal closes the channel), a little later each time, within the read's timeout."""
        from aio_pika.exceptions import ChannelPreconditionFailed

        wanted, pause = list(jobs), _REPLICA_RETRY_S
        while True:
            try:
                return await self._read_window_once(wanted, begin, stop)
            except ChannelPreconditionFailed as exc:
                if _NO_LOCAL_REPLICA not in str(exc):
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    async def _read_window_once(
        self, jobs: Iterable[str], begin: int | None, stop: int | None
    ) -> tuple[dict[str, list[bytes]], int, bool] | None:
        from aio_pika import Message
        from aio_pika.exceptions import ChannelNotFoundEntity

        stream = history_stream_name(self._prefix)
        mark = uuid.uuid4().hex
        found: dict[str, list[bytes]] = {job: [] for job in jobs}
        done = asyncio.Event()
        first: list[int] = []
        seen = 0

        async with self._side_channel() as channel:
            await channel.set_qos(prefetch_count=_HISTORY_PREFETCH)
            try:
                queue = await channel.declare_queue(stream, passive=True)
            except ChannelNotFoundEntity:
                self._history_ready = False
                return None

            async def collect(message: AbstractIncomingMessage) -> None:
                # Everything before the first await: deliveries are handled in their order.
                nonlocal seen
                if done.is_set():
                    return
                headers = message.headers or {}
                offset = headers.get("x-stream-offset")
                if not isinstance(offset, int):
                    return
                if not first:
                    first.append(offset)
                if (stop is not None and offset >= stop) or _text(
                    headers.get(_MARK_HEADER)
                ) == mark:
                    done.set()
                    return
                bodies = found.get(_text(headers.get(_JOB_HEADER)) or "")
                if bodies is not None:
                    bodies.append(message.body)
                seen += 1
                if seen % (_HISTORY_PREFETCH // 2) == 0:  # streams need acks to deliver more
                    await message.ack(multiple=True)

            where: int | str = "last" if begin is None else begin
            await queue.consume(collect, arguments={"x-stream-offset": where})
            if begin is None:
                async with self._side_channel(confirms=True) as writer:
                    await writer.default_exchange.publish(
                        Message(b"", headers={_MARK_HEADER: mark}),
                        stream,
                        mandatory=True,
                    )
            await done.wait()
        if not first:
            return None
        # The broker starts a read that asks for an offset it no longer holds at its first one.
        at_first = first[0] == 0 or (begin is not None and first[0] > begin)
        return found, first[0], at_first

    async def _read_old_queue(self, job: str) -> list[bytes]:
        """The records of ``job``'s per-job history queue of an earlier brokersched
        (migration): read, left in place, newest first; warned about once."""
        queue = history_queue_name(self._prefix, job)
        bodies = await self._read_history(queue)
        if bodies and job not in self._old_history_warned:
            self._old_history_warned.add(job)
            _log.warning(
                "job %r still has the per-job history queue %r of an earlier brokersched"
                " (%d records): it is read along with the history stream %r, where new records"
                " go. It costs the broker a quorum queue (about 3 file handles); once its"
                " records are no longer wanted: rabbitmqctl delete_queue %s",
                job,
                queue,
                len(bodies),
                history_stream_name(self._prefix),
                queue,
            )
        return list(reversed(bodies))

    async def _read_history(self, queue: str) -> list[bytes]:
        """Every message of ``queue``, oldest first, left in the queue."""
        from aiormq.exceptions import ChannelAccessRefused

        while True:
            try:
                bodies = await self._read_once(queue)
            except ChannelAccessRefused:  # another reader took the exclusive consumer first
                bodies = None
            if bodies is not None:
                return bodies
            await asyncio.sleep(_READER_RETRY_S)

    async def _read_once(self, queue: str) -> list[bytes] | None:
        """The messages of ``queue``; ``None`` while another reader holds some of them.

        A reader takes every message without acking, then closes its channel: the broker puts
        them back, in order, as it removes the reader's consumer. So with no consumer on the
        queue, the ready count is the whole history; and an exclusive consumer keeps a second
        reader from taking part of it meanwhile. No prefetch limit: the queue pushes it all.
        """
        from aio_pika.exceptions import ChannelNotFoundEntity

        bodies: list[bytes] = []
        complete = asyncio.Event()
        async with self._side_channel() as channel:
            try:
                declared = await channel.declare_queue(queue, passive=True)
            except ChannelNotFoundEntity:  # no old queue: the common case
                return []
            counts = declared.declaration_result
            if counts.consumer_count:
                return None
            expected = counts.message_count or 0
            if expected == 0:
                return []
            if expected > _MAX_PREFETCH:
                raise BackendError(
                    f"{self.name}: history queue {queue!r} holds {expected} records, more than"
                    f" one read takes ({_MAX_PREFETCH}): lower history_size"
                )
            # Explicit: a quorum queue gives an unlimited consumer 2000 messages at most.
            await channel.set_qos(prefetch_count=expected)

            async def collect(message: AbstractIncomingMessage) -> None:
                bodies.append(message.body)
                if len(bodies) >= expected:
                    complete.set()

            await declared.consume(collect, exclusive=True)
            await complete.wait()
        return bodies[:expected]  # a record written meanwhile is for the next read

    @contextlib.asynccontextmanager
    async def _side_channel(
        self, *, confirms: bool = False
    ) -> AsyncGenerator[AbstractChannel, None]:
        """A short-lived channel off the pool, for declares that may fail and for reads."""
        if self._connection is None:
            raise BackendUnavailableError(f"{self.name} is not started; call start() first")
        channel = await _open_channel(self._connection, confirms=confirms)
        try:
            yield channel
        finally:
            await asyncio.shield(_close_quietly(channel))

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    _NAMES = _rabbitmq_ops.Names(
        record=record_queue_name,
        lock=lock_queue_name,
        fence=fence_exchange_name,
        history=history_queue_name,
        stream=history_stream_name,
        claim=claim_queue_name,
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
        prefix = self._prefix if namespace is None else _check_prefix(namespace, self.name)
        memories = [to_ms(self._slot_ttl), to_ms(BOOT_MEMORY)]

        async def call(channels: _rabbitmq_ops.Channels, _: dict[str, Any]) -> Inventory:
            return await _rabbitmq_ops.inventory(
                channels,
                self._NAMES,
                prefix,
                jobs=jobs,
                slots=slots,
                memories_ms=memories,
                parse=_memory_of,
                management=self._management,
                now_ms=host_time_ms(),
            )

        return await self._operation("listing its queues", call)

    async def purge(self, inventory: Inventory) -> Inventory:
        """Delete the queues and exchanges of ``inventory``; what is left of them (listed
        again with ``management_url``)."""

        async def call(channels: _rabbitmq_ops.Channels, _: dict[str, Any]) -> Inventory:
            await _rabbitmq_ops.purge(channels, inventory, self._NAMES)
            return await _rabbitmq_ops.left(channels, inventory, self._NAMES, self._management)

        return await self._operation("deleting its queues", call)

    async def doctor(self) -> list[Finding]:
        async def call(
            channels: _rabbitmq_ops.Channels, properties: dict[str, Any]
        ) -> list[Finding]:
            return await _rabbitmq_ops.doctor(
                channels,
                properties,
                self._NAMES,
                self._prefix,
                slot_ttl=self._slot_ttl,
                parse=_memory_of,
                management=self._management,
            )

        return await self._operation("checking the broker", call)

    async def _operation(
        self,
        action: str,
        call: Callable[[_rabbitmq_ops.Channels, dict[str, Any]], Awaitable[T]],
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
        shown = ", ".join(_redact.redact_url(url) for url in self._urls)
        with self._client_errors(f"{action} on {shown}"), _quieted() as quiet:
            connection = await _connect_robust(self._urls, 0, options)
            quiet.active = False
            try:

                @contextlib.asynccontextmanager
                async def channels() -> AsyncGenerator[AbstractChannel, None]:
                    channel = await _open_channel(connection, confirms=False)
                    try:
                        yield channel
                    finally:
                        await asyncio.shield(_close_quietly(channel))

                async with asyncio.timeout(_OPERATION_TIMEOUT_S * 6):
                    return await call(channels, _server_properties(connection))
            finally:
                await to_the_end(_close_for_good(connection))

    # -- errors ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _client_errors(self, action: str) -> Generator[None, None, None]:
        """Translate aio-pika/aiormq errors into ``BackendError``; no secret reaches a message."""
        from aiormq.exceptions import AMQPError

        try:
            yield
        except BrokerschedError:
            raise
        except TimeoutError as exc:
            raise BackendUnavailableError(
                f"{self.name}: {action}: no answer from the broker in time"
            ) from _redact.chainable(exc, self._secrets)
        except (ConnectionError, OSError, RuntimeError, StopAsyncIteration) as exc:
            # aio-pika's own CONNECTION_EXCEPTIONS: aiormq raises a bare RuntimeError ("...
            # closed") from channel() when the connection drops during a reconnect, and
            # ChannelInvalidStateError is a RuntimeError too.
            raise BackendUnavailableError(
                f"{self.name}: {action}: no connection to the broker ({self._describe(exc)})"
            ) from _redact.chainable(exc, self._secrets)
        except AMQPError as exc:
            raise BackendError(
                f"{self.name}: {action} failed ({self._describe(exc)})"
            ) from _redact.chainable(exc, self._secrets)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # a real cancellation of this task: never swallowed
            # aiormq fails the waiters of a closing channel or connection with CancelledError
            # although nobody cancelled this task: that is a lost connection.
            raise BackendUnavailableError(
                f"{self.name}: {action}: the connection closed while waiting for the broker"
            ) from _redact.chainable(exc, self._secrets)
        except Exception as exc:  # the contract: nothing but BackendError leaves a backend call
            raise BackendError(
                f"{self.name}: {action} failed ({self._describe(exc)})"
            ) from _redact.chainable(exc, self._secrets)

    def _describe(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {_redact.scrub(str(exc), self._secrets)}"


def _memory_of(body: bytes) -> int:
    """The memory of a slot memory record (``ValueError`` for anything else)."""
    try:
        return _record_from_json(body).memory_ms
    except _NewerRecord as exc:
        raise ValueError(str(exc)) from None


def _server_properties(connection: AbstractRobustConnection) -> dict[str, Any]:
    """What the broker told of itself in ``Connection.Start`` (version, product...)."""
    transport = connection.transport
    underlay = transport.connection if transport is not None else None
    properties = getattr(underlay, "server_properties", None)
    return dict(properties) if isinstance(properties, dict) else {}


def _text(value: object) -> str | None:
    """A header's value as text (aiormq gives long strings as ``bytes`` or ``str``)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else None


def _refused_vhost(exc: BaseException) -> bool:
    """Whether aiormq's ``InvalidFrameError`` is the broker closing the connection in answer
    to ``Connection.Open``: RabbitMQ's ``530 NOT_ALLOWED``, for a vhost that does not exist or
    that the user may not use. aiormq keeps only the frame's type (not its reply text)."""
    text = str(exc)
    return "Connection.OpenOk" in text and "Connection.Close" in text


def _url_vhost(url: str) -> str:
    """The vhost aiormq asks for: the URL's path without its first '/', or '/'."""
    from yarl import URL

    path = URL(url).path
    return path[1:].replace("%2F", "/") if path not in {"", "/"} else "/"


def _url_user(url: str) -> str:
    from yarl import URL

    return URL(url).user or "guest"  # aiormq's default login


def _check_urls(urls: object, backend: str) -> list[str]:
    """One URL, or a non-empty list of them (the nodes of a cluster)."""
    if isinstance(urls, str):
        return [_check_url(urls, backend)]
    for n, url in enumerate(urls if isinstance(urls, Sequence) else ()):
        if not isinstance(url, str):
            raise ConfigurationError(
                f"url {url!r} (item {n + 1} of the list) of {backend} must be a string, an"
                " amqp:// or amqps:// URL",
                option="url",
                backend=backend,
            )
    if not isinstance(urls, Sequence) or not urls:
        shown = type(urls).__name__ if not isinstance(urls, Sequence) else "an empty list"
        raise ConfigurationError(
            f"url of {backend} must be an amqp:// or amqps:// URL or a non-empty list of them"
            f" (one per node of a cluster), not {shown}",
            option="url",
            backend=backend,
        )
    return [_check_url(url, backend) for url in urls]


def _check_url(url: str, backend: str) -> str:
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme not in {"amqp", "amqps"}:
        raise ConfigurationError(
            f"url {_redact.redact_url(url)!r} of {backend} must start with amqp:// or amqps://",
            option="url",
            backend=backend,
        )
    return url


def _check_channels(channels: object, backend: str) -> int:
    if isinstance(channels, bool) or not isinstance(channels, int) or not 1 <= channels <= 1000:
        raise ConfigurationError(
            f"channels {channels!r} of {backend} must be an integer from 1 to 1000",
            option="channels",
            backend=backend,
        )
    return channels


def _check_prefix(prefix: object, backend: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix) or prefix == "amq":
        raise ConfigurationError(
            f"prefix {prefix!r} of {backend} must be 1-100 characters of [A-Za-z0-9_-], not"
            " starting with '-', without '.' ('.' separates the parts of queue names: write"
            " 'my-app' or 'my_app' rather than 'my.app') and other than 'amq' (queue names"
            " starting 'amq.' are reserved by RabbitMQ)",
            option="prefix",
            backend=backend,
        )
    return prefix

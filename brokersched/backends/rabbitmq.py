"""RabbitMQ: a claim-only backend on the broker the application already has.

How a claim works
    Every slot gets its own durable classic queue ``<prefix>.claim.<job>.<slot_ms>`` declared
    with ``x-max-length=1``, ``x-overflow=reject-publish`` and ``x-expires=slot_ttl``. A claim
    declares that queue and publishes one persistent message to it through the default exchange,
    ``mandatory=True``, on a channel in publisher-confirm mode. The broker acks the first message
    (won) and nacks every later one while the queue holds it (lost). The queue expires when
    nobody has declared it for ``slot_ttl``, so the slot is remembered that long after the last
    claim. Nothing ever consumes a claim queue: a message taken out of it would let the next
    publish in.

Why each detail (measured on RabbitMQ 3.10)
    * Classic, never quorum: quorum queues do not enforce ``reject-publish`` exactly and let
      two or more claims of one slot win. ``x-queue-type`` is set explicitly because a vhost may
      default to quorum queues.
    * Durable queue, persistent message: a transient queue vanishes with a broker restart, after
      which a late claimer would win a slot that already ran.
    * No ``x-message-ttl``: a late claimer would win once the message expired.
    * ``mandatory=True``: without it a publish to a queue that expired between the declare and
      the publish is acked, a false win. A returned message makes the claim declare again.
    * Plain channels on the robust connection, never robust channels: a robust channel would
      re-declare every slot queue it ever saw after a reconnect (a leak, and a way to
      resurrect a forgotten slot); a plain channel remembers nothing (the ``robust=False``
      declare of the issue, for every declare).
    * A pool of channels, each used by one operation at a time: synchronous AMQP methods
      serialise per channel, and a channel error (``406 PRECONDITION_FAILED`` when two instances
      declare a slot with different ``slot_ttl``) closes only the channel it happened on, which
      the pool then replaces.

Failures
    A claim that gets no definite answer within its deadline, or whose connection drops after
    the publish left and before the confirm came back, raises ``BackendError``: the scheduler
    skips the slot (``backend-error``). An ambiguous claim may have won on the broker, in which
    case nobody runs the slot; it is never run twice. The connection is robust: it reconnects by
    itself and claims resume.

History
    A durable classic queue ``<prefix>.history.<job>`` per job with ``x-max-length=history_size``
    (drop-head). It is read by an exclusive consumer that takes every message without acking
    them and then closes its channel, which puts them back in their original order. Records are
    trimmed by count only, so ``history_ttl`` is refused.

Broker cost
    One live queue per job per slot claimed within ``slot_ttl``: a job running every
    ``interval`` keeps about ``slot_ttl / interval + 1`` claim queues alive, each costing
    roughly 30-37 KB of broker memory (measured on 3.10).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from .. import _redact
from .._clock import Clock
from .._durations import Duration, format_duration, parse_duration, to_ms
from .._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ConfigurationError,
)
from ..abc import Capabilities, ClaimBackend, JobPolicy, RunRecord, Slot

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractRobustConnection
    from pamqp.common import FieldTable

__all__ = ["RabbitMQBackend", "claim_queue_name", "history_queue_name", "redact_url"]

_log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'brokersched[rabbitmq]'"
_MAX_QUEUE_NAME = 255  # bytes, an AMQP short string
_SLOT_WIDTH = 20  # characters of the widest slot_ms (a signed 64-bit integer)
_HASH_HEX = 32  # 128 bits of SHA-256: names of over-long jobs stay collision-free
_NAME_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_LONGEST_KIND = ".history."
_DECLARE_ATTEMPTS = 3  # a claim queue can expire between declare and publish; rarely twice
_OPERATION_TIMEOUT_S = 10.0  # record(), history() and prepare(): not time-critical, but bounded
_READER_RETRY_S = 0.05  # another history reader holds the exclusive consumer
_CONNECT_DEFAULTS: Mapping[str, Any] = {
    "timeout": 10,  # seconds for one connection attempt
    "reconnect_interval": 1,  # aio-pika waits 5 s by default; claims should resume sooner
}


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``; for logs, errors and ``repr``."""
    return _redact.redact_url(url)


def _escape(job: str) -> str:
    """Keep ``[A-Za-z0-9_.-]``; every other character becomes ``+XX`` per UTF-8 byte.

    Queue names may only use ``[A-Za-z0-9-_.:@#,/+ ]`` (pamqp refuses others, ``$`` among
    them). The result is injective (``+`` itself is escaped) and plain ASCII. ``.`` stays
    readable: names cannot collide through it because the slot is always the last, all-digit
    segment. ``:`` is escaped so that a queue name never looks like a slot key.
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
    """``<prefix>.history.<escaped job>``, at most 255 bytes."""
    return f"{prefix}.history.{_job_segment(prefix, job)}"


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
    """

    def __init__(self, connection: AbstractRobustConnection, size: int) -> None:
        self._connection = connection
        self._idle: asyncio.Queue[AbstractChannel | None] = asyncio.Queue()
        for _ in range(size):
            self._idle.put_nowait(None)  # opened on first use
        self._closing: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def channel(self) -> AsyncGenerator[AbstractChannel, None]:
        channel = await self._idle.get()
        healthy = False
        try:
            if channel is None or channel.is_closed:
                self._discard(channel)
                channel = None
                channel = await self._open()
            yield channel
            healthy = True
        finally:
            if not healthy:
                self._discard(channel)
                channel = None
            self._idle.put_nowait(channel)

    async def _open(self) -> AbstractChannel:
        return await _open_channel(self._connection, confirms=True)

    def _discard(self, channel: AbstractChannel | None) -> None:
        """Close ``channel`` in the background: the caller may be in its cancellation path."""
        if channel is None:
            return
        task = asyncio.get_running_loop().create_task(_close_quietly(channel))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        while not self._idle.empty():
            self._discard(self._idle.get_nowait())
        await asyncio.gather(*self._closing, return_exceptions=True)


async def _open_channel(connection: AbstractRobustConnection, *, confirms: bool) -> AbstractChannel:
    from aio_pika import Channel

    await connection.ready()  # a robust connection may be between two attempts
    channel = Channel(connection, publisher_confirms=confirms, on_return_raises=confirms)
    await channel
    return channel


async def _close_quietly(channel: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await channel.close()


class RabbitMQBackend(ClaimBackend):
    """Claims slots through RabbitMQ (classic queues, publisher confirms).

    ``url``: ``amqp://`` or ``amqps://``. ``slot_ttl``: how long a claimed slot is remembered
    (``jitter + max_late`` of every job must stay below it). ``prefix``: the start of every
    queue name. ``channels``: claims in flight at once. ``claim_timeout``: the longest a claim
    waits for the broker (the scheduler's own deadline applies when shorter). Other keyword
    arguments go to ``aio_pika.connect_robust`` (``ssl_context``, ``timeout``,
    ``reconnect_interval``, ``client_properties``...) and are never logged.
    """

    def __init__(
        self,
        url: str = "amqp://guest:guest@127.0.0.1/",
        *,
        slot_ttl: Duration = "5m",
        prefix: str = "brokersched",
        channels: int = 8,
        claim_timeout: Duration = "2s",
        **connect_options: Any,
    ) -> None:
        super().__init__()
        self._url = _check_url(url, self.name)
        self._secrets = _secrets(url, connect_options)
        self._slot_ttl = _positive(slot_ttl, "slot_ttl", self.name)
        self._claim_timeout = _positive(claim_timeout, "claim_timeout", self.name)
        self._prefix = _check_prefix(prefix, self.name)
        self._channel_count = _check_channels(channels, self.name)
        in_url = parse_qs(urlsplit(url).query)  # the URL may carry its own timeout etc.
        defaults = {key: value for key, value in _CONNECT_DEFAULTS.items() if key not in in_url}
        self._connect_options = {**defaults, **connect_options}
        self._connect_options.setdefault(
            "client_properties", {"connection_name": f"brokersched ({prefix})"}
        )
        self._connection: AbstractRobustConnection | None = None
        self._pool: _ChannelPool | None = None
        self._history_ready: set[str] = set()  # history queues declared on this connection
        self._claim_arguments: FieldTable = {
            "x-queue-type": "classic",
            "x-max-length": 1,
            "x-overflow": "reject-publish",
            "x-expires": to_ms(self._slot_ttl),
        }

    def __repr__(self) -> str:
        return (
            f"{self.name}({redact_url(self._url)!r}, slot_ttl={format_duration(self._slot_ttl)!r},"
            f" prefix={self._prefix!r})"
        )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            leases=False,
            slot_memory=self._slot_ttl,
            history_ttl=False,
            history_size_per_job=True,
        )

    @property
    def slot_ttl(self) -> timedelta:
        return self._slot_ttl

    @property
    def prefix(self) -> str:
        return self._prefix

    # -- lifecycle -------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        try:
            import aio_pika
        except ImportError as exc:
            raise ConfigurationError(
                f"{self.name} needs aio-pika: {_INSTALL_HINT}", backend=self.name
            ) from exc
        self._check_parsable()
        action = f"connecting to {redact_url(self._url)}"
        with self._client_errors(action):
            try:
                connection = await aio_pika.connect_robust(self._url, **self._connect_options)
            except ValueError as exc:  # aio-pika refused an option (the URL's query, a keyword)
                raise ConfigurationError(
                    f"{self.name}: {action}: {self._describe(exc)}", backend=self.name
                ) from self._chainable(exc)
        self._connection = connection
        self._pool = _ChannelPool(connection, self._channel_count)
        self._history_ready.clear()
        _log.debug("%s connected to %s", self.name, redact_url(self._url))

    async def _close(self) -> None:
        pool, connection = self._pool, self._connection
        self._pool = self._connection = None
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.close()
        if connection is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await connection.close()

    def _check_parsable(self) -> None:
        """Refuse a URL that aio-pika cannot parse, without the parser's message: it may quote
        a piece of a password that was cut at an unescaped ``#``, ``/`` or ``?``."""
        from yarl import URL

        try:
            URL(self._url).port  # noqa: B018 (older yarl checks the port when it is read)
        except ValueError:
            pass
        else:
            return
        # Raised here, outside the except block: no parser error chained to it.
        raise ConfigurationError(
            f"url {redact_url(self._url)!r} of {self.name} cannot be parsed: is the port a"
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
        pool = self._require_pool()
        queue = claim_queue_name(self._prefix, slot)
        body = json.dumps({"instance_id": instance_id, "run_id": run_id}).encode()
        deadline = min(timeout, self._claim_timeout.total_seconds())
        attempt = _ClaimAttempt()
        try:
            with self._client_errors(f"claim of slot {slot.key}"):
                async with asyncio.timeout(deadline), pool.channel() as channel:
                    return await self._claim_on(channel, queue, slot, body, attempt)
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

    async def _claim_on(
        self, channel: AbstractChannel, queue: str, slot: Slot, body: bytes, attempt: _ClaimAttempt
    ) -> bool:
        from aio_pika import DeliveryMode, Message
        from aio_pika.exceptions import ChannelPreconditionFailed, DeliveryError, PublishError

        message = Message(
            body,
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=slot.key,
        )
        for _ in range(_DECLARE_ATTEMPTS):
            try:
                await channel.declare_queue(queue, durable=True, arguments=self._claim_arguments)
            except ChannelPreconditionFailed as exc:
                raise BackendError(
                    f"{self.name}: claim queue {queue!r} exists with other arguments; every"
                    f" instance must use the same slot_ttl ({self._describe(exc)})"
                ) from exc
            attempt.unconfirmed = True
            try:
                await channel.default_exchange.publish(message, queue, mandatory=True)
            except PublishError:  # returned unrouted: the queue expired after our declare
                attempt.unconfirmed = False
                continue
            except DeliveryError:  # nacked: the queue already holds another claim
                attempt.unconfirmed = False
                return False
            attempt.unconfirmed = False
            return True
        raise BackendError(
            f"{self.name}: claim queue {queue!r} vanished {_DECLARE_ATTEMPTS} times between"
            " declare and publish"
        )

    # -- history ---------------------------------------------------------------------------

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        """Declare the history queues now, so a mismatch is reported at start. Best effort:
        a failure is logged and ``record()`` tries again."""
        if self._connection is None:
            return
        for job in jobs:
            try:
                with self._client_errors(f"declaring the history of job {job.name!r}"):
                    async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                        await self._declare_history(job)
            except BackendError as exc:
                _log.warning("%s", exc)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        from aio_pika import DeliveryMode, Message
        from aio_pika.exceptions import PublishError

        pool = self._require_pool()
        queue = history_queue_name(self._prefix, job.name)
        message = Message(
            record.to_json().encode(),
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=record.run_id,
        )
        with self._client_errors(f"recording run {record.run_id} of job {job.name!r}"):
            async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                for _ in range(2):
                    if job.name not in self._history_ready:
                        await self._declare_history(job)
                    try:
                        async with pool.channel() as channel:
                            await channel.default_exchange.publish(message, queue, mandatory=True)
                        return
                    except PublishError:  # deleted since we declared it: declare again
                        self._history_ready.discard(job.name)
                raise BackendError(f"{self.name}: history queue {queue!r} keeps disappearing")

    async def _declare_history(self, job: JobPolicy) -> None:
        """Declare on a channel of its own: a 406 closes the channel it happens on."""
        from aio_pika.exceptions import ChannelPreconditionFailed

        queue = history_queue_name(self._prefix, job.name)
        arguments: FieldTable = {
            "x-queue-type": "classic",  # quorum queues drop messages requeued too often
            "x-max-length": job.history_size,
            "x-overflow": "drop-head",
        }
        try:
            async with self._side_channel() as channel:
                await channel.declare_queue(queue, durable=True, arguments=arguments)
        except ChannelPreconditionFailed:
            # The queue exists with other arguments: history_size changed. Keep using it.
            _log.warning(
                "history queue %r exists with another length (history_size changed?); records"
                " keep the old length until the queue is deleted",
                queue,
            )
        self._history_ready.add(job.name)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        # The queue may be longer than history_size: it keeps the length it was declared with
        # (see _declare_history) after history_size was lowered.
        limit = min(limit, job.history_size)
        if limit <= 0:
            return []
        self._require_pool()
        queue = history_queue_name(self._prefix, job.name)
        with self._client_errors(f"reading the history of job {job.name!r}"):
            async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                bodies = await self._read_history(queue)
        records: list[RunRecord] = []
        for body in reversed(bodies):
            try:
                records.append(RunRecord.from_json(body))
            except (ValueError, TypeError, KeyError):  # not written by brokersched: skip it
                _log.warning("history queue %r holds a message that is not a run record", queue)
            if len(records) == limit:
                break
        return records

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
        from aio_pika.abc import AbstractIncomingMessage
        from aio_pika.exceptions import ChannelNotFoundEntity

        bodies: list[bytes] = []
        complete = asyncio.Event()
        async with self._side_channel() as channel:
            try:
                declared = await channel.declare_queue(queue, passive=True)
            except ChannelNotFoundEntity:  # no run recorded yet
                return []
            counts = declared.declaration_result
            if counts.consumer_count:
                return None
            expected = counts.message_count or 0
            if expected == 0:
                return []

            async def collect(message: AbstractIncomingMessage) -> None:
                bodies.append(message.body)
                if len(bodies) >= expected:
                    complete.set()

            await declared.consume(collect, exclusive=True)
            await complete.wait()
        return bodies[:expected]  # a record written meanwhile is for the next read

    @contextlib.asynccontextmanager
    async def _side_channel(self) -> AsyncGenerator[AbstractChannel, None]:
        """A short-lived channel off the pool, for declares that may fail and for reads."""
        if self._connection is None:
            raise BackendUnavailableError(f"{self.name} is not started; call start() first")
        channel = await _open_channel(self._connection, confirms=False)
        try:
            yield channel
        finally:
            await asyncio.shield(_close_quietly(channel))

    # -- errors ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _client_errors(self, action: str) -> Generator[None, None, None]:
        """Translate aio-pika/aiormq errors into ``BackendError``; no secret reaches a message."""
        from aiormq.exceptions import AMQPError, ChannelInvalidStateError

        try:
            yield
        except BrokerschedError:
            raise
        except TimeoutError as exc:
            raise BackendUnavailableError(
                f"{self.name}: {action}: no answer from the broker in time"
            ) from self._chainable(exc)
        except (ConnectionError, OSError, ChannelInvalidStateError) as exc:
            raise BackendUnavailableError(
                f"{self.name}: {action}: no connection to the broker ({self._describe(exc)})"
            ) from self._chainable(exc)
        except AMQPError as exc:
            raise BackendError(
                f"{self.name}: {action} failed ({self._describe(exc)})"
            ) from self._chainable(exc)

    def _describe(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {_redact.scrub(str(exc), self._secrets)}"

    def _chainable(self, exc: BaseException) -> BaseException | None:
        """``exc``, scrubbed of the password in place (with what is chained to it); ``None``
        if some text of it still carries the password."""
        return exc if _redact.scrub_exception(exc, self._secrets) else None


def _secrets(url: str, connect_options: Mapping[str, Any]) -> list[str]:
    """The forms of the URL's password, and of a ``password=`` keyword for aio-pika."""
    found = _redact.url_secrets(url)
    password = connect_options.get("password")
    if isinstance(password, str) and password:
        found.append(password)
    return sorted(set(found), key=len, reverse=True)


def _check_url(url: str, backend: str) -> str:
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme not in {"amqp", "amqps"}:
        raise ConfigurationError(
            f"url {redact_url(url)!r} of {backend} must start with amqp:// or amqps://",
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
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix) or prefix.startswith("amq."):
        raise ConfigurationError(
            f"prefix {prefix!r} of {backend} must be 1-100 characters of [A-Za-z0-9_.-], not"
            " starting with '.', '-' or 'amq.' (reserved by RabbitMQ)",
            option="prefix",
            backend=backend,
        )
    return prefix


def _positive(value: Duration, option: str, backend: str) -> timedelta:
    result = parse_duration(value, name=option)
    if result < timedelta(milliseconds=1):
        raise ConfigurationError(
            f"{option} ({value!r}) of {backend} must be at least 1ms",
            option=option,
            backend=backend,
        )
    return result

"""The run history of ``RabbitMQBackend``.

One stream ``<prefix>.history`` per prefix (``x-queue-type: stream``, 16 MiB kept in 1 MiB
segments), every job's records in it with the job in a header: replicated, so a cluster keeps
recording and reading it while a node is down, and it costs the broker no handle of its
file-handle cache (a quorum queue per job held 3, and a 3.x node with the Debian open-files
limit of 1024 stopped answering at ~310 of them). A read finds the end of the stream
without writing to it and steps back from there until it has the job's newest ``min(limit,
history_size)`` records (see ``History._read_stream``); records are trimmed by count only, so
``history_ttl`` is refused. The per-job quorum history queue of an earlier brokersched is still
read, merged with the stream, and reported once per job.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._exceptions import BackendError
from ...abc import JobPolicy, RunRecord
from ._connection import OPERATION_TIMEOUT_S, ChannelPool
from ._names import history_queue_name, history_stream_name
from ._slotmemory import SideChannels

if TYPE_CHECKING:
    from aio_pika.abc import AbstractIncomingMessage
    from aiormq.abc import DeliveredMessage
    from pamqp.common import FieldTable

__all__ = ["History"]

_log = logging.getLogger("brokersched.backends.rabbitmq")

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
# Finding the end (History._read_end): how long the stream's last chunk may take to arrive
# before the reader writes a marker to have something arrive (an empty stream), and how many
# rounds of its prefetch a reader chases writers before it writes one to stop at.
_END_PROBE_S = 2.0
_END_ROUNDS = 4
_JOB_HEADER = "bs-job"  # a history record's job
_MARK_HEADER = "bs-mark"  # a reader's end marker (no record): skipped by every reader
_MAX_PREFETCH = 65535  # AMQP's prefetch count is 16 bits


@dataclass(frozen=True, slots=True)
class _Window:
    """What one read of the stream found: the records of the jobs asked for (by job, oldest
    first), the offset where the read began, whether that is the stream's first retained
    message (nothing older exists), and how many records (not end markers) it read."""

    found: dict[str, list[bytes]]
    start: int
    at_first: bool
    records: int


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


class History:
    """The prefix's history stream (and the per-job queues of an earlier brokersched, still
    read): the only owner of what this instance knows of them."""

    def __init__(
        self,
        backend: str,
        prefix: str,
        *,
        pool: Callable[[], ChannelPool],
        channels: SideChannels,
        errors: Callable[[str], AbstractContextManager[None]],
        describe: Callable[[BaseException], str],
    ) -> None:
        self._backend = backend
        self._prefix = prefix
        self._pool = pool
        self._channels = channels
        self._errors = errors
        self._describe = describe
        self._ready = False  # the history stream declared on this connection
        self._old_history_warned: set[str] = set()  # jobs whose pre-stream queue was reported
        self._stream_reads = _StreamReads(self._read_stream)  # reads asked together, one scan

    def open(self) -> None:
        self._ready = False

    def close(self) -> None:
        self._stream_reads.close()

    async def prepare(self) -> None:
        """Declare the history stream now, so a mismatch is reported at start; best effort: a
        failure is logged and ``record()`` tries again."""
        try:
            with self._errors("declaring the history stream"):
                async with asyncio.timeout(OPERATION_TIMEOUT_S):
                    await self._declare()
        except BackendError as exc:
            _log.warning("%s", exc)

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        from aio_pika import DeliveryMode, Message
        from aio_pika.exceptions import PublishError

        pool = self._pool()
        stream = history_stream_name(self._prefix)
        message = Message(
            record.to_json().encode(),
            content_type="application/json",
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=record.run_id,
            headers={_JOB_HEADER: job.name},
        )
        with self._errors(f"recording run {record.run_id} of job {job.name!r}"):
            async with asyncio.timeout(OPERATION_TIMEOUT_S):
                for _ in range(2):
                    if not self._ready:
                        await self._declare()
                    try:
                        async with pool.channel() as channel:
                            await channel.default_exchange.publish(message, stream, mandatory=True)
                        return
                    except PublishError:  # deleted since we declared it: declare again
                        self._ready = False
                raise BackendError(f"{self._backend}: history stream {stream!r} keeps disappearing")

    async def _declare(self) -> None:
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
            async with self._channels() as channel:
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
        self._ready = True

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        limit = min(limit, job.history_size)
        if limit <= 0:
            return []
        self._pool()  # started?
        with self._errors(f"reading the history of job {job.name!r}"):
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

        The end: the reader attaches at the stream's last chunk and reads to the end without
        writing (``_read_end``). Then it steps back: it reads the window ``[start - step,
        start)`` (the step doubling each time) until it has every job's records, or the broker
        starts it past where it asked (the stream's first retained record is within the
        window: nothing older exists), or it has read ``_HISTORY_SCAN_MAX`` records (each
        message read costs the broker ~0.15 ms of CPU). End markers (``_read_end``'s rare
        ones; one per read in earlier releases) are read over, not counted: reads never push a
        record out of that bound, and, writing nothing, nor out of the stream's retention.
        """
        newest: dict[str, list[bytes]] = {job: [] for job in wants}  # newest first
        window = await self._read_window(newest.keys(), None, None)  # the last chunk, to the end
        if window is None:  # a read declares nothing: no stream yet, no record
            return newest

        def short() -> bool:
            return any(len(newest[job]) < want for job, want in wants.items())

        def add(found: dict[str, list[bytes]]) -> None:
            for job, bodies in found.items():
                newest[job].extend(reversed(bodies))

        add(window.found)
        start, at_first, records = window.start, window.at_first, window.records
        step = max(_HISTORY_STEP, 4 * max(wants.values()))
        while short() and not at_first and records < _HISTORY_SCAN_MAX:
            wanted = [job for job, want in wants.items() if len(newest[job]) < want]
            # A window of n offsets holds n records at most: the bound is never overshot.
            size = min(step, _HISTORY_SCAN_MAX - records)
            window = await self._read_window(wanted, max(0, start - size), start)
            if window is None:
                break
            add(window.found)
            start, at_first, records = window.start, window.at_first, records + window.records
            step *= 2
        return {job: newest[job][:want] for job, want in wants.items()}

    async def _read_window(
        self, jobs: Iterable[str], begin: int | None, stop: int | None
    ) -> _Window | None:
        """The records of ``jobs`` at offsets ``[begin, stop)`` (``_Window``); ``begin=None``:
        from the last chunk to the end (``_read_end``). ``None`` when the stream is gone.

        A stream just made (by another instance's first record), or whose replica on this node
        is still starting (a node back in its cluster), refuses consumers for a moment ("does
        not have a replica on the local node"): the read is tried again, on a new channel (the
        refusal closes the channel), a little later each time, within the read's timeout."""
        from aio_pika.exceptions import ChannelPreconditionFailed

        wanted, pause = list(jobs), _REPLICA_RETRY_S
        while True:
            try:
                if begin is None:
                    return await self._read_end(wanted)
                assert stop is not None
                return await self._read_window_once(wanted, begin, stop)
            except ChannelPreconditionFailed as exc:
                if _NO_LOCAL_REPLICA not in str(exc):
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    async def _read_window_once(self, jobs: Iterable[str], begin: int, stop: int) -> _Window | None:
        from aio_pika.exceptions import ChannelNotFoundEntity

        stream = history_stream_name(self._prefix)
        found: dict[str, list[bytes]] = {job: [] for job in jobs}
        done = asyncio.Event()
        first: list[int] = []
        seen = records = 0

        async with self._channels() as channel:
            await channel.set_qos(prefetch_count=_HISTORY_PREFETCH)
            try:
                queue = await channel.declare_queue(stream, passive=True)
            except ChannelNotFoundEntity:
                self._ready = False
                return None

            async def collect(message: AbstractIncomingMessage) -> None:
                # Everything before the first await: deliveries are handled in their order.
                nonlocal seen, records
                if done.is_set():
                    return
                headers = message.headers or {}
                offset = headers.get("x-stream-offset")
                if not isinstance(offset, int):
                    return
                if not first:
                    first.append(offset)
                if offset >= stop:
                    done.set()
                    return
                if _MARK_HEADER not in headers:  # a record, of any job
                    records += 1
                bodies = found.get(_text(headers.get(_JOB_HEADER)) or "")
                if bodies is not None:
                    bodies.append(message.body)
                seen += 1
                if seen % (_HISTORY_PREFETCH // 2) == 0:  # streams need acks to deliver more
                    await message.ack(multiple=True)

            await queue.consume(collect, arguments={"x-stream-offset": begin})
            await done.wait()
        if not first:
            return None
        # The broker starts a read that asks for an offset it no longer holds at its first one.
        return _Window(found, first[0], first[0] == 0 or first[0] > begin, records)

    async def _read_end(self, jobs: Iterable[str]) -> _Window | None:
        """The records of ``jobs`` from the stream's last chunk to its end (``_Window``);
        ``None`` when the stream is gone. Nothing is written to the stream unless it is empty
        or writers outrun the read.

        A stream consumer over AMQP 0-9-1 is never told it has caught up, but a synchronous
        method on its channel (a passive declare) tells as much: the broker's channel hands a
        stream consumer, in one step, every message it can read until the consumer's credit
        (the prefetch, less the messages not yet acknowledged) runs out or the stream ends,
        and it answers the channel's methods in order with those steps. So once the last
        chunk's first message has arrived, the answer to a declare sent afterwards comes after
        every message that step read; if fewer than the prefetch are unacknowledged then, the
        credit did not run out: the step met the end, which lies after every record confirmed
        before the read began (read through the stream leader's node; a replica elsewhere may
        lag it by the replication's delay). Otherwise the reader acknowledges them and asks
        again.

        Fallbacks, each with a marker (an empty message with a header of its own, skipped by
        every reader) that the reader reads up to: an empty stream sends no first message
        (none within ``_END_PROBE_S``), and writers faster than the reader keep the credit
        spent (``_END_ROUNDS`` rounds): both are rare, and the second writes a marker only
        among many records.

        The consumer is aiormq's (its callback runs in a task of its own, started in the
        order of the deliveries and before the declare's answer is handed on, so every
        delivery is counted when the declare returns); aio-pika's runs the callback one task
        further."""
        from aio_pika.exceptions import ChannelNotFoundEntity

        stream = history_stream_name(self._prefix)
        found: dict[str, list[bytes]] = {job: [] for job in jobs}
        first: list[int] = []
        arrived, marked = asyncio.Event(), asyncio.Event()
        mark: str | None = None
        delivered = last_tag = records = 0

        async def collect(message: DeliveredMessage) -> None:
            # Synchronous, so done by the time a later answer of the channel is handed on.
            nonlocal delivered, last_tag, records
            delivered += 1
            tag = getattr(message.delivery, "delivery_tag", None)  # a Basic.Deliver's
            last_tag = tag if isinstance(tag, int) else last_tag
            headers = message.header.properties.headers or {}
            offset = headers.get("x-stream-offset")
            if isinstance(offset, int) and not first:
                first.append(offset)
            arrived.set()
            if mark is not None and _text(headers.get(_MARK_HEADER)) == mark:
                marked.set()
            if marked.is_set():  # written after the read began
                return
            if _MARK_HEADER not in headers:  # a record, of any job
                records += 1
            bodies = found.get(_text(headers.get(_JOB_HEADER)) or "")
            if bodies is not None:
                bodies.append(message.body)

        async with self._channels() as channel:
            await channel.set_qos(prefetch_count=_HISTORY_PREFETCH)
            try:
                await channel.declare_queue(stream, passive=True)
            except ChannelNotFoundEntity:
                self._ready = False
                return None
            amqp = await channel.get_underlay_channel()
            await amqp.basic_consume(stream, collect, arguments={"x-stream-offset": "last"})
            acked = 0
            try:
                async with asyncio.timeout(_END_PROBE_S):
                    await arrived.wait()
            except TimeoutError:
                mark = uuid.uuid4().hex  # known before it can arrive
                await self._append_mark(stream, mark)
            for _ in range(_END_ROUNDS):
                if mark is not None:
                    break
                await arrived.wait()
                await amqp.queue_declare(stream, passive=True)  # after what the broker sent
                if delivered - acked < _HISTORY_PREFETCH:
                    return _Window(found, first[0], first[0] == 0, records)
                await amqp.basic_ack(last_tag, multiple=True)
                acked = delivered
            if mark is None:
                mark = uuid.uuid4().hex
                await self._append_mark(stream, mark)
            while not marked.is_set():  # up to the marker, acknowledging as it goes
                await arrived.wait()
                if delivered > acked:
                    await amqp.basic_ack(last_tag, multiple=True)
                    acked = delivered
                await amqp.queue_declare(stream, passive=True)
        return _Window(found, first[0], first[0] == 0, records)

    async def _append_mark(self, stream: str, mark: str) -> None:
        """Append the end marker ``mark`` to ``stream`` (confirmed)."""
        from aio_pika import Message

        async with self._channels(confirms=True) as writer:
            await writer.default_exchange.publish(
                Message(b"", headers={_MARK_HEADER: mark}), stream, mandatory=True
            )

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
        async with self._channels() as channel:
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
                    f"{self._backend}: history queue {queue!r} holds {expected} records, more than"
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


def _text(value: object) -> str | None:
    """A header's value as text (aiormq gives long strings as ``bytes`` or ``str``)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else None

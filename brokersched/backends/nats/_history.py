"""Reading the last runs of a job from a history stream (a subject per job), shared by
``NATSBackend`` and ``NATSLeaseBackend``."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ._errors import MSG_ID

if TYPE_CHECKING:
    from nats.js import JetStreamContext

__all__ = ["read_last"]

_FETCH_BATCH = 512
_FETCH_TIMEOUT_S = 2.0
_CONSUMER_IDLE_S = 30.0  # server-side clean-up of a history reader that died mid-read


class _Stored(NamedTuple):
    """A message of the subject as read: its stream sequence, message id and body."""

    seq: int
    msg_id: str | None
    body: bytes

    @classmethod
    def of(cls, seq: int, headers: Mapping[str, str] | None, body: bytes) -> _Stored:
        return cls(seq, (headers or {}).get(MSG_ID), body)


async def read_last(js: JetStreamContext, stream: str, subject: str, count: int) -> list[bytes]:
    """The last ``count`` bodies stored on ``subject`` of ``stream``, oldest first (none when
    the stream does not exist yet)."""
    if count <= 0:
        return []
    if count == 1:
        return await _last_body(js, stream, subject)
    return await _last_bodies(js, stream, subject, count)


async def _last_body(js: JetStreamContext, stream: str, subject: str) -> list[bytes]:
    import nats.js.errors

    try:
        # Not a direct get: a missing stream must be "not found", not "no responders".
        msg = await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:  # no stream yet, or no run of this job
        return []
    return [msg.data] if msg.data else []


async def _last_bodies(js: JetStreamContext, stream: str, subject: str, count: int) -> list[bytes]:
    """JetStream 2.9 cannot read a subject backwards, so an ephemeral consumer reads the
    subject's messages (at most ``max_msgs_per_subject``) and keeps the last ``count``.

    On a cluster the consumer sits on any replica of the stream, which may not hold what the
    stream's leader does: one still catching up after a restart or a heal holds only the older
    part of the subject, so the read ends with the leader's messages after the last one the
    consumer gave (``_walk``: usually none, one request); and after a partition a replica of
    nats-server 2.9 was seen to give a run twice (once, under load) or to lack runs amid the
    subject (4 of 26, once in a partition test under load). So the leader is asked first how
    many messages the subject holds, and a read that found fewer distinct ones is made again
    from the leader alone (``_walk`` from the start: a request a message, only then). A run
    is one message id (the publish's ``Nats-Msg-Id``): a copy read twice counts once, at its
    newest place."""
    import nats.js.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    try:
        info = await js.stream_info(stream, subjects_filter=subject)  # the leader answers
    except nats.js.errors.NotFoundError:  # no history stream yet
        return []
    stored = (info.state.subjects or {}).get(subject, 0)
    if stored == 0:
        return []
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        mem_storage=True,
        inactive_threshold=_CONSUMER_IDLE_S,
    )
    try:
        consumer = await js.add_consumer(stream, config)  # pyright: ignore[reportUnknownMemberType]
    except nats.js.errors.NotFoundError:  # deleted meanwhile
        return []
    assert consumer.name is not None
    newest: deque[_Stored] = deque(maxlen=count)
    seen: set[str | int] = set()  # each message read: its id, or its sequence if it has none
    try:
        await _drain(js, stream, consumer.name, consumer.num_pending or 0, newest, seen)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(js.delete_consumer(stream, consumer.name))
    await _walk(js, stream, subject, newest[-1].seq + 1 if newest else 1, newest, seen)
    if len(seen) < stored:  # the replica lacked some: the leader's alone
        newest.clear()
        await _walk(js, stream, subject, 1, newest, set())
    return _once_each(newest)


async def _drain(
    js: JetStreamContext,
    stream: str,
    consumer: str,
    pending: int,
    newest: deque[_Stored],
    seen: set[str | int],
) -> None:
    """Read ``consumer``'s ``pending`` messages into ``newest`` (and ``seen``)."""
    import nats.errors

    if pending <= 0:
        return
    sub = await js.pull_subscribe_bind(consumer, stream=stream)
    try:
        while pending > 0:
            try:
                msgs = await sub.fetch(min(pending, _FETCH_BATCH), timeout=_FETCH_TIMEOUT_S)
            except nats.errors.TimeoutError:  # trimmed while we read: nothing more
                break
            if not msgs:
                break
            for msg in msgs:
                _keep(_Stored.of(msg.metadata.sequence.stream, msg.headers, msg.data), newest, seen)
            pending = msgs[-1].metadata.num_pending
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _walk(
    js: JetStreamContext,
    stream: str,
    subject: str,
    seq: int,
    newest: deque[_Stored],
    seen: set[str | int],
) -> None:
    """Append the messages of ``subject`` from sequence ``seq`` on, read from the stream's
    leader one by one (``next_by_subj``, nats-server 2.9+); after a consumer's read usually
    none are left: one round trip."""
    import nats.js.errors

    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:  # nothing after it (or the stream is gone)
            return
        assert msg.seq is not None
        _keep(_Stored.of(msg.seq, msg.headers, msg.data or b""), newest, seen)
        seq = msg.seq + 1


def _keep(message: _Stored, newest: deque[_Stored], seen: set[str | int]) -> None:
    seen.add(message.msg_id or message.seq)
    if message.body:
        newest.append(message)


def _once_each(stored: Sequence[_Stored]) -> list[bytes]:
    """The bodies in stream order, each message id once, at its last place."""
    last = {message.msg_id: n for n, message in enumerate(stored) if message.msg_id}
    return [
        message.body
        for n, message in enumerate(stored)
        if not message.msg_id or last[message.msg_id] == n
    ]

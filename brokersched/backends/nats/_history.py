"""Reading the last runs of a job from a history stream (a subject per job), shared by
``NATSBackend`` and ``NATSLeaseBackend``."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nats.js import JetStreamContext

__all__ = ["read_last"]

_FETCH_BATCH = 512
_FETCH_TIMEOUT_S = 2.0
_CONSUMER_IDLE_S = 30.0  # server-side clean-up of a history reader that died mid-read


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
    subject's messages (at most ``max_msgs_per_subject``) and keeps the last ``count``."""
    import nats.js.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        mem_storage=True,
        inactive_threshold=_CONSUMER_IDLE_S,
    )
    try:
        info = await js.add_consumer(stream, config)  # pyright: ignore[reportUnknownMemberType]
    except nats.js.errors.NotFoundError:  # no history stream yet
        return []
    assert info.name is not None
    try:
        pending = info.num_pending or 0
        return await _drain(js, stream, info.name, pending, count) if pending else []
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(js.delete_consumer(stream, info.name))


async def _drain(
    js: JetStreamContext, stream: str, consumer: str, pending: int, count: int
) -> list[bytes]:
    import nats.errors

    sub = await js.pull_subscribe_bind(consumer, stream=stream)
    newest: deque[bytes] = deque(maxlen=count)
    try:
        while pending > 0:
            try:
                msgs = await sub.fetch(min(pending, _FETCH_BATCH), timeout=_FETCH_TIMEOUT_S)
            except nats.errors.TimeoutError:  # trimmed while we read: nothing more
                break
            newest.extend(msg.data for msg in msgs)
            pending = msgs[-1].metadata.num_pending if msgs else 0
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return list(newest)

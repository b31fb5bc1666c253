"""How ``RabbitMQBackend`` names its queues and exchanges: every name of a prefix starts with
``<prefix>.`` and fits AMQP's 255 bytes, whatever the job's name."""

from __future__ import annotations

import hashlib

from ...abc import Slot
from .._options import name_check

__all__ = [
    "check_prefix",
    "claim_queue_name",
    "fence_exchange_name",
    "history_queue_name",
    "history_stream_name",
    "lock_queue_name",
    "record_queue_name",
]

_MAX_QUEUE_NAME = 255  # bytes, an AMQP short string
_SLOT_WIDTH = 20  # characters of the widest slot_ms (a signed 64-bit integer)
_HASH_HEX = 32  # 128 bits of SHA-256: names of over-long jobs stay collision-free
_NAME_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
# No '.' in a prefix: '.' separates the parts of a queue name, and a prefix holding one would
# make ``P`` + job ``claim.x`` and ``P.claim`` + job ``x`` share a queue.
check_prefix = name_check(
    "prefix",
    r"(?!amq$)[A-Za-z0-9_][A-Za-z0-9_-]{0,99}",
    "1-100 characters of [A-Za-z0-9_-], not starting with '-', without '.' ('.' separates the "
    "parts of queue names: write 'my-app' or 'my_app' rather than 'my.app') and other than "
    "'amq' (queue names starting 'amq.' are reserved by RabbitMQ)",
)
_LONGEST_KIND = ".history."


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

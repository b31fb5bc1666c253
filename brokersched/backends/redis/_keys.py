"""The names of the Redis backends' keys.

Key layout (``P`` the prefix, ``J`` the escaped job name)::

    P:{J}:claim:<slot_ms>   RedisBackend: a claimed slot (SET NX PX the fleet's slot memory)
    P:{J}:job               RedisLeaseBackend: hash of the fences (fence, manual)
    P:{J}:runs              RedisLeaseBackend: hash slot_ms -> the run being run or handed over
    P:{J}:history           both: list of runs, newest first
    P:{J}:evictions         both: the eviction count a claim of the job last saw, and since
                            when (``_scripts._GUARD``)

Every key of a job carries the job's hash tag ``{J}``: on a Redis Cluster every operation on a
job touches one hash slot, and jobs spread over the nodes. The prefix comes first so that an
ACL key pattern (``~brokersched:*``) can confine the backend. Names are injective: the prefix
holds no ``{``, so the first ``{`` opens the tag; the escaped job holds no ``}`` (nor ``%``
unescaped), so the tag closes where the job ends; the kind and the slot follow.
"""

from __future__ import annotations

from ...abc import FleetKind, Slot

__all__ = [
    "claim_key",
    "evictions_key",
    "fleet_key",
    "hash_tag",
    "history_key",
    "job_key",
    "runs_key",
]

_NAME_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:$-")


def _escape(job: str) -> str:
    """Keep ``[A-Za-z0-9_.:$-]``; every other character becomes ``%XX`` per UTF-8 byte (so no
    ``{``, ``}`` or unescaped ``%``: injective, and the hash tag ends where the job does)."""
    return "".join(
        char if char in _NAME_SAFE else "".join(f"%{byte:02X}" for byte in char.encode())
        for char in job
    )


def hash_tag(job: str) -> str:
    """``{<escaped job>}``: every key of the job hashes to the same cluster slot."""
    return "{" + _escape(job) + "}"


def claim_key(prefix: str, slot: Slot) -> str:
    return f"{prefix}:{hash_tag(slot.job)}:claim:{slot.slot_ms}"


def job_key(prefix: str, job: str) -> str:
    return f"{prefix}:{hash_tag(job)}:job"


def runs_key(prefix: str, job: str) -> str:
    return f"{prefix}:{hash_tag(job)}:runs"


def history_key(prefix: str, job: str) -> str:
    return f"{prefix}:{hash_tag(job)}:history"


def evictions_key(prefix: str, job: str) -> str:
    return f"{prefix}:{hash_tag(job)}:evictions"


def fleet_key(prefix: str, kind: FleetKind) -> str:
    """The hash of the fleet's records of ``kind`` (``_fleet``)."""
    return f"{prefix}:{{%fleet}}:{kind}"

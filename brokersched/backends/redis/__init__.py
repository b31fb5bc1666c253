"""Redis backends: ``RedisBackend`` (claim-only) and ``RedisLeaseBackend`` (leases).

Claims (``RedisBackend``)
    A claim is one script (``_scripts.CLAIM``): ``SET <prefix>:{<job>}:claim:<slot_ms>
    <instance, run> NX PX <memory>``, the first wins, every later one loses while Redis
    remembers the key (on the server's clock). ``<memory>`` is the fleet's slot memory, the
    longest ``slot_ttl`` of the instances of the prefix (``<prefix>:slot-memory``; see
    ``_claims``), so that instances with different ``slot_ttl`` never both win a slot. No
    retries by the client: an answer lost on the way (a cut connection, a timeout) raises
    ``BackendError``, and the scheduler skips the slot.

Leases (``RedisLeaseBackend``)
    Each decision (claim, renew, release, the take-over's read and its commit) is one Lua
    script (``EVALSHA``) on the job's keys only, judged on the server's clock (``TIME``): the
    rules of ``MemoryBackend``, the reference, in Lua (see ``_scripts``). A take-over decides
    with the shared rules of ``backends/_lease.py`` between a read script and a commit script
    that applies the decisions only if the job's fences and the dead run's token are unchanged,
    writing the lost attempt's ``interrupted`` record in the same atomic step.

Cluster (``cluster=True``)
    Every key of a job carries the job's hash tag (``{<job>}``), so every script touches one
    hash slot, on one node; jobs spread over the nodes.

Servers
    Redis 5.0 or later (or Valkey): the scripts read ``TIME`` before they write, which needs
    scripts replicated by their effects, the default since 5.0.

Eviction
    Both backends refuse to start on a ``maxmemory-policy`` other than ``noeviction``, and a
    claim that would win reads, in the same script, the policy and the server's count of
    evicted keys (``_scripts._GUARD``): it is not made while the policy evicts, nor when keys
    were evicted since the slot could first be claimed (its claim, fence or lease may be
    among them).

Durability
    Redis acknowledges a write before it reaches the disk, and replicas asynchronously: a
    server restarted without an append-only file forgets the claims and the leases, and a
    failover may lose the last acknowledged ones. ``start()`` reads ``CONFIG GET appendonly``
    and warns when it is off (``require_persistence=True`` refuses to start instead).

Modules: the layout every backend package shares (``docs/contributing.md``), ``_leases``
holding ``RedisLeaseBackend``; Redis's own: ``_link`` (``RedisLink``, what the claims ask of a
connection), ``_scripts`` (the Lua scripts), ``_keys`` (key names), ``_server`` (the server's
persistence and eviction checks).
"""

from __future__ import annotations

from ._backend import RedisBackend
from ._keys import claim_key, hash_tag, history_key, job_key, runs_key
from ._leases import RedisLeaseBackend

__all__ = [
    "RedisBackend",
    "RedisLeaseBackend",
    "claim_key",
    "hash_tag",
    "history_key",
    "job_key",
    "runs_key",
]

"""``RedisBackend``: the claim-only Redis backend, its configuration and its life (connect,
close); its claims and the fleet's slot memory are ``_claims``'s, the calls on the server
``_connection``'s, the history ``_history``'s, the fleet's records ``_fleet``'s."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Self

from ..._clock import Clock
from ..._durations import Duration, format_duration, to_ms
from ..._slotmemory import DEFAULT_CLAIM_SKEW
from ...abc import JobPolicy, RunRecord
from .._claims import shown
from .._keywords import own_options
from .._options import ClaimOptions
from . import _ops
from ._claims import SlotMemoryClaims, slot_memory_key
from ._connection import RedisConnection
from ._fleet import FleetRecords
from ._link import RedisLink
from ._options import RedisOptions, check_client_options

__all__ = ["RedisBackend"]

logger = logging.getLogger("brokersched.backends.redis")


class RedisBackend(_ops.Operations, FleetRecords, SlotMemoryClaims):
    """Claims slots in Redis: the first ``SET <prefix>:{<job>}:claim:<slot_ms> ... NX PX
    <fleet's slot memory>`` of a slot wins; Redis forgets the slot that long later (on its own
    clock).

    ``url``: ``redis://``, ``rediss://`` (TLS) or ``unix://``; its password never appears in a
    log, an error or ``repr``. ``cluster=True``: a Redis Cluster (``redis.asyncio.cluster``),
    reached through any of its nodes. ``max_clock_skew``: how far the clocks of the fleet's
    instances (and the server's) may disagree (see ``_slotmemory``). ``require_persistence``:
    refuse to start on a server without an append-only file (by default a warning is logged).
    Other keyword arguments go to redis-py's ``from_url`` (``ssl_ca_certs``,
    ``max_connections``, ``username``...); one it does not accept is refused at construction
    (``retry`` and ``decode_responses`` are brokersched's own: given ones are ignored).
    History: a list per job, trimmed to ``history_size`` (and ``history_ttl``) on each write.
    ``budget_interval``: how often the server's budget (``budget``) is read while started
    (``None``: never); under an evicting policy, from 80 % of ``maxmemory`` it sheds until back
    under 60 % (``_budget``), though each claim refuses such a policy by itself.
    """

    history_ttl = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        slot_ttl: Duration = "5m",
        prefix: str = "brokersched",
        cluster: bool = False,
        max_clock_skew: Duration = DEFAULT_CLAIM_SKEW,
        require_persistence: bool = False,
        budget_interval: Duration | None = "30s",
        **client_options: Any,
    ) -> None:
        options = RedisOptions.parse(self.name, locals())
        self._setup(options)
        check_client_options(
            self.name, own_options(RedisBackend), client_options, cluster=options.cluster
        )
        self._redis: RedisLink = RedisConnection(self.name, options, client_options)

    @classmethod
    def over(
        cls,
        link: RedisLink,
        *,
        slot_ttl: Duration = "5m",
        max_clock_skew: Duration = DEFAULT_CLAIM_SKEW,
    ) -> Self:
        """A backend that talks to Redis through ``link`` instead of a connection of its own
        (the prefix, the server and its checks are the link's): the fleet simulator makes
        the real backend over its model of a server this way (``_link``)."""
        backend = cls.__new__(cls)
        backend._setup(ClaimOptions.parse(cls.__name__, locals()))
        backend._redis = link
        return backend

    def _setup(self, options: ClaimOptions) -> None:
        super().__init__()
        self._set_memory(options)
        self._setup_claims()

    def __repr__(self) -> str:
        cluster = ", cluster=True" if self._redis.cluster else ""
        return (
            f"{self.name}({self._redis.redacted!r}, slot_ttl="
            f"{format_duration(self._slot_ttl)!r}, prefix={self.prefix!r}{cluster})"
        )

    @property
    def prefix(self) -> str:
        return self._redis.prefix

    async def _open(self, clock: Clock) -> None:
        await self._redis.open(clock)
        try:
            self._memory = await self._raise_memory()
        except BaseException:
            await self._redis.close()
            raise
        fleet = self._memory.memory_ms
        if fleet > to_ms(self._slot_ttl):
            logger.info(
                "%s: the fleet of prefix %r remembers claimed slots for %s, longer than this "
                "instance's slot_ttl %s: claims use the fleet's (to lower it, deploy the "
                "shorter slot_ttl everywhere, then DEL %s)",
                self.name, self.prefix, shown(fleet), format_duration(self._slot_ttl),
                slot_memory_key(self.prefix),
            )  # fmt: skip

    async def _close(self) -> None:
        await self._redis.close()
        self._memory = None
        self._read_sent_ms = -(2**63)

    def _slot_memory(self) -> tuple[str | None, timedelta | None]:
        return slot_memory_key(self.prefix), self._slot_ttl

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self._redis.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await self._redis.history(job, limit)

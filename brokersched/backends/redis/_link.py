"""``RedisLink``: what ``RedisBackend`` asks of the connection it talks to Redis through.

Two classes implement it: ``RedisConnection`` (``_connection``), the real one over redis-py,
and the fleet simulator's model of a Redis server (``brokersched.testing._sim_redis.RedisModel``),
which runs the scripts' rules in Python on the simulated store's clock. ``RedisBackend`` is
made over either (``RedisBackend(url, ...)`` makes its own ``RedisConnection``;
``RedisBackend.over(link, ...)`` takes one), so the simulator runs the real backend's code and
only the server is modelled; ``tests/backends/redis/test_redis_model.py`` runs the same
scenario on both and compares what each answered, so the model cannot drift from the server.

The scripts are named by their constant in ``_scripts`` (``CLAIM``, ``FLEET_MEMORY``...); the
exchanges of ``call`` talk to a client with redis-py's methods (a pipeline's ``hmget``...).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from ..._clock import Clock
from ..._exceptions import BackendError
from ...abc import Finding, FleetKind, JobPolicy, RunRecord
from .._budget import BudgetWatch

__all__ = ["RedisLink"]

T = TypeVar("T")


class RedisLink(Protocol):
    """One backend's connection to one Redis server (or cluster) and its key prefix.

    Every call answers within its timeout (seconds; ``None``: the connection's own bound) or
    raises ``BackendError``; a call that raised may have been applied (a claim that won), so
    its caller fails closed."""

    @property
    def backend(self) -> str:
        """The backend's name, for errors and logs."""

    @property
    def prefix(self) -> str: ...

    @property
    def cluster(self) -> bool: ...

    @property
    def redacted(self) -> str:
        """The server's URL without its password, for errors and logs."""

    @property
    def budget(self) -> BudgetWatch | None:
        """The server's budget while started, ``None`` when it is not read."""

    async def open(self, clock: Clock) -> None:
        """Connect and check the server (its eviction policy above all: one that evicts keys
        is refused with ``ConfigurationError``)."""

    async def close(self) -> None: ...

    def now_ms(self) -> int:
        """The scheduler's clock (history times, the claims' deadlines); raises
        ``BackendUnavailableError`` when not started."""

    async def call(
        self, action: str, exchange: Callable[[Any], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """``exchange(client)``: commands of redis-py's client, ``action`` naming them in an
        error."""

    async def script(
        self,
        name: str,
        action: str,
        keys: list[str],
        args: list[str | int],
        timeout: float | None = None,
    ) -> Any:
        """The script ``_scripts.<name>`` on ``keys`` and ``args``: its answer."""

    async def scripts(
        self,
        name: str,
        action: str,
        calls: Sequence[tuple[list[str], list[str | int]]],
        timeout: float | None = None,
    ) -> list[Any]:
        """The script once per ``(keys, args)`` in one round trip: per call its answer, or the
        exception it raised."""

    def refusal(self, answer: Sequence[Any], what: str) -> BackendError | None:
        """The eviction guard's refusal in a script's ``answer`` as the error that skips the
        slot; ``None`` for any other answer."""

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        """Push ``record`` onto the job's history, trimmed to its size and age."""

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        """The job's latest runs, newest first, within its ``history_ttl``."""

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        """The fleet's records of ``kind`` not yet expired (``Backend._fleet_read``)."""

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        """Write one record of the fleet, expiring ``ttl`` from now."""

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        """Compare-and-set one record (kept for ever): ``True`` when it held ``old``."""

    # -- operations (``brokersched purge``, ``doctor``) -----------------------------------------

    def namespace(self, namespace: str | None) -> str:
        """``namespace`` checked as a prefix, or this link's prefix."""

    async def operate(self, action: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """``call(client)`` on a client of its own (the backend need not be started)."""

    async def server_findings(self, client: Any) -> list[Finding]:
        """The server's checks of ``open()`` as findings, on ``client``."""

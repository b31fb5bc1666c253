"""What the Redis backends read of the server itself: its persistence and eviction policy,
checked at start and again while running, as ``brokersched doctor``'s findings, and its budget.
``ServerChecks`` is mixed into ``RedisConnection`` (``_connection``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..._clock import Clock, ms_to_datetime
from ..._exceptions import BackendError, BrokerschedError, ConfigurationError
from ...abc import BrokerBudget, Finding
from ._budget import read_budget

__all__ = ["POLICY_RECHECK_MS", "ServerChecks", "guard_refusal"]

logger = logging.getLogger("brokersched.backends.redis")

T = TypeVar("T")

_APPENDONLY = ("CONFIG", "GET", "appendonly")
_POLICY_CONFIG = ("CONFIG", "GET", "maxmemory-policy")
# Where CONFIG is disabled (managed Redis: ElastiCache, whose default is volatile-lru), INFO
# still tells the policy.
_POLICY_SOURCES = (_POLICY_CONFIG, ("INFO", "memory"))
POLICY_RECHECK_MS = 60_000
_MAXCLIENTS = ("CONFIG", "GET", "maxclients")
_NO_AOF_CONSEQUENCE = (
    "if it restarts it forgets the slots claimed and the leases held, and an instance that is "
    "late can run a slot that already ran"
)
_NO_AOF_FIX = "set appendonly yes (appendfsync always or everysec) on the server"


class ServerChecks:
    """The server's checks and reads of ``RedisConnection``, on its client and its state."""

    backend: str
    redacted: str
    cluster: bool
    require_persistence: bool
    clock: Clock | None
    _client: Any
    # How the eviction policy was read at start (None: it could not be), when to read it
    # again, and the evicting policies last seen (an error is logged when they change).
    _policy_source: tuple[str, ...] | None
    _policy_due_ms: int
    _policies_seen: list[tuple[str, str]]

    if TYPE_CHECKING:

        async def call(
            self,
            action: str,
            exchange: Callable[[Any], Awaitable[T]],
            timeout: float | None = None,
        ) -> T: ...

        def _describe(self, exc: BaseException) -> str: ...

    async def read_budget(self) -> BrokerBudget:
        """The server's budget (``_budget.read_budget``) from ``INFO memory`` and ``INFO
        clients`` of the server or of every primary, ``maxclients`` from ``CONFIG GET`` where
        ``INFO`` lacks it (Redis before 7) and it is allowed."""

        async def read(client: Any) -> list[tuple[str, dict[str, Any]]]:
            from redis.exceptions import ResponseError

            memory = await self._on_primaries(client, "INFO", "memory")
            clients = dict(await self._on_primaries(client, "INFO", "clients"))
            nodes: list[tuple[str, dict[str, Any]]] = []
            limits: dict[str, Any] | None = None  # CONFIG GET maxclients, asked once
            for where, answer in memory:
                info = {**_info_dict(answer), **_info_dict(clients.get(where))}
                if "maxclients" not in info:
                    if limits is None:
                        try:
                            limits = dict(await self._on_primaries(client, *_MAXCLIENTS))
                        except ResponseError:  # CONFIG disabled or refused: not counted
                            limits = {}
                    if where in limits:
                        info["maxclients"] = _setting(limits[where], "maxclients")
                nodes.append(("" if where == self.redacted else where, info))
            return nodes

        return read_budget(await self.call("read the server's budget", read))

    async def server_findings(self, client: Any) -> list[Finding]:
        """The checks ``open()`` makes (persistence, eviction policy), as findings."""
        from redis.exceptions import ResponseError

        findings: list[Finding] = []
        try:
            values = [value for _, value in await self._on_primaries(client, *_APPENDONLY)]
        except ResponseError as exc:
            findings.append(
                Finding(
                    "warning",
                    "persistence",
                    f"CONFIG GET appendonly was refused ({self._describe(exc)})",
                    "if the server keeps no append-only file, a restart forgets the claims "
                    "and leases and a slot can run twice",
                    "make sure the server runs with appendonly yes",
                )
            )
        else:
            if all(_setting(value, "appendonly") == "yes" for value in values):
                findings.append(Finding("ok", "persistence", "appendonly yes"))
            else:
                findings.append(
                    Finding(
                        "error",
                        "persistence",
                        f"{self.redacted} has no append-only file (appendonly no)",
                        _NO_AOF_CONSEQUENCE,
                        _NO_AOF_FIX,
                    )
                )
        findings.append(await self._eviction_finding(client))
        return findings

    async def _eviction_finding(self, client: Any) -> Finding:
        from redis.exceptions import ResponseError

        refusals: list[str] = []
        for source in _POLICY_SOURCES:
            try:
                policies = await self._read_policies(client, source)
            except ResponseError as exc:
                refusals.append(f"{' '.join(source)}: {self._describe(exc)}")
                continue
            evicting = _evicting(policies)
            if evicting:
                message = self._eviction_message(evicting)
                found, _, rest = message.partition("): ")
                consequence, _, fix = rest.partition("; set ")
                return Finding("error", "maxmemory-policy", f"{found})", consequence, f"set {fix}")
            if all(policy is not None for _, policy in policies):
                return Finding("ok", "maxmemory-policy", "noeviction")
            refusals.append(f"{' '.join(source)} gave no policy")
        return Finding(
            "warning",
            "maxmemory-policy",
            f"the eviction policy could not be read ({'; '.join(refusals)})",
            "with a policy other than noeviction, Redis can evict claims and leases under "
            "memory pressure and a slot runs twice",
            "make sure maxmemory-policy is noeviction",
        )

    def _persistence_message(self) -> str:
        return (
            f"{self.backend}: {self.redacted} has no append-only file (appendonly no): "
            f"{_NO_AOF_CONSEQUENCE}; {_NO_AOF_FIX}"
        )

    async def _on_primaries(self, client: Any, *command: str) -> list[tuple[str, Any]]:
        """``command``'s answer from the server, or from every primary of a cluster, each with
        where it came from."""
        if not self.cluster:
            return [(self.redacted, await client.execute_command(*command))]
        return [
            (node.name, await client.execute_command(*command, target_nodes=node))
            for node in client.get_primaries()
        ]

    async def _check_persistence(self, client: Any) -> None:
        """A Redis without the append-only file forgets claims and leases when it restarts
        (or keeps only its last snapshot): a late instance could then run a slot again."""
        from redis.exceptions import ResponseError

        try:
            values = [value for _, value in await self._on_primaries(client, *_APPENDONLY)]
        except ResponseError as exc:  # CONFIG renamed or disabled (managed Redis), or an ACL
            detail = self._describe(exc)
            if self.require_persistence:
                raise ConfigurationError(
                    f"{self.backend} cannot check that {self.redacted} persists its data "
                    f"(CONFIG GET appendonly was refused: {detail}) and require_persistence "
                    "is set; allow CONFIG GET for this user, or set require_persistence=False "
                    "once you know the server keeps an append-only file",
                    option="require_persistence",
                    backend=self.backend,
                ) from None
            logger.info(
                "%s could not check the persistence of %s (CONFIG GET appendonly: %s)",
                self.backend, self.redacted, detail,
            )  # fmt: skip
            return
        if all(_setting(value, "appendonly") == "yes" for value in values):
            return
        message = self._persistence_message()
        if self.require_persistence:
            raise ConfigurationError(
                message + ", or set require_persistence=False",
                option="require_persistence",
                backend=self.backend,
            )
        logger.warning(message)

    async def _check_eviction(self, client: Any) -> None:
        """Refuse a server that may evict keys: under memory pressure an evicting policy drops
        claims, fences and leases, and a slot runs again (seen: 19-23 of 30-42 slots twice).
        Sidekiq checks the same INFO field at boot (it warns; a lost claim here is a double
        run, so brokersched refuses)."""
        from redis.exceptions import ResponseError

        refusals: list[str] = []
        for source in _POLICY_SOURCES:
            try:
                policies = await self._read_policies(client, source)
            except ResponseError as exc:  # CONFIG disabled (managed Redis), or an ACL
                refusals.append(f"{' '.join(source)}: {self._describe(exc)}")
                continue
            evicting = _evicting(policies)
            if evicting:
                raise ConfigurationError(
                    self._eviction_message(evicting),
                    option="maxmemory-policy",
                    backend=self.backend,
                )
            unknown = [where for where, policy in policies if policy is None]
            if unknown:
                refusals.append(f"{' '.join(source)} gave no policy for {', '.join(unknown)}")
                continue
            self._policy_source = source
            if source == _POLICY_CONFIG:
                await self._check_guard(client)
            return
        logger.warning(
            "%s could not check the eviction policy of %s (%s): if its maxmemory-policy is not "
            "noeviction, Redis can evict the claims and leases brokersched writes and a slot "
            "would run twice; make sure it is noeviction",
            self.backend, self.redacted, "; ".join(refusals),
        )  # fmt: skip

    async def _check_guard(self, client: Any) -> None:
        """Claims read the policy and the eviction count with ``INFO`` (``_scripts._GUARD``):
        where only ``CONFIG`` answers, say that a policy set to evict while running goes
        unseen."""
        from redis.exceptions import ResponseError

        try:
            await self._on_primaries(client, "INFO", "stats")
        except ResponseError as exc:
            logger.warning(
                "%s: INFO is refused on %s (%s): claims cannot read the eviction policy and "
                "count with each claim, and one set to evict while the backend runs would go "
                "unseen (a slot could run twice); allow INFO for this user (+info)",
                self.backend, self.redacted, self._describe(exc),
            )  # fmt: skip

    async def _read_policies(
        self, client: Any, source: tuple[str, ...]
    ) -> list[tuple[str, str | None]]:
        """``(where, maxmemory-policy)`` of the server or of every primary; ``None``: not
        given (Redis Enterprise Cloud answers INFO with an empty one)."""
        answers = await self._on_primaries(client, *source)
        if source == _POLICY_CONFIG:
            return [(where, _setting(answer, "maxmemory-policy")) for where, answer in answers]
        return [(where, _info_field(answer, "maxmemory_policy")) for where, answer in answers]

    def _eviction_message(self, evicting: Sequence[tuple[str, str]]) -> str:
        shown = ", ".join(
            policy if node == self.redacted else f"{policy} on {node}" for node, policy in evicting
        )
        return (
            f"{self.backend}: {self.redacted} may evict keys (maxmemory-policy {shown}): "
            "under memory pressure Redis could evict the keys brokersched writes (claims, "
            "fences, leases, the fleet's slot-memory record) and a slot would run twice; set "
            "maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in "
            "redis.conf or the managed service's parameter group), or give brokersched a Redis "
            "server of its own with noeviction (the policy is the whole server's, not a "
            "database's)"
        )

    async def recheck_eviction(self) -> None:
        """The policy can change while the backend runs (CONFIG SET, a managed service's
        parameter group): read it again at most once a minute, after a record (which is not
        time-critical), and log an error once per change to an evicting policy. Never
        raises: the record was written."""
        clock = self.clock
        if self._policy_source is None or clock is None or self._client is None:
            return
        now = clock.monotonic_ms()
        if now < self._policy_due_ms:
            return
        self._policy_due_ms = now + POLICY_RECHECK_MS
        source = self._policy_source
        try:
            policies = await self.call(
                "read maxmemory-policy", lambda client: self._read_policies(client, source)
            )
        except BrokerschedError as exc:
            logger.debug("%s: %s", self.backend, exc)
            return
        evicting = _evicting(policies)
        if evicting and evicting != self._policies_seen:
            logger.error(self._eviction_message(evicting) + "; it was noeviction at start")
        self._policies_seen = evicting


def guard_refusal(
    backend: str, redacted: str, answer: Sequence[Any], what: str
) -> BackendError | None:
    """``RedisLink.refusal``: the eviction guard's answer in words, for ``backend`` on the
    server ``redacted``."""
    kind = _text(answer[0]) if answer else None
    if kind == "evicting":
        return BackendError(
            f"{backend}: {what} is not made: {redacted} may evict keys "
            f"(maxmemory-policy {_text(answer[1])}, read with the claim): Redis could "
            "evict the claims, fences and leases brokersched keeps, and the slot would "
            "run twice; only maxmemory-policy noeviction is accepted (CONFIG SET "
            "maxmemory-policy noeviction, and in redis.conf or the managed service's "
            "parameter group)"
        )
    if kind == "evicted":
        count, since = _text(answer[1]), int(_text(answer[2]))
        return BackendError(
            f"{backend}: {what} is not made: {redacted} may have evicted keys "
            "since a claim of this slot could have been made (evicted_keys "
            f"{count} in INFO stats, first seen by a claim of this job at {_utc(since)}, "
            "the server's clock): that claim may have been evicted and the slot run "
            "already; slots that fall due later are claimed again. Redis evicts keys only "
            "under a maxmemory-policy other than noeviction: keep noeviction"
        )
    return None


def _setting(value: object, name: str) -> str | None:
    """One setting from a CONFIG GET answer (a dict, or a flat list of names and values)."""
    if isinstance(value, dict):
        found = value.get(name, value.get(name.encode()))
    elif isinstance(value, list | tuple) and len(value) >= 2:
        found = value[1]
    else:
        return None
    return found.decode() if isinstance(found, bytes) else None if found is None else str(found)


def _info_field(answer: object, name: str) -> str | None:
    """One field of an INFO answer (parsed to a dict by redis-py; raw text otherwise); ``None``
    when missing or empty."""
    if isinstance(answer, bytes | str):
        text = answer.decode() if isinstance(answer, bytes) else answer
        lines = (line.partition(":") for line in text.splitlines())
        answer = {key: value.strip() for key, _, value in lines}
    if not isinstance(answer, dict):
        return None
    found = answer.get(name, answer.get(name.encode()))
    if isinstance(found, bytes):
        found = found.decode()
    return str(found) if found not in (None, "", b"") else None


def _info_dict(answer: object) -> dict[str, Any]:
    """An INFO answer as a dict (redis-py parses it; raw text otherwise)."""
    if isinstance(answer, bytes | str):
        text = answer.decode() if isinstance(answer, bytes) else answer
        lines = (line.partition(":") for line in text.splitlines() if not line.startswith("#"))
        return {key: value.strip() for key, _, value in lines if key}
    return dict(answer) if isinstance(answer, dict) else {}


def _evicting(policies: Sequence[tuple[str, str | None]]) -> list[tuple[str, str]]:
    """The ``(where, policy)`` that may evict a key: any known policy but ``noeviction``."""
    return [(where, p) for where, p in policies if p is not None and p != "noeviction"]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _utc(ms: int) -> str:
    """An instant of the server's clock as ``2026-01-02T03:04:05.678Z``."""
    return ms_to_datetime(ms).isoformat(timespec="milliseconds").replace("+00:00", "Z")

"""What both Redis backends share: key names, the URL, the client, error translation, the
checks of the server at start (persistence, eviction policy), history.

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

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ... import _redact
from ..._clock import Clock, datetime_to_ms, ms_to_datetime
from ..._durations import Duration, to_ms
from ..._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ConfigurationError,
)
from ...abc import BrokerBudget, Finding, FleetKind, JobPolicy, RunRecord, Slot
from .._budget import BudgetWatch, budget_period
from .._errors import ErrorMap, ErrorRow
from .._keywords import parameter_names, refuse_unknown
from . import _scripts
from ._budget import read_budget, redis_budget_watch

__all__ = [
    "RedisConnection",
    "check_client_options",
    "claim_key",
    "evictions_key",
    "fleet_key",
    "guard_refusal",
    "hash_tag",
    "history_entry",
    "history_key",
    "job_key",
    "runs_key",
]

logger = logging.getLogger("brokersched.backends.redis")

T = TypeVar("T")

_INSTALL_HINT = "pip install 'brokersched[redis]'"
_SCHEMES = ("redis", "rediss", "unix")
_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_NAME_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:$-")
_OPERATION_TIMEOUT_S = 10.0  # start, record, history, take-over: not time-critical, but bounded
_CONNECT_TIMEOUT_S = 5.0
_APPENDONLY = ("CONFIG", "GET", "appendonly")
_POLICY_CONFIG = ("CONFIG", "GET", "maxmemory-policy")
# Where CONFIG is disabled (managed Redis: ElastiCache, whose default is volatile-lru), INFO
# still tells the policy.
_POLICY_SOURCES = (_POLICY_CONFIG, ("INFO", "memory"))
_POLICY_RECHECK_MS = 60_000
_MAXCLIENTS = ("CONFIG", "GET", "maxclients")
_NO_AOF_CONSEQUENCE = (
    "if it restarts it forgets the slots claimed and the leases held, and an instance that is "
    "late can run a slot that already ran"
)
_NO_AOF_FIX = "set appendonly yes (appendfsync always or everysec) on the server"


def _client_keywords(cluster: bool) -> Callable[[], set[str]]:
    def keywords() -> set[str]:
        """The keywords redis-py's ``from_url`` and the client's constructor accept; for a
        single server also its pools' and connections' (``from_url`` hands them on:
        ``connection_class``, ``path``, the ``ssl_*`` options...)."""
        import redis.asyncio
        import redis.asyncio.connection as connection
        from redis.asyncio.cluster import RedisCluster

        if cluster:
            return parameter_names(RedisCluster.__init__, RedisCluster.from_url) - {"url"}
        handed_on = (
            connection.ConnectionPool.__init__,
            connection.BlockingConnectionPool.__init__,
            connection.AbstractConnection.__init__,
            connection.Connection.__init__,
            connection.SSLConnection.__init__,
            connection.UnixDomainSocketConnection.__init__,
        )
        client = redis.asyncio.Redis
        return parameter_names(client.__init__, client.from_url, *handed_on) - {"url"}

    return keywords


def check_client_options(
    backend: str, own: Sequence[str], options: Mapping[str, Any], *, cluster: bool
) -> None:
    """Refuse, at construction, a keyword that is neither the backend's nor redis-py's."""
    refuse_unknown(
        backend,
        options,
        own=own,
        library="redis-py's RedisCluster" if cluster else "redis-py's Redis.from_url",
        accepted=_client_keywords(bool(cluster)),
    )


# -- names -------------------------------------------------------------------------------------


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


# -- options -----------------------------------------------------------------------------------


def _check_prefix(prefix: object, backend: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix {prefix!r} of {backend} must be 1-100 characters of [A-Za-z0-9_.:-] (no "
            "'{', '}' or spaces: the job's hash tag follows it in every key)",
            option="prefix",
            backend=backend,
        )
    return prefix


def _check_url(url: object, backend: str, *, cluster: bool) -> str:
    """The scheme and the port are checked at construction; the rest by redis-py at start."""
    shown = _redact.redact_url(url) if isinstance(url, str) else repr(url)
    accepted = "redis://, rediss:// (TLS) or unix:// (a socket path)"
    try:
        if not isinstance(url, str):
            raise ValueError("not a string")
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        scheme = parts.scheme
    except ValueError as exc:
        raise ConfigurationError(
            f"url {shown!r} of {backend} is not a valid URL ({exc}); use {accepted}",
            option="url",
            backend=backend,
        ) from None
    if scheme not in _SCHEMES:
        raise ConfigurationError(
            f"url {shown!r} of {backend} must start with {accepted}",
            option="url",
            backend=backend,
        )
    if cluster and scheme == "unix":
        raise ConfigurationError(
            f"url {shown!r} of {backend}: a Redis Cluster is reached over TCP (redis:// or "
            "rediss://), not a unix socket",
            option="url",
            backend=backend,
        )
    if scheme != "unix" and not parts.hostname:
        raise ConfigurationError(
            f"url {shown!r} of {backend} names no host; e.g. redis://127.0.0.1:6379/0",
            option="url",
            backend=backend,
        )
    return url


# -- the connection ----------------------------------------------------------------------------


class RedisConnection:
    """One backend's client (a ``redis.asyncio.Redis`` or ``RedisCluster``), its scripts, and
    the one place where redis-py's errors become brokersched's, with the password scrubbed.

    The client never retries a command by itself: a command whose answer was lost may have
    been applied (a claim that won), and only a definite answer may be returned; a failed call
    raises ``BackendError`` and the scheduler fails closed. The next call uses a fresh
    connection from the pool, so an outage fails only the calls made during it.
    """

    def __init__(
        self,
        backend: str,
        url: str,
        *,
        prefix: str,
        cluster: bool,
        require_persistence: bool,
        client_options: Mapping[str, Any],
        budget_interval: Duration | None = "30s",
    ) -> None:
        self.backend = backend
        self._budget_period = budget_period(budget_interval, backend=backend)
        #: The server's budget while started (``_budget``), unless ``budget_interval=None``.
        self.budget: BudgetWatch | None = None
        self.url = _check_url(url, backend, cluster=cluster)
        self.prefix = _check_prefix(prefix, backend)
        self.cluster = bool(cluster)
        self.require_persistence = bool(require_persistence)
        self.redacted = _redact.redact_url(url)
        self._secrets = _redact.url_secrets(url)
        password = client_options.get("password")
        if isinstance(password, str) and password:
            self._secrets = sorted({*self._secrets, password}, key=len, reverse=True)
        self._options = dict(client_options)
        self._errors = ErrorMap(self._error_rows, self._secrets)
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        #: For tests only: scripts judge time as if the server's clock read this (ms).
        self.store_time: int | None = None
        self.clock: Clock | None = None
        # How the eviction policy was read at start (None: it could not be), when to read it
        # again, and the evicting policies last seen (an error is logged when they change).
        self._policy_source: tuple[str, ...] | None = None
        self._policy_due_ms = 0
        self._policies_seen: list[tuple[str, str]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self, clock: Clock) -> None:
        """Connect, check the server (its persistence, its eviction policy) and load the
        scripts; one clear line for every failure."""
        client = self._make_client()
        try:
            with self.translate(f"connect to {self.redacted}"):
                async with asyncio.timeout(_OPERATION_TIMEOUT_S):
                    if self.cluster:
                        await client.initialize()
                    await client.ping()
                    await self._check_persistence(client)
                    await self._check_eviction(client)
        except BaseException:
            await _close_quietly(client)
            raise
        self._client = client
        self._scripts = {
            name: client.register_script(getattr(_scripts, name))
            for name in _scripts.__all__
            if name != "CLOCKED"
        }
        self.clock = clock
        self._policy_due_ms = clock.monotonic_ms() + _POLICY_RECHECK_MS
        if self._budget_period is not None:
            self.budget = redis_budget_watch(self.backend, self.read_budget, self._budget_period)
            try:
                await self.budget.start(clock)
            except BaseException:  # cancelled
                await self.close()
                raise
        logger.debug("%s connected to %s", self.backend, self.redacted)

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

    def namespace(self, namespace: str | None) -> str:
        """``namespace`` checked as a prefix (``brokersched purge --prefix``), or this one's."""
        return self.prefix if namespace is None else _check_prefix(namespace, self.backend)

    @property
    def client_name(self) -> str:
        """The name of this backend's connections (``CLIENT LIST``): ``brokersched:<prefix>``,
        how ``brokersched purge`` sees that an instance of the prefix runs."""
        return f"brokersched:{self.prefix}"

    async def operate(self, action: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """``call(client)`` on a client of its own, named ``brokersched-ops`` (``brokersched
        purge`` and ``doctor``: the backend need not be started, and no check refuses)."""
        client = self._make_client(name="brokersched-ops")
        try:
            with self.translate(action):
                async with asyncio.timeout(_OPERATION_TIMEOUT_S * 6):
                    if self.cluster:
                        await client.initialize()
                    return await call(client)
        finally:
            await _close_quietly(client)

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

    def _make_client(self, name: str | None = None) -> Any:
        try:
            import redis.asyncio
            from redis.asyncio.cluster import RedisCluster
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError as exc:
            raise ConfigurationError(
                f"{self.backend} needs redis-py: {_INSTALL_HINT}", backend=self.backend
            ) from exc
        options: dict[str, Any] = {
            "socket_connect_timeout": _CONNECT_TIMEOUT_S,
            "client_name": name or self.client_name,
            **self._options,
            "retry": Retry(NoBackoff(), 0),  # never resend a command: see the class docstring
            "decode_responses": False,  # the scripts' answers and the history are bytes
        }
        try:
            if self.cluster:
                return RedisCluster.from_url(self.url, **options)
            return redis.asyncio.Redis.from_url(self.url, **options)
        except (ValueError, TypeError) as exc:  # a URL or option redis-py refuses
            raise ConfigurationError(
                f"{self.backend} cannot use the url {self.redacted}: {self._describe(exc)}",
                option="url",
                backend=self.backend,
            ) from _redact.chainable(exc, self._secrets)

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
        self._policy_due_ms = now + _POLICY_RECHECK_MS
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

    async def close(self) -> None:
        budget, self.budget = self.budget, None
        if budget is not None:
            await budget.close()
        client, self._client = self._client, None
        self._scripts = {}
        self.clock = None
        self._policy_source, self._policies_seen = None, []
        if client is not None:
            await _close_quietly(client)

    # -- calls -------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            raise BackendUnavailableError(f"{self.backend} is not started")
        return self._client

    def now_ms(self) -> int:
        if self.clock is None:
            raise BackendUnavailableError(f"{self.backend} is not started")
        return self.clock.now_ms()

    async def call(
        self, action: str, exchange: Callable[[Any], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """``exchange(client)``, answered within ``timeout`` seconds or ``BackendError``."""
        with self.translate(action):
            client = self.client
            limit = _OPERATION_TIMEOUT_S if timeout is None else max(0.0, timeout)
            try:
                async with asyncio.timeout(limit):
                    return await exchange(client)
            finally:
                if client is not self._client:
                    # Closed meanwhile: redis-py's pool opens a connection for a command sent
                    # after its close, which nobody would close.
                    await _close_quietly(client)

    def _clocked(self, name: str, args: list[str | int]) -> list[str | int]:
        """A script that reads the clock takes the store time override first (see
        ``_scripts._NOW``): '' (the server's ``TIME``) unless ``store_time`` is set."""
        if name not in _scripts.CLOCKED:
            return args
        return ["" if self.store_time is None else self.store_time, *args]

    async def script(
        self,
        name: str,
        action: str,
        keys: list[str],
        args: list[str | int],
        timeout: float | None = None,
    ) -> Any:
        """One script (EVALSHA; loaded once per node on ``NOSCRIPT``)."""
        args = self._clocked(name, args)

        async def run(client: Any) -> Any:
            return await self._scripts[name](keys=keys, args=args, client=client)

        return await self.call(action, run, timeout)

    async def scripts(
        self,
        name: str,
        action: str,
        calls: Sequence[tuple[list[str], list[str | int]]],
        timeout: float | None = None,
    ) -> list[Any]:
        """The script once per ``(keys, args)``, pipelined (``EVALSHA``; on a cluster, to the
        node of each call's keys): one round trip, two when a node had not loaded it (it is
        loaded, and the calls it refused with ``NOSCRIPT``, which ran nothing, are sent
        again); per call, its answer or its error."""
        script = self._scripts[name]
        sent = [(keys, self._clocked(name, args)) for keys, args in calls]

        async def send(client: Any, which: Sequence[int]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for n in which:
                keys, args = sent[n]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            answers: list[Any] = await pipe.execute(raise_on_error=False)
            return answers

        async def run(client: Any) -> list[Any]:
            from redis.exceptions import NoScriptError

            answers = await send(client, range(len(sent)))
            again = [n for n, answer in enumerate(answers) if isinstance(answer, NoScriptError)]
            if again:
                await client.script_load(script.script)  # every primary of a cluster
                for n, answer in zip(again, await send(client, again), strict=True):
                    answers[n] = answer
            return answers

        return await self.call(action, run, timeout)

    def refusal(self, answer: Sequence[Any], what: str) -> BackendError | None:
        """The eviction guard's refusal (``_scripts._GUARD``) as the error that skips the
        slot, ``what`` saying what was not done ("the claim of job:1700000000000"); ``None``
        for any other answer."""
        return guard_refusal(self.backend, self.redacted, answer, what)

    def translate(self, action: str) -> AbstractContextManager[None]:
        """redis-py's errors (and timeouts) become ``BackendError``, with the password
        scrubbed (``backends/_errors.py``: an exception not redis-py's is raised unchanged)."""
        return self._errors(action)

    def _error_rows(self) -> list[ErrorRow]:
        from redis import exceptions as errors

        def where(action: str) -> str:
            return f"{self.backend} could not {action}"

        def refused(action: str, exc: BaseException) -> BackendError:
            if urlsplit(self.url).password is None and not self._options.get("password"):
                return BackendUnavailableError(
                    f"{where(action)}: the server requires a password and the URL gives none "
                    f"({self._describe(exc)}); write it as redis://user:password@host"
                )
            return BackendUnavailableError(
                f"{where(action)}: the server refused the credentials ({self._describe(exc)}); "
                "check the user name and password in the URL"
            )

        unavailable = (
            OSError,
            errors.ConnectionError,
            errors.ClusterDownError,
            errors.TryAgainError,
            errors.RedisClusterException,
            errors.BusyLoadingError,
        )
        return [
            (lambda exc: isinstance(exc, errors.AuthenticationError) or _says_auth(exc), refused),
            (
                (TimeoutError, errors.TimeoutError),
                lambda action, exc: BackendUnavailableError(
                    f"{where(action)}: no answer from {self.redacted} in time"
                ),
            ),
            (
                unavailable,
                lambda action, exc: BackendUnavailableError(
                    f"{where(action)}: {self._describe(exc)}"
                ),
            ),
            # A script's call refused by the ACL is a plain ResponseError on Redis 7.0.
            (
                lambda exc: (
                    isinstance(exc, errors.NoPermissionError)
                    or (isinstance(exc, errors.RedisError) and "can't run this command" in str(exc))
                ),
                lambda action, exc: BackendError(
                    f"{where(action)}: the server's ACL refused it ({self._describe(exc)}); the "
                    f"user needs the keys ~{self.prefix}:* and the commands the backend runs "
                    "(docs/backends.md, Redis)"
                ),
            ),
            (
                errors.RedisError,
                lambda action, exc: BackendError(f"{where(action)}: {self._describe(exc)}"),
            ),
        ]

    def _describe(self, exc: BaseException) -> str:
        text = " ".join(_redact.scrub(str(exc), self._secrets).split())  # one line
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

    # -- history -----------------------------------------------------------------------------

    def history_ttl_args(self, job: JobPolicy) -> list[str | int]:
        """The scripts' cutoff (ms, the scheduler's clock, like the records' times) and the
        history list's expiry, for ``history_ttl``; empty strings without one."""
        if job.history_ttl is None:
            return ["", ""]
        return [self.now_ms() - to_ms(job.history_ttl), max(1, to_ms(job.history_ttl))]

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        args: list[str | int] = [
            history_entry(record),
            job.history_size,
            *self.history_ttl_args(job),
        ]
        await self.script(
            "RECORD", f"record a run of {job.name}", [history_key(self.prefix, job.name)], args
        )
        await self.recheck_eviction()

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        count = max(0, min(limit, job.history_size))
        if count == 0:
            return []
        key = history_key(self.prefix, job.name)

        async def read(client: Any) -> list[bytes]:
            entries: list[bytes] = await client.lrange(key, 0, count - 1)
            return entries

        entries = await self.call(f"read the history of {job.name}", read)
        cutoff = None if job.history_ttl is None else self.now_ms() - to_ms(job.history_ttl)
        records: list[RunRecord] = []
        for entry in entries:
            started, _, text = entry.partition(b":")
            if cutoff is not None and int(started) < cutoff:
                continue
            records.append(RunRecord.from_json(text))
        return records

    # -- the fleet's records (``_fleet``) ----------------------------------------------------

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        key = fleet_key(self.prefix, kind)
        now = self.now_ms()

        async def read(client: Any) -> dict[str, str]:
            found: dict[str, str] = {}
            expired: list[bytes] = []
            for field, raw in (await client.hgetall(key)).items():
                expires, _, value = raw.decode().partition(":")
                if expires != "0" and int(expires) <= now:
                    expired.append(field)
                else:
                    found[field.decode()] = value
            if expired:
                await client.hdel(key, *expired)
            return found

        return await self.call(f"read the fleet's {kind}s", read)

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        name = fleet_key(self.prefix, kind)
        ttl_ms = to_ms(ttl)
        stored = f"{self.now_ms() + ttl_ms}:{value}"

        async def put(client: Any) -> None:
            pipe = client.pipeline(transaction=False)  # (MULTI is not in the README's ACL)
            pipe.hset(name, key, stored)
            pipe.pexpire(name, ttl_ms)
            await pipe.execute()

        await self.call(f"write its {kind} record", put)

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        name = fleet_key(self.prefix, kind)
        held = "" if old is None else f"0:{old}"
        action = f"change the {kind} record of {key}"
        return bool(await self.script("FLEET_SWAP", action, [name], [key, held, f"0:{new}"]))


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


def history_entry(record: RunRecord) -> str:
    """``<started_ms>:<the record's JSON>``: the scripts trim by age on the number alone."""
    return f"{datetime_to_ms(record.started_at)}:{record.to_json()}"


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


def _says_auth(exc: BaseException) -> bool:
    """Authentication failures redis-py reports as a plain ResponseError (``WRONGPASS``, or a
    ``NOAUTH`` on a command)."""
    text = str(exc)
    return text.startswith(("WRONGPASS", "NOAUTH", "invalid username-password")) or (
        "Authentication required" in text
    )


async def _close_quietly(client: Any) -> None:
    try:
        async with asyncio.timeout(5):
            await client.aclose()
    except Exception:  # closing must not raise (Backend._close)
        logger.debug("closing the Redis client failed", exc_info=True)

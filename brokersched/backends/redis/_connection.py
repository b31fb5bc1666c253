"""``RedisConnection``: one Redis backend's client, its scripts, its calls and the translation of
redis-py's errors; the checks of the server it makes at start are ``_server``'s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ... import _redact
from ..._clock import Clock
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ...abc import FleetKind, JobPolicy, RunRecord
from .._budget import BudgetWatch
from .._errors import ErrorMap, ErrorRow
from . import _scripts
from ._budget import redis_budget_watch
from ._fleet import put_record, read_records, swap_record
from ._history import read_history, record_run
from ._options import RedisServerOptions, check_prefix
from ._server import POLICY_RECHECK_MS, ServerChecks, guard_refusal

__all__ = ["RedisConnection"]

logger = logging.getLogger("brokersched.backends.redis")

T = TypeVar("T")

_INSTALL_HINT = "pip install 'brokersched[redis]'"
_OPERATION_TIMEOUT_S = 10.0  # start, record, history, take-over: not time-critical, but bounded
_CONNECT_TIMEOUT_S = 5.0


class RedisConnection(ServerChecks):
    """One backend's client (a ``redis.asyncio.Redis`` or ``RedisCluster``), its scripts, and
    the one place where redis-py's errors become brokersched's, with the password scrubbed.

    The client never retries a command by itself: a command whose answer was lost may have
    been applied (a claim that won), and only a definite answer may be returned; a failed call
    raises ``BackendError`` and the scheduler fails closed. The next call uses a fresh
    connection from the pool, so an outage fails only the calls made during it.
    """

    def __init__(
        self, backend: str, options: RedisServerOptions, client_options: Mapping[str, Any]
    ) -> None:
        self.backend = backend
        self._budget_period = options.budget_interval
        #: The server's budget while started (``_budget``), unless ``budget_interval=None``.
        self.budget: BudgetWatch | None = None
        self.url, self.prefix, self.cluster = options.url, options.prefix, options.cluster
        self.require_persistence = options.require_persistence
        self.redacted = _redact.redact_url(self.url)
        self._secrets = _redact.url_secrets(self.url)
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
        self._policy_due_ms = clock.monotonic_ms() + POLICY_RECHECK_MS
        if self._budget_period is not None:
            self.budget = redis_budget_watch(self.backend, self.read_budget, self._budget_period)
            try:
                await self.budget.start(clock)
            except BaseException:  # cancelled
                await self.close()
                raise
        logger.debug("%s connected to %s", self.backend, self.redacted)

    def namespace(self, namespace: str | None) -> str:
        """``namespace`` checked as a prefix (``brokersched purge --prefix``), or this one's."""
        return self.prefix if namespace is None else check_prefix(namespace, self.backend)

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

    # -- history (``_history``) and the fleet's records (``_fleet``) ---------------------------

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await record_run(self, job, record)
        await self.recheck_eviction()

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await read_history(self, job, limit)

    async def fleet_read(self, kind: FleetKind) -> dict[str, str]:
        return await read_records(self, kind)

    async def fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        await put_record(self, kind, key, value, ttl=ttl)

    async def fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        return await swap_record(self, kind, key, old, new)


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

"""The one way a client library's exceptions become brokersched's (httpx's
``map_httpcore_exceptions``): each backend writes a table, which client exception means what,
and applies it with ``with errors(action):`` around the calls it makes.

The policy, the same for every backend:

- a ``BrokerschedError`` raised inside passes unchanged (it says what happened already);
- the first row whose match fits the exception makes the error raised, ``from`` the client's
  exception scrubbed of the backend's secrets (``_redact.chainable``), so a message never
  carries a password and the traceback still shows the cause;
- an exception no row matches is raised unchanged: a bug stays a bug, with its own type and
  traceback (the scheduler's runner logs it and skips the slot: a claim still fails closed).

A row may match a ``BaseException`` that is not an ``Exception`` only through a predicate
(RabbitMQ: a ``CancelledError`` nobody asked for is a lost connection); a real cancellation,
``KeyboardInterrupt`` and ``SystemExit`` match no table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TypeAlias

from .. import _redact
from .._durations import format_duration
from .._exceptions import BackendError, BrokerschedError

__all__ = ["ErrorMap", "ErrorRow", "Translating", "Within"]

#: What a row matches: exception classes, or a predicate over the exception.
Match: TypeAlias = (
    type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
)
#: What a row makes: brokersched's error for ``(action, the client's exception)``.
Make: TypeAlias = Callable[[str, BaseException], BackendError]
ErrorRow: TypeAlias = tuple[Match, Make]


class ErrorMap:
    """A backend's table of client exceptions, applied by ``with errors(action):``.

    ``rows`` is called once, at the first exception: the client libraries are imported lazily
    (an extra that is not installed has no exception classes to name).
    """

    __slots__ = ("_rows", "_table", "secrets")

    def __init__(self, rows: Callable[[], Sequence[ErrorRow]], secrets: Sequence[str] = ()):
        self._rows = rows
        self._table: Sequence[ErrorRow] | None = None
        self.secrets = secrets

    def __call__(self, action: str) -> Translating:
        return Translating(self, action)

    def translate(self, action: str, exc: BaseException) -> BackendError | None:
        """Brokersched's error for ``exc`` (what ``action`` was doing); ``None``: not the
        client's (a bug, a cancellation), to be raised unchanged."""
        if isinstance(exc, BrokerschedError):
            return None
        if self._table is None:
            self._table = tuple(self._rows())
        for match, make in self._table:
            if _matches(match, exc):
                return make(action, exc)
        return None


def _matches(match: Match, exc: BaseException) -> bool:
    if isinstance(match, type | tuple):
        return isinstance(exc, match)
    return match(exc)


class Translating:
    """One ``with`` of an ``ErrorMap``: a class rather than a ``contextmanager`` generator,
    as it wraps every claim (cheap, and nothing is formatted unless something failed)."""

    __slots__ = ("_action", "_map")

    def __init__(self, errors: ErrorMap, action: str) -> None:
        self._map = errors
        self._action = action

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        error = self._map.translate(self._action, exc)
        if error is not None:
            raise error from _redact.chainable(exc, self._map.secrets)


class Within:
    """``asyncio.timeout(seconds)`` whose expiry says its bound: ``TimeoutError("timed out
    after 2s")`` (or ``after 333ms``), shown as it is by the rows that translate a timeout. A
    ``TimeoutError`` raised inside, not by the expiry, passes unchanged."""

    __slots__ = ("_seconds", "_timeout")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._timeout = asyncio.timeout(seconds)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)  # raises only when it expired
        except TimeoutError as expired:
            bound = format_duration(timedelta(seconds=self._seconds))
            raise TimeoutError(f"timed out after {bound}") from expired

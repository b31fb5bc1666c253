"""How ``NATSBackend`` (``_backend``) makes one claim: publishes with the claim's message id
(``Nats-Msg-Id: <job>:<slot_ms>``) retried until a definite answer, a retry that comes back a
duplicate read back to tell an earlier attempt of this very claim (its token) from another
instance's (see the package's docstring, "Ambiguous claims"), and the watch of the connection
that ends an attempt at a disconnect and waits for the connection to come back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ..._exceptions import BackendError, BackendUnavailableError
from ._errors import BACKEND, MSG_ID, redact

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js import JetStreamContext
    from nats.js.api import PubAck

__all__ = [
    "RETRY_PAUSE_S",
    "ClaimMessage",
    "ClaimRetries",
    "Watch",
    "attempt_seconds",
    "check_stream",
    "claim_body",
]

_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii
# A single publish attempt waits at most this long (or a quarter of the claim budget, if more)
# before it is retried with the same message id: a request sent just before a disconnect never
# gets its ack, and waiting for the whole deadline would leave no time for the retry.
_MIN_ATTEMPT_S = 0.25
# ... and at most this long: with a long budget (a cluster's 30 s), a request lost with a dying
# stream leader is retried against the new one soon after it is elected.
_MAX_ATTEMPT_S = 2.0
RETRY_PAUSE_S = 0.02  # between attempts that got a definite "try again" (no responders, 503)
_CONNECTED_POLL_S = 0.05


class Watch:
    """The connection's state as claims need it: when it is back, and which publish attempts
    are in flight (a disconnect ends them at once: their acks will never come)."""

    def __init__(self) -> None:
        self._attempts: set[asyncio.Timeout] = set()
        self._changed = asyncio.Event()

    def changed(self) -> None:
        self._changed.set()

    def disconnected(self) -> None:
        self._changed.clear()
        now = asyncio.get_running_loop().time()
        for attempt in list(self._attempts):
            with contextlib.suppress(RuntimeError):  # already leaving its block
                attempt.reschedule(now)

    def attempt(self, seconds: float) -> _Attempt:
        """A deadline for one publish attempt that a disconnect ends at once."""
        return _Attempt(self._attempts, asyncio.timeout(seconds))

    async def wait_connected(self, nc: NATSClient, until: float) -> None:
        """Return when ``nc`` is connected again or at ``until`` (``time.monotonic()``)."""
        while not nc.is_connected:
            if nc.is_closed:
                raise BackendUnavailableError(f"{BACKEND}: the NATS connection is closed")
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):  # the event can miss a change: poll too
                await asyncio.wait_for(self._changed.wait(), min(remaining, _CONNECTED_POLL_S))


class _Attempt:
    """An ``asyncio.timeout`` that its ``Watch`` can end early while it is active."""

    __slots__ = ("_attempts", "_timeout")

    def __init__(self, attempts: set[asyncio.Timeout], timeout: asyncio.Timeout) -> None:
        self._attempts, self._timeout = attempts, timeout

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._attempts.add(self._timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._attempts.discard(self._timeout)
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it expired


class ClaimMessage(NamedTuple):
    """What every attempt of one claim publishes; ``token`` is in ``body``."""

    subject: str
    msg_id: str
    body: bytes
    token: str


def attempt_seconds(budget: float) -> float:
    """How long one publish attempt waits for its ack before it is retried."""
    return min(max(_MIN_ATTEMPT_S, budget / 4), _MAX_ATTEMPT_S, budget)


def check_stream(ack: PubAck, stream: str, msg_id: str) -> None:
    if ack.stream != stream:
        raise BackendError(
            f"{BACKEND}: claim {msg_id} was stored in stream {ack.stream!r}, expected {stream!r}"
        )


def claim_body(instance_id: str, slot_ms: int, run_id: str, token: str) -> bytes:
    # Formatted by hand (strings still JSON-escaped): json.dumps of a dict costs more than the
    # rest of the claim's client-side work together.
    return (
        f'{{"instance_id":{_json_str(instance_id)},"slot_ms":{int(slot_ms)},'
        f'"run_id":{_json_str(run_id)},"claim":"{token}"}}'
    ).encode()


class ClaimRetries:
    """One ``claim()`` call: publish attempts with the same message id until a definite answer."""

    def __init__(
        self,
        watch: Watch,
        nc: NATSClient,
        js: JetStreamContext,
        stream: str,
        message: ClaimMessage,
        started: float,
        budget: float,
    ) -> None:
        self.watch, self.nc, self.js, self.stream = watch, nc, js, stream
        self.message, self.msg_id, self.budget = message, message.msg_id, budget
        self.deadline = started + budget  # on time.monotonic()
        self.attempt_s = attempt_seconds(budget)
        self.attempts = 0
        self.cause: Exception | None = None  # why the last attempt had no answer

    async def retry(self, first_error: Exception | None) -> bool:
        """Attempt until a definite answer or the deadline; ``first_error`` ended attempt 1."""
        if first_error is not None:
            self.attempts = 1
            await self._absorb(first_error)
        while (remaining := self.deadline - time.monotonic()) > 0:
            if not self.nc.is_connected:
                # Waiting, rather than letting nats-py buffer the publish, means a claim we give
                # up on was never sent: it cannot be stored later behind our back.
                await self.watch.wait_connected(self.nc, self.deadline)
                continue
            try:
                async with self.watch.attempt(min(remaining, self.attempt_s)):
                    verdict = await self._attempt()
            except Exception as exc:
                await self._absorb(exc)
                continue
            if verdict is not None:
                return verdict
        raise self._no_answer()

    async def _absorb(self, exc: Exception) -> None:
        """Keep ``exc`` as the cause of a retry, or re-raise it when retrying cannot help."""
        import nats.errors
        import nats.js.errors

        if isinstance(exc, TimeoutError | nats.errors.OutboundBufferLimitError):
            self.cause = exc  # maybe stored: the next attempt finds out
        elif isinstance(
            exc, nats.js.errors.NoStreamResponseError | nats.js.errors.ServiceUnavailableError
        ):  # JetStream not ready (restarting, electing a leader): not stored
            self.cause = exc
            await asyncio.sleep(max(0.0, min(RETRY_PAUSE_S, self.deadline - time.monotonic())))
        else:
            raise exc

    async def _attempt(self) -> bool | None:
        """``True``/``False`` when definite, ``None`` to try again."""
        self.attempts += 1
        ack = await self.js.publish(
            self.message.subject,
            self.message.body,
            timeout=self.budget,  # the attempt's own deadline ends it sooner
            headers={MSG_ID: self.msg_id},
        )
        check_stream(ack, self.stream, self.msg_id)
        if not ack.duplicate:
            return True
        if self.attempts == 1:
            return False  # nothing of this call can have been stored before: definite
        if not ack.seq:  # clustered: the first copy is still being replicated
            await asyncio.sleep(RETRY_PAUSE_S)
            return None
        return await self._stored_is_ours(ack.seq)

    async def _stored_is_ours(self, seq: int) -> bool:
        """Whether the message stored under our id is an earlier attempt of this call.

        Read from the stream leader (not a direct get, which a lagging replica may answer).
        """
        msg = await self.js.get_msg(self.stream, seq=seq)
        headers = cast(dict[str, str], msg.headers or {})  # pyright: ignore[reportUnknownMemberType]
        stored_id = headers.get(MSG_ID)
        if stored_id != self.msg_id:
            raise BackendError(
                f"{BACKEND}: claim {self.msg_id}: sequence {seq} of {self.stream} holds "
                f"{stored_id!r}; cannot tell who won"
            )
        try:
            stored = json.loads(msg.data or b"")
        except ValueError as exc:
            raise BackendError(f"{BACKEND}: claim {self.msg_id}: unreadable stored body") from exc
        ours = self.message.token
        return isinstance(stored, dict) and cast(dict[str, Any], stored).get("claim") == ours

    def _no_answer(self) -> BackendError:
        if self.cause is not None:
            cause = redact(str(self.cause)) or type(self.cause).__name__
        else:
            cause = "no time left to try" if self.nc.is_connected else "not connected"
        error = BackendUnavailableError(
            f"{BACKEND}: claim {self.msg_id}: no definite answer within {self.budget:g}s "
            f"after {self.attempts} attempt(s) ({cause})"
        )
        error.__cause__ = self.cause
        return error

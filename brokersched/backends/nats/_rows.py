"""The lease rows of ``NATSLeaseBackend``, apart from nats-py: each job's row as one entry of
a key-value table with revisions, and every change of it a compare-and-set.

``Table`` is what a row needs of the store: read an entry with its revision (and the store's
clock), write one only if its revision is still the one read. ``Rows.decide`` applies the lease
protocol (``_lease.decide``) to a job's row on the store's clock and writes the result; a lost
race (another instance wrote first) reads again. A failed call is made again until the
decision's deadline; a write whose answer is lost (a link cut, a timeout) may have landed: the
row carries the id of the write that made it, so reading it back says whether ours did.
The fleet simulator runs these rows over a model of the table (``_link``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Literal, Protocol, cast

from ..._exceptions import BackendError, BackendUnavailableError
from ..._tasks import cancel_requests, raise_if_cancelled_since
from ...abc import Lease, LeaseState, RunReason
from .._lease import Acquire, Answer, JobRow, LeaseRow, Request, Store, TakenOver, decide

__all__ = ["Conflict", "Rows", "Table", "decode_row", "encode_row", "row_key"]

#: Compare-and-sets a decision may lose to other instances' writes of the same row before it
#: gives up (the job is contested).
_ROUNDS = 32
#: The longest one call waits for its answer before it is made again (a request lost with a
#: dying stream leader is retried against the new one soon after its election).
_ATTEMPT_S = 2.0
#: The pause after a failed call, doubled after each, up to the longest.
_PAUSE_S = 0.02
_MAX_PAUSE_S = 0.5
_KEY_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


class Conflict(Exception):
    """The entry's revision was no longer the one read: another write came first."""


class Table(Protocol):
    """One key-value bucket, as the lease rows use it (``KVLink.open`` gives it: the real
    ``_bucket.KVTable``, or the fleet simulator's model). Every method answers within
    ``timeout`` seconds or raises ``TimeoutError`` or ``BackendError`` (no answer)."""

    async def read(self, key: str, timeout: float) -> tuple[bytes | None, int]:
        """The entry's value and revision, read from the store's leader (``None, 0``: none)."""

    async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
        """Store ``value`` if the entry's revision is still ``last`` (0: if there is none);
        raise ``Conflict`` otherwise. Without an answer it may have landed or not."""

    async def read_at(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
        """``read()``, and the store's clock (ms since the epoch) at about that moment."""


def row_key(job: str) -> str:
    """``job.<job>``: every character but ``[A-Za-z0-9_-]`` becomes ``=XX`` per UTF-8 byte (key
    tokens are separated by ``.``, and ``:`` or ``$`` are not allowed; ``=`` is never in a job
    name, so the key is injective)."""
    escaped = "".join(
        char if char in _KEY_SAFE else "".join(f"={byte:02X}" for byte in char.encode())
        for char in job
    )
    return f"job.{escaped}"


def encode_row(row: JobRow, write_id: str) -> bytes:
    leases = {
        str(slot): [
            lease.token, lease.run_id, lease.instance_id, lease.reason, lease.attempt,
            lease.state, lease.started_ms, lease.expires_ms,
        ]
        for slot, lease in row.leases.items()
    }  # fmt: skip
    body = {"fence": row.fence, "manual": row.manual_fence, "leases": leases, "write": write_id}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_row(value: bytes | None) -> tuple[JobRow, str | None]:
    """The row and the id of the write that made it (``JobRow(), None``: no entry)."""
    if not value:
        return JobRow(), None
    try:
        body = json.loads(value)
        leases = {int(slot): _lease(fields) for slot, fields in body["leases"].items()}
        return JobRow(body["fence"], body["manual"], leases), body.get("write")
    except (ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"a lease row is not brokersched's ({exc!r}): {value[:80]!r}") from exc


def _lease(fields: list[Any]) -> LeaseRow:
    token, run_id, instance, reason, attempt, state, started, expires = fields
    return LeaseRow(
        str(token), str(run_id), str(instance), cast(RunReason, reason), int(attempt),
        cast(Literal["running", "handover"], state), int(started), int(expires),
    )  # fmt: skip


class Rows:
    """The lease rows of one bucket: ``decide`` is the lease protocol applied to a job's row,
    atomically (a compare-and-set on its revision).

    ``monotonic`` (seconds) and ``sleep`` are the time the retries are bounded and paced by,
    ``bound`` the timeout of a wait on another claim, which ``blocking`` marks (the scheduler's
    clock's: the fleet simulator's are virtual)."""

    def __init__(
        self,
        table: Table,
        backend: str,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        blocking: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        bound: Callable[[float], AbstractAsyncContextManager[object]] = asyncio.timeout,
    ) -> None:
        self.table = table
        self.backend = backend
        self._monotonic = monotonic
        self._sleep = sleep
        self._blocking = blocking
        self._bound = bound
        self._claiming: dict[str, asyncio.Lock] = {}  # by job: this instance's claims in turn

    async def read(self, job: str, timeout: float) -> JobRow:
        row, _ = decode_row((await self.table.read(row_key(job), timeout))[0])
        return row

    async def read_at(self, job: str, timeout: float) -> LeaseState:
        """The job's state (``LeaseBackend.lease_state``) with the store's clock."""
        value, _, now_ms = await self.table.read_at(row_key(job), timeout)
        return decode_row(value)[0].state(now_ms)

    async def decide(
        self, job: str, request: Request, *, ttl_ms: int, skew_ms: int, timeout: float
    ) -> tuple[Answer, int]:
        """``_decide``; this instance's claims of one job one after the other, in the order
        they came (so that, when the bucket answers again after an outage, a job's slots that
        waited are claimed oldest first: a later slot's claim landing first would fence them
        all away)."""
        if not isinstance(request, Acquire):
            return await self._decide(job, request, ttl_ms=ttl_ms, skew_ms=skew_ms, timeout=timeout)
        began = self._monotonic()
        lock = self._claiming.setdefault(job, asyncio.Lock())
        try:
            with self._blocking():  # a virtual clock: waiting on another claim, not on time
                async with self._bound(max(timeout, 0.0)):
                    await lock.acquire()
        except TimeoutError as exc:
            raise BackendUnavailableError(
                f"{self.backend}: an earlier claim of {job!r} still waits for an answer"
            ) from exc
        try:
            left = timeout - (self._monotonic() - began)
            return await self._decide(job, request, ttl_ms=ttl_ms, skew_ms=skew_ms, timeout=left)
        finally:
            lock.release()

    async def _decide(
        self, job: str, request: Request, *, ttl_ms: int, skew_ms: int, timeout: float
    ) -> tuple[Answer, int]:
        """The answer to ``request`` and the store's clock it was decided at; raises
        ``BackendError`` when no answer is definite within ``timeout`` seconds.

        A call that fails (no leader while the bucket's stream elects one, a link cut) is made
        again until the deadline: a read changes nothing, and a write is a compare-and-set, so
        of all the writes made from one revision at most one lands. Which one, if any, the next
        read tells: the row names the write that made it, and a write of this call's stands
        (its answer is returned) as long as nothing was written after it. A write of this call
        that granted leases (a claim, a take-over) is found by their tokens even after others
        wrote.
        """
        key = row_key(job)
        deadline = self._monotonic() + timeout
        cancels = cancel_requests()
        mine: dict[str, tuple[Answer, int]] = {}  # this call's writes, by id: their answers
        error: Exception | None = None
        pause, conflicts = _PAUSE_S, 0
        while conflicts < _ROUNDS:
            if error is not None:
                if deadline - self._monotonic() <= pause:
                    break
                await self._sleep(pause)
                pause = min(pause * 2, _MAX_PAUSE_S)
            left = deadline - self._monotonic()
            if left <= 0:
                break
            try:
                value, revision, now = await self.table.read_at(key, min(left, _ATTEMPT_S))
            except (BackendError, TimeoutError) as exc:
                raise_if_cancelled_since(cancels)  # swallowed by nats-py's wait_for (3.11)
                error = exc
                continue
            raise_if_cancelled_since(cancels)  # no write after a cancellation swallowed
            row, write_id = decode_row(value)
            if write_id in mine:
                return mine[write_id]  # a write of this call landed, and nothing after it
            held = {lease.token for lease in row.leases.values()}
            for granted in mine.values():
                if _tokens(granted[0]) & held:  # it landed, and others wrote after it
                    return granted
            after, answer = decide(job, row, request, Store(now, ttl_ms, skew_ms))
            if after == row:
                return answer, now  # nothing changes: the answer holds as read
            write_id = secrets.token_hex(8)
            mine[write_id] = (answer, now)
            left = deadline - self._monotonic()
            try:
                await self.table.write(
                    key, encode_row(after, write_id), revision, max(min(left, _ATTEMPT_S), 0.001)
                )
            except Conflict:
                error = None  # another instance's write came first: decide again on it
                conflicts += 1
                continue
            except (BackendError, TimeoutError) as exc:
                raise_if_cancelled_since(cancels)
                error = exc  # landed or not: the next read tells
                continue
            return answer, now
        if error is None and conflicts >= _ROUNDS:
            raise BackendError(
                f"{self.backend}: the lease row of {job!r} kept changing ({_ROUNDS} writes of "
                "other instances came first)"
            )
        if isinstance(error, BackendError):
            raise error
        raise BackendUnavailableError(
            f"{self.backend}: no definite answer for {job!r} within {timeout:g}s"
        ) from error


def _tokens(answer: Answer) -> set[str]:
    """The lease tokens a write with this answer granted (fresh ones: no other holds them)."""
    if isinstance(answer, Lease):
        return {answer.token}
    if isinstance(answer, TakenOver):
        return {lease.token for lease in answer.leases}
    return set()

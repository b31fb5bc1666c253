"""``NATSBackend``: its configuration and its life (connect, prepare, close), its claims and its
run history; a claim's retries and the resolution of ambiguous ones are ``_claims``'s, the
streams are set up and checked by ``_streams``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ... import _redact
from ..._clock import Clock
from ..._durations import Duration, to_ms
from ..._exceptions import BackendError
from ..._slotmemory import BOOT_MEMORY, DEFAULT_CLAIM_SKEW, claim_deadline_ms
from ..._tasks import cancel_requests, gather_each, raise_if_cancelled_since, to_the_end
from ...abc import Claim, Finding, Inventory, JobPolicy, RunRecord, Slot
from .._claims import ClaimBackendBase
from .._keywords import own_options, refuse_unknown
from . import _ops
from ._claims import (
    RETRY_PAUSE_S,
    ClaimMessage,
    ClaimRetries,
    Watch,
    attempt_seconds,
    check_stream,
    claim_body,
)
from ._connection import API_TIMEOUT_S, NATSClientBase, server_version
from ._errors import (
    BACKEND,
    CALLBACKS,
    MSG_ID,
    close_client,
    connect_keywords,
    describe,
    logger,
)
from ._history import read_last
from ._names import Names
from ._options import NATSOptions, check_prefix
from ._streams import Streams

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js import JetStreamContext
    from nats.js.api import PubAck

__all__ = ["NATSBackend"]

_API_TIMEOUT_S = API_TIMEOUT_S  # here too, for the tests that shorten it
_FORGOTTEN = " (the claims stream's duplicate window), so its first claim may have been forgotten"


class NATSBackend(NATSClientBase, ClaimBackendBase):
    """Claims and history on NATS JetStream (claim-only: no leases).

    ``servers``: one URL or a list (``nats://``, ``tls://``, ``ws://``, ``wss://``, or
    scheme-less ``host:port``; anything else is refused at construction; user-info in URLs is
    redacted from every log line and error). ``slot_ttl``: how long a claimed slot is
    remembered (the claims stream's duplicate window and max age). ``replicas``: stream
    replicas in a cluster.
    ``claim_timeout``: the longest a claim may take, whatever ``timeout`` the scheduler allows
    (the rest of the job's ``max_late``); by default 2 s on one server and 30 s with
    ``replicas`` > 1, where a stream leader's election takes seconds (``_options``).
    ``connect_options`` go to ``nats.connect`` (``user_credentials``, ``tls``, ``token``, ...);
    they are never logged, and one it does not accept is refused at construction. ``start()``
    waits up to twice ``connect_timeout`` (2 s) per server. ``budget_interval``: how often the
    JetStream account's budget (``budget``) is read while started (``None``: never); from
    80 % of the account's storage or memory limit no claim is published (the slot is skipped,
    never run twice) until back under 60 % (``_budget``).
    """

    history_size_per_job = False  # one stream for every job's history
    _backend = BACKEND

    def __init__(
        self,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        *,
        slot_ttl: Duration = "5m",
        prefix: str = "brokersched",
        replicas: int = 1,
        claim_timeout: Duration | None = None,
        max_clock_skew: Duration = DEFAULT_CLAIM_SKEW,
        budget_interval: Duration | None = "30s",
        **connect_options: Any,
    ) -> None:
        options = NATSOptions.parse(BACKEND, locals())
        super().__init__()
        refuse_unknown(
            BACKEND,
            connect_options,
            own=own_options(NATSBackend),
            library="nats.connect",
            accepted=connect_keywords,
        )
        self._set_memory(options)
        self._keep_client(options, connect_options)
        self._clock: Clock | None = None
        self._raising_window = asyncio.Lock()
        self._claim_timeout, self._names = options.claim_timeout, Names(options.prefix)
        self._streams = self._new_streams()
        self._watch = Watch()
        self._last_error: str | None = None
        self._claim_budget_s = self._claim_timeout.total_seconds()
        self._token_base = secrets.token_hex(6)
        self._token_seq = itertools.count()
        self._claim_subjects: dict[str, str] = {}  # job -> subject, validated once

    def _new_streams(self) -> Streams:
        return Streams(
            self._names,
            slot_ttl=self._slot_ttl,
            replicas=self._replicas,
            secrets=self._secrets,
            shown_servers=self._shown_servers,
            last_error=lambda: self._last_error,
            skew_ms=self._skew_ms,
        )

    def __repr__(self) -> str:
        return f"{BACKEND}({self._shown_servers!r}, prefix={self._names.prefix!r})"

    # -- lifecycle -----------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        # Fresh per start: asyncio primitives belong to the loop they are first used in.
        self._watch, self._streams = Watch(), self._new_streams()
        cancels = cancel_requests()
        nc = await self._connect(cancels)
        try:
            js = nc.jetstream(timeout=_API_TIMEOUT_S)  # pyright: ignore[reportUnknownMemberType]
            with self._translated("preparing streams"):
                await self._streams.start(js, clock.now_ms)
            raise_if_cancelled_since(cancels)
        except BaseException:
            await to_the_end(close_client(nc))
            raise
        self._nc, self._js, self._clock = nc, js, clock
        self._fleet_buckets = None  # opened on first use, on this connection
        await self._start_budget(clock, cancels)

    def _callbacks(self) -> dict[str, Callable[..., Awaitable[None]]]:
        """Our connection callbacks, each also calling the caller's own if given."""
        ours: dict[str, Callable[..., Awaitable[None]]] = {
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }
        for name in CALLBACKS:
            theirs = self._connect_options.get(name)
            if theirs is not None:
                ours[name] = _chain(ours[name], theirs)
        return ours

    async def _close(self) -> None:
        await self._stop_budget()
        await self._streams.close()
        nc, self._nc, self._js, self._clock = self._nc, None, None, None
        if nc is not None:
            await close_client(nc)

    async def _on_error(self, exc: Exception) -> None:
        # nats-py calls this on every failed reconnect attempt: keep the message for the next
        # error we raise, and log at debug while we know we are disconnected.
        self._last_error = describe(exc, self._secrets)
        connected = self._nc is not None and self._nc.is_connected
        logger.log(
            logging.WARNING if connected else logging.DEBUG, "NATS error: %s", self._last_error
        )

    async def _on_disconnected(self) -> None:
        self._watch.disconnected()
        if self._nc is not None:  # not the initial connection, nor closing
            logger.warning("NATS connection lost; claims fail closed until it is back")

    async def _on_reconnected(self) -> None:
        self._watch.changed()
        nc = self._nc
        url = "?"
        if nc is not None and nc.connected_url:
            url = _redact.scrub(_redact.redact_url(nc.connected_url.geturl()), self._secrets)
        logger.info("NATS connection back (%s); claiming resumes", url)

    async def _on_closed(self) -> None:
        self._watch.changed()
        if self._nc is not None:
            logger.error("NATS connection closed for good; claims fail until restart")

    def _namespace(self, namespace: str | None) -> str:
        return self._names.prefix if namespace is None else check_prefix(namespace, BACKEND)

    # -- operations (brokersched purge, doctor) ---------------------------------------------

    async def _inventory(self, namespace: str | None) -> Inventory:
        """The prefix's streams (claims, history). Live: a message stored in the last
        minute (a claim, the fleet's record, a run)."""
        names = self._names if namespace is None else Names(self._namespace(namespace))
        return await self._operation("list its streams", _ops.inventory, names)

    async def purge(self, inventory: Inventory) -> Inventory:
        return await self._operation("delete its streams", _ops.purge, inventory)

    async def doctor(self, *, slots: Sequence[Slot] = ()) -> list[Finding]:
        async def check(js: JetStreamContext, nc: NATSClient) -> list[Finding]:
            shown = server_version(nc)
            return await _ops.doctor(js, shown, self._names, self._slot_ttl, self._replicas)

        return await self._operation("check its streams", check, with_client=True)

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        if jobs:
            _, js = self._client()
            with self._translated("preparing the history stream"):
                await self._streams.ensure_history(js, max(job.history_size for job in jobs))

    # -- claims --------------------------------------------------------------------------------

    def claim_deadline_ms(self, slot: Slot) -> int | None:
        """From the claims stream's window and the raises noted in its record, as read at start
        (``_slotmemory``): a slot that fell due before a raise is claimed at most the old window
        late."""
        if self._js is None:
            return super().claim_deadline_ms(slot)
        return claim_deadline_ms(self._streams.fleet, slot.slot_ms, skew_ms=self._skew_ms)

    def _check_deadline(self, slot: Slot) -> None:
        if self._clock is not None:
            self._refuse_too_late(self._streams.fleet, slot, self._clock.now_ms(), _FORGOTTEN)

    async def claim_boot(
        self, slot: Slot, *, instance_id: str, run_id: str, timeout: float
    ) -> bool:
        """A boot window's claim: the claims stream's window is raised to ``BOOT_MEMORY`` first
        when shorter (once), then the claim is an ordinary one."""
        _, js = self._client()
        if self._budget is not None:  # before the window is raised (a write of its own)
            self._budget.refuse_if_shedding(f"the claim of {slot.key} is not published")
        if self._streams.fleet.memory_ms < to_ms(BOOT_MEMORY):
            async with self._raising_window:
                if self._streams.fleet.memory_ms < to_ms(BOOT_MEMORY):
                    with self._translated("raising the claims window"):
                        await self._streams.raise_window(js, BOOT_MEMORY)
        return await self.claim(slot, instance_id=instance_id, run_id=run_id, timeout=timeout)

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        nc, js = self._client()
        if self._budget is not None:
            self._budget.refuse_if_shedding(f"the claim of {slot.key} is not published")
        self._check_deadline(slot)
        message = self._message(slot, instance_id, run_id)
        with self._translated("claim", message.msg_id):
            started = time.monotonic()
            budget = min(timeout, self._claim_budget_s)
            if not nc.is_connected or budget <= 0:
                return await self._retry_claim(nc, js, message, started, budget, None)
            # The first attempt, kept lean: it is nearly always the only one. It relies on
            # nats-py's timeout rather than an asyncio.timeout that a disconnect could end early
            # (~7 us per claim); it is retried after attempt_seconds() anyway.
            try:
                ack = await js.publish(
                    message.subject,
                    message.body,
                    timeout=attempt_seconds(budget),
                    headers={MSG_ID: message.msg_id},
                )
            except Exception as exc:
                return await self._retry_claim(nc, js, message, started, budget, exc)
            check_stream(ack, self._names.claims, message.msg_id)
            return not ack.duplicate  # a definite answer: nothing of this call was stored before

    async def claim_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[bool | Exception]:
        """The claims' publishes in one write, their acks awaited together; a claim without
        a definite answer then goes on alone, exactly as its own ``claim()`` would."""
        nc, js = self._client()
        budget = min(timeout, self._claim_budget_s)
        if self._budget is not None and self._budget.shedding:  # each claim refused alone
            return await super().claim_many(claims, instance_id=instance_id, timeout=timeout)
        if not nc.is_connected or budget <= 0 or len(claims) < 2:
            return await super().claim_many(claims, instance_id=instance_id, timeout=timeout)
        for claim in claims:
            try:
                self._check_deadline(claim.slot)
            except BackendError:  # each claim alone: the late one fails, the others go on
                return await super().claim_many(claims, instance_id=instance_id, timeout=timeout)
        started = time.monotonic()
        messages = [self._message(c.slot, instance_id, c.run_id) for c in claims]
        acks: list[asyncio.Future[PubAck] | Exception] = []
        for message in messages:
            try:  # buffered: nats-py's flusher sends every publish of the batch together
                ack = await js.publish_async(
                    message.subject, message.body, headers={MSG_ID: message.msg_id}
                )
            except Exception as exc:  # not sent (the connection is going): retried alone
                acks.append(exc)
            else:
                acks.append(ack)
        pending = [ack for ack in acks if isinstance(ack, asyncio.Future)]
        try:
            if pending:
                await asyncio.wait(pending, timeout=attempt_seconds(budget))
        finally:
            for ack in pending:
                ack.cancel()  # no answer in time: this claim's retry finds out what was stored

        async def outcome(message: ClaimMessage, ack: asyncio.Future[PubAck] | Exception) -> bool:
            with self._translated("claim", message.msg_id):
                if isinstance(ack, Exception):
                    first: Exception = ack
                elif ack.cancelled():
                    first = TimeoutError("no ack within the attempt")
                elif (error := ack.exception()) is not None:
                    first = cast(Exception, error)
                else:
                    answer = ack.result()
                    check_stream(answer, self._names.claims, message.msg_id)
                    return not answer.duplicate  # definite: the first attempt of this claim
                return await self._retry_claim(nc, js, message, started, budget, first)

        return await gather_each(
            [outcome(message, ack) for message, ack in zip(messages, acks, strict=True)]
        )

    def _message(self, slot: Slot, instance_id: str, run_id: str) -> ClaimMessage:
        """What every attempt of this claim publishes. Its token tells a retry of this very
        claim from any other, even one by the same instance with the same run id."""
        token = f"{self._token_base}{next(self._token_seq):x}"
        subject = self._claim_subjects.get(slot.job) or self._claim_subject(slot.job)
        body = claim_body(instance_id, slot.slot_ms, run_id, token)
        return ClaimMessage(subject, slot.key, body, token)  # Nats-Msg-Id: <job>:<slot_ms>

    def _claim_subject(self, job: str) -> str:
        subject = self._claim_subjects[job] = self._names.claim_subject(job)
        return subject

    async def _retry_claim(
        self,
        nc: NATSClient,
        js: JetStreamContext,
        message: ClaimMessage,
        started: float,
        budget: float,
        first_error: Exception | None,
    ) -> bool:
        claim = ClaimRetries(self._watch, nc, js, self._names.claims, message, started, budget)
        return await claim.retry(first_error)

    # -- history -------------------------------------------------------------------------------

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        nc, js = self._client()
        with self._translated(f"recording a run of {job.name!r}"):
            await self._streams.ensure_history(js, job.history_size)
            await self._publish_record(nc, js, job, record)

    async def record_many(self, records: Sequence[tuple[JobPolicy, RunRecord]]) -> None:
        """The records' publishes in one write, their acks awaited together; one without an
        ack is published again alone (its message id makes a stored one a duplicate)."""
        nc, js = self._client()
        with self._translated(f"recording {len(records)} runs"):
            await self._streams.ensure_history(js, max(job.history_size for job, _ in records))
            acks: list[asyncio.Future[PubAck] | None] = []
            for job, record in records:
                if not nc.is_connected:
                    acks.append(None)
                    continue
                subject, body, headers = self._record_message(job, record)
                acks.append(await js.publish_async(subject, body, headers=headers))
            sent = [ack for ack in acks if ack is not None]
            try:
                if sent:
                    await asyncio.wait(sent, timeout=_API_TIMEOUT_S)
            finally:
                for ack in sent:
                    ack.cancel()
            for (job, record), answer in zip(records, acks, strict=True):
                if answer is None or answer.cancelled() or answer.exception() is not None:
                    await self._publish_record(nc, js, job, record)  # retried like record()

    def _record_message(
        self, job: JobPolicy, record: RunRecord
    ) -> tuple[str, bytes, dict[str, str]]:
        headers = {MSG_ID: f"{Slot(record.job, record.slot_ms).key}:{record.run_id}"}
        return self._names.history_subject(job.name), record.to_json().encode(), headers

    async def _publish_record(
        self, nc: NATSClient, js: JetStreamContext, job: JobPolicy, record: RunRecord
    ) -> None:
        """Publish ``record``, retried like a claim while the stream has no leader (a node
        lost): its message id makes a retry of a stored record a duplicate, not a second copy
        (within the history stream's duplicate window, 2 minutes by default)."""
        import nats.js.errors

        subject, body, headers = self._record_message(job, record)
        deadline = time.monotonic() + max(_API_TIMEOUT_S, self._claim_budget_s)
        while True:
            await self._watch.wait_connected(nc, deadline)
            remaining = deadline - time.monotonic()
            try:
                async with self._watch.attempt(min(max(remaining, 0.01), _API_TIMEOUT_S)):
                    await js.publish(subject, body, timeout=_API_TIMEOUT_S, headers=headers)
                return
            except (
                TimeoutError,
                nats.js.errors.NoStreamResponseError,
                nats.js.errors.ServiceUnavailableError,
            ):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        _, js = self._client()
        subject = self._names.history_subject(job.name)
        with self._translated(f"reading the history of {job.name!r}"):
            bodies = await read_last(js, self._names.history, subject, min(limit, job.history_size))
        return [RunRecord.from_json(body) for body in reversed(bodies)]


def _chain(
    first: Callable[..., Awaitable[None]], second: Callable[..., Awaitable[None]]
) -> Callable[..., Awaitable[None]]:
    async def both(*args: Any) -> None:
        await first(*args)
        await second(*args)

    return both

"""The two streams of ``NATSBackend`` while it runs: created when missing, checked at start,
and grown where this instance needs more (replicas, the history size, the claims stream's
duplicate window), by the rules of ``_stream_settings``; their names are ``_names``'. Streams
are never deleted or recreated: that would forget claimed slots and allow double runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ..._slotmemory import FleetMemory
from ._errors import BACKEND, describe, logger
from ._names import Names
from ._stream_settings import (
    claims_config,
    claims_problems,
    duration,
    grown,
    history_config,
    history_problems,
    raised_window,
)

if TYPE_CHECKING:
    import nats.js.errors
    from nats.js import JetStreamContext
    from nats.js.api import StreamConfig

__all__ = ["Streams"]

_GUARD_DELAYS_S = (0.2, 1.0, 5.0)  # see Streams._start_history_guard
_WINDOW_RAISES = 5  # see Streams._raise_claims_window
_WINDOW_SETTLE_S = 0.25
_ERR_STREAM_NAME_IN_USE = 10058
_ERR_WRONG_LAST_SEQUENCE = 10071
_FLEET_READ_S = 2.0  # see Streams._read_fleet
_ERR_SUBJECTS_OVERLAP = 10065
# "replicas > 1 not supported in non-clustered mode", "insufficient resources" (too few servers)
_ERR_REPLICAS = (10074, 10023)
# "no suitable peers for placement" (+ why): too few servers, or "peer offline": a server the
# cluster counts is down, cut off, or not yet current again after a restart or a partition.
_ERR_NO_PEERS = 10005


def _claims_refusals(config: StreamConfig, names: Names, slot_ttl: timedelta) -> list[str]:
    """``claims_problems`` of an existing claims stream, or none when raising its window to
    ``slot_ttl`` (``raised_window``) would leave nothing wrong: ``start()`` raises it then."""
    problems = claims_problems(config, names, slot_ttl)
    raised = raised_window(config, slot_ttl)
    if problems and raised is not None and not claims_problems(raised, names, slot_ttl):
        return []
    return problems


class Streams:
    """The claims and history streams of one started backend: created when missing, checked,
    grown where this instance needs more (never shrunk, deleted or recreated).

    ``last_error`` returns the connection's last error (an -ERR such as a permissions
    violation, which a refused stream update only shows there).
    """

    def __init__(
        self,
        names: Names,
        *,
        slot_ttl: timedelta,
        replicas: int,
        secrets: Sequence[str],
        shown_servers: str,
        last_error: Callable[[], str | None],
        skew_ms: int,
    ) -> None:
        self._names, self._slot_ttl, self._replicas = names, slot_ttl, replicas
        self._skew_ms = skew_ms
        self._now_ms: Callable[[], int] = lambda: 0
        #: The fleet's slot memory as read at start (the claims stream's duplicate window and
        #: the raises noted in its record); raised by this instance, never read again: a raise
        #: by another instance only makes the window longer than this view says.
        self.fleet = FleetMemory(0, 0)
        self._secrets, self._shown_servers, self._last_error = secrets, shown_servers, last_error
        self._history_capacity = 0  # max_msgs_per_subject known to be in place (0: unknown)
        self._history_lock = asyncio.Lock()
        self._history_guard: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Stop checking the history stream in the background."""
        guard, self._history_guard = self._history_guard, None
        if guard is not None:
            guard.cancel()
            await asyncio.gather(guard, return_exceptions=True)

    async def start(self, js: JetStreamContext, now_ms: Callable[[], int]) -> None:
        """At start: create, check and grow the claims stream, read the fleet's record; check
        the history stream. ``now_ms``: the scheduler's clock."""
        import nats.js.errors

        self._now_ms = now_ms
        try:
            # Read before anything changes: nats-server 2.9 leaves requests unanswered while a
            # stream grows its replicas. This instance's own raises are added as it makes them.
            self.fleet = await self._read_fleet(js)
            await self._ensure_claims_stream(js)
        except (
            nats.js.errors.ServiceUnavailableError,
            nats.js.errors.NoStreamResponseError,
        ) as exc:
            raise BackendUnavailableError(
                f"{BACKEND}: JetStream does not answer at {self._shown_servers}: is it enabled "
                "on the server (nats-server -js, or jetstream {} in its config) and for this "
                "account?"
            ) from exc
        await self._check_history_stream(js)

    async def _ensure_claims_stream(self, js: JetStreamContext) -> None:
        """The window is raised before the replicas: nats-server 2.9 leaves a stream update
        unanswered (``nats: timeout``) while the stream is still growing its replicas, so the
        other order made ``start()`` fail on a stream short of both. It is raised again after,
        for a stream created or lowered by another instance meanwhile (a no-op otherwise)."""
        import nats.js.errors

        with contextlib.suppress(nats.js.errors.NotFoundError):  # created below
            await self._raise_claims_window(js)
        await self._ensure_stream(
            js,
            claims_config(self._names, self._slot_ttl, self._replicas),
            problems=lambda c: _claims_refusals(c, self._names, self._slot_ttl),
            per_subject=None,
            option="slot_ttl",
        )
        await self._raise_claims_window(js)

    async def raise_window(self, js: JetStreamContext, memory: timedelta) -> None:
        """Raise the claims stream's window to ``memory`` (a boot claim needs
        ``BOOT_MEMORY``), as a start raises it to ``slot_ttl``."""
        await self._raise_claims_window(js, memory)

    async def _read_fleet(self, js: JetStreamContext, window_ms: int | None = None) -> FleetMemory:
        """The claims stream's window (``window_ms`` if known), with the raises its record notes
        (see ``_note_raise``); no stream yet: nothing. A window longer than the record says was
        raised without a note (an instance of an earlier release): what it was is unknown, so
        no slot that fell due before now is claimed late by this instance."""
        import nats.js.errors

        if window_ms is None:
            try:
                info = await js.stream_info(self._names.claims)
            except nats.js.errors.NotFoundError:
                return FleetMemory(0, 0)
            window_ms = round((info.config.duplicate_window or 0) * 1000)
        memory = window_ms
        try:
            async with asyncio.timeout(_FLEET_READ_S):
                msg = await js.get_last_msg(self._names.claims, self._names.fleet_subject)
        except nats.js.errors.NotFoundError:
            return FleetMemory(memory, 0)
        except TimeoutError:
            # A stream still catching up new replicas does not answer (nats-server 2.9): the
            # raises are unknown, so no slot that fell due before now is claimed late here.
            logger.warning(
                "%s: %s did not answer (its replicas catching up?): slots that fell due before "
                "this start are not claimed late by this instance",
                BACKEND, self._names.fleet_subject,
            )  # fmt: skip
            return FleetMemory(memory, self._now_ms())
        try:
            noted = FleetMemory.from_dict(json.loads(msg.data or b"{}"))
        except ValueError:
            logger.warning("%s: %s holds no slot memory record", BACKEND, self._names.fleet_subject)
            return FleetMemory(memory, 0)
        if noted.memory_ms < memory:
            logger.warning(
                "%s: the duplicate window of %s (%s) was raised without a note in %s: slots that "
                "fell due before this start are not claimed late by this instance",
                BACKEND, self._names.claims, duration(timedelta(milliseconds=memory)),
                self._names.fleet_subject,
            )  # fmt: skip
            return FleetMemory(memory, self._now_ms(), noted.raises)
        return FleetMemory(memory, 0, noted.raises)

    async def _adopt_window(self, js: JetStreamContext, window_ms: int, ttl: timedelta) -> None:
        """The window is long enough: if it is longer than this instance's view, another
        instance raised it (or made the stream) since this one read the record: read it again,
        with the raise it noted first."""
        if window_ms <= self.fleet.memory_ms:
            return
        if self.fleet.memory_ms == 0 and window_ms == round(ttl.total_seconds() * 1000):
            self.fleet = FleetMemory(window_ms, 0)  # the stream as this instance made it
            return
        self.fleet = await self._read_fleet(js, window_ms)

    async def _note_raise(
        self, js: JetStreamContext, before: StreamConfig, after: StreamConfig
    ) -> None:
        """Note a raise of the window in the fleet's record (a message in the claims stream),
        *before* the stream is updated: an instance that starts meanwhile reads the note, or
        finds the window as it was; one that finds the window raised finds the note too. An
        instance started later then claims a slot that fell due before the raise at most the
        old window late (an ``at()`` slot, whose time passed before its start). A raise that
        does not follow (this instance died) only made a few slots' limits shorter. The update
        then raises the stream's max_age, and the note is kept as long as the raised window:
        as long as the raise can limit a claim. Written with
        ``Nats-Expected-Last-Subject-Sequence``, so that two raisers never lose each other's
        raise."""
        import nats.js.errors

        old_ms = round((before.duplicate_window or 0) * 1000)
        new_ms = round((after.duplicate_window or 0) * 1000)
        if new_ms <= old_ms:
            return
        subject = self._names.fleet_subject
        for _ in range(_WINDOW_RAISES):
            try:
                last = await js.get_last_msg(self._names.claims, subject)
                current = FleetMemory.from_dict(json.loads(last.data or b"{}"))
                seq = last.seq or 0
            except (nats.js.errors.NotFoundError, ValueError):
                current, seq = FleetMemory(old_ms, 0), 0
            record = dataclasses.replace(current, memory_ms=max(old_ms, current.memory_ms)).raised(
                new_ms, self._now_ms(), self._skew_ms
            )
            if current.memory_ms >= new_ms:  # noted already, by a concurrent raiser
                record = current
            headers = {"Nats-Expected-Last-Subject-Sequence": str(seq)}
            try:
                await js.publish(subject, record.to_json().encode(), headers=headers)
            except nats.js.errors.APIError as exc:
                if exc.err_code != _ERR_WRONG_LAST_SEQUENCE:
                    raise
                continue
            self.fleet = FleetMemory(max(self.fleet.memory_ms, new_ms), 0, record.raises)
            return
        logger.warning("%s: the raise of %s could not be noted", BACKEND, self._names.claims)

    async def _raise_claims_window(
        self, js: JetStreamContext, memory: timedelta | None = None
    ) -> None:
        """Raise the claims stream's ``duplicate_window`` and ``max_age`` to ``slot_ttl`` when
        shorter (a rolling deploy that raises ``slot_ttl``), or refuse as ``claims_problems``
        says when NATS refuses the update.

        Why raising is safe for the fleet: the scheduler calls ``start()``, then ``prepare()``, and
        only then arms its jobs, each at its next slot after *now* (``LifeCycle._start``,
        ``Timers.arm``); a claim-only instance never claims a slot from before its start. So every
        slot this instance claims is first claimed, by anyone, after the raise (clocks agreeing to
        better than the old window, as claim-only backends require anyway), and every claim message
        from then on is deduplicated under the longer window. JetStream purges a message id once its
        age reaches the window in force at purge time (an update re-runs the purge with the new
        window), so the raise also extends the ids stored before it; only ids already purged under
        the old window are gone, and their slots are older than this instance. A longer window never
        hurts the instances with a shorter ``slot_ttl``: they accept it (``raised_window`` never
        lowers). ``max_age`` grows too: a restarted server rebuilds its ids from the stored messages
        only. The one way around it is ``Job.resume()`` within its jitter of ``start()`` of a job
        paused before it: ``Timers.rearm`` may arm a slot still in its jitter window from before the
        start.

        NATS 2.9 has no conditional update: an instance that read the stream before our update
        can overwrite it with its own, smaller raise. So the stream is read again after each
        update, and once more after ``_WINDOW_SETTLE_S``, and raised again while it is short.
        """
        stream, names, ttl = self._names.claims, self._names, memory or self._slot_ttl
        raises, settled = 0, False
        while True:
            config = (await js.stream_info(stream)).config
            raised = raised_window(config, ttl)
            if raised is None:
                await self._adopt_window(js, round((config.duplicate_window or 0) * 1000), ttl)
                if raises == 0 or settled:
                    return
                settled = True  # a concurrent stale update lands within milliseconds
                await asyncio.sleep(_WINDOW_SETTLE_S)
                continue
            settled = False
            problems = claims_problems(config, names, ttl)
            if claims_problems(raised, names, ttl):  # changed meanwhile: refuse as it is
                self._raise_problems(stream, problems, option="slot_ttl")
            if raises == _WINDOW_RAISES:
                self._raise_problems(
                    stream,
                    [*problems, f"brokersched raised it {raises} times and it was lowered again"],
                    option="slot_ttl",
                )
            await self._note_raise(js, config, raised)
            await self._update_claims_window(js, raised, problems)
            raises += 1
            logger.warning(
                "raised duplicate_window of JetStream stream %s from %s to %s and max_age from %s "
                "to %s: slot_ttl of this instance is %s; the whole fleet now remembers each "
                "claimed slot that long. To lower it again, first deploy the shorter slot_ttl on "
                "every instance, then run `nats stream edit %s --dupe-window %s --max-age %s`",
                stream,
                duration(timedelta(seconds=config.duplicate_window or 0)),
                duration(timedelta(seconds=raised.duplicate_window or 0)),
                duration(timedelta(seconds=config.max_age or 0)),
                duration(timedelta(seconds=raised.max_age or 0)),
                duration(ttl),
                stream,
                duration(timedelta(seconds=config.duplicate_window or 0)),
                duration(timedelta(seconds=config.max_age or 0)),
            )

    async def _update_claims_window(
        self, js: JetStreamContext, raised: StreamConfig, problems: list[str]
    ) -> None:
        """Update the claims stream to ``raised``; a refused update (account limits, no
        permission) is a ``ConfigurationError`` with ``problems`` and NATS's answer."""
        import nats.errors
        import nats.js.errors

        try:
            await js.update_stream(raised)  # pyright: ignore[reportUnknownMemberType]
            return
        except nats.js.errors.APIError as exc:
            answer = describe(exc, self._secrets)
        except nats.errors.TimeoutError:
            # A publish the user may not make gets no reply, only an -ERR on the connection
            # ("nats: permissions violation for publish to "$js.api.stream.update.<name>"").
            denied = self._last_error() or ""
            if not all(text in denied.lower() for text in ("permissions violation", "update")):
                raise
            answer = denied
        assert raised.name is not None
        self._raise_problems(
            raised.name,
            [*problems, f"brokersched could not raise them itself: NATS answered {answer}"],
            option="slot_ttl",
        )

    async def _check_history_stream(self, js: JetStreamContext) -> None:
        """At start, fail on an unusable history stream; it is created in ``prepare()``."""
        import nats.js.errors

        try:
            info = await js.stream_info(self._names.history)
        except nats.js.errors.NotFoundError:
            return
        self._raise_problems(self._names.history, history_problems(info.config, self._names))

    async def ensure_history(self, js: JetStreamContext, size: int) -> None:
        """Create the history stream, or grow it to keep ``size`` runs per job."""
        if size <= self._history_capacity:
            return
        async with self._history_lock:
            if size <= self._history_capacity:
                return
            if await self._ensure_history_stream(js, size):
                self._start_history_guard(js, size)
            self._history_capacity = size

    def _start_history_guard(self, js: JetStreamContext, size: int) -> None:
        """Check again, a few times, that nobody shrank the history stream after we grew it.

        JetStream 2.9 has no conditional stream update: an instance that read the stream just
        before our update and wants a smaller (yet larger than before) size can overwrite ours.
        Its read-update window is milliseconds long, so checks spread over seconds restore the
        largest size for good.
        """
        if self._history_guard is not None:
            self._history_guard.cancel()
        self._history_guard = asyncio.create_task(
            self._guard_history(js, size), name="brokersched:nats-history-size"
        )

    async def _guard_history(self, js: JetStreamContext, size: int) -> None:
        for delay in _GUARD_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                if await self._ensure_history_stream(js, size):
                    logger.warning(
                        "history stream %s had been shrunk below %d by another instance; "
                        "grown again",
                        self._names.history,
                        size,
                    )
            except Exception as exc:  # best effort: the next check or start tries again
                logger.debug("checking the history stream failed: %s", describe(exc, self._secrets))

    async def _ensure_history_stream(self, js: JetStreamContext, size: int) -> bool:
        return await self._ensure_stream(
            js,
            history_config(self._names, size, self._replicas),
            problems=lambda c: history_problems(c, self._names, size),
            per_subject=size,
            option="history_size",
        )

    async def _ensure_stream(
        self,
        js: JetStreamContext,
        desired: StreamConfig,
        *,
        problems: Callable[[StreamConfig], list[str]],
        per_subject: int | None,
        option: str,
    ) -> bool:
        """Create ``desired`` if missing, else check it and grow what must grow; ``True`` when
        an existing stream was updated.

        Loops because another instance may create or update the stream at the same time; after
        an update the stream is read again, so a concurrent smaller update is noticed and undone.
        """
        import nats.js.errors

        assert desired.name is not None
        updated = overlapped = False
        for _ in range(5):
            try:
                info = await js.stream_info(desired.name)
            except nats.js.errors.NotFoundError:
                if overlapped:  # still missing: another stream really holds these subjects
                    raise ConfigurationError(
                        f"{BACKEND}: another JetStream stream already uses the subjects of "
                        f"{desired.name!r} ({', '.join(desired.subjects or [])}); use another "
                        "prefix or remove that stream",
                        option="prefix",
                        backend=BACKEND,
                    ) from None
                try:
                    await js.add_stream(desired)  # pyright: ignore[reportUnknownMemberType]
                except nats.js.errors.APIError as exc:
                    if exc.err_code in (*_ERR_REPLICAS, _ERR_NO_PEERS):
                        raise self._replicas_error(desired.name, None, exc) from exc
                    if not isinstance(exc, nats.js.errors.BadRequestError):
                        raise
                    # Instances starting together race to create it; NATS 2.9 may answer the
                    # losers "name in use" or "subjects overlap". Either way: check theirs.
                    if exc.err_code in (_ERR_STREAM_NAME_IN_USE, _ERR_SUBJECTS_OVERLAP):
                        overlapped = exc.err_code == _ERR_SUBJECTS_OVERLAP
                        continue
                    raise
                logger.info("created JetStream stream %s", desired.name)
                return updated
            self._raise_problems(desired.name, problems(info.config), option=option)
            # A server that is not clustered stores any num_replicas it is given, and keeps one.
            have = (info.config.num_replicas or 1) if info.cluster is not None else 1
            if have < self._replicas and (updated or info.cluster is None):
                raise self._replicas_error(desired.name, have, None)
            update = grown(info.config, replicas=self._replicas, per_subject=per_subject)
            if update is None:
                return updated
            try:
                await js.update_stream(update)  # pyright: ignore[reportUnknownMemberType]
            except nats.js.errors.APIError as exc:
                if have < self._replicas:
                    raise self._replicas_error(desired.name, have, exc) from exc
                raise
            if have < self._replicas:
                logger.warning(
                    "raised num_replicas of JetStream stream %s from %d to %d (replicas of this "
                    "instance)",
                    desired.name,
                    have,
                    self._replicas,
                )
            updated = True
            logger.info("updated JetStream stream %s", desired.name)
        raise BackendError(f"{BACKEND}: stream {desired.name} keeps changing; is it contested?")

    def _replicas_error(
        self, stream: str, have: int | None, refusal: nats.js.errors.APIError | None
    ) -> ConfigurationError | BackendUnavailableError:
        """``replicas`` cannot be had: the stream is missing (``have`` None) or has fewer;
        ``refusal`` is NATS's answer (``None``: the server is not clustered).

        A ``ConfigurationError``, unless NATS counts enough servers but one is offline: then an
        outage (``BackendUnavailableError``), which ``start(wait=False)`` retries until every
        server is back and current."""
        want = self._replicas
        why = "the server is not clustered"
        if refusal is not None:
            why = f"NATS answered {describe(refusal, self._secrets)}"
            if refusal.err_code == _ERR_NO_PEERS and "offline" in (refusal.description or ""):
                return BackendUnavailableError(
                    f"{BACKEND}: cannot place {want} replicas of JetStream stream {stream!r} "
                    f"now ({why}): a server of the cluster is down, cut off, or not yet current "
                    "again after a restart or a partition; start again once every server is back"
                )
        if have is None:
            what = f"cannot create JetStream stream {stream!r} with {want} replicas ({why})"
        else:
            what = (
                f"the existing JetStream stream {stream!r} has num_replicas {have}, fewer than "
                f"replicas={want} of this instance, and could not be raised ({why})"
            )
        return ConfigurationError(
            f"{BACKEND}: {what}: replicas > 1 needs a NATS cluster with at least {want} "
            f"JetStream servers (then `nats stream edit {stream} --replicas {want}`); on one "
            "server pass replicas=1",
            option="replicas",
            backend=BACKEND,
        )

    def _raise_problems(self, stream: str, problems: list[str], option: str = "prefix") -> None:
        if problems:
            raise ConfigurationError(
                f"{BACKEND}: the existing JetStream stream {stream!r} cannot be used: "
                + "; ".join(problems),
                option=option,
                backend=BACKEND,
            )

"""The two streams of ``NATSBackend``: their names, the settings brokersched creates them with,
the check of an existing stream, and what grows (replicas, the history size, the claims
stream's duplicate window). Streams are never deleted or recreated: that would forget claimed
slots and allow double runs.

A restarted server rebuilds its duplicate table from the stored messages only, so claims must
leave their stream by age alone: memory storage, max_msgs, max_bytes, max_msgs_per_subject or a
max_age shorter than ``slot_ttl`` would let a late instance win a slot that already ran; no_ack,
a mirror or discard 'new' with a limit make claims fail; an unlimited max_age lets the stream
grow for ever. An existing stream that cannot work fails ``start()`` with a
``ConfigurationError`` that names each setting, its value and how to fix it
(``claims_problems``, ``history_problems``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..._durations import format_duration
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ..._options import NAME_PATTERN
from .._claims import FleetMemory
from ._base import BACKEND, describe, logger

if TYPE_CHECKING:
    import nats.js.errors
    from nats.js import JetStreamContext
    from nats.js.api import StreamConfig

__all__ = [
    "Names",
    "Streams",
    "claims_config",
    "claims_problems",
    "history_config",
    "history_problems",
    "limit_value",
    "setting_text",
    "subject_token",
]

# Everything else is percent-encoded in subject tokens ('.' separates tokens; '%' is escaped so
# the encoding stays reversible and two job names never share a subject).
_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9_:$-]")

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


@functools.lru_cache(maxsize=4096)
def subject_token(job: str) -> str:
    """The NATS subject token for ``job``: reversible, no ``.``, ``*``, ``>`` or spaces."""
    # The scheduler checked it already; the backend's own guard, as the name becomes a subject
    # token and a header value.
    if not NAME_PATTERN.fullmatch(job):
        raise ConfigurationError(
            f"job name {job!r} cannot be used as a NATS subject token; "
            "use letters, digits and _ . : $ - (at most 128 characters)",
            backend=BACKEND,
            job=job,
        )
    return _TOKEN_UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m[0].encode()), job)


@dataclasses.dataclass(frozen=True, slots=True)
class Names:
    """Stream names and subjects derived from the prefix."""

    prefix: str

    @property
    def claims(self) -> str:
        return f"{self.prefix}-claims"

    @property
    def history(self) -> str:
        return f"{self.prefix}-history"

    @property
    def claim_subjects(self) -> str:
        return f"{self.prefix}.claim.>"

    @property
    def history_subjects(self) -> str:
        return f"{self.prefix}.history.>"

    def claim_subject(self, job: str) -> str:
        return f"{self.prefix}.claim.{subject_token(job)}"

    @property
    def fleet_subject(self) -> str:
        """The fleet's slot memory record, in the claims stream: two tokens after ``claim``,
        so never a job's subject (a job's token has no ``.``)."""
        return f"{self.prefix}.claim.fleet.memory"

    def history_subject(self, job: str) -> str:
        return f"{self.prefix}.history.{subject_token(job)}"


def _seconds(value: timedelta) -> str:
    return format_duration(value)


# A claim is under 2 KiB (a 128-character job name, a 200-character instance id, escaped), a
# failed run's record under 8 KiB (its traceback is capped at 4 KiB, JSON-escaped); a stream
# whose max_msg_size is smaller refuses some claims or run records.
_MIN_MSG_SIZE = 8192
_DEFAULT_HISTORY_SIZE = 1000  # the scheduler's default; a fix suggested before prepare() knows
_LIMIT_FLAGS = {
    "max_msgs": "--max-msgs",
    "max_bytes": "--max-bytes",
    "max_msgs_per_subject": "--max-msgs-per-subject",
}


def setting_text(value: object) -> str:
    """An enum setting (storage, retention, discard, ...) as the server spells it."""
    return str(getattr(value, "value", value))


def limit_value(value: int | None) -> int:
    """A count or size limit, every spelling of "unlimited" (None, 0, -1) as 0."""
    return value if value is not None and value > 0 else 0


def _recreate(stream: str, forgets: str) -> str:
    return (
        f"delete the stream while no scheduler runs (`nats stream rm {stream}`, which forgets "
        f"{forgets}) so that brokersched creates it, or use another prefix"
    )


def claims_problems(config: StreamConfig, names: Names, slot_ttl: timedelta) -> list[str]:
    """Every setting of an existing claims stream that breaks the claim guarantee or its
    bounded size, each with how to fix it (the one place that checks them).

    A claimed slot must stay in the stream's duplicate table for ``slot_ttl``, across server
    restarts too, and a restarted server rebuilds that table from the *stored* messages only.
    So claims must leave the stream by age alone: file storage (memory storage forgets every
    claim on a restart, exactly like a dropped message), no count or size limit, and a
    ``max_age`` of at least ``slot_ttl`` that is not unlimited (one message per claimed slot).
    Irrelevant, so accepted: description, max_consumers, num_replicas (grown), placement,
    deny_delete, deny_purge and allow_rollup_hdrs (they only govern what an operator or another
    client does on purpose), republish, compression, allow_direct (set), metadata, ...
    """
    stream = names.claims
    problems = _common_problems(config, stream, names.claim_subjects, "claim", "claimed slots")
    window = timedelta(seconds=config.duplicate_window or 0)
    if window < slot_ttl:
        problems.append(
            f"duplicate_window is {_seconds(window)}, shorter than slot_ttl {_seconds(slot_ttl)} "
            f"(a late instance could win a slot again): run `nats stream edit {stream} "
            f"--dupe-window {_seconds(slot_ttl)} --max-age {_seconds(slot_ttl)}` or pass "
            f"slot_ttl={_seconds(window)!r}"
        )
    # The server wants max_age >= duplicate_window: never suggest less.
    keep = _seconds(max(window, slot_ttl))
    max_age = timedelta(seconds=config.max_age or 0)
    if max_age <= timedelta(0):
        problems.append(
            f"max_age is 0 (unlimited: the stream would grow for ever, one message per claimed "
            f"slot): run `nats stream edit {stream} --max-age {keep}`"
        )
    elif max_age < slot_ttl:
        problems.append(
            f"max_age is {_seconds(max_age)}, shorter than slot_ttl {_seconds(slot_ttl)} "
            f"(claims would be forgotten on a server restart): run `nats stream edit "
            f"{stream} --max-age {keep}`"
        )
    problems += _claim_limit_problems(config, stream)
    persist_mode = setting_text(config.persist_mode)
    if config.persist_mode is not None and persist_mode != "default":
        problems.append(
            f"persist_mode is {persist_mode!r}, not 'default' (claims acknowledged just before "
            f"a server crash could be lost, and a late instance win them again): "
            f"{_recreate(stream, 'claimed slots')}"
        )
    if config.allow_msg_counter:
        problems.append(
            "allow_msg_counter is true (a counter stream refuses claims): "
            + _recreate(stream, "claimed slots")
        )
    return problems


def _claim_limit_problems(config: StreamConfig, stream: str) -> list[str]:
    problems: list[str] = []
    discard_new = setting_text(config.discard) == "new"
    for setting, flag in _LIMIT_FLAGS.items():
        value = limit_value(getattr(config, setting))
        if not value:
            continue
        if discard_new and (setting != "max_msgs_per_subject" or config.discard_new_per_subject):
            why = "with discard 'new', every claim fails once the limit is reached"
        else:
            why = (
                "claims it drops before slot_ttl ends are forgotten on a server restart, and a "
                "late instance wins a slot that already ran"
            )
        if setting == "max_msgs_per_subject" and config.discard_new_per_subject:
            flag = "--no-discard-per-subject " + flag  # the server wants both at once
        problems.append(
            f"{setting} is {value} ({why}; claims must expire by max_age only): run `nats "
            f"stream edit {stream} {flag}=-1`, or {_recreate(stream, 'claimed slots')}"
        )
    problems += _msg_size_problems(config, stream)
    return problems


def _msg_size_problems(config: StreamConfig, stream: str) -> list[str]:
    size = limit_value(config.max_msg_size)
    if not size or size >= _MIN_MSG_SIZE:
        return []
    return [
        f"max_msg_size is {size} bytes (a claim or a run record can be larger, and is then "
        f"refused): run `nats stream edit {stream} --max-msg-size=-1`"
    ]


def _common_problems(
    config: StreamConfig, stream: str, subjects: str, what: str, forgets: str
) -> list[str]:
    """What breaks both streams; ``what`` is written to each (a claim, a run record)."""
    problems: list[str] = []
    storage = setting_text(config.storage)
    if storage != "file":
        problems.append(
            f"storage is {storage!r}, not 'file' (it would be lost on a server restart); storage "
            f"cannot be edited: delete the stream (`nats stream rm {stream}`, which forgets "
            f"{forgets}) while no scheduler runs, or use another prefix"
        )
    retention = setting_text(config.retention)
    if retention != "limits":
        problems.append(
            f"retention is {retention!r}, not 'limits' (messages would be removed by consumers, "
            f"not by age, and {forgets} with them): {_recreate(stream, forgets)}"
        )
    if subjects not in (config.subjects or []):
        problems.append(
            f"subjects are {config.subjects}, without {subjects!r}: run `nats stream edit "
            f"{stream} --subjects '{subjects}'` or use another prefix"
        )
    if config.sealed:
        problems.append(
            f"sealed is true (it takes no more messages): use another prefix than {stream!r}"
        )
    if config.no_ack:
        problems.append(
            f"no_ack is true (publishes are not acknowledged, so every {what} fails): run "
            f"`nats stream edit {stream} --ack`"
        )
    if config.mirror is not None:
        problems.append(
            f"mirror is {config.mirror.name!r} (a mirror takes no publishes, so every {what} "
            f"fails): {_recreate(stream, forgets)}"
        )
    if config.sources:
        sources = [source.name for source in config.sources]
        problems.append(
            f"sources are {sources} (messages copied from other streams would be taken for "
            f"brokersched's): remove the sources from its configuration, or "
            f"{_recreate(stream, forgets)}"
        )
    return problems


def history_problems(config: StreamConfig, names: Names, size: int | None = None) -> list[str]:
    """Every setting of an existing history stream that breaks writing or trimming runs.

    ``max_msgs_per_subject`` is what trims each job's history: it must be set (brokersched
    grows it to ``size``). A ``max_age``, or a max_msgs/max_bytes with discard 'old', only
    drops old runs sooner: accepted. With discard 'new' a full stream refuses every record.
    """
    stream = names.history
    forgets = "the run history"
    problems = _common_problems(config, stream, names.history_subjects, "run record", forgets)
    if not limit_value(config.max_msgs_per_subject):
        problems.append(
            "max_msgs_per_subject is unlimited (it is what trims each job's history; without it "
            f"the history grows for ever): run `nats stream edit {stream} "
            f"--max-msgs-per-subject={size or _DEFAULT_HISTORY_SIZE}`, or "
            f"{_recreate(stream, forgets)}"
        )
    if setting_text(config.discard) == "new":
        limits = [f"{s}={limit_value(getattr(config, s))}" for s in ("max_msgs", "max_bytes")]
        if config.discard_new_per_subject:
            limits.append(f"max_msgs_per_subject={limit_value(config.max_msgs_per_subject)}")
        limits = [limit for limit in limits if not limit.endswith("=0")]
        if limits:
            problems.append(
                f"discard is 'new' with {', '.join(limits)} (once full, every run record is "
                f"refused): run `nats stream edit {stream} --discard=old"
                + (" --no-discard-per-subject`" if config.discard_new_per_subject else "`")
            )
    problems += _msg_size_problems(config, stream)
    return problems


def claims_config(names: Names, slot_ttl: timedelta, replicas: int) -> StreamConfig:
    """The claims stream brokersched creates (it passes ``claims_problems``)."""
    ttl = slot_ttl.total_seconds()
    return _stream_config(
        names.claims,
        "brokersched slot claims (deduplicated by Nats-Msg-Id)",
        names.claim_subjects,
        replicas,
        duplicate_window=ttl,
        max_age=ttl,
    )


def history_config(names: Names, size: int, replicas: int) -> StreamConfig:
    """The history stream brokersched creates (it passes ``history_problems``)."""
    return _stream_config(
        names.history,
        "brokersched run history (one subject per job)",
        names.history_subjects,
        replicas,
        max_msgs_per_subject=size,
    )


def _stream_config(
    name: str, description: str, subjects: str, replicas: int, **limits: Any
) -> StreamConfig:
    """What both streams are: file storage, messages removed by their limits only (the oldest
    first), read directly."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    return StreamConfig(
        name=name,
        description=description,
        subjects=[subjects],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        num_replicas=replicas,
        allow_direct=True,
        **limits,
    )


def _grown(config: StreamConfig, *, replicas: int, per_subject: int | None) -> StreamConfig | None:
    """``config`` with the settings that must grow, or ``None`` when nothing must change.

    Settings only grow here: another instance (another version of the application) may need the
    larger value.
    """
    changes: dict[str, Any] = {}
    if not config.allow_direct:
        changes["allow_direct"] = True
    if (config.num_replicas or 1) < replicas:
        changes["num_replicas"] = replicas
    current = config.max_msgs_per_subject
    if per_subject is not None and 0 < current < per_subject:
        changes["max_msgs_per_subject"] = per_subject
    return dataclasses.replace(config, **changes) if changes else None


def _raised_window(config: StreamConfig, slot_ttl: timedelta) -> StreamConfig | None:
    """``config`` (as the server reports it) with ``duplicate_window`` and ``max_age`` raised to
    ``slot_ttl`` where shorter, every other setting kept; ``None`` when both cover it already.

    Never lowers either (another instance may need the longer window); an unlimited max_age
    stays unlimited (``claims_problems`` refuses it anyway).
    """
    window = timedelta(seconds=config.duplicate_window or 0)
    max_age = timedelta(seconds=config.max_age or 0)
    if window >= slot_ttl and (max_age <= timedelta(0) or max_age >= slot_ttl):
        return None
    ttl = slot_ttl.total_seconds()
    return dataclasses.replace(
        config,
        duplicate_window=max(window.total_seconds(), ttl),
        max_age=max(max_age.total_seconds(), ttl) if max_age > timedelta(0) else config.max_age,
    )


def _claims_refusals(config: StreamConfig, names: Names, slot_ttl: timedelta) -> list[str]:
    """``claims_problems`` of an existing claims stream, or none when raising its window to
    ``slot_ttl`` (``_raised_window``) would leave nothing wrong: ``start()`` raises it then."""
    problems = claims_problems(config, names, slot_ttl)
    raised = _raised_window(config, slot_ttl)
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
                BACKEND, self._names.claims, _seconds(timedelta(milliseconds=memory)),
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
        hurts the instances with a shorter ``slot_ttl``: they accept it (``_raised_window`` never
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
            raised = _raised_window(config, ttl)
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
                _seconds(timedelta(seconds=config.duplicate_window or 0)),
                _seconds(timedelta(seconds=raised.duplicate_window or 0)),
                _seconds(timedelta(seconds=config.max_age or 0)),
                _seconds(timedelta(seconds=raised.max_age or 0)),
                _seconds(ttl),
                stream,
                _seconds(timedelta(seconds=config.duplicate_window or 0)),
                _seconds(timedelta(seconds=config.max_age or 0)),
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
            update = _grown(info.config, replicas=self._replicas, per_subject=per_subject)
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

"""NATS JetStream claim backend.

Claims: one file-storage stream (``<prefix>-claims``, subjects ``<prefix>.claim.>``) whose
``duplicate_window`` and ``max_age`` are ``slot_ttl``. A claim publishes a small JSON body with
the header ``Nats-Msg-Id: <job>:<slot_ms>``; JetStream stores the first message with that id and
acknowledges every later one with ``duplicate: true``. Not a duplicate: this claim won.

Ambiguous claims. A publish whose ack never arrives (timeout, connection cut, nats-py replaying
its buffer after a reconnect) may still have been stored. Retrying blindly would read our own
stored message as someone else's (a false loss: the slot runs nowhere). So a claim retries with
the same message id until its deadline, and when a *retry* comes back as a duplicate it reads the
stored message by the ack's sequence and compares the claim token in its body (unique to each
``claim()`` call) with its own. Only a definite answer is returned; anything else raises
``BackendError``. A claim never publishes while disconnected: it waits for the connection (until
its deadline) rather than let nats-py buffer a message that could be stored after we gave up.

History: one file-storage stream (``<prefix>-history``, a subject per job) whose
``max_msgs_per_subject`` is the largest ``history_size`` of the jobs seen (NATS keeps one size
for all jobs); reads are trimmed to each job's own size.

Streams are created when missing and updated when a setting must grow (the claims stream's
duplicate_window and max_age grow to the longest ``slot_ttl`` that starts, never shrink:
``NATSBackend._raise_claims_window``); they are never deleted or recreated (that would forget
claimed slots and allow double runs). An existing stream that cannot
work fails ``start()`` with a ``ConfigurationError`` that names each setting, its value and how to
fix it (``_claims_problems``, ``_history_problems``). A restarted server rebuilds its duplicate
table from the stored messages only, so claims must leave their stream by age alone: memory
storage, max_msgs, max_bytes, max_msgs_per_subject or a max_age shorter than ``slot_ttl`` would
let a late instance win a slot that already ran; no_ack, a mirror or discard 'new' with a limit
make claims fail; an unlimited max_age lets the stream grow for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from .. import _redact
from .._clock import Clock
from .._durations import Duration, format_duration, parse_duration
from .._exceptions import (
    BackendError,
    BackendUnavailableError,
    BrokerschedError,
    ConfigurationError,
)
from .._tasks import cancel_requests, raise_if_cancelled_since, to_the_end
from ..abc import Capabilities, ClaimBackend, JobPolicy, RunRecord, Slot

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient
    from nats.js import JetStreamContext
    from nats.js.api import PubAck, StreamConfig

__all__ = ["NATSBackend", "redact", "subject_token"]

logger = logging.getLogger("brokersched.backends.nats")

_BACKEND = "NATSBackend"
_EXTRA_HINT = "pip install 'brokersched[nats]'"
_PREFIX_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Job names are validated by the scheduler; this is the backend's own guard before a name
# becomes a subject token and a header value.
_JOB_RE = re.compile(r"[A-Za-z0-9_$][A-Za-z0-9_.:$-]{0,127}")
# Everything else is percent-encoded in subject tokens ('.' separates tokens; '%' is escaped so
# the encoding stays reversible and two job names never share a subject).
_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9_:$-]")

_MSG_ID = "Nats-Msg-Id"
_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii
# A single publish attempt waits at most this long (or a quarter of the claim budget, if more)
# before it is retried with the same message id: a request sent just before a disconnect never
# gets its ack, and waiting for the whole deadline would leave no time for the retry.
_MIN_ATTEMPT_S = 0.25
# ... and at most this long: with a long budget (a cluster's 30 s), a request lost with a dying
# stream leader is retried against the new one soon after it is elected.
_MAX_ATTEMPT_S = 2.0
_RETRY_PAUSE_S = 0.02  # between attempts that got a definite "try again" (no responders, 503)
_CONNECTED_POLL_S = 0.05
_API_TIMEOUT_S = 5.0
# How long a claim waits for a definite answer by default. On one server a claim that cannot be
# answered within 2 s means the server is down: fail closed, the slot is skipped. A replicated
# stream has no leader for seconds after its leader dies, and again after a partitioned node
# comes back (it has raised its Raft term while cut off, so the leader steps down and a new
# election runs; measured here on nats-server 2.9.10: 2-12 s). A claim that gives up after 2 s
# then loses every slot of the election (the issue's "84 slots lost just after the link came
# back"); one that waits runs them late instead, within max_late, still exactly once.
_CLAIM_TIMEOUT = "2s"
_CLUSTER_CLAIM_TIMEOUT = "30s"
_FETCH_BATCH = 512
_FETCH_TIMEOUT_S = 2.0
_CONSUMER_IDLE_S = 30.0  # server-side clean-up of a history reader that died mid-read
_GUARD_DELAYS_S = (0.2, 1.0, 5.0)  # see NATSBackend._start_history_guard
_WINDOW_RAISES = 5  # see NATSBackend._raise_claims_window
_WINDOW_SETTLE_S = 0.25
_ERR_STREAM_NAME_IN_USE = 10058
_ERR_SUBJECTS_OVERLAP = 10065
# "replicas > 1 not supported in non-clustered mode", "insufficient resources" (too few servers)
_ERR_REPLICAS = (10074, 10023)

# Defaults for nats.connect that suit a scheduler (the caller's connect_options win): reconnect
# for ever and quickly, so that claiming resumes by itself shortly after NATS returns, and notice
# a half-open connection within ~30 s instead of nats-py's 4 minutes.
_CONNECT_DEFAULTS: dict[str, Any] = {
    "name": "brokersched",
    "max_reconnect_attempts": -1,
    "reconnect_time_wait": 0.5,
    "ping_interval": 10,
    "max_outstanding_pings": 3,
    "connect_timeout": 2,
}
_CALLBACKS = ("error_cb", "disconnected_cb", "reconnected_cb", "closed_cb")
# connect_options that hold a secret (nats.connect's keywords)
_SECRET_OPTIONS = ("password", "token", "nkeys_seed_str")


def redact(text: str) -> str:
    """``text`` with the user-info part of every URL (``user:pass@``, ``token@``) replaced.

    The user name stays (it helps to debug permissions); passwords and tokens never appear.
    Only URLs with a scheme are found in free text: a backend also scrubs the secrets it knows.
    """
    return _redact.redact_text(text)


def _secrets(servers: Sequence[str], connect_options: dict[str, Any]) -> list[str]:
    """Every form of the secrets in ``servers`` and ``connect_options``, longest first."""
    found = {secret for server in servers for secret in _redact.url_secrets(server)}
    for option in _SECRET_OPTIONS:
        value = connect_options.get(option)
        if isinstance(value, str) and value:
            found.add(value)
    return sorted(found, key=len, reverse=True)


def _describe(exc: BaseException, secrets: Sequence[str]) -> str:
    """The text of a client exception, fit for a message: no secret, never empty."""
    return _redact.scrub(redact(str(exc)), secrets) or type(exc).__name__


@functools.lru_cache(maxsize=4096)
def subject_token(job: str) -> str:
    """The NATS subject token for ``job``: reversible, no ``.``, ``*``, ``>`` or spaces."""
    if not _JOB_RE.fullmatch(job):
        raise ConfigurationError(
            f"job name {job!r} cannot be used as a NATS subject token; "
            "use letters, digits and _ . : $ - (at most 128 characters)",
            backend=_BACKEND,
            job=job,
        )
    return _TOKEN_UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m[0].encode()), job)


_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEMES = ("nats", "tls", "ws", "wss")  # what nats-py connects with
_ACCEPTED = "nats://host:4222, tls://host:4222, ws://host:8080, wss://host:443 or host:4222"


def _check_servers(servers: object) -> list[str]:
    """``servers`` as a list of URLs nats-py can connect to, or a ``ConfigurationError``.

    nats-py takes anything: it reads ``http://host:4222`` as the host ``http`` and fails with a
    DNS error seconds after ``start()``. Scheme-less ``host:port`` (and ``user:pw@host:port``)
    is nats-py's own shorthand for ``nats://``.
    """
    found = [servers] if isinstance(servers, str) else servers
    if not isinstance(found, list | tuple) or not found:
        raise ConfigurationError(
            f"servers of {_BACKEND} must be a URL or a non-empty list of URLs ({_ACCEPTED})",
            option="servers",
            backend=_BACKEND,
        )
    checked: list[str] = []
    for server in cast(Sequence[object], found):
        if not isinstance(server, str) or not server.strip():
            raise ConfigurationError(
                f"server {server!r} of {_BACKEND} is not a URL; write {_ACCEPTED}",
                option="servers",
                backend=_BACKEND,
            )
        scheme = _scheme(server)
        if scheme is not None and scheme not in _SCHEMES:
            raise ConfigurationError(
                f"server {_redact.redact_url(server)!r} of {_BACKEND} has the scheme"
                f" {scheme!r}; NATS URLs start with nats://, tls://, ws:// or wss://, in lower"
                " case (or have no scheme: host:4222)",
                option="servers",
                backend=_BACKEND,
            )
        checked.append(server)
    websocket = [_scheme(server) in ("ws", "wss") for server in checked]
    if any(websocket) and not all(websocket):
        raise ConfigurationError(
            f"servers of {_BACKEND} mix WebSocket (ws://, wss://) and plain (nats://, tls://)"
            " URLs, which nats-py refuses: list one kind only",
            option="servers",
            backend=_BACKEND,
        )
    return checked


def _scheme(server: str) -> str | None:
    match = _SCHEME_RE.match(server)
    return match[1] if match else None


def _import_nats() -> Any:
    try:
        return importlib.import_module("nats")
    except ImportError as exc:  # the extra is not installed
        raise ConfigurationError(
            f"{_BACKEND} needs the nats-py client: {_EXTRA_HINT}", backend=_BACKEND
        ) from exc


def _translate(exc: Exception, what: str, secrets: Sequence[str]) -> BackendError | None:
    """The brokersched error for a client exception, or ``None`` for a bug to re-raise."""
    import nats.errors
    import nats.js.errors

    detail = _describe(exc, secrets)
    unavailable = (
        OSError,  # includes TimeoutError and nats.errors.TimeoutError
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.ConnectionDrainingError,
        nats.errors.NoServersError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.StaleConnectionError,
        nats.js.errors.NoStreamResponseError,
        nats.js.errors.ServiceUnavailableError,
    )
    if isinstance(exc, unavailable):
        return BackendUnavailableError(f"{_BACKEND}: {what}: NATS unavailable ({detail})")
    if isinstance(exc, nats.errors.Error):
        return BackendError(f"{_BACKEND}: {what}: {detail}")
    return None


class _Translated:
    """The one place nats-py exceptions become ``BackendError`` (chained).

    A class rather than a ``contextmanager`` generator: it wraps every claim, so it is cheap,
    and the message is only formatted when something failed.
    """

    __slots__ = ("_secrets", "_what")

    def __init__(self, *what: str, secrets: Sequence[str] = ()) -> None:
        self._what = what
        self._secrets = secrets

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or isinstance(exc, BrokerschedError) or not isinstance(exc, Exception):
            return
        error = _translate(exc, " ".join(self._what), self._secrets)
        if error is not None:
            clean = _redact.scrub_exception(exc, self._secrets)
            raise error from (exc if clean else None)


@dataclasses.dataclass(frozen=True, slots=True)
class _Names:
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

    def history_subject(self, job: str) -> str:
        return f"{self.prefix}.history.{subject_token(job)}"


def _seconds(value: timedelta) -> str:
    return format_duration(value)


# A claim is under 2 KiB (a 128-character job name, a 200-character instance id, escaped); a
# stream whose max_msg_size is smaller refuses some claims (and most run records).
_MIN_MSG_SIZE = 4096
_DEFAULT_HISTORY_SIZE = 1000  # the scheduler's default; a fix suggested before prepare() knows
_LIMIT_FLAGS = {
    "max_msgs": "--max-msgs",
    "max_bytes": "--max-bytes",
    "max_msgs_per_subject": "--max-msgs-per-subject",
}


def _text(value: object) -> str:
    """An enum setting (storage, retention, discard, ...) as the server spells it."""
    return str(getattr(value, "value", value))


def _limit(value: int | None) -> int:
    """A count or size limit, every spelling of "unlimited" (None, 0, -1) as 0."""
    return value if value is not None and value > 0 else 0


def _recreate(stream: str, forgets: str) -> str:
    return (
        f"delete the stream while no scheduler runs (`nats stream rm {stream}`, which forgets "
        f"{forgets}) so that brokersched creates it, or use another prefix"
    )


def _claims_problems(config: StreamConfig, names: _Names, slot_ttl: timedelta) -> list[str]:
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
    persist_mode = _text(config.persist_mode)
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
    discard_new = _text(config.discard) == "new"
    for setting, flag in _LIMIT_FLAGS.items():
        value = _limit(getattr(config, setting))
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
    size = _limit(config.max_msg_size)
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
    storage = _text(config.storage)
    if storage != "file":
        problems.append(
            f"storage is {storage!r}, not 'file' (it would be lost on a server restart); storage "
            f"cannot be edited: delete the stream (`nats stream rm {stream}`, which forgets "
            f"{forgets}) while no scheduler runs, or use another prefix"
        )
    retention = _text(config.retention)
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


def _history_problems(config: StreamConfig, names: _Names, size: int | None = None) -> list[str]:
    """Every setting of an existing history stream that breaks writing or trimming runs.

    ``max_msgs_per_subject`` is what trims each job's history: it must be set (brokersched
    grows it to ``size``). A ``max_age``, or a max_msgs/max_bytes with discard 'old', only
    drops old runs sooner: accepted. With discard 'new' a full stream refuses every record.
    """
    stream = names.history
    forgets = "the run history"
    problems = _common_problems(config, stream, names.history_subjects, "run record", forgets)
    if not _limit(config.max_msgs_per_subject):
        problems.append(
            "max_msgs_per_subject is unlimited (it is what trims each job's history; without it "
            f"the history grows for ever): run `nats stream edit {stream} "
            f"--max-msgs-per-subject={size or _DEFAULT_HISTORY_SIZE}`, or "
            f"{_recreate(stream, forgets)}"
        )
    if _text(config.discard) == "new":
        limits = [f"{s}={_limit(getattr(config, s))}" for s in ("max_msgs", "max_bytes")]
        if config.discard_new_per_subject:
            limits.append(f"max_msgs_per_subject={_limit(config.max_msgs_per_subject)}")
        limits = [limit for limit in limits if not limit.endswith("=0")]
        if limits:
            problems.append(
                f"discard is 'new' with {', '.join(limits)} (once full, every run record is "
                f"refused): run `nats stream edit {stream} --discard=old"
                + (" --no-discard-per-subject`" if config.discard_new_per_subject else "`")
            )
    problems += _msg_size_problems(config, stream)
    return problems


def _claims_config(names: _Names, slot_ttl: timedelta, replicas: int) -> StreamConfig:
    """The claims stream brokersched creates (it passes ``_claims_problems``)."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    ttl = slot_ttl.total_seconds()
    return StreamConfig(
        name=names.claims,
        description="brokersched slot claims (deduplicated by Nats-Msg-Id)",
        subjects=[names.claim_subjects],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        num_replicas=replicas,
        duplicate_window=ttl,
        max_age=ttl,
        allow_direct=True,
    )


def _history_config(names: _Names, size: int, replicas: int) -> StreamConfig:
    """The history stream brokersched creates (it passes ``_history_problems``)."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    return StreamConfig(
        name=names.history,
        description="brokersched run history (one subject per job)",
        subjects=[names.history_subjects],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        num_replicas=replicas,
        max_msgs_per_subject=size,
        allow_direct=True,
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
    stays unlimited (``_claims_problems`` refuses it anyway).
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


def _claims_refusals(config: StreamConfig, names: _Names, slot_ttl: timedelta) -> list[str]:
    """``_claims_problems`` of an existing claims stream, or none when raising its window to
    ``slot_ttl`` (``_raised_window``) would leave nothing wrong: ``start()`` raises it then."""
    problems = _claims_problems(config, names, slot_ttl)
    raised = _raised_window(config, slot_ttl)
    if problems and raised is not None and not _claims_problems(raised, names, slot_ttl):
        return []
    return problems


class NATSBackend(ClaimBackend):
    """Claims and history on NATS JetStream (claim-only: no leases).

    ``servers``: one URL or a list (``nats://``, ``tls://``, ``ws://``, ``wss://``, or
    scheme-less ``host:port``; anything else is refused at construction; user-info in URLs is
    redacted from every log line and error). ``slot_ttl``: how long a claimed slot is
    remembered (the claims stream's duplicate window and max age). ``replicas``: stream
    replicas in a cluster.
    ``claim_timeout``: the longest a claim may take, whatever ``timeout`` the scheduler allows
    (the rest of the job's ``max_late``); by default 2 s on one server and 30 s with
    ``replicas`` > 1, where a stream leader's election takes seconds (see ``_CLAIM_TIMEOUT``).
    ``connect_options`` go to ``nats.connect`` (``user_credentials``, ``tls``, ``token``, ...);
    they are never logged. ``start()`` waits up to twice ``connect_timeout`` (2 s) per server.
    """

    def __init__(
        self,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        *,
        slot_ttl: Duration = "5m",
        prefix: str = "brokersched",
        replicas: int = 1,
        claim_timeout: Duration | None = None,
        **connect_options: Any,
    ) -> None:
        super().__init__()
        self._servers = _check_servers(servers)
        self._slot_ttl = parse_duration(slot_ttl, name="slot_ttl")
        if claim_timeout is None:
            claim_timeout = _CLUSTER_CLAIM_TIMEOUT if replicas != 1 else _CLAIM_TIMEOUT
        self._claim_timeout = parse_duration(claim_timeout, name="claim_timeout")
        for option, value in (("slot_ttl", self._slot_ttl), ("claim_timeout", self._claim_timeout)):
            if value <= timedelta(0):
                raise ConfigurationError(
                    f"{option} must be longer than 0s", option=option, backend=_BACKEND
                )
        if not _PREFIX_RE.fullmatch(prefix):
            raise ConfigurationError(
                f"prefix {prefix!r} must be 1-64 letters, digits, '_' or '-' "
                "(it names streams and subjects)",
                option="prefix",
                backend=_BACKEND,
            )
        if type(replicas) is not int or not 1 <= replicas <= 5:
            raise ConfigurationError(
                f"replicas {replicas!r} must be an integer from 1 to 5",
                option="replicas",
                backend=_BACKEND,
            )
        self._names = _Names(prefix)
        self._replicas = replicas
        self._connect_options = dict(connect_options)
        self._secrets = _secrets(self._servers, self._connect_options)
        self._shown_servers = ", ".join(_redact.redact_url(s) for s in self._servers)
        self._capabilities = Capabilities(
            leases=False, slot_memory=self._slot_ttl, history_ttl=False, history_size_per_job=False
        )
        self._nc: NATSClient | None = None
        self._js: JetStreamContext | None = None
        self._history_capacity = 0  # max_msgs_per_subject known to be in place (0: unknown)
        self._history_lock = asyncio.Lock()
        self._history_guard: asyncio.Task[None] | None = None
        self._watch = _Watch()
        self._last_error: str | None = None
        self._claim_budget_s = self._claim_timeout.total_seconds()
        self._token_base = secrets.token_hex(6)
        self._token_seq = itertools.count()
        self._claim_subjects: dict[str, str] = {}  # job -> subject, validated once

    def __repr__(self) -> str:
        return f"{_BACKEND}({self._shown_servers!r}, prefix={self._names.prefix!r})"

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def slot_ttl(self) -> timedelta:
        return self._slot_ttl

    # -- lifecycle -----------------------------------------------------------------------------

    async def _open(self, clock: Clock) -> None:
        nats = _import_nats()
        # Fresh per start: asyncio primitives belong to the loop they are first used in.
        self._watch, self._history_lock = _Watch(), asyncio.Lock()
        cancels = cancel_requests()
        nc = await self._connect(nats, cancels)
        try:
            js = nc.jetstream(timeout=_API_TIMEOUT_S)  # pyright: ignore[reportUnknownMemberType]
            with _Translated("preparing streams", secrets=self._secrets):
                await self._prepare_streams(js)
            raise_if_cancelled_since(cancels)
        except BaseException:
            await to_the_end(self._close_client(nc))
            raise
        self._nc, self._js = nc, js

    async def _connect(self, nats: Any, cancels: int) -> NATSClient:
        options: dict[str, Any] = {
            **_CONNECT_DEFAULTS,
            **self._connect_options,
            **self._callbacks(),
        }
        budget = 2 * float(options["connect_timeout"]) * len(self._servers)
        nc: NATSClient = nats.NATS()
        self._last_error = None
        try:
            async with asyncio.timeout(budget):
                await nc.connect(self._servers, **options)
            raise_if_cancelled_since(cancels)
        except BaseException as exc:
            await to_the_end(self._close_client(nc))
            if not isinstance(exc, Exception):
                raise
            cause = self._last_error or _describe(exc, self._secrets)
            clean = _redact.scrub_exception(exc, self._secrets)
            raise BackendUnavailableError(
                f"{_BACKEND}: cannot connect to NATS at {self._shown_servers} within "
                f"{budget:g}s ({cause})"
            ) from (exc if clean else None)
        return nc

    def _callbacks(self) -> dict[str, Callable[..., Awaitable[None]]]:
        """Our connection callbacks, each also calling the caller's own if given."""
        ours: dict[str, Callable[..., Awaitable[None]]] = {
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }
        for name in _CALLBACKS:
            theirs = self._connect_options.get(name)
            if theirs is not None:
                ours[name] = _chain(ours[name], theirs)
        return ours

    async def _close(self) -> None:
        guard, self._history_guard = self._history_guard, None
        if guard is not None:
            guard.cancel()
            await asyncio.gather(guard, return_exceptions=True)
        nc, self._nc, self._js = self._nc, None, None
        self._history_capacity = 0
        if nc is not None:
            await self._close_client(nc)

    @staticmethod
    async def _close_client(nc: NATSClient) -> None:
        with contextlib.suppress(Exception):
            await nc.close()

    async def _on_error(self, exc: Exception) -> None:
        # nats-py calls this on every failed reconnect attempt: keep the message for the next
        # error we raise, and log at debug while we know we are disconnected.
        self._last_error = _describe(exc, self._secrets)
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

    def _client(self) -> tuple[NATSClient, JetStreamContext]:
        if self._nc is None or self._js is None:
            raise BackendUnavailableError(f"{_BACKEND} is not started (call start() first)")
        return self._nc, self._js

    # -- streams -------------------------------------------------------------------------------

    async def _prepare_streams(self, js: JetStreamContext) -> None:
        import nats.js.errors

        try:
            await self._ensure_claims_stream(js)
        except (
            nats.js.errors.ServiceUnavailableError,
            nats.js.errors.NoStreamResponseError,
        ) as exc:
            raise BackendUnavailableError(
                f"{_BACKEND}: JetStream does not answer at {self._shown_servers}: is it enabled "
                "on the server (nats-server -js, or jetstream {} in its config) and for this "
                "account?"
            ) from exc
        await self._check_history_stream(js)

    async def _ensure_claims_stream(self, js: JetStreamContext) -> None:
        await self._ensure_stream(
            js,
            _claims_config(self._names, self._slot_ttl, self._replicas),
            problems=lambda c: _claims_refusals(c, self._names, self._slot_ttl),
            per_subject=None,
            option="slot_ttl",
        )
        await self._raise_claims_window(js)

    async def _raise_claims_window(self, js: JetStreamContext) -> None:
        """Raise the claims stream's ``duplicate_window`` and ``max_age`` to ``slot_ttl`` when
        shorter (a rolling deploy that raises ``slot_ttl``), or refuse as ``_claims_problems``
        says when NATS refuses the update.

        Why raising is safe for the fleet: the scheduler calls ``start()``, then ``prepare()``,
        and only then arms its jobs, each at its next slot after *now* (``Scheduler._start``,
        ``_arm``); a claim-only instance never claims a slot from before its start. So every slot
        this instance claims is first claimed, by anyone, after the raise (clocks agreeing to
        better than the old window, as claim-only backends require anyway), and every claim
        message from then on is deduplicated under the longer window. JetStream purges a message
        id once its age reaches the window in force at purge time (an update re-runs the purge
        with the new window), so the raise also extends the ids stored before it; only ids
        already purged under the old window are gone, and their slots are older than this
        instance. A longer window never hurts the instances with a shorter ``slot_ttl``: they
        accept it (``_raised_window`` never lowers). ``max_age`` grows too: a restarted server
        rebuilds its ids from the stored messages only. The one way around it is
        ``Job.resume()`` within its jitter of ``start()`` of a job paused before it:
        ``Scheduler._rearm`` may arm a slot still in its jitter window from before the start.

        NATS 2.9 has no conditional update: an instance that read the stream before our update
        can overwrite it with its own, smaller raise. So the stream is read again after each
        update, and once more after ``_WINDOW_SETTLE_S``, and raised again while it is short.
        """
        stream, names, ttl = self._names.claims, self._names, self._slot_ttl
        raises, settled = 0, False
        while True:
            config = (await js.stream_info(stream)).config
            raised = _raised_window(config, ttl)
            if raised is None:
                if raises == 0 or settled:
                    return
                settled = True  # a concurrent stale update lands within milliseconds
                await asyncio.sleep(_WINDOW_SETTLE_S)
                continue
            settled = False
            problems = _claims_problems(config, names, ttl)
            if _claims_problems(raised, names, ttl):  # changed meanwhile: refuse as it is
                self._raise_problems(stream, problems, option="slot_ttl")
            if raises == _WINDOW_RAISES:
                self._raise_problems(
                    stream,
                    [*problems, f"brokersched raised it {raises} times and it was lowered again"],
                    option="slot_ttl",
                )
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
            answer = _describe(exc, self._secrets)
        except nats.errors.TimeoutError:
            # A publish the user may not make gets no reply, only an -ERR on the connection
            # ("nats: permissions violation for publish to "$js.api.stream.update.<name>"").
            denied = self._last_error or ""
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
        self._raise_problems(self._names.history, _history_problems(info.config, self._names))

    async def _ensure_history(self, size: int) -> None:
        if size <= self._history_capacity:
            return
        async with self._history_lock:
            if size <= self._history_capacity:
                return
            _, js = self._client()
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
                logger.debug(
                    "checking the history stream failed: %s", _describe(exc, self._secrets)
                )

    async def _ensure_history_stream(self, js: JetStreamContext, size: int) -> bool:
        return await self._ensure_stream(
            js,
            _history_config(self._names, size, self._replicas),
            problems=lambda c: _history_problems(c, self._names, size),
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
                        f"{_BACKEND}: another JetStream stream already uses the subjects of "
                        f"{desired.name!r} ({', '.join(desired.subjects or [])}); use another "
                        "prefix or remove that stream",
                        option="prefix",
                        backend=_BACKEND,
                    ) from None
                try:
                    await js.add_stream(desired)  # pyright: ignore[reportUnknownMemberType]
                except nats.js.errors.APIError as exc:
                    if exc.err_code in _ERR_REPLICAS:
                        raise self._replicas_error(
                            desired.name, None, f"NATS answered {_describe(exc, self._secrets)}"
                        ) from exc
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
                raise self._replicas_error(desired.name, have, "the server is not clustered")
            update = _grown(info.config, replicas=self._replicas, per_subject=per_subject)
            if update is None:
                return updated
            try:
                await js.update_stream(update)  # pyright: ignore[reportUnknownMemberType]
            except nats.js.errors.APIError as exc:
                if have < self._replicas:
                    raise self._replicas_error(
                        desired.name, have, f"NATS answered {_describe(exc, self._secrets)}"
                    ) from exc
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
        raise BackendError(f"{_BACKEND}: stream {desired.name} keeps changing; is it contested?")

    def _replicas_error(self, stream: str, have: int | None, why: str) -> ConfigurationError:
        """``replicas`` cannot be had: the stream is missing (``have`` None) or has fewer."""
        want = self._replicas
        if have is None:
            what = f"cannot create JetStream stream {stream!r} with {want} replicas ({why})"
        else:
            what = (
                f"the existing JetStream stream {stream!r} has num_replicas {have}, fewer than "
                f"replicas={want} of this instance, and could not be raised ({why})"
            )
        return ConfigurationError(
            f"{_BACKEND}: {what}: replicas > 1 needs a NATS cluster with at least {want} "
            f"JetStream servers (then `nats stream edit {stream} --replicas {want}`); on one "
            "server pass replicas=1",
            option="replicas",
            backend=_BACKEND,
        )

    def _raise_problems(self, stream: str, problems: list[str], option: str = "prefix") -> None:
        if problems:
            raise ConfigurationError(
                f"{_BACKEND}: the existing JetStream stream {stream!r} cannot be used: "
                + "; ".join(problems),
                option=option,
                backend=_BACKEND,
            )

    async def prepare(self, jobs: Sequence[JobPolicy]) -> None:
        if jobs:
            with _Translated("preparing the history stream", secrets=self._secrets):
                await self._ensure_history(max(job.history_size for job in jobs))

    # -- claims --------------------------------------------------------------------------------

    async def claim(self, slot: Slot, *, instance_id: str, run_id: str, timeout: float) -> bool:
        nc, js = self._client()
        msg_id = slot.key  # Nats-Msg-Id: <job>:<slot_ms>
        with _Translated("claim", msg_id, secrets=self._secrets):
            started = time.monotonic()
            budget = min(timeout, self._claim_budget_s)
            # The token tells a retry of this very call from any other claim, even one by the
            # same instance with the same run id.
            token = f"{self._token_base}{next(self._token_seq):x}"
            subject = self._claim_subjects.get(slot.job) or self._claim_subject(slot.job)
            message = _Message(
                subject,
                msg_id,
                _claim_body(instance_id, slot.slot_ms, run_id, token),
                token,
            )
            if not nc.is_connected or budget <= 0:
                return await self._retry_claim(nc, js, message, started, budget, None)
            # The first attempt, kept lean: it is nearly always the only one. It relies on
            # nats-py's timeout rather than an asyncio.timeout that a disconnect could end early
            # (~7 us per claim); it is retried after _attempt_seconds() anyway.
            try:
                ack = await js.publish(
                    message.subject,
                    message.body,
                    timeout=_attempt_seconds(budget),
                    headers={_MSG_ID: msg_id},
                )
            except Exception as exc:
                return await self._retry_claim(nc, js, message, started, budget, exc)
            _check_stream(ack, self._names.claims, msg_id)
            return not ack.duplicate  # a definite answer: nothing of this call was stored before

    def _claim_subject(self, job: str) -> str:
        subject = self._claim_subjects[job] = self._names.claim_subject(job)
        return subject

    async def _retry_claim(
        self,
        nc: NATSClient,
        js: JetStreamContext,
        message: _Message,
        started: float,
        budget: float,
        first_error: Exception | None,
    ) -> bool:
        claim = _Claim(self._watch, nc, js, self._names.claims, message, started, budget)
        return await claim.retry(first_error)

    # -- history -------------------------------------------------------------------------------

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        nc, js = self._client()
        with _Translated(f"recording a run of {job.name!r}", secrets=self._secrets):
            await self._ensure_history(job.history_size)
            await self._publish_record(nc, js, job, record)

    async def _publish_record(
        self, nc: NATSClient, js: JetStreamContext, job: JobPolicy, record: RunRecord
    ) -> None:
        """Publish ``record``, retried like a claim while the stream has no leader (a node
        lost): its message id makes a retry of a stored record a duplicate, not a second copy
        (within the history stream's duplicate window, 2 minutes by default)."""
        import nats.js.errors

        subject, body = self._names.history_subject(job.name), record.to_json().encode()
        headers = {_MSG_ID: f"{record.job}:{record.slot_ms}:{record.run_id}"}
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
                await asyncio.sleep(_RETRY_PAUSE_S)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        _, js = self._client()
        count = min(limit, job.history_size)
        if count <= 0:
            return []
        subject = self._names.history_subject(job.name)
        with _Translated(f"reading the history of {job.name!r}", secrets=self._secrets):
            if count == 1:
                bodies = await self._last_body(js, subject)
            else:
                bodies = await self._last_bodies(js, subject, count)
        return [RunRecord.from_json(body) for body in reversed(bodies)]

    async def _last_body(self, js: JetStreamContext, subject: str) -> list[bytes]:
        import nats.js.errors

        try:
            # Not a direct get: a missing stream must be "not found", not "no responders".
            msg = await js.get_last_msg(self._names.history, subject)
        except nats.js.errors.NotFoundError:  # no stream yet, or no run of this job
            return []
        return [msg.data] if msg.data else []

    async def _last_bodies(self, js: JetStreamContext, subject: str, count: int) -> list[bytes]:
        """The last ``count`` bodies on ``subject``, oldest first.

        JetStream 2.9 cannot read a subject backwards, so an ephemeral consumer reads the
        subject's messages (at most ``max_msgs_per_subject``) and keeps the last ``count``.
        """
        import nats.js.errors
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            filter_subject=subject,
            mem_storage=True,
            inactive_threshold=_CONSUMER_IDLE_S,
        )
        try:
            info = await js.add_consumer(  # pyright: ignore[reportUnknownMemberType]
                self._names.history, config
            )
        except nats.js.errors.NotFoundError:  # no history stream yet
            return []
        assert info.name is not None
        try:
            pending = info.num_pending or 0
            return await self._drain(js, info.name, pending, count) if pending else []
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(js.delete_consumer(self._names.history, info.name))

    async def _drain(
        self, js: JetStreamContext, consumer: str, pending: int, count: int
    ) -> list[bytes]:
        import nats.errors

        sub = await js.pull_subscribe_bind(consumer, stream=self._names.history)
        newest: deque[bytes] = deque(maxlen=count)
        try:
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(pending, _FETCH_BATCH), timeout=_FETCH_TIMEOUT_S)
                except nats.errors.TimeoutError:  # trimmed while we read: nothing more
                    break
                newest.extend(msg.data for msg in msgs)
                pending = msgs[-1].metadata.num_pending if msgs else 0
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return list(newest)


class _Watch:
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
                raise BackendUnavailableError(f"{_BACKEND}: the NATS connection is closed")
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):  # the event can miss a change: poll too
                await asyncio.wait_for(self._changed.wait(), min(remaining, _CONNECTED_POLL_S))


class _Attempt:
    """An ``asyncio.timeout`` that its ``_Watch`` can end early while it is active."""

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


class _Message(NamedTuple):
    """What every attempt of one claim publishes; ``token`` is in ``body``."""

    subject: str
    msg_id: str
    body: bytes
    token: str


def _attempt_seconds(budget: float) -> float:
    """How long one publish attempt waits for its ack before it is retried."""
    return min(max(_MIN_ATTEMPT_S, budget / 4), _MAX_ATTEMPT_S, budget)


def _check_stream(ack: PubAck, stream: str, msg_id: str) -> None:
    if ack.stream != stream:
        raise BackendError(
            f"{_BACKEND}: claim {msg_id} was stored in stream {ack.stream!r}, expected {stream!r}"
        )


def _claim_body(instance_id: str, slot_ms: int, run_id: str, token: str) -> bytes:
    # Formatted by hand (strings still JSON-escaped): json.dumps of a dict costs more than the
    # rest of the claim's client-side work together.
    return (
        f'{{"instance_id":{_json_str(instance_id)},"slot_ms":{int(slot_ms)},'
        f'"run_id":{_json_str(run_id)},"claim":"{token}"}}'
    ).encode()


class _Claim:
    """One ``claim()`` call: publish attempts with the same message id until a definite answer."""

    def __init__(
        self,
        watch: _Watch,
        nc: NATSClient,
        js: JetStreamContext,
        stream: str,
        message: _Message,
        started: float,
        budget: float,
    ) -> None:
        self.watch, self.nc, self.js, self.stream = watch, nc, js, stream
        self.message, self.msg_id, self.budget = message, message.msg_id, budget
        self.deadline = started + budget  # on time.monotonic()
        self.attempt_s = _attempt_seconds(budget)
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
            await asyncio.sleep(max(0.0, min(_RETRY_PAUSE_S, self.deadline - time.monotonic())))
        else:
            raise exc

    async def _attempt(self) -> bool | None:
        """``True``/``False`` when definite, ``None`` to try again."""
        self.attempts += 1
        ack = await self.js.publish(
            self.message.subject,
            self.message.body,
            timeout=self.budget,  # the attempt's own deadline ends it sooner
            headers={_MSG_ID: self.msg_id},
        )
        _check_stream(ack, self.stream, self.msg_id)
        if not ack.duplicate:
            return True
        if self.attempts == 1:
            return False  # nothing of this call can have been stored before: definite
        if not ack.seq:  # clustered: the first copy is still being replicated
            await asyncio.sleep(_RETRY_PAUSE_S)
            return None
        return await self._stored_is_ours(ack.seq)

    async def _stored_is_ours(self, seq: int) -> bool:
        """Whether the message stored under our id is an earlier attempt of this call.

        Read from the stream leader (not a direct get, which a lagging replica may answer).
        """
        msg = await self.js.get_msg(self.stream, seq=seq)
        headers = cast(dict[str, str], msg.headers or {})  # pyright: ignore[reportUnknownMemberType]
        stored_id = headers.get(_MSG_ID)
        if stored_id != self.msg_id:
            raise BackendError(
                f"{_BACKEND}: claim {self.msg_id}: sequence {seq} of {self.stream} holds "
                f"{stored_id!r}; cannot tell who won"
            )
        try:
            stored = json.loads(msg.data or b"")
        except ValueError as exc:
            raise BackendError(f"{_BACKEND}: claim {self.msg_id}: unreadable stored body") from exc
        ours = self.message.token
        return isinstance(stored, dict) and cast(dict[str, Any], stored).get("claim") == ours

    def _no_answer(self) -> BackendError:
        if self.cause is not None:
            cause = redact(str(self.cause)) or type(self.cause).__name__
        else:
            cause = "no time left to try" if self.nc.is_connected else "not connected"
        error = BackendUnavailableError(
            f"{_BACKEND}: claim {self.msg_id}: no definite answer within {self.budget:g}s "
            f"after {self.attempts} attempt(s) ({cause})"
        )
        error.__cause__ = self.cause
        return error


def _chain(
    first: Callable[..., Awaitable[None]], second: Callable[..., Awaitable[None]]
) -> Callable[..., Awaitable[None]]:
    async def both(*args: Any) -> None:
        await first(*args)
        await second(*args)

    return both

"""The settings of ``NATSBackend``'s two streams: those brokersched creates them with
(``claims_config``, ``history_config``), what is wrong with an existing one
(``claims_problems``, ``history_problems``: each setting, its value and how to fix it), and
what growing one changes (``grown``, ``raised_window``).

A restarted server rebuilds its duplicate table from the stored messages only, so claims must
leave their stream by age alone: memory storage, max_msgs, max_bytes, max_msgs_per_subject or a
max_age shorter than ``slot_ttl`` would let a late instance win a slot that already ran; no_ack,
a mirror or discard 'new' with a limit make claims fail; an unlimited max_age lets the stream
grow for ever. An existing stream that cannot work fails ``start()`` with a
``ConfigurationError`` that names each setting, its value and how to fix it
(``claims_problems``, ``history_problems``).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..._durations import format_duration
from ._names import Names

if TYPE_CHECKING:
    from nats.js.api import StreamConfig

__all__ = [
    "claims_config",
    "claims_problems",
    "duration",
    "grown",
    "history_config",
    "history_problems",
    "limit_value",
    "raised_window",
    "setting_text",
]


def duration(value: timedelta) -> str:
    """``value`` as the messages show it (``5m``)."""
    return format_duration(value)


# A claim is under 2 KiB (a 128-character job name, a 200-character instance id, escaped), a
# run's record under 8 KiB (a failed run's traceback is capped at 4 KiB, JSON-escaped, and so is
# a completed run's result: a record has one or the other); a stream whose max_msg_size is
# smaller refuses some claims or run records.
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
            f"duplicate_window is {duration(window)}, shorter than slot_ttl {duration(slot_ttl)} "
            f"(a late instance could win a slot again): run `nats stream edit {stream} "
            f"--dupe-window {duration(slot_ttl)} --max-age {duration(slot_ttl)}` or pass "
            f"slot_ttl={duration(window)!r}"
        )
    # The server wants max_age >= duplicate_window: never suggest less.
    keep = duration(max(window, slot_ttl))
    max_age = timedelta(seconds=config.max_age or 0)
    if max_age <= timedelta(0):
        problems.append(
            f"max_age is 0 (unlimited: the stream would grow for ever, one message per claimed "
            f"slot): run `nats stream edit {stream} --max-age {keep}`"
        )
    elif max_age < slot_ttl:
        problems.append(
            f"max_age is {duration(max_age)}, shorter than slot_ttl {duration(slot_ttl)} "
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


def grown(config: StreamConfig, *, replicas: int, per_subject: int | None) -> StreamConfig | None:
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


def raised_window(config: StreamConfig, slot_ttl: timedelta) -> StreamConfig | None:
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

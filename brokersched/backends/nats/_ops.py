"""``NATSBackend.inventory()``, ``purge()`` and ``doctor()``: the prefix's streams (claims,
history and the fleet's two buckets: all the backend makes), the signs that an instance of the
prefix runs (a claim or a run stored in the last minute), and the checks ``start()`` makes of
existing streams, as findings (``claims_problems``, ``history_problems``)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ...abc import Finding, Inventory, StoredObject
from .._ops import LIVE_WINDOW, server_finding, slot_memory_finding
from ._errors import BACKEND
from ._fleet import bucket_streams
from ._names import Names
from ._stream_settings import claims_problems, history_problems

if TYPE_CHECKING:
    from nats.js import JetStreamContext

__all__ = [
    "MIN_VERSION",
    "delete_streams",
    "doctor",
    "inventory",
    "last_stored",
    "problem_findings",
    "purge",
    "replicas_finding",
    "stream_info_or_none",
    "streams_inventory",
]

MIN_VERSION = (2, 9)
_FRACTION = re.compile(r"\.(\d{6})\d*")


def _streams(names: Names) -> tuple[str, ...]:
    return names.claims, names.history, *bucket_streams(names.prefix)


async def stream_info_or_none(js: JetStreamContext, stream: str) -> Any:
    import nats.js.errors

    try:
        return await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return None


async def inventory(js: JetStreamContext, names: Names) -> Inventory:
    def window(stream: str, info: Any) -> timedelta:
        if stream == names.claims:  # its messages are the claims: needed while remembered
            return max(LIVE_WINDOW, timedelta(seconds=info.config.duplicate_window or 0))
        return LIVE_WINDOW

    return await streams_inventory(js, BACKEND, names.prefix, _streams(names), window)


async def streams_inventory(
    js: JetStreamContext,
    backend: str,
    namespace: str,
    streams: Sequence[str],
    window: Callable[[str, Any], timedelta] = lambda _stream, _info: LIVE_WINDOW,
) -> Inventory:
    """Which of ``streams`` exist; live: one that stored a message within its ``window``.

    Not the fleet's buckets: an instance writes its presence every heartbeat, its last one
    when it stops, so when presence was written says nothing; ``purge`` judges the presence
    records themselves (``Backend.presence``). A control is written by an operator too."""
    objects: list[StoredObject] = []
    live: list[str] = []
    fleet = set(bucket_streams(namespace))
    for stream in streams:
        info = await stream_info_or_none(js, stream)
        if info is None:
            continue
        objects.append(StoredObject("stream", stream))
        if stream in fleet:
            continue
        last = await last_stored(js, stream, info)
        if last is not None and last > datetime.now(last.tzinfo) - window(stream, info):
            seconds = (datetime.now(last.tzinfo) - last).total_seconds()
            live.append(f"stream {stream} stored a message {seconds:.0f}s ago")
    return Inventory(backend, namespace, tuple(objects), live=tuple(live))


async def last_stored(js: JetStreamContext, stream: str, info: Any) -> datetime | None:
    """When the stream's last message was stored (the server's clock), if it has one."""
    import nats.js.errors

    seq = info.state.last_seq if info.state is not None else 0
    if not seq or not info.state.messages:
        return None
    try:
        msg = await js.get_msg(stream, seq=seq)
    except nats.js.errors.NotFoundError:
        return None
    stamp = getattr(msg, "time", None)  # nats-py parses it, or leaves the server's text
    if isinstance(stamp, datetime):
        return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)
    if not isinstance(stamp, str):
        return None
    return datetime.fromisoformat(_FRACTION.sub(r".\1", stamp.replace("Z", "+00:00")))


async def purge(js: JetStreamContext, found: Inventory) -> Inventory:
    names = Names(found.namespace)
    await delete_streams(js, found, _streams(names))
    return await inventory(js, names)


async def delete_streams(js: JetStreamContext, found: Inventory, ours: Sequence[str]) -> None:
    """Delete the streams of ``found`` that are among ``ours`` (never another's)."""
    import nats.js.errors

    for item in found.objects:
        if item.kind == "stream" and item.name in ours:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(item.name)


async def doctor(
    js: JetStreamContext, version: str | None, names: Names, slot_ttl: timedelta, replicas: int
) -> list[Finding]:
    findings = [server_finding("nats-server", version, MIN_VERSION)]
    claims = await stream_info_or_none(js, names.claims)
    if claims is None:
        findings.append(
            Finding(
                "ok", "claims stream", f"no stream {names.claims} yet: the first start makes it"
            )
        )
        findings.append(slot_memory_finding(BACKEND, names.claims, None, slot_ttl))
    else:
        findings += problem_findings(names.claims, claims_problems(claims.config, names, slot_ttl))
        window_ms = round((claims.config.duplicate_window or 0) * 1000)
        findings.append(
            slot_memory_finding(
                BACKEND, f"the duplicate window of {names.claims}", window_ms, slot_ttl
            )
        )
        findings.append(replicas_finding(names.claims, claims, replicas))
    history = await stream_info_or_none(js, names.history)
    if history is not None:
        findings += problem_findings(names.history, history_problems(history.config, names))
        findings.append(replicas_finding(names.history, history, replicas))
    return findings


def problem_findings(stream: str, problems: list[str]) -> list[Finding]:
    """``claims_problems`` and ``history_problems`` say each problem and its fix in one
    sentence (``... (consequence): fix``): each is an error, as ``start()`` refuses them."""
    if not problems:
        return [Finding("ok", f"stream {stream}", "its settings keep the guarantees")]
    findings = []
    for problem in problems:
        found, _, fix = problem.partition("): ")
        what, _, consequence = found.partition(" (")
        findings.append(Finding("error", f"stream {stream}", what, consequence, fix))
    return findings


def replicas_finding(stream: str, info: Any, replicas: int) -> Finding:
    count = info.config.num_replicas or 1
    check = f"stream {stream} replicas"
    cluster = info.cluster
    peers = [] if cluster is None or cluster.replicas is None else cluster.replicas
    down = [peer.name for peer in peers if peer.offline or not peer.current]
    if count < replicas:
        return Finding(
            "warning",
            check,
            f"{count} replica(s), fewer than the backend's replicas={replicas}",
            "the stream survives fewer server losses than configured; the next start grows it",
            "start an instance (it grows the replicas), or lower replicas",
        )
    if down:
        return Finding(
            "warning",
            check,
            f"{count} replicas, {len(down)} not current: {', '.join(down)}",
            "one more server lost and the stream has no quorum: claims fail (slots skipped)",
            "bring the servers back, or move the stream's peers (nats stream cluster peer-remove)",
        )
    if count > 1 and cluster is not None and len(peers) + 1 < count:
        return Finding(
            "error",
            check,
            f"{count} replicas but only {len(peers) + 1} peers in the cluster",
            "the stream has no quorum: every claim fails",
            "add servers to the cluster or lower the stream's replicas",
        )
    return Finding("ok", check, f"{count} replica{'s' if count > 1 else ''}")

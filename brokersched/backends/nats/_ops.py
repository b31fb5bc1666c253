"""``NATSBackend.inventory()``, ``purge()`` and ``doctor()``: the prefix's two streams (claims
and history: all the backend makes), the signs that an instance of the prefix runs (a message
stored in the last minute), and the checks ``start()`` makes of existing streams, as findings
(``claims_problems``, ``history_problems``)."""

from __future__ import annotations

import contextlib
import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ...abc import Finding, Inventory, StoredObject
from .._ops import LIVE_WINDOW, server_finding, slot_memory_finding
from ._base import BACKEND
from ._fleet import bucket_streams
from ._streams import Names, claims_problems, history_problems

if TYPE_CHECKING:
    from nats.js import JetStreamContext

__all__ = ["MIN_VERSION", "doctor", "inventory", "purge"]

MIN_VERSION = (2, 9)
_FRACTION = re.compile(r"\.(\d{6})\d*")


def _streams(names: Names) -> tuple[str, ...]:
    return names.claims, names.history, *bucket_streams(names.prefix)


async def _info(js: JetStreamContext, stream: str) -> Any:
    import nats.js.errors

    try:
        return await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return None


async def inventory(js: JetStreamContext, names: Names) -> Inventory:
    objects: list[StoredObject] = []
    live: list[str] = []
    for stream in _streams(names):
        info = await _info(js, stream)
        if info is None:
            continue
        objects.append(StoredObject("stream", stream))
        last = await _last_stored(js, stream, info)
        window = LIVE_WINDOW
        if stream == names.claims:  # its messages are the claims: needed while remembered
            window = max(window, timedelta(seconds=info.config.duplicate_window or 0))
        if last is not None and last > datetime.now(last.tzinfo) - window:
            seconds = (datetime.now(last.tzinfo) - last).total_seconds()
            live.append(f"stream {stream} stored a message {seconds:.0f}s ago")
    return Inventory(BACKEND, names.prefix, tuple(objects), live=tuple(live))


async def _last_stored(js: JetStreamContext, stream: str, info: Any) -> datetime | None:
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
    ours = set(_streams(names))
    for item in found.objects:
        if item.kind == "stream" and item.name in ours:
            import nats.js.errors

            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(item.name)
    return await inventory(js, names)


async def doctor(
    js: JetStreamContext, version: str | None, names: Names, slot_ttl: timedelta, replicas: int
) -> list[Finding]:
    findings = [server_finding("nats-server", version, MIN_VERSION)]
    claims = await _info(js, names.claims)
    if claims is None:
        findings.append(
            Finding(
                "ok", "claims stream", f"no stream {names.claims} yet: the first start makes it"
            )
        )
        findings.append(slot_memory_finding(BACKEND, names.claims, None, slot_ttl))
    else:
        findings += _problems(names.claims, claims_problems(claims.config, names, slot_ttl))
        window_ms = round((claims.config.duplicate_window or 0) * 1000)
        findings.append(
            slot_memory_finding(
                BACKEND, f"the duplicate window of {names.claims}", window_ms, slot_ttl
            )
        )
        findings.append(_replicas_finding(names.claims, claims, replicas))
    history = await _info(js, names.history)
    if history is not None:
        findings += _problems(names.history, history_problems(history.config, names))
        findings.append(_replicas_finding(names.history, history, replicas))
    return findings


def _problems(stream: str, problems: list[str]) -> list[Finding]:
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


def _replicas_finding(stream: str, info: Any, replicas: int) -> Finding:
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

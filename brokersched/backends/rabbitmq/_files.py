"""What exhausts a RabbitMQ node's open files, by the node's version.

The budget watch (``_budget``) and ``brokersched doctor`` (``_ops``) weigh each node with the
rule of its own version, read from ``GET /api/nodes`` (the ``rabbit`` application's version of
each node; a cluster in a rolling upgrade has both), and never count what costs that version
nothing:

- **3.x**: a file-handle cache. It closes the handles of classic queues it least recently used
  when it needs them (a soak on 3.10.8 at 1,024: ~1,800 claim queues, the node answering in
  0.4 s), but each quorum queue holds about 3 handles, and the node keeps ~97 for itself: past
  (limit - 97) / 3 quorum queues it stops answering every client and does not recover
  (measured 308 fine and 310 hung at 1,024, 625 and 650 at 2,048). Sockets have a limit of
  their own (``sockets_total``).
- **4.x**: no handle cache. Measured on 4.0.5 (Erlang/OTP 27) at 1,024, with ``/proc/<beam
  pid>/fd``: a node with the management plugin holds ~42 files; each classic queue holding a
  persistent message holds one more (its queue-index file: 200 such queues, 200 files), an
  empty classic queue or one holding only transient messages none, 200 idle quorum queues 1
  in all (their write-ahead log), a stream 2, each connection 1. At 1,024 the node hit
  ``emfile`` at ~978 live claim queues: publishes nacked, queues crashed, connections closed
  with ``541 INTERNAL_ERROR``. ``sockets_used`` and ``sockets_total`` read 0.

What a 4.x node holds is *counted*, not read from management's ``fd_used``: that figure is
sampled (on 4.0.5 it trailed the process's real count by up to 15 s, and was seen at 46 while
the process held 796), whereas the queue list says at once which classic queues hold a
persistent message (``messages_persistent``; a queue whose statistics are not in yet, its first
seconds, counts as holding one: a claim queue always does), and the connection list which
connections the node serves. The larger of that count and ``fd_used`` is taken: ``fd_used``
still sees what no listing names (another plugin's files, a burst of reads).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONNECTION_COLUMNS",
    "NODE_FILES_3",
    "NODE_FILES_4",
    "QUEUE_COLUMNS",
    "QUORUM_HANDLES_3",
    "STREAM_FILES_4",
    "Need",
    "NodeFiles",
    "counts_connections",
    "files_needed",
    "limit_needed",
    "major_version",
    "node_files",
    "node_version",
    "quorum_budget",
]

#: RabbitMQ 3.x: file handles a node keeps for itself, and each quorum queue's.
NODE_FILES_3 = 97
QUORUM_HANDLES_3 = 3
#: RabbitMQ 4.x: files a node holds for itself (42 measured with management, some margin),
#: and each stream's (its segment and index).
NODE_FILES_4 = 50
STREAM_FILES_4 = 2
#: The columns of ``GET /api/queues`` and ``GET /api/connections`` the rules read.
QUEUE_COLUMNS = "name,type,node,messages,messages_persistent"
CONNECTION_COLUMNS = "node"


def quorum_budget(fd_total: int) -> int:
    """How many quorum queues a 3.x node of this open-files limit holds before it hangs."""
    return max(0, (fd_total - NODE_FILES_3) // QUORUM_HANDLES_3)


def major_version(version: str | None) -> int | None:
    """``4`` for ``"4.0.5"``; ``None`` for no version or one that does not start with a
    number."""
    found = re.match(r"\s*(\d+)\.", version or "")
    return int(found[1]) if found else None


def node_version(node: dict[str, Any]) -> str | None:
    """The version of a node of ``GET /api/nodes``: its ``rabbit`` application's."""
    for application in node.get("applications") or ():
        if isinstance(application, dict) and application.get("name") == "rabbit":
            version = application.get("version")
            return version if isinstance(version, str) else None
    return None


@dataclass(frozen=True, slots=True)
class NodeFiles:
    """One node's open files as its version spends them: ``share`` of its limit that counts
    (``None``: the node tells no limit) and ``detail`` saying what was counted."""

    name: str
    version: str | None
    total: int | None
    share: float | None
    detail: str


def node_files(
    node: dict[str, Any],
    queues: Sequence[dict[str, Any]],
    connections: Sequence[dict[str, Any]] = (),
    *,
    version: str | None = None,
) -> NodeFiles:
    """``node`` (of ``GET /api/nodes``) weighed by the rule of its version (``version``, else
    its own; unknown: both rules, the fuller decides); ``queues`` the broker's
    (``type``, ``node``, ``messages``, ``messages_persistent``) and ``connections`` (``node``)."""
    name = str(node.get("name", "?"))
    version = version or node_version(node)
    major = major_version(version)
    total = node.get("fd_total")
    shown = f"node {name}" + (f" (RabbitMQ {version})" if version else "")
    if not isinstance(total, int) or total <= 0:
        return NodeFiles(name, version, None, None, f"{shown} does not tell its open-files limit")
    rules = []
    if major is None or major < 4:
        rules.append(_rule_3(node, total, queues))
    if major is None or major >= 4:
        rules.append(_rule_4(node, total, queues, connections))
    share, detail = max(rules, key=lambda rule: rule[0])
    if major is None:
        detail += " (version unknown: the fuller of the 3.x and 4.x rules)"
    return NodeFiles(name, version, total, share, f"{shown}: {detail}")


def _rule_3(
    node: dict[str, Any], total: int, queues: Sequence[dict[str, Any]]
) -> tuple[float, str]:
    quorum = sum(row.get("type") == "quorum" for row in queues)
    holds = quorum_budget(total)
    sockets = _ratio(node.get("sockets_used"), node.get("sockets_total"))
    share = max(quorum / holds if holds else 1.0, sockets)
    detail = (
        f"{quorum} quorum queues of the {holds} its open-files limit ({total}) holds, "
        f"{node.get('fd_used')} file descriptors used"
    )
    return share, detail + (f", sockets at {sockets:.0%}" if sockets else "")


def _rule_4(
    node: dict[str, Any],
    total: int,
    queues: Sequence[dict[str, Any]],
    connections: Sequence[dict[str, Any]],
) -> tuple[float, str]:
    name = node.get("name")
    here = [row for row in queues if row.get("node") in (name, None)]
    holding = sum(row.get("type") == "classic" and _holds_persistent(row) for row in here)
    streams = sum(row.get("type") == "stream" for row in queues)  # a replica on every node
    served = sum(row.get("node") in (name, None) for row in connections)
    counted = NODE_FILES_4 + holding + STREAM_FILES_4 * streams + served
    reported = node.get("fd_used")
    held = max(counted, reported if isinstance(reported, int) else 0)
    detail = (
        f"{held} of its open-files limit ({total}) held: {holding} classic queues holding a "
        f"persistent message (brokersched's live claim queues among them), {served} "
        f"connections, {streams} streams, ~{NODE_FILES_4} for the node ({reported} file "
        "descriptors reported by management, which trails)"
    )
    return held / total, detail


def _holds_persistent(row: dict[str, Any]) -> bool:
    """A classic queue's statistics say it holds a persistent message; a queue without them
    yet (its first seconds) counts as holding one, as a claim queue always does."""
    for field in ("messages_persistent", "messages"):
        count = row.get(field)
        if isinstance(count, int) and not isinstance(count, bool):
            return count > 0
    return True


def _ratio(used: object, total: object) -> float:
    if isinstance(used, int) and isinstance(total, int) and total > 0:
        return used / total
    return 0.0


def counts_connections(nodes: Sequence[dict[str, Any]]) -> bool:
    """Whether a node's rule counts connections (4.x, or a version not told)."""
    return any((major_version(node_version(node)) or 4) >= 4 for node in nodes)


@dataclass(frozen=True, slots=True)
class Need:
    """The open files a node of ``major`` version holds for an application: ``files`` in all,
    and each part (``parts``: what, how many files)."""

    major: int | None
    files: int
    parts: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return ", ".join(f"{what}: {count}" for what, count in self.parts if count)


def files_needed(
    major: int | None,
    *,
    claim_queues: int,
    connections: int,
    quorum: int = 0,
    others: int = 0,
    streams: int = 1,
) -> Need:
    """What a node of version ``major`` holds open at the application's peak: its
    ``claim_queues`` live at once and ``connections`` (4.x: a file each, ``others`` being the
    other classic queues holding a persistent message, ``streams`` a few each; 3.x: the
    ``quorum`` queues' handles and the connections, claim queues costing no file the cache
    cannot close). Unknown version: the larger of the two."""
    if major is None:
        three = files_needed(3, claim_queues=claim_queues, connections=connections, quorum=quorum)
        four = files_needed(
            4, claim_queues=claim_queues, connections=connections, others=others, streams=streams
        )
        return Need(None, *max((three.files, three.parts), (four.files, four.parts)))
    parts: tuple[tuple[str, int], ...]
    if major < 4:
        parts = (
            ("the node", NODE_FILES_3),
            (f"{quorum} quorum queue(s)", QUORUM_HANDLES_3 * quorum),
            (f"{connections} connection(s)", connections),
        )
    else:
        parts = (
            ("the node", NODE_FILES_4),
            (f"{claim_queues} live claim queue(s)", claim_queues),
            (f"{others} other classic queue(s) holding a persistent message", others),
            (f"{streams} stream(s)", STREAM_FILES_4 * streams),
            (f"{connections} connection(s)", connections),
        )
    return Need(major, sum(count for _, count in parts), parts)


def limit_needed(files: int, share: float) -> int:
    """The smallest open-files limit of which ``files`` is at most ``share``, rounded up to
    the next 1,024."""
    return math.ceil(files / share / 1024) * 1024

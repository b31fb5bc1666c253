"""``RabbitMQBackend.inventory()``, ``purge()`` and ``doctor()``.

AMQP cannot list queues or exchanges: without a management URL, the objects of a prefix are
found by name (``known_names``: the slot memory record and its lock queue, the fence exchanges
of the memories known, the history queue of every job of the application, the claim queues of
its recent slots), each checked with a passive declare. With ``management_url`` (the management
plugin's HTTP API) every queue and exchange of the vhost is listed and filtered by prefix
(``kind_of``), the connections named ``brokersched (<prefix>)`` tell that an instance runs, and
``doctor`` reads each node's open files by the rule of its version (``_files``), partitions and
the policies that would apply to claim queues, and names the open-files limit the application's
jobs need on that version.

A new kind of object of the backend goes into ``known_names`` and ``kind_of``, nowhere else.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ... import _redact
from ..._durations import format_duration
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from ...abc import Finding, Inventory, Slot, StoredObject
from .._budget import SHED, WARN
from .._ops import recent_claims, server_finding, slot_memory_finding
from ._files import (
    CONNECTION_COLUMNS,
    QUEUE_COLUMNS,
    counts_connections,
    files_needed,
    limit_needed,
    major_version,
    node_files,
    node_version,
    quorum_budget,
)
from ._fleet import State, live_instances, newest
from ._slotmemory import take_lock

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel

#: A channel of its own for one operation (a 404 closes the channel it happens on).
Channels = Callable[[], AbstractAsyncContextManager["AbstractChannel"]]

__all__ = [
    "MIN_VERSION",
    "Channels",
    "Management",
    "Names",
    "claim_policy_findings",
    "doctor",
    "fd_finding",
    "inventory",
    "kind_of",
    "known_names",
    "left",
    "limit_finding",
    "purge",
    "quorum_budget",
    "read_memory",
    "read_presence",
]

_BACKEND = "RabbitMQBackend"
MIN_VERSION = (3, 9)
_HTTP_TIMEOUT_S = 10.0
_LOCK_WAIT_S = 5.0  # for the slot memory record's lock, held by an instance only briefly
# Policy keys that change what a claim queue remembers or refuses: each can run a slot twice
# (the claim forgotten early, or a second claim accepted) or lose every claim.
_CLAIM_POLICY_KEYS = {
    "message-ttl": "the claim message expires before the slot memory ends: a later claim wins",
    "expires": "the claim queue expires at another time than the slot memory",
    "max-length": "the queue accepts another number of claims than one: a second claim can win",
    "max-length-bytes": "a byte limit drops or refuses claims",
    "overflow": "the queue drops the claim instead of refusing a second one: a second claim wins",
    "dead-letter-exchange": "claims dropped from the queue are moved elsewhere",
    "dead-letter-routing-key": "claims dropped from the queue are moved elsewhere",
    "queue-mode": "the claim queue is stored another way",
}


@dataclass(frozen=True, slots=True)
class Names:
    """How the backend names its objects (``_names``'s ``*_name`` functions)."""

    record: Callable[[str], str]
    lock: Callable[[str], str]
    fence: Callable[[str, int], str]
    history: Callable[[str, str], str]  # a job's quorum queue, before the history stream
    stream: Callable[[str], str]  # the prefix's history stream
    claim: Callable[[str, Slot], str]
    fleet: Callable[[str], str]  # the fleet's records (presence, controls)
    fleet_lock: Callable[[str], str]


def known_names(
    names: Names,
    prefix: str,
    *,
    jobs: Sequence[str],
    slots: Sequence[Slot],
    memories_ms: Sequence[int],
) -> list[StoredObject]:
    """Every object of ``prefix`` that can be named without listing the broker's."""
    found = [
        StoredObject("queue", names.record(prefix)),
        StoredObject("queue", names.lock(prefix)),
        StoredObject("queue", names.stream(prefix)),
        StoredObject("queue", names.fleet(prefix)),
        StoredObject("queue", names.fleet_lock(prefix)),
    ]
    found += [StoredObject("exchange", names.fence(prefix, ms)) for ms in sorted(set(memories_ms))]
    found += [StoredObject("queue", names.history(prefix, job)) for job in jobs]
    found += [StoredObject("queue", names.claim(prefix, slot)) for slot in slots]
    return list(dict.fromkeys(found))


def kind_of(names: Names, prefix: str, name: str, kind: str) -> bool:
    """Whether a listed queue or exchange ``name`` is one the backend makes for ``prefix`` (a
    prefix holds no ``.``, so ``<prefix>.`` never starts another prefix's names)."""
    if kind == "queue":
        mine = (
            names.record(prefix),
            names.lock(prefix),
            names.stream(prefix),
            names.fleet(prefix),
            names.fleet_lock(prefix),
        )
        return name in mine or name.startswith((f"{prefix}.claim.", f"{prefix}.history."))
    fence = re.fullmatch(re.escape(f"{prefix}.slot-memory.") + r"(\d+)ms", name)
    return kind == "exchange" and fence is not None and names.fence(prefix, int(fence[1])) == name


# -- the management API ---------------------------------------------------------------------


class Management:
    """The management plugin's HTTP API (``http://user:password@host:15672/``), read with the
    standard library in a thread. The password is never shown."""

    def __init__(self, url: str, vhost: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"management_url {_redact.redact_url(url)!r} of {_BACKEND} must be an http:// or "
                "https:// URL of the management plugin (http://user:password@host:15672/)",
                option="management_url",
                backend=_BACKEND,
            )
        self.shown = _redact.redact_url(url)
        self._secrets = _redact.url_secrets(url)
        user = urllib.parse.unquote(parts.username or "guest")
        password = urllib.parse.unquote(parts.password or "guest")
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        self._base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self._headers = {"Authorization": f"Basic {token}", "Accept": "application/json"}
        self.vhost = urllib.parse.quote(vhost, safe="")

    async def get(self, path: str) -> Any:
        """The JSON answer of ``GET /api/<path>``; ``BackendError`` when there is none."""
        return await asyncio.to_thread(self._get, path)

    def _get(self, path: str) -> Any:
        request = urllib.request.Request(f"{self._base}/api/{path}", headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise BackendError(
                f"{_BACKEND}: the management API at {self.shown} answered {exc.code} to "
                f"/api/{path} (is the user's tag 'monitoring' or 'administrator'?)"
            ) from None
        except (OSError, ValueError) as exc:
            detail = _redact.scrub(str(exc), self._secrets)
            raise BackendUnavailableError(
                f"{_BACKEND}: no answer from the management API at {self.shown} ({detail}): is "
                "the rabbitmq_management plugin enabled (rabbitmq-plugins enable "
                "rabbitmq_management)?"
            ) from None

    async def connections(self, prefix: str) -> int:
        """How many connections are named ``brokersched (<prefix>)`` (the backend's default
        ``connection_name``). The API lists a connection once the node has emitted its
        statistics (``collect_statistics_interval``, 5 s by default): one opened just before
        is not seen yet."""
        found = await self.get(f"vhosts/{self.vhost}/connections?columns=client_properties")
        wanted = f"brokersched ({prefix})"
        return sum(
            (row.get("client_properties") or {}).get("connection_name") == wanted for row in found
        )


# -- inventory and purge --------------------------------------------------------------------


async def _exists(channels: Channels, item: StoredObject) -> bool:
    """A passive declare, on a channel of its own."""
    from aio_pika.exceptions import ChannelNotFoundEntity

    async with channels() as channel:
        try:
            if item.kind == "exchange":
                await channel.declare_exchange(item.name, passive=True)
            else:
                await channel.declare_queue(item.name, passive=True)
        except ChannelNotFoundEntity:
            return False
        return True


async def read_memory(
    channels: Channels, names: Names, prefix: str, parse: Callable[[bytes], int]
) -> int | None:
    """The memory of the fleet's slot memory record, read under the lock instances take in
    turn (an instance that found the record taken would make it again) and put back; ``None``:
    no record, or the lock not free within a few seconds."""
    from aio_pika.exceptions import ChannelNotFoundEntity

    loop = asyncio.get_running_loop()
    deadline = loop.time() + _LOCK_WAIT_S
    while loop.time() < deadline:
        async with channels() as channel:
            try:
                lock = await channel.declare_queue(names.lock(prefix), passive=True)
            except ChannelNotFoundEntity:  # no instance ever made a record
                return None
            if await take_lock(lock):
                return await _read_locked(channel, names.record(prefix), parse)
        await asyncio.sleep(0.05)
    return None


async def read_presence(channels: Channels, names: Names, prefix: str, now_ms: int) -> list[str]:
    """The instance records of the fleet's record queue not yet expired at ``now_ms``, read
    under its lock and put back (none when no instance ever wrote one). Raises
    ``BackendError`` when the lock is not free within a few seconds."""
    return live_instances(await read_fleet_state(channels, names, prefix), now_ms)


async def read_controls(channels: Channels, names: Names, prefix: str) -> list[str]:
    """The control records of the fleet's record queue, read as ``read_presence`` reads."""
    return list((await read_fleet_state(channels, names, prefix))["control"].values())


async def read_fleet_state(channels: Channels, names: Names, prefix: str) -> State:
    """The newest state of the fleet's record queue, read under its lock and put back (empty
    when no instance ever wrote one), declaring nothing. Raises ``BackendError`` when the
    lock is not free within a few seconds."""
    from aio_pika.exceptions import ChannelNotFoundEntity

    loop = asyncio.get_running_loop()
    deadline = loop.time() + _LOCK_WAIT_S
    while loop.time() < deadline:
        missing = False
        async with channels() as channel:
            try:
                lock = await channel.declare_queue(names.fleet_lock(prefix), passive=True)
            except ChannelNotFoundEntity:  # no instance ever wrote a record under it
                missing = True  # (and the answer closed the channel)
            else:
                if await take_lock(lock):
                    return await _read_state_locked(channel, names.fleet(prefix))
        if missing:
            async with channels() as channel:
                return await _read_state_locked(channel, names.fleet(prefix))
        await asyncio.sleep(0.05)
    raise BackendError(
        f"{_BACKEND}: the lock of the fleet's records ({names.fleet_lock(prefix)}) stayed "
        f"taken for {_LOCK_WAIT_S:g}s"
    )


async def _read_state_locked(channel: AbstractChannel, queue: str) -> State:
    """On the channel holding the lock (when there is one): every state message, the newest
    read, all put back."""
    from aio_pika.exceptions import ChannelNotFoundEntity

    try:
        records = await channel.declare_queue(queue, passive=True)
    except ChannelNotFoundEntity:
        return newest([])
    held = []
    try:
        for _ in range(records.declaration_result.message_count or 0):
            message = await records.get(no_ack=False, fail=False, timeout=5)
            if message is not None:
                held.append(message)
        return newest(held)
    finally:
        for message in held:
            await message.reject(requeue=True)


async def _read_locked(
    channel: AbstractChannel, queue: str, parse: Callable[[bytes], int]
) -> int | None:
    """The record's memory, on the channel that holds the lock (closing it releases the lock,
    after the record is back in its queue)."""
    from aio_pika.exceptions import ChannelNotFoundEntity

    try:
        records = await channel.declare_queue(queue, passive=True)
    except ChannelNotFoundEntity:
        return None
    message = await records.get(no_ack=False, fail=False, timeout=5)
    if message is None:
        return None
    try:
        return parse(message.body)
    except ValueError:
        return None
    finally:
        await message.reject(requeue=True)


async def inventory(
    channels: Channels,
    names: Names,
    prefix: str,
    *,
    jobs: Sequence[str],
    slots: Sequence[Slot],
    memories_ms: Sequence[int],
    parse: Callable[[bytes], int],
    management: Management | None,
    now_ms: int,
) -> Inventory:
    memories = list(memories_ms)
    record = await read_memory(channels, names, prefix, parse)
    if record is not None:
        memories.append(record)
    unknown: list[str] = []
    live: list[str] = []
    if management is not None:
        objects = await _listed(management, names, prefix)
        if count := await management.connections(prefix):
            live.append(f"{count} connection(s) named 'brokersched ({prefix})' (management API)")
    else:
        candidates = known_names(names, prefix, jobs=jobs, slots=slots, memories_ms=memories)
        objects = [item for item in candidates if await _exists(channels, item)]
        unknown += [
            "AMQP cannot list queues: without management_url only the objects named from the "
            "application were checked (its jobs' history queues, the claim queues of its recent "
            "slots, the slot memory record, its lock and the fence exchanges of the memories "
            "known); queues of jobs no longer in the application, or of older slots, were not",
            "claim queues not found expire on their own (x-expires: the slot memory)",
            "connections of running instances cannot be seen over AMQP",
        ]
        if record is None:
            unknown.append(f"no slot memory record read from {names.record(prefix)}")
    claimed = [_claim_slot(prefix, item.name) for item in objects if item.kind == "queue"]
    live += recent_claims([ms for ms in claimed if ms is not None], now_ms, "claim queues")
    return Inventory(_BACKEND, prefix, tuple(objects), tuple(unknown), tuple(live))


def _claim_slot(prefix: str, name: str) -> int | None:
    """The slot (ms) of a claim queue: its last segment."""
    head, _, slot = name.rpartition(".")
    if not head.startswith(f"{prefix}.claim.") or not slot.isdigit():
        return None
    return int(slot)


async def _listed(management: Management, names: Names, prefix: str) -> list[StoredObject]:
    columns = "?columns=name"
    queues = await management.get(f"queues/{management.vhost}{columns}")
    exchanges = await management.get(f"exchanges/{management.vhost}{columns}")
    found = [StoredObject("queue", row["name"]) for row in queues]
    found += [StoredObject("exchange", row["name"]) for row in exchanges]
    return sorted(
        (item for item in found if kind_of(names, prefix, item.name, item.kind)),
        key=lambda item: (item.kind, item.name),
    )


async def purge(channels: Channels, found: Inventory, names: Names) -> None:
    for item in found.objects:
        if not kind_of(names, found.namespace, item.name, item.kind):
            continue
        async with channels() as channel:
            if item.kind == "exchange":
                await channel.exchange_delete(item.name)
            else:
                await channel.queue_delete(item.name)


async def left(
    channels: Channels, found: Inventory, names: Names, management: Management | None
) -> Inventory:
    """What is left of ``found`` after a purge: listed again with the management API, else each
    object looked at again."""
    if management is not None:
        objects = await _listed(management, names, found.namespace)
    else:
        objects = [item for item in found.objects if await _exists(channels, item)]
    return Inventory(_BACKEND, found.namespace, tuple(objects))


# -- doctor ---------------------------------------------------------------------------------


async def doctor(
    channels: Channels,
    properties: dict[str, Any],
    names: Names,
    prefix: str,
    *,
    slot_ttl: timedelta,
    parse: Callable[[bytes], int],
    management: Management | None,
    slots: Sequence[Slot] = (),
    instances: int = 1,
) -> list[Finding]:
    """``slots``: the application's claimed slots of one slot memory (the open-files limit its
    jobs need is named from them); ``instances``: how many instances run it (a connection
    each)."""
    version = _text(properties.get("version"))
    findings = [
        server_finding(_text(properties.get("product")) or "RabbitMQ", version, MIN_VERSION)
    ]
    if cluster := _text(properties.get("cluster_name")):
        findings[-1] = Finding(
            findings[-1].severity,
            findings[-1].check,
            f"{findings[-1].found}, cluster {cluster}",
            findings[-1].consequence,
            findings[-1].fix,
        )
    memory = await read_memory(channels, names, prefix, parse)
    findings.append(slot_memory_finding(_BACKEND, names.record(prefix), memory, slot_ttl))
    if management is None:
        findings.append(
            Finding(
                "warning",
                "management API",
                "no management_url: the file-descriptor budget, partitions and policies "
                "matching claim queues were not checked (AMQP does not tell them)",
                "a policy on claim queues can run a slot twice, and a node out of open files "
                "(3.x: too many quorum queues; 4.x: too many live claim queues) stops serving "
                "its clients, unseen here",
                "pass management_url='http://user:password@host:15672/' to RabbitMQBackend "
                "(rabbitmq-plugins enable rabbitmq_management)",
            )
        )
        if slots:
            findings.append(limit_finding(version, slots, slot_ttl, connections=instances))
        return findings
    nodes = await management.get("nodes")
    queues = await management.get(f"queues?columns={QUEUE_COLUMNS}")
    connections = (
        await management.get(f"connections?columns={CONNECTION_COLUMNS}")
        if counts_connections(nodes)
        else []
    )
    findings += _node_findings(nodes, queues, connections)
    listed = await _listed(management, names, prefix)
    findings.append(_footprint_finding(listed, prefix))
    claims = [item for item in listed if item.kind == "queue" and ".claim." in item.name]
    if slots or claims:
        findings.append(
            limit_finding(
                version,
                slots,
                slot_ttl,
                connections=max(len(connections), instances),
                nodes=nodes,
                queues=queues,
                live_claims={item.name for item in claims},
            )
        )
    policies = await management.get(f"policies/{management.vhost}")
    operator = await management.get(f"operator-policies/{management.vhost}")
    findings += claim_policy_findings(names.claim(prefix, Slot("x", 0)), policies, operator)
    return findings


def _footprint_finding(objects: list[StoredObject], prefix: str) -> Finding:
    """What the prefix holds on the broker now (the file-descriptor check weighs it)."""
    claims = sum(".claim." in item.name for item in objects if item.kind == "queue")
    history = sum(".history." in item.name for item in objects if item.kind == "queue")
    return Finding(
        "ok",
        "footprint",
        f"prefix {prefix!r}: {claims} claim queue(s), {history} history queue(s), "
        f"{len(objects)} object(s) in all",
    )


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else None


def _node_findings(
    nodes: list[dict[str, Any]], queues: list[dict[str, Any]], connections: list[dict[str, Any]]
) -> list[Finding]:
    findings = [fd_finding(node, queues, connections) for node in nodes]
    partitions = sorted({peer for node in nodes for peer in node.get("partitions") or ()})
    if partitions:
        findings.append(
            Finding(
                "error",
                "partitions",
                f"the cluster is partitioned from {', '.join(partitions)}",
                "both sides may accept claims of one slot: it can run twice",
                "heal the partition; run cluster_partition_handling = pause_minority",
            )
        )
    elif len(nodes) > 1:
        findings.append(
            Finding(
                "warning",
                "cluster_partition_handling",
                f"a cluster of {len(nodes)} nodes; its cluster_partition_handling is not "
                "readable over HTTP",
                "with ignore (the default) or autoheal, both sides of a partition may accept "
                "claims of one slot, or a heal drop them: a slot can run twice",
                "set cluster_partition_handling = pause_minority in rabbitmq.conf (check: "
                "rabbitmqctl environment | grep partition)",
            )
        )
    for node in nodes:
        alarms = [name for name in ("mem_alarm", "disk_free_alarm") if node.get(name)]
        if alarms:
            findings.append(
                Finding(
                    "error",
                    "alarms",
                    f"node {node.get('name')}: {', '.join(alarms)}",
                    "publishers are blocked: claims time out (slots skipped) and connections hang",
                    "free memory or disk on the node, or raise its watermarks",
                )
            )
    return findings


def fd_finding(
    node: dict[str, Any],
    queues: Sequence[dict[str, Any]],
    connections: Sequence[dict[str, Any]] = (),
) -> Finding:
    """The node's open-files limit against what its version spends files on (``_files``)."""
    files = node_files(node, queues, connections)
    check = "file descriptors"
    if files.total is None or files.share is None:
        return Finding("warning", check, files.detail)
    major = major_version(files.version)
    found = f"{files.detail}; {files.share:.0%} of what it holds"
    if major is not None and major >= 4:
        consequence = (
            "once its open files are spent (emfile) a RabbitMQ 4.x node nacks publishes, its "
            "queues crash and it closes connections (541 INTERNAL_ERROR); each live claim queue "
            "holds a file there"
        )
    else:
        consequence = (
            "past (limit - 97) / 3 quorum queues a 3.x node stops answering AMQP handshakes and "
            "rabbitmqctl, for every client of the broker, and does not recover by itself"
        )
    fix = (
        "raise the node's open-files limit (LimitNOFILE=65536, or ulimit -n before "
        "rabbitmq-server; the 'open-files limit needed' check names what this application "
        "needs), and delete the queues of retired prefixes (brokersched purge)"
    )
    if files.share >= SHED:
        return Finding("error", check, found, consequence, fix)
    if files.share >= WARN or files.total < 4096:
        return Finding("warning", check, found, consequence, fix)
    return Finding("ok", check, found)


def limit_finding(
    version: str | None,
    slots: Sequence[Slot],
    slot_ttl: timedelta,
    *,
    connections: int,
    nodes: Sequence[dict[str, Any]] = (),
    queues: Sequence[dict[str, Any]] = (),
    live_claims: Collection[str] = (),
) -> Finding:
    """The open-files limit a node needs for the application: its jobs' claim queues live at
    once (``slots``: its claimed slots of one slot memory, and one declared ahead per job;
    without them, the prefix's claim queues listed now, ``live_claims``), its ``connections``,
    and, with the management API's ``nodes`` and ``queues``, what the broker holds besides;
    against each node's limit when known. ``version``: the handshake's, when no node tells
    its own."""
    jobs = len({slot.job for slot in slots})
    claim_queues = len(slots) + jobs if slots else len(live_claims)
    quorum = sum(row.get("type") == "quorum" for row in queues)
    streams = max(1, sum(row.get("type") == "stream" for row in queues))
    others = sum(
        row.get("type") == "classic"
        and row.get("name") not in live_claims
        and (row.get("messages_persistent") or 0) > 0
        for row in queues
    )
    versions = [node_version(node) for node in nodes] or [version]
    major = major_version(max(versions, key=lambda found: major_version(found) or 0) or version)
    need = files_needed(
        major,
        claim_queues=claim_queues,
        connections=connections,
        quorum=quorum,
        others=others,
        streams=streams,
    )
    shown = f"RabbitMQ {version}" if major is not None else "a RabbitMQ node of unknown version"
    source = (
        f"{jobs} claimed job(s) keep up to {claim_queues} claim queues alive (their slots of one "
        f"slot_ttl, {format_duration(slot_ttl)}, and one declared ahead each)"
        if slots
        else f"the prefix's {claim_queues} claim queues now"
    )
    recommended = limit_needed(need.files, WARN)
    found = (
        f"{source}; {shown} holds about {need.files} open files for this broker ({need}): "
        f"an open-files limit of at least {limit_needed(need.files, SHED)} is needed, "
        f"{recommended} recommended (the budget watch warns from {WARN:.0%} of it, sheds from "
        f"{SHED:.0%})"
    )
    if major is not None and major < 4:
        found += "; on 3.x claim queues hold no file the node cannot close"
    limits = [node["fd_total"] for node in nodes if isinstance(node.get("fd_total"), int)]
    check = "open-files limit needed"
    if not limits:
        return Finding(
            "ok" if nodes else "warning",
            check,
            found,
            "" if nodes else "the node's open-files limit is not known without management_url",
            "" if nodes else "check it (cat /proc/<beam.smp pid>/limits) against the figure above",
        )
    lowest = min(limits)
    fix = (
        f"raise the open-files limit of every node to {recommended} or more (LimitNOFILE in "
        "the rabbitmq-server unit), or lower slot_ttl to just above the largest jitter + "
        "max_late (fewer claim queues live at once)"
    )
    consequence = (
        f"below it the budget watch sheds (slots skipped) and the node runs out of files; the "
        f"lowest limit of the cluster is {lowest}"
    )
    if need.files >= SHED * lowest:
        return Finding("error", check, found, consequence, fix)
    if need.files >= WARN * lowest:
        return Finding("warning", check, found, consequence, fix)
    return Finding("ok", check, f"{found}; the lowest limit of the cluster is {lowest}")


def claim_policy_findings(sample: str, *policy_lists: list[dict[str, Any]]) -> list[Finding]:
    """An error for each policy (or operator policy) whose pattern matches the claim queue
    name ``sample`` and that sets a key changing what a claim queue remembers."""
    findings: list[Finding] = []
    for policies in policy_lists:
        for policy in policies:
            if policy.get("apply-to") not in ("queues", "all", "classic_queues", None):
                continue
            try:
                matches = re.search(str(policy.get("pattern", "")), sample) is not None
            except re.error:
                matches = False
            keys = sorted(set(policy.get("definition") or {}) & set(_CLAIM_POLICY_KEYS))
            if not matches or not keys:
                continue
            name, vhost = policy.get("name"), policy.get("vhost", "/")
            findings.append(
                Finding(
                    "error",
                    "policies",
                    f"policy {name!r} (pattern {policy.get('pattern')!r}) sets "
                    f"{', '.join(keys)} on the claim queues",
                    "; ".join(_CLAIM_POLICY_KEYS[key] for key in keys),
                    f"narrow its pattern so that it does not match '{sample.rsplit('.', 3)[0]}.*', "
                    f"or remove it (rabbitmqctl clear_policy -p {vhost} {name})",
                )
            )
    if not findings:
        findings.append(Finding("ok", "policies", "no policy changes the claim queues"))
    return findings

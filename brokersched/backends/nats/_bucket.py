"""The key-value bucket of ``NATSLeaseBackend`` (``_leases``): the rows' table over nats-py's KV
API with the server's clock read from a probe (``KVTable``), the bucket's name
(``check_bucket``, ``kv_stream``) and the check of an existing bucket (``bucket_problems``); the
backend talks to it through ``_connection.OwnBucket``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC
from typing import TYPE_CHECKING, Any

from ..._clock import datetime_to_ms
from ..._exceptions import BackendError
from .._options import name_check
from ._errors import Translated
from ._rows import Conflict, Table
from ._stream_settings import limit_value, setting_text

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = [
    "BACKEND",
    "MSG_TTL",
    "OPERATION_TIMEOUT_S",
    "SERIAL_CAS",
    "KVTable",
    "bucket_problems",
    "check_bucket",
    "kv_stream",
]

BACKEND = "NATSLeaseBackend"
check_bucket = name_check(
    "bucket",
    r"[A-Za-z0-9_-]{1,64}",
    "1-64 letters, digits, '_' or '-' (it names the KV bucket and the history stream)",
)
_CLOCK_KEY = "clock"
OPERATION_TIMEOUT_S = 10.0  # take-over, record, history: not time-critical, but bounded
MSG_TTL = (2, 11)  # the first nats-server with per-message TTLs
SERIAL_CAS = (2, 11)  # the first whose clustered streams serialize compare-and-sets
_PROBE_TIMEOUT_S = 2.0  # a probe lost with a dying leader gives way to a new one soon


class KVTable(Table):
    """The bucket through nats-py's KV API; the clock from the probe's stored timestamp."""

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        *,
        bucket: str,
        translated: Callable[..., Translated],
        store_time: Callable[[], int | None],
    ) -> None:
        """``translated``: the backend's error translation; ``store_time``: its override of
        the server's clock, for tests (``None``: the server's)."""
        self._js, self._kv = js, kv
        self._translated, self._store_time = translated, store_time
        self._stream = kv_stream(bucket)
        self._clock_subject = f"$KV.{bucket}.{_CLOCK_KEY}"
        self._probe: asyncio.Future[int] | None = None

    async def read(self, key: str, timeout: float) -> tuple[bytes | None, int]:
        import nats.js.errors

        with self._translated("reading", key):
            try:
                async with asyncio.timeout(timeout):
                    entry = await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None, 0
        return entry.value, entry.revision or 0

    async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
        import nats.js.errors

        with self._translated("writing", key):
            try:
                async with asyncio.timeout(timeout):
                    if last:
                        await self._kv.update(key, value, last=last)
                    else:
                        await self._kv.create(key, value)
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                raise Conflict(key) from exc

    async def read_at(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
        """The row and the server's clock, read together."""
        (value, revision), now = await asyncio.gather(self.read(key, timeout), self.now_ms(timeout))
        return value, revision, now

    async def now_ms(self, timeout: float) -> int:
        """The server's clock: a probe written and read back (decisions that start while one
        is in flight share it: a reading taken a round trip earlier only makes leases look
        live a little longer)."""
        store_time = self._store_time()
        if store_time is not None:
            return store_time
        probe = self._probe
        if probe is None or probe.done():
            probe = self._probe = asyncio.ensure_future(self._read_clock())
            # Retrieved even when every caller gave up waiting (its error is theirs to see).
            probe.add_done_callback(lambda done: done.cancelled() or done.exception())
        async with asyncio.timeout(timeout):
            return await asyncio.shield(probe)

    async def _read_clock(self) -> int:
        with self._translated("reading the server's clock"):
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                await self._js.publish(self._clock_subject, b"")
                msg = await self._js.get_last_msg(self._stream, self._clock_subject)
        if msg.time is None:
            raise BackendError(f"{BACKEND}: the server stored the clock probe without a time")
        stamp = msg.time if msg.time.tzinfo is not None else msg.time.replace(tzinfo=UTC)
        return datetime_to_ms(stamp)


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def bucket_problems(config: Any, max_payload: int | None = None) -> list[str]:
    """What breaks the rows in an existing bucket: they must stay (file storage, no TTL, no
    limit that drops them), every write must be taken (no limit that refuses one), and rows
    must be read from the leader. ``max_payload``: the connected server's, the largest message
    it takes anyway (a ``max_msg_size`` at least that large limits nothing more).

    What the backend writes to the bucket: a row per job (``job.<job>``: its fences and a lease
    per slot running or handed over, so with no fixed size: ``overlap="allow"`` and manual runs
    add leases) and the clock probe (``clock``), written by every decision; each key's last
    revision is all it reads. So a count or size limit of the stream either drops rows (discard
    'old': their fences with them, and a late instance runs a slot again) or refuses writes
    once reached (discard 'new': every claim fails and every slot is skipped, with no other
    sign); a value size limit refuses the rows that outgrow it; a per-key history must be kept
    (1 is enough), but not unlimited, nor refuse a key's next revision.
    """
    stream = config.name
    problems: list[str] = []
    if str(getattr(config.storage, "value", config.storage)) != "file":
        problems.append(
            f"storage is {config.storage!r}, not 'file' (a server restart would forget every "
            f"fence, and a late instance run a slot again): `nats kv rm` the bucket while no "
            "scheduler runs, or use another bucket"
        )
    if (config.max_age or 0) > 0:
        problems.append(
            f"its TTL is {config.max_age:g}s (rows would expire with their fences, and a late "
            f"instance run a slot again): run `nats stream edit {stream} --max-age=0`"
        )
    if config.allow_direct:
        problems.append(
            "allow_direct is true (rows read from a lagging replica could abort healthy runs): "
            f"run `nats stream edit {stream} --no-allow-direct`"
        )
    discard = setting_text(config.discard)
    for setting, flag in (("max_bytes", "--max-bytes"), ("max_msgs", "--max-msgs")):
        value = limit_value(getattr(config, setting))
        if not value:
            continue
        if discard == "new":
            why = (
                "with discard 'new' the bucket refuses every write once full: every claim fails "
                "and every slot is skipped"
            )
        else:
            why = (
                f"with discard {discard!r} it drops the oldest rows once full, their fences "
                "with them, and a late instance runs a slot again"
            )
        problems.append(
            f"{setting} is {value} ({why}; only unlimited, -1, is accepted): run `nats stream "
            f"edit {stream} {flag}=-1`"
        )
    size = limit_value(config.max_msg_size)
    if size and (max_payload is None or size < max_payload):
        server = f"the server's max_payload {max_payload}" if max_payload else "max_payload"
        problems.append(
            f"max_msg_size is {size} bytes (the bucket's max_value_size: a row holds a lease "
            "per slot running or handed over and has no fixed size, and a row that outgrows "
            "it is refused, its job's slots skipped; accepted: -1, unlimited, or at least "
            f"{server}): run `nats stream edit {stream} --max-msg-size=-1`"
        )
    per_key = limit_value(config.max_msgs_per_subject)
    if not per_key:
        problems.append(
            "max_msgs_per_subject is unlimited (the bucket's history: every decision writes "
            "the clock probe again, and each revision would be kept: the bucket grows for ever; "
            f"accepted: a limit, 1 is enough): run `nats stream edit {stream} "
            "--max-msgs-per-subject=1`"
        )
    elif config.discard_new_per_subject:
        problems.append(
            "discard_new_per_subject is true (with max_msgs_per_subject, the bucket's "
            f"history, at {per_key}, a key holding that many revisions refuses the next: its "
            "row can no longer change and its slots are skipped; accepted: false): run `nats "
            f"stream edit {stream} --no-discard-per-subject`"
        )
    if config.sealed:
        problems.append(
            "sealed is true (it takes no more writes: every claim fails and every slot is "
            "skipped): use another bucket"
        )
    return problems

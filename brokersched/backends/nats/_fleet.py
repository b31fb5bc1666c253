"""The fleet's records of ``NATSBackend`` (issue 25): two JetStream key-value buckets per
prefix, made on first use, one value kept per key (``history=1``):

* ``<prefix>-fleet-instance``: presence, with the bucket's TTL (``FORGET``, on the server's
  clock: nats-server 2.9 has no per-key TTL), so a dead instance's record goes by itself;
* ``<prefix>-fleet-control``: the jobs' controls, kept for ever, changed by compare-and-set on
  the key's last revision.

Keys are base64url (instance ids and job names hold characters a KV key may not).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..._fleetrecords import FORGET
from ...abc import FleetKind
from ._base import Translated

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["FleetBuckets", "bucket_name", "bucket_streams"]

_READ_S = 5.0  # a read waits this long at most for the bucket's values
_FETCH_S = 1.0
_CONSUMER_IDLE_S = 30.0  # server-side clean-up of a reader that died mid-read


def bucket_name(prefix: str, kind: FleetKind) -> str:
    return f"{prefix}-fleet-{kind}"


def bucket_streams(prefix: str) -> tuple[str, ...]:
    """The streams behind the buckets (``KV_<bucket>``), for ``inventory()`` and ``purge()``."""
    return tuple(f"KV_{bucket_name(prefix, kind)}" for kind in ("instance", "control"))


def _key(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def _text(key: str) -> str:
    return base64.urlsafe_b64decode(key.encode()).decode()


class FleetBuckets:
    """The two buckets of one started backend (opened, or made, on first use)."""

    def __init__(
        self,
        prefix: str,
        replicas: int,
        secrets: list[str],
        client: Callable[[], JetStreamContext],
    ) -> None:
        self._prefix = prefix
        self._replicas = replicas
        self._secrets = secrets
        self._client = client
        self._buckets: dict[str, KeyValue] = {}
        self._opening = asyncio.Lock()

    async def _bucket(self, kind: FleetKind) -> KeyValue:
        found = self._buckets.get(kind)
        if found is not None:
            return found
        import nats.js.errors

        async with self._opening:
            js, name = self._client(), bucket_name(self._prefix, kind)
            try:
                bucket = await js.key_value(name)
            except nats.js.errors.BucketNotFoundError:
                ttl = FORGET.total_seconds() if kind == "instance" else None
                bucket = await js.create_key_value(  # pyright: ignore[reportUnknownMemberType]
                    bucket=name,
                    history=1,
                    ttl=ttl,
                    replicas=self._replicas,
                    description=f"brokersched {self._prefix}: the fleet's {kind} records",
                )
            self._buckets[kind] = bucket
            return bucket

    async def read(self, kind: FleetKind) -> dict[str, str]:
        """Every key's last value: an ephemeral consumer delivers the last message of each
        subject, fetched until none is pending (as the history is read)."""
        with Translated(f"reading the fleet's {kind}s", secrets=self._secrets):
            await self._bucket(kind)
            async with asyncio.timeout(_READ_S):
                return await self._read(kind)

    async def _read(self, kind: FleetKind) -> dict[str, str]:
        import nats.errors
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        js, name = self._client(), bucket_name(self._prefix, kind)
        stream, subjects = f"KV_{name}", f"$KV.{name}."
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            filter_subject=f"{subjects}>",
            mem_storage=True,
            inactive_threshold=_CONSUMER_IDLE_S,
        )
        info = await js.add_consumer(stream, config)  # pyright: ignore[reportUnknownMemberType]
        assert info.name is not None
        found: dict[str, str] = {}
        pending = info.num_pending or 0
        sub = await js.pull_subscribe_bind(info.name, stream=stream)
        try:
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(pending, 256), timeout=_FETCH_S)
                except nats.errors.TimeoutError:  # purged while we read: nothing more
                    break
                for msg in msgs:
                    key = _text(msg.subject[len(subjects) :])
                    if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                        found.pop(key, None)
                    elif msg.data:
                        found[key] = msg.data.decode()
                pending = msgs[-1].metadata.num_pending if msgs else 0
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await asyncio.shield(js.delete_consumer(stream, info.name))
        return found

    async def put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        # ttl: the bucket's own (FORGET): nats-server 2.9 keeps no TTL per key.
        with Translated(f"writing its {kind} record", secrets=self._secrets):
            bucket = await self._bucket(kind)
            await bucket.put(_key(key), value.encode())

    async def swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        import nats.js.errors

        with Translated(f"changing the {kind} record of {key}", secrets=self._secrets):
            bucket = await self._bucket(kind)
            revision = 0
            if old is not None:
                entry: Any = await _entry(bucket, _key(key))
                if entry is None or (entry.value or b"").decode() != old:
                    return False
                revision = entry.revision
            try:
                await bucket.update(_key(key), new.encode(), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return False
            return True


async def _entry(bucket: KeyValue, key: str) -> Any:
    import nats.js.errors

    try:
        return await bucket.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None

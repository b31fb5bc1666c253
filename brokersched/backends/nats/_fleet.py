"""The fleet's records of ``NATSBackend``: JetStream key-value buckets per
prefix, made on first use, one value kept per key (``history=1``):

* ``<prefix>-fleet-instance``: presence, with the bucket's TTL (``FORGET``, on the server's
  clock: nats-server 2.9 has no per-key TTL), so a dead instance's record goes by itself;
* ``<prefix>-fleet-control``: the jobs' controls, kept for ever, changed by compare-and-set on
  the key's last revision;
* ``<prefix>-fleet-missed``: which instance reported a slot missed, with the bucket's TTL
  (``MISSED_KEPT``), made by the first report.

Keys are base64url (instance ids and job names hold characters a KV key may not).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, get_args

from ..._fleetrecords import FORGET, MISSED_KEPT
from ...abc import FleetKind
from ._errors import Translated

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["FleetBuckets", "bucket_name", "bucket_streams", "presence", "read_records"]

_READ_S = 5.0  # a read waits this long at most for the bucket's values
# nats-server 2.9 keeps no TTL per key: a bucket's own, for the kinds whose records go by
# themselves (controls are kept for ever)
_BUCKET_TTL = {"instance": FORGET.total_seconds(), "missed": MISSED_KEPT.total_seconds()}


def bucket_name(prefix: str, kind: FleetKind) -> str:
    return f"{prefix}-fleet-{kind}"


def bucket_streams(prefix: str) -> tuple[str, ...]:
    """The streams behind the buckets (``KV_<bucket>``), for ``inventory()`` and ``purge()``."""
    return tuple(f"KV_{bucket_name(prefix, kind)}" for kind in get_args(FleetKind))


def _key(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def _text(key: str) -> str:
    return base64.urlsafe_b64decode(key.encode()).decode()


class FleetBuckets:
    """The buckets of one started backend (opened, or made, on first use)."""

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
                ttl = _BUCKET_TTL.get(kind)
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
        """Every key's last value: the stream's subjects (its info, filtered), then each one's
        last message, all from the stream's leader, with no consumer to create (a consumer is
        a Raft proposal to the metadata leader on a cluster, and this read runs before every
        slot instant's claims)."""
        with Translated(f"reading the fleet's {kind}s", secrets=self._secrets):
            await self._bucket(kind)
            async with asyncio.timeout(_READ_S):
                return await self._read(kind)

    async def _read(self, kind: FleetKind) -> dict[str, str]:
        return await read_records(self._client(), self._prefix, kind)

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


async def read_records(js: JetStreamContext, prefix: str, kind: FleetKind) -> dict[str, str]:
    """Every key's last value in the bucket of ``kind`` (``NotFoundError`` without it)."""
    name = bucket_name(prefix, kind)
    stream, subjects = f"KV_{name}", f"$KV.{name}."
    info = await js.stream_info(stream, subjects_filter=f"{subjects}>")
    names = sorted(info.state.subjects or {})
    found: dict[str, str] = {}
    for subject, msg in zip(
        names, await asyncio.gather(*(_last(js, stream, s) for s in names)), strict=True
    ):
        if msg is None or (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            continue  # gone since the info was read, or deleted
        if msg.data:
            found[_text(subject[len(subjects) :])] = msg.data.decode()
    return found


async def presence(js: JetStreamContext, prefix: str, kind: FleetKind = "instance") -> list[str]:
    """The records of the bucket of ``kind`` (instance, the presence, by default; its TTL
    drops the expired ones; none without the bucket): read only, nothing made."""
    import nats.js.errors

    try:
        records = await read_records(js, prefix, kind)
    except nats.js.errors.NotFoundError:
        return []
    return list(records.values())


async def _last(js: JetStreamContext, stream: str, subject: str) -> Any:
    """The last message of ``subject``, or ``None`` when it has none any more."""
    import nats.js.errors

    try:
        return await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None


async def _entry(bucket: KeyValue, key: str) -> Any:
    import nats.js.errors

    try:
        return await bucket.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None

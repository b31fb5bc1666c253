"""The fleet's records of ``SQLiteBackend`` (presence, controls): one fleet table, a row
per record, expiry judged on the host's clock (``_store_now_ms``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..._durations import to_ms
from ...abc import FleetKind
from ._connection import SQLiteCalls

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["SQLiteFleet"]


class SQLiteFleet(SQLiteCalls):
    """Reads and writes of the fleet table."""

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        params = {"kind": kind, "now": self._store_now_ms()}

        async def read(conn: aiosqlite.Connection) -> Iterable[Sequence[Any]]:
            return await conn.execute_fetchall(self._sql.fleet_read, params)

        return {key: value for key, value in await self._run(f"read the fleet's {kind}s", read)}

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        params = {"kind": kind, "key": key, "value": value, "ttl_ms": to_ms(ttl)}
        params["now"] = self._store_now_ms()

        async def put(conn: aiosqlite.Connection) -> None:
            await conn.execute(self._sql.fleet_expire, params)
            await conn.execute(self._sql.fleet_put, params)

        await self._run(f"write its {kind} record", put, transaction=True)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        params = {"kind": kind, "key": key, "old": old, "new": new}
        sql = self._sql.fleet_insert if old is None else self._sql.fleet_swap

        async def swap(conn: aiosqlite.Connection) -> bool:
            return bool(await conn.execute_fetchall(sql, params))

        return await self._run(f"change the {kind} record of {key}", swap, transaction=True)

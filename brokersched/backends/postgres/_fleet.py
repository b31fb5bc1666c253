"""The fleet's records of ``PostgresBackend`` (presence, controls): one ``fleet`` table,
a row per record, expiry judged on the database's clock."""

from __future__ import annotations

from datetime import timedelta

from ..._durations import to_ms
from ...abc import FleetKind
from ._connection import Connection, PostgresCalls, Row

__all__ = ["PostgresFleet"]


class PostgresFleet(PostgresCalls):
    """Reads and writes of the ``fleet`` table."""

    async def _fleet_read(self, kind: FleetKind) -> dict[str, str]:
        async def read(conn: Connection) -> list[Row]:
            return await conn.fetch(self._sql.fleet_read, kind)

        rows = await self._call(f"read the fleet's {kind}s", read)
        return {row["key"]: row["value"] for row in rows}

    async def _fleet_put(self, kind: FleetKind, key: str, value: str, *, ttl: timedelta) -> None:
        async def put(conn: Connection) -> None:
            await conn.execute(self._sql.fleet_put, kind, key, value, to_ms(ttl))

        await self._call(f"write its {kind} record", put)

    async def _fleet_swap(self, kind: FleetKind, key: str, old: str | None, new: str) -> bool:
        async def swap(conn: Connection) -> bool:
            if old is None:
                return bool(await conn.fetchval(self._sql.fleet_insert, kind, key, new))
            return bool(await conn.fetchval(self._sql.fleet_swap, kind, key, new, old))

        return await self._call(f"change the {kind} record of {key}", swap)

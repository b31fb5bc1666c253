"""``SQLiteBackend.inventory()``, ``purge()`` and ``doctor()``: plain ``sqlite3`` calls, run in
a thread. The file is never created nor deleted (it may hold the application's own tables):
only the tables of one table prefix are dropped."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ...abc import Finding, FleetKind, Inventory, StoredObject
from .._ops import LIVE_WINDOW_MS, ago
from .._sql import schema_finding

__all__ = ["doctor", "inventory", "presence", "purge", "table_names"]

_BACKEND = "SQLiteBackend"
# File systems on which SQLite's locks do not work (SQLite's FAQ: "not over a network").
_NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb", "smb2", "smbfs", "fuse.sshfs", "9p", "afs", "ceph", "glusterfs"}
)


def table_names(prefix: str) -> tuple[str, ...]:
    """Every table the backend makes for ``prefix`` (its index goes with its table)."""
    kinds = ("jobs", "leases", "history", "fleet", "schema_version")
    return tuple(f"{prefix}{kind}" for kind in kinds)


def _connect(path: str) -> sqlite3.Connection | None:
    """The file opened for reading and writing, or ``None`` when there is no such file (never
    created)."""
    if not os.path.exists(path):
        return None
    uri = f"{Path(path).resolve().as_uri()}?mode=rw"
    return sqlite3.connect(uri, uri=True, isolation_level=None, timeout=5)


def inventory(path: str, prefix: str, now_ms: int) -> Inventory:
    conn = _connect(path)
    if conn is None:
        return Inventory(_BACKEND, prefix, unknown=(f"no file {path}",))
    try:
        return _inventory(conn, prefix, now_ms)
    finally:
        conn.close()


def _inventory(conn: sqlite3.Connection, prefix: str, now_ms: int) -> Inventory:
    wanted = table_names(prefix)
    marks = ", ".join("?" for _ in wanted)
    found = {
        name
        for (name,) in conn.execute(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({marks})", wanted
        )
    }
    objects = tuple(StoredObject("table", name) for name in wanted if name in found)
    live: list[str] = []
    jobs, leases = f"{prefix}jobs", f"{prefix}leases"
    if jobs in found:
        for job, until in conn.execute(
            f'SELECT job, lease_until_ms FROM "{jobs}" WHERE lease_until_ms > ?',
            (now_ms - LIVE_WINDOW_MS,),
        ):
            live.append(f"job {job!r} had a lease until {ago(until, now_ms)} (table {jobs})")
    if leases in found:
        for job, slot_ms, instance, expires in conn.execute(
            f'SELECT job, slot_ms, instance_id, expires_ms FROM "{leases}" '
            "WHERE state = 'running' AND expires_ms > ?",
            (now_ms,),
        ):
            live.append(
                f"job {job!r} slot {slot_ms} is being run by instance {instance!r} (lease "
                f"expires {ago(expires, now_ms)})"
            )
    history = f"{prefix}history"
    if history in found:
        (newest,) = conn.execute(f'SELECT max(started_us) FROM "{history}"').fetchone()
        if newest is not None and newest // 1000 > now_ms - LIVE_WINDOW_MS:
            live.append(f"a run started {ago(newest // 1000, now_ms)} was recorded ({history})")
    return Inventory(_BACKEND, prefix, objects, live=tuple(live))


def presence(path: str, prefix: str, now_ms: int, kind: FleetKind = "instance") -> list[str]:
    """The records of ``kind`` (instance, by default) of the prefix's ``fleet`` table not yet
    expired (none without the file or the table)."""
    conn = _connect(path)
    if conn is None:
        return []
    try:
        fleet = f"{prefix}fleet"
        found = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (fleet,)
        ).fetchone()
        if found is None:
            return []
        rows = conn.execute(
            f'SELECT value FROM "{fleet}" WHERE kind = ? '
            "AND (expires_ms IS NULL OR expires_ms > ?)",
            (kind, now_ms),
        )
        return [value for (value,) in rows]
    finally:
        conn.close()


def purge(path: str, found: Inventory, now_ms: int) -> Inventory:
    conn = _connect(path)
    if conn is None:
        return Inventory(_BACKEND, found.namespace, unknown=(f"no file {path}",))
    try:
        conn.execute("BEGIN IMMEDIATE")
        for item in found.objects:
            if item.kind == "table" and item.name in table_names(found.namespace):
                conn.execute(f'DROP TABLE IF EXISTS "{item.name}"')
        conn.execute("COMMIT")
        return _inventory(conn, found.namespace, now_ms)
    finally:
        conn.close()


def doctor(path: str, prefix: str) -> list[Finding]:
    findings = [_filesystem_finding(path)]
    conn = _connect(path)
    if conn is None:
        findings.append(
            Finding("ok", "database file", f"no file {path} yet: the first start creates it")
        )
        return findings
    try:
        findings.append(Finding("ok", "server version", f"SQLite {sqlite3.sqlite_version}"))
        (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        if str(mode).lower() == "wal":
            findings.append(Finding("ok", "journal mode", "WAL"))
        else:
            findings.append(
                Finding(
                    "warning",
                    "journal mode",
                    f"journal_mode is {mode!r}, not WAL",
                    "readers and writers block each other; brokersched switches the file to "
                    "WAL when it starts, and refuses to start if it cannot",
                    "start the application once (or PRAGMA journal_mode = WAL)",
                )
            )
        findings.append(_schema_finding(conn, prefix))
    finally:
        conn.close()
    return findings


def _schema_finding(conn: sqlite3.Connection, prefix: str) -> Finding:
    table = f"{prefix}schema_version"
    try:
        row = conn.execute(f'SELECT version FROM "{table}"').fetchone()
    except sqlite3.OperationalError:
        return Finding("ok", "schema", f"no tables {prefix}* yet: the first start creates them")
    version = None if row is None else int(row[0])
    return schema_finding(version, f"tables {prefix}* at schema version", "them")


def _filesystem_finding(path: str) -> Finding:
    kind = _filesystem_of(Path(path).resolve().parent)
    if kind is None:
        return Finding("warning", "file system", f"the file system of {path} is not known")
    if kind in _NETWORK_FS or kind.startswith("fuse"):
        return Finding(
            "error",
            "file system",
            f"{path} is on a {kind} file system",
            "SQLite's locks do not hold over a network file system: two instances can "
            "both take a slot's lease, and run it twice",
            "put the file on a local disk, or use PostgreSQL for a fleet on several hosts",
        )
    return Finding("ok", "file system", f"{path} is on a local {kind} file system")


def _filesystem_of(directory: Path) -> str | None:
    """The type of the mount holding ``directory`` (Linux ``/proc/mounts``), or ``None``."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    text = str(directory)
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = text == mount or text.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > best[0]):
            best = (len(mount), fields[2])
    return None if best is None else best[1]

"""The process that serves a TCP port on this machine (a RabbitMQ node's Erlang VM, for the
benches that read its CPU in /proc), found by the port itself: several nodes run here (the
3.10 service on 5672, scripts/rabbitmq4.sh's 4.0 nodes on 5673 and 5674, private test nodes),
so neither ``rabbitmqctl``'s default node nor the name ``beam.smp`` tells which one a URL names.

Linux only: the listening socket's inode in ``/proc/net/tcp`` (``tcp6``), then the process
holding that inode among its ``/proc/<pid>/fd`` (root sees every process's; the chroot'd
4.0 nodes share this machine's process and network namespaces)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["cpu_seconds", "serving_pid", "url_port"]

_LISTEN = "0A"


def url_port(url: str, default: int = 5672) -> int:
    return urlsplit(url).port or default


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and int(local.rpartition(":")[2], 16) == port:
                inodes.add(inode)
    return inodes


def serving_pid(port: int) -> int | None:
    """The process listening on ``port`` (``None``: none found, or not readable here)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:  # gone, or not ours to read
            continue
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

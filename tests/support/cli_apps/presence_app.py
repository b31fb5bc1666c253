"""``brokersched purge`` on memory backends whose presence is set by
``BROKERSCHED_TEST_PRESENCE`` (tests/unit/test_cli_purge.py): ``fleet``, four instances (alive,
late, dead, stopped); ``quiet``, the dead and the stopped one; ``garbled``, a record that is not
brokersched's; ``fails``, a read that fails; ``none``, a backend that cannot read it
(``Backend``'s default)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from brokersched import BackendUnavailableError, JobContext, MemoryBackend, Scheduler
from brokersched.abc import Backend, Instance

HEARTBEAT = timedelta(seconds=5)
#: How long ago each instance of ``fleet`` was last seen, and whether it said it stopped.
FLEET = {
    "web-alive": (timedelta(seconds=1), False),
    "web-late": (timedelta(seconds=9), False),  # 1.5 to 3 heartbeats
    "web-dead": (timedelta(seconds=20), False),
    "web-stopped": (timedelta(seconds=1), True),
}


class FailingPresence(MemoryBackend):
    async def _presence_records(self, namespace: str | None) -> Sequence[str]:
        raise BackendUnavailableError("PresenceBackend: connection refused")


class NoPresence(MemoryBackend):
    _presence_records = Backend._presence_records


def _instance(name: str, ago: timedelta, stopped: bool) -> str:
    now = datetime.now(UTC)
    return Instance(
        name, "host-1", 4242, "1.0", now - timedelta(hours=1), now - ago, HEARTBEAT,
        stopped=stopped,
    ).to_json()  # fmt: skip


def create() -> Scheduler[MemoryBackend]:
    kind = os.environ["BROKERSCHED_TEST_PRESENCE"]
    backend = {"fails": FailingPresence, "none": NoPresence}.get(kind, MemoryBackend)()
    expires = round((datetime.now(UTC) + timedelta(minutes=10)).timestamp() * 1000)
    for name, (ago, stopped) in FLEET.items():
        if kind == "fleet" or (kind == "quiet" and name in ("web-dead", "web-stopped")):
            backend.store.fleet["instance", name] = (_instance(name, ago, stopped), expires)
    if kind == "garbled":
        backend.store.fleet["instance", "odd"] = ('{"id": "odd"}', expires)
    scheduler = Scheduler(backend)

    @scheduler.every("tick", "1h")
    async def tick(ctx: JobContext) -> None:
        pass

    return scheduler

"""The end-of-run check: this run left nothing on any server (a pytest plugin of
tests/conftest.py).

Every name a test gives what it makes starts with this run's prefix (``names.RUN_PREFIX``), so
at the session's end this plugin lists, on each shared server the run used, what still carries
that prefix: RabbitMQ queues and exchanges (on a local broker, through the node that serves the
run's AMQP port: its management API, beside it on the port 10000 higher, else the
``rabbitmqctl`` of the node on this machine that port is the default of, the 3.10 service's or a
scripts/rabbitmq4.sh node's, checked to serve it; AMQP cannot list), NATS streams (KV buckets
included), Redis keys, PostgreSQL schemas, and files in the temporary directory. It removes
them, through ``brokersched purge``'s machinery where the backend has it
(``Backend.inventory()``/``purge()`` of each prefix found, then by name), so an interrupted run
cleans up too, and fails the run naming each one: a test that leaves something behind is a bug.
Objects of other runs (other prefixes) and of anything else are never touched.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.support.names import RUN_PREFIX

#: The servers this run used, by kind (``amqp``, ``nats``, ``postgres``, ``redis``): filled by
#: ``servers.server_url``.
USED: dict[str, str] = {}
_FOUND: list[str] = []
_NOT_CHECKED: list[str] = []
_BOUND_S = 60  # a listing or a removal of one server that takes longer is a failure itself


def _carries(name: str, prefix: str) -> bool:
    # NATS KV buckets are streams named KV_<bucket>, object stores OBJ_<bucket>
    return name.removeprefix("KV_").removeprefix("OBJ_").startswith(prefix)


# -- each server: remove what carries this run's prefix, answer what was there -----------------


async def remove_rabbitmq(url: str, prefix: str = RUN_PREFIX) -> list[str]:
    from tests.support.rabbitmq_helpers import delete_queues

    parts = urlsplit(url)
    port = parts.port or 5672
    if parts.hostname not in {"127.0.0.1", "localhost", "::1"}:
        _NOT_CHECKED.append(f"RabbitMQ at {parts.hostname}: AMQP cannot list it from here")
        return []
    vhost = unquote(parts.path[1:]) or "/"
    listed = await _rabbitmq_by_management(url, vhost)
    if listed is None:
        listed = await _rabbitmq_by_rabbitmqctl(port, vhost)
    if listed is None:
        _NOT_CHECKED.append(
            f"RabbitMQ at {parts.hostname}:{port}: neither a management API on port "
            f"{port + _MANAGEMENT_OFFSET} nor this machine's rabbitmqctl serves it"
        )
        return []
    found = [(kind, name) for kind, name in listed if _carries(name, prefix)]
    queues = [name for kind, name in found if kind == "queue"]
    exchanges = [name for kind, name in found if kind == "exchange"]
    await delete_queues(url, queues, exchanges)
    return [f"RabbitMQ {kind} {name}" for kind, name in found]


# The management plugin's port beside an AMQP port, as RabbitMQ's defaults have it (5672 and
# 15672) and scripts/rabbitmq4.sh's nodes (5673 and 15673, 5674 and 15674).
_MANAGEMENT_OFFSET = 10_000


async def _rabbitmq_by_management(url: str, vhost: str) -> list[tuple[str, str]] | None:
    """The queues and exchanges of ``vhost`` as the management API of the node serving ``url``
    lists them; ``None`` when no management API answers beside its AMQP port, or the one there
    belongs to a node that does not serve that port."""
    from brokersched._exceptions import BackendError
    from brokersched.backends.rabbitmq._ops import Management

    parts = urlsplit(url)
    port = parts.port or 5672
    credentials = parts.netloc.rpartition("@")[0]
    management = Management(f"http://{credentials}@127.0.0.1:{port + _MANAGEMENT_OFFSET}/", vhost)
    try:
        overview = await management.get("overview")
    except BackendError:
        return None
    served = {
        listener.get("port")
        for listener in overview.get("listeners", [])
        if listener.get("protocol") == "amqp"
    }
    if port not in served:
        return None
    found: list[tuple[str, str]] = []
    for kind in ("queue", "exchange"):
        rows = await management.get(f"{kind}s/{management.vhost}?columns=name")
        found += [(kind, row["name"]) for row in rows]
    return found


def _rabbitmqctl_of(port: int) -> list[str] | None:
    """The rabbitmqctl of the node on this machine whose default AMQP port is ``port`` (the
    3.10 service's, or a node of scripts/rabbitmq4.sh run through it); ``None``: none here."""
    from tests.support.servers import RABBITMQ_SERVERS

    for server in RABBITMQ_SERVERS.values():
        if (urlsplit(server.default).port or 5672) == port:
            return server.rabbitmqctl()
    return None


async def _rabbitmq_by_rabbitmqctl(port: int, vhost: str) -> list[tuple[str, str]] | None:
    """The queues and exchanges of ``vhost`` as the ``rabbitmqctl`` of the node on this machine
    that ``port`` is the default port of lists them; ``None`` when there is none, or its node
    does not serve ``port``."""
    ctl = _rabbitmqctl_of(port)
    if ctl is None:
        return None

    def run(*args: str) -> str:
        return subprocess.run(
            [*ctl, "-s", *args], capture_output=True, text=True, timeout=_BOUND_S, check=True
        ).stdout

    status = json.loads(await asyncio.to_thread(run, "status", "--formatter", "json"))
    if not any(
        listener.get("protocol") == "amqp" and listener.get("port") == port
        for listener in status.get("listeners", [])
    ):
        return None
    found: list[tuple[str, str]] = []
    for kind in ("queue", "exchange"):
        listed = await asyncio.to_thread(run, f"list_{kind}s", "-p", vhost, "name")
        found += [(kind, name) for name in listed.split()]
    return found


async def remove_nats(url: str, prefix: str = RUN_PREFIX) -> list[str]:
    import nats

    from brokersched import NATSBackend

    async def streams() -> list[str]:
        nc = await nats.connect(url, allow_reconnect=False)
        try:
            return [i.config.name or "" for i in await nc.jetstream().streams_info()]
        finally:
            await nc.close()

    found = [name for name in await streams() if _carries(name, prefix)]
    for made_by in {name.rpartition("-")[0] for name in found if name.startswith(prefix)}:
        backend = NATSBackend(url, prefix=made_by)
        await backend.purge(await backend.inventory())
    nc = await nats.connect(url, allow_reconnect=False)
    try:
        js = nc.jetstream()
        for name in set(found) & set(await streams()):  # what purge does not know (a KV bucket)
            await js.delete_stream(name)
    finally:
        await nc.close()
    return [f"NATS stream {name}" for name in found]


async def remove_redis(url: str, prefix: str = RUN_PREFIX) -> list[str]:
    import redis.asyncio

    from brokersched import RedisBackend

    client = redis.asyncio.Redis.from_url(url)
    try:
        found = sorted([key.decode() async for key in client.scan_iter(f"{prefix}*", 1000)])
        for made_by in {key.split(":", 1)[0] for key in found}:
            backend = RedisBackend(url, prefix=made_by)
            await backend.purge(await backend.inventory())
        if found:
            await client.unlink(*found)  # what purge does not know: a test's own keys
    finally:
        await client.aclose()
    shown = found[:20] + ([f"... and {len(found) - 20} more"] if len(found) > 20 else [])
    return [f"Redis key {key}" for key in shown]


async def remove_postgres(dsn: str, prefix: str = RUN_PREFIX) -> list[str]:
    import asyncpg

    from brokersched import PostgresBackend

    async def schemas() -> list[str]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)", prefix
            )
            return sorted(row[0] for row in rows)
        finally:
            await conn.close()

    found = await schemas()
    for schema in found:
        backend = PostgresBackend(dsn, schema=schema)
        await backend.purge(await backend.inventory())
    left = await schemas()
    if left:  # a schema holding what is not brokersched's (a test's own table)
        conn = await asyncpg.connect(dsn)
        try:
            for schema in left:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()
    return [f"PostgreSQL schema {schema}" for schema in found]


def _files() -> list[str]:
    found = sorted(Path(tempfile.gettempdir()).glob(f"{RUN_PREFIX}*"))
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [f"temporary file {path}" for path in found]


#: Each server's removal of everything named ``prefix...``: what it found (and removed).
REMOVE: dict[str, Callable[[str, str], Awaitable[list[str]]]] = {
    "amqp": remove_rabbitmq,
    "nats": remove_nats,
    "redis": remove_redis,
    "postgres": remove_postgres,
}


async def sweep() -> tuple[list[str], list[str]]:
    """Remove what this run left on the servers it used: (what was left, what failed)."""
    left, errors = _files(), []
    for kind, url in sorted(USED.items()):
        try:
            async with asyncio.timeout(_BOUND_S):
                left += await REMOVE[kind](url, RUN_PREFIX)
        except Exception as exc:  # a server gone by now: said, and a failure too
            errors.append(f"{kind}: the check failed: {type(exc).__name__}: {exc}")
    return left, errors


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session: pytest.Session) -> None:
    if not USED:
        return
    left, errors = asyncio.run(sweep())
    _FOUND.extend(left + errors)
    if _FOUND and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FOUND:
        terminalreporter.write_sep("=", f"left behind on the servers by this run ({RUN_PREFIX})")
        for line in _FOUND:
            terminalreporter.write_line(line)
        terminalreporter.write_line("(removed now; the test that made them must remove them)")
    for line in _NOT_CHECKED:
        terminalreporter.write_line(f"not checked for leftovers: {line}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's last line says it failed (pytest's own says "N passed")."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _FOUND and reporter is not None:
        reporter.write_sep(
            "=", f"{len(_FOUND)} left behind on the servers: the run failed", red=True
        )

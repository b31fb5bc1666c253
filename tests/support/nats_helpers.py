"""NATS test helpers: a throwaway nats-server, a fault-injecting TCP proxy, clean-up, streams
made as an operator would.

Everything listens on 127.0.0.1 on a free port and is stopped by the test that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from tests.support.helpers import missing
from tests.support.wait import free_port, until

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
SLOT_TTL = timedelta(minutes=5)  # the slot_ttl whose claims stream ``claims_stream`` makes


async def delete_streams(url: str, prefix: str) -> None:
    """Remove the streams a test created under ``prefix``: the backend's (``<prefix>-claims``,
    ``<prefix>-history``, the fleet's buckets ``KV_<prefix>-fleet-...``, a lease bucket
    ``KV_<prefix>``) and any other
    ``<prefix>-...`` stream it made (a foreign one)."""
    nc = await nats.connect(url, allow_reconnect=False, error_cb=_quiet)
    try:
        js = nc.jetstream()
        for info in await js.streams_info():
            name = info.config.name or ""
            if name == f"KV_{prefix}" or name.startswith((f"{prefix}-", f"KV_{prefix}-")):
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(name)
    finally:
        await nc.close()


def claims_stream(prefix: str, **settings: Any) -> StreamConfig:
    """A claims stream that a NATSBackend of ``prefix`` (slot_ttl ``SLOT_TTL``) accepts, with
    ``settings`` changed."""
    config = StreamConfig(
        name=f"{prefix}-claims",
        subjects=[f"{prefix}.claim.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=SLOT_TTL.total_seconds(),
        max_age=SLOT_TTL.total_seconds(),
    )
    return with_settings(config, prefix, settings)


def history_stream(prefix: str, **settings: Any) -> StreamConfig:
    """A history stream that a NATSBackend of ``prefix`` accepts, with ``settings`` changed."""
    config = StreamConfig(
        name=f"{prefix}-history",
        subjects=[f"{prefix}.history.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_msgs_per_subject=100,
    )
    return with_settings(config, prefix, settings)


def with_settings(config: StreamConfig, prefix: str, settings: dict[str, Any]) -> StreamConfig:
    """``settings`` applied to ``config``; ``{p}`` in a subject stands for the prefix."""
    for name, value in settings.items():
        if name == "subjects":
            value = [subject.format(p=prefix) for subject in value]
        setattr(config, name, value)
    return config


async def create_stream(url: str, config: StreamConfig, *, seal: bool = False) -> None:
    """Pre-create a stream as an operator would (``seal``: then seal it, which only an update
    can do)."""
    nc = await nats.connect(url, allow_reconnect=False, error_cb=_quiet)
    try:
        js = nc.jetstream()
        await js.add_stream(config)
        if seal:
            await js.update_stream(dataclasses.replace(config, sealed=True))
    finally:
        await nc.close()


async def stream_config(url: str, name: str) -> StreamConfig:
    """The configuration of stream ``name`` as the server reports it."""
    nc = await nats.connect(url, allow_reconnect=False, error_cb=_quiet)
    try:
        return (await nc.jetstream().stream_info(name)).config
    finally:
        await nc.close()


async def update_stream(url: str, name: str, **changes: Any) -> None:
    """Edit stream ``name`` as ``nats stream edit`` would."""
    nc = await nats.connect(url, allow_reconnect=False, error_cb=_quiet)
    try:
        js = nc.jetstream()
        config = (await js.stream_info(name)).config
        await js.update_stream(dataclasses.replace(config, **changes))
    finally:
        await nc.close()


async def delete_named_streams(url: str, *names: str) -> None:
    """Remove the streams ``names`` that exist (beside ``delete_streams``: a test's own)."""
    nc = await nats.connect(url, allow_reconnect=False, error_cb=_quiet)
    try:
        js = nc.jetstream()
        for name in names:
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()


def lease_streams(bucket: str) -> tuple[str, ...]:
    """The streams a ``NATSLeaseBackend`` of ``bucket`` may make: its KV bucket, its history,
    and the fleet's KV buckets (one per kind of record)."""
    from brokersched.backends.nats._fleet import bucket_streams

    return f"KV_{bucket}", *bucket_streams(bucket), f"{bucket}-history"


async def _quiet(exc: Exception) -> None:
    """nats-py logs every connection error with a traceback by default; polling expects some."""


async def listening(url: str) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", urlsplit(url).port or 4222)
    except OSError:
        return False
    writer.close()
    return True


async def jetstream_ready(url: str) -> bool:
    # nats-py retries a refused first connect after reconnect_time_wait: probe TCP first
    if not await listening(url):
        return False
    try:
        nc = await asyncio.wait_for(
            nats.connect(url, allow_reconnect=False, connect_timeout=1, error_cb=_quiet), 2
        )
    except (OSError, nats.errors.Error):
        return False
    try:
        await nc.jetstream().account_info()
        return True
    except (OSError, nats.errors.Error):
        return False
    finally:
        await nc.close()


class NatsServer:
    """A nats-server with JetStream and a file store under ``store``; restartable on its port."""

    def __init__(
        self,
        store: Path,
        *,
        user: str | None = None,
        password: str | None = None,
        jetstream: bool = True,
        binary: str = NATS_SERVER,
    ) -> None:
        if not Path(binary).exists():
            missing(f"nats-server not found at {binary}")
        self.binary, self.store = binary, store
        self.port = free_port()
        self.auth = ["--user", user, "--pass", password] if user and password else []
        self.jetstream = jetstream
        self.process: asyncio.subprocess.Process | None = None
        credentials = f"{user}:{password}@" if user and password else ""
        self.url = f"nats://{credentials}127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            self.binary,
            *("-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)),
            *(["-js"] if self.jetstream else []),
            *self.auth,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        ready = jetstream_ready if self.jetstream else listening
        await until(lambda: ready(self.url), timeout=15, what="nats-server to start")

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        process.send_signal(sig)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()

    async def restart(self, sig: int = signal.SIGKILL, *, downtime: float = 0.0) -> None:
        """Stop with ``sig``, stay down ``downtime`` seconds (an outage), start again."""
        await self.stop(sig)
        await asyncio.sleep(downtime)
        await self.start()


@contextlib.asynccontextmanager
async def nats_server(store: Path, **options: Any) -> AsyncIterator[NatsServer]:
    server = NatsServer(store, **options)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class FaultProxy:
    """A TCP proxy to ``target_port`` (on ``target_host``) that can hold the server's replies or
    cut connections."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target_port, self.target_host = target_port, target_host
        self.port = free_port()
        self.replies_flowing = asyncio.Event()
        self.replies_flowing.set()
        self.held = bytearray()  # everything the server sent while replies were held
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.closing = False
        self._hold_after: Callable[[bytes], bool] | None = None
        self.answers_held = asyncio.Event()  # set once hold_replies_after() held the replies

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def hold_replies(self) -> None:
        """Keep what the server sends (acks included) from reaching the client. The server's
        side is still read (into ``held``), so every answer sent while held can be seen."""
        self.replies_flowing.clear()

    def hold_replies_after(self, predicate: Callable[[bytes], bool]) -> None:
        """``hold_replies()`` as soon as a chunk the client sends matches ``predicate``, once
        that chunk reached the server (a request that lands, its answer held); once."""
        self._hold_after = predicate

    def release_replies(self) -> None:
        """Deliver what was held, in order (unless ``cut()`` dropped it), then flow again."""
        self.replies_flowing.set()
        self.held.clear()

    async def holding(self, pattern: bytes) -> bool:
        """Whether the replies held so far contain ``pattern`` (the server has answered, e.g. an
        ack), in whichever reads they arrived."""
        return pattern in self.held

    def cut(self) -> None:
        """Drop every proxied connection at once (held replies are lost)."""
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.closing = True
        if self.server is not None:
            self.server.close()
        self.cut()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.closing:  # accepted just before close(), started after it
            client_w.transport.abort()
            return
        connecting = asyncio.current_task()
        assert connecting is not None
        self.tasks.add(connecting)  # close() cancels it
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        except asyncio.CancelledError:
            # Closed meanwhile (the proxy is this task's only canceller): the client is not left
            # open. Not raised: asyncio 3.11 logs a handler's cancellation as an error.
            client_w.transport.abort()
            return
        finally:
            self.tasks.discard(connecting)
        self.writers.update((client_w, server_w))
        self._spawn(self._pipe(client_r, server_w))
        self._spawn(self._pipe_replies(server_r, client_w))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Client to server: never held."""
        try:
            while data := await reader.read(65536):
                if writer.transport.is_closing():
                    break
                writer.write(data)
                if self._hold_after is not None and self._hold_after(data):
                    self._hold_after = None
                    self.hold_replies()  # before any await: its answer cannot slip through
                    self.answers_held.set()
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()
            self.writers.discard(writer)

    async def _pipe_replies(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Server to client. Reading goes on while replies are held (into ``held``): stopping
        after the first held read would hide every answer that arrives in a later read (two
        acks sent a moment apart, or after a PING or INFO), and ``holding()`` would wait in
        vain for an answer the server gave."""
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        forwarding = self._spawn(self._forward(chunks, writer))
        try:
            while data := await reader.read(65536):
                if not self.replies_flowing.is_set():
                    self.held.extend(data)
                chunks.put_nowait(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            chunks.put_nowait(None)  # the forwarder ends the client's side once it is done
        await forwarding

    async def _forward(
        self, chunks: asyncio.Queue[bytes | None], writer: asyncio.StreamWriter
    ) -> None:
        try:
            while (data := await chunks.get()) is not None:
                await self.replies_flowing.wait()
                if writer.transport.is_closing():
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.transport.abort()
            self.writers.discard(writer)


@contextlib.asynccontextmanager
async def fault_proxy(
    target_port: int, target_host: str = "127.0.0.1"
) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy(target_port, target_host)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


_DENY_STREAM_UPDATES = """
authorization {
  users = [
    {user: admin, password: adminpw}
    {user: app, password: apppw, permissions: {
      publish: {allow: [">"], deny: ["$JS.API.STREAM.UPDATE.>"]}, subscribe: {allow: [">"]}}}
  ]
}
"""


@contextlib.asynccontextmanager
async def nats_server_denying_stream_updates(
    store: Path, binary: str = NATS_SERVER
) -> AsyncIterator[tuple[str, str]]:
    """A nats-server with JetStream where user ``app`` may do everything but update streams
    (as an account whose streams are managed elsewhere); yields the admin's and app's URLs."""
    config = store.with_suffix(".conf")
    config.write_text(_DENY_STREAM_UPDATES)
    server = NatsServer(store, binary=binary)
    server.auth = ["-c", str(config)]  # extra arguments of nats-server
    server.url = f"nats://admin:adminpw@127.0.0.1:{server.port}"
    await server.start()
    try:
        yield server.url, f"nats://app:apppw@127.0.0.1:{server.port}"
    finally:
        await server.stop()


_LIMITED_ACCOUNT = """
accounts {
  APP {
    jetstream { max_file: %(max_file)d, max_mem: %(max_mem)d, max_streams: %(max_streams)d }
    users = [{user: app, password: apppw}]
  }
}
"""


@contextlib.asynccontextmanager
async def nats_server_with_account_limits(
    store: Path, *, max_file: int, max_mem: int, max_streams: int, binary: str = NATS_SERVER
) -> AsyncIterator[str]:
    """A nats-server with JetStream whose account ``APP`` (user ``app``) has JetStream limits
    (bytes of file and memory storage, streams); yields that user's URL."""
    config = store.with_suffix(".conf")
    limits = {"max_file": max_file, "max_mem": max_mem, "max_streams": max_streams}
    config.write_text(_LIMITED_ACCOUNT % limits)
    server = NatsServer(store, binary=binary)
    server.auth = ["-c", str(config)]  # extra arguments of nats-server
    server.url = f"nats://app:apppw@127.0.0.1:{server.port}"
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()

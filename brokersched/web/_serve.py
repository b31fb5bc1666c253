"""Serving the admin app with uvicorn in the scheduler's own event loop
(``brokersched run app:scheduler --http 127.0.0.1:8080``)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from .._exceptions import ConfigurationError
from .._scheduler import Scheduler
from ._app import TOKEN_ENV, create_app
from ._security import HOSTS_ENV, LoopbackHostsOnly
from ._stream import EventHub

__all__ = ["HTTPServer", "is_loopback", "parse_address"]

_STOP_GRACE_S = 3


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``127.0.0.1:8080``, ``[::1]:8080``, ``localhost:0``) as a pair."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(
            f"--http {address!r} is not HOST:PORT; write e.g. 127.0.0.1:8080 "
            "(port 0: any free port)",
            option="http",
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the CLI's own SIGINT/SIGTERM handlers stop the scheduler, then this server


class HTTPServer:
    """The admin app on ``host:port``; refuses a non-loopback address without a token."""

    def __init__(self, scheduler: Scheduler[Any], host: str, port: int) -> None:
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if not is_loopback(host) and not os.environ.get(TOKEN_ENV):
            raise ConfigurationError(
                f"--http {self.address} is not a loopback address and no admin token is set: "
                f"set {TOKEN_ENV} (at least 16 characters) or serve on 127.0.0.1",
                option="http",
            )
        self.token_set = bool(os.environ.get(TOKEN_ENV, "").strip())
        self.app = create_app(scheduler)
        if is_loopback(host):  # reading is open: only to this machine's pages (DNS rebinding)
            extra = os.environ.get(HOSTS_ENV, "").split(",")
            self.app.add_middleware(LoopbackHostsOnly, extra=extra)
        self._host, self._port = host, port
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Listen and serve; the URL (``port=0``: a free port). Raises ``OSError`` when the
        address cannot be bound."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.create_server((self._host, self._port), family=family)
        config = uvicorn.Config(
            self.app,
            log_config=None,  # the application's (the CLI's) logging
            log_level="warning",  # its own start and stop lines are the CLI's
            access_log=False,
            lifespan="off",
            # The peer stays the peer: forwarded headers are judged by the app's own trusted
            # proxies (BROKERSCHED_TRUSTED_PROXIES), not by uvicorn's default 127.0.0.1.
            proxy_headers=False,
            timeout_graceful_shutdown=_STOP_GRACE_S,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve([sock]), name="brokersched:http")
        while not self._server.started:  # startup is a few steps of this loop
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped during its start")
            await asyncio.sleep(0.01)
        port: int = sock.getsockname()[1]
        return f"http://{self.address.rpartition(':')[0]}:{port}/"

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        hub: EventHub = self.app.state.events
        hub.close()  # event streams never end by themselves
        self._server.should_exit = True
        await self._task

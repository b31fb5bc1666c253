"""Waiting on a condition, never on the clock: the one ``until`` of the suite.

A test that needs something to have happened (a run recorded, a server answering, a process
ready) polls the condition itself, with a bound that only fails a test that is broken: the
bound says how long is "never", not how long it usually takes, so a slow or loaded machine
waits longer and still passes. What the test can be told directly (an ``asyncio.Event``, a
line a process prints, virtual time with ``TestClock``) needs no polling at all.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

EVERY_S = 0.02  # how often a condition is looked at: cheap conditions, short waits


async def until(
    condition: Callable[[], Awaitable[object] | object],
    *,
    timeout: float = 10.0,
    what: str = "the condition",
    every: float = EVERY_S,
    ignore: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> float:
    """Poll ``condition`` (sync or async) until it is truthy; the seconds it took.

    Fails the test after ``timeout`` seconds, naming ``what``. ``ignore``: exceptions of the
    condition that mean "not yet" (a server still starting).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return loop.time() - started
        except ignore:
            pass
        if loop.time() - started > timeout:
            pytest.fail(f"{what}: not so after {timeout}s", pytrace=False)
        await asyncio.sleep(every)


def until_sync(
    condition: Callable[[], object],
    *,
    timeout: float = 10.0,
    what: str = "the condition",
    every: float = EVERY_S,
) -> float:
    """``until`` for code without an event loop (processes, threads, servers of the tests);
    raises ``TimeoutError`` (it also runs outside pytest, in ``bench/``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not so after {timeout}s")
        time.sleep(every)
    return time.monotonic() - started


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

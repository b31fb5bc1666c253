"""``SchedulerThread``: a scheduler on an event loop of its own, in a thread, for applications
without one (a Flask or Django app under a WSGI server, a script): what APScheduler's
``BackgroundScheduler`` is to its users. ``scheduler.start_in_thread()`` makes one."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

__all__ = ["SchedulerThread"]

logger = logging.getLogger("brokersched")
T = TypeVar("T")


class Startable(Protocol):
    """What a ``SchedulerThread`` runs: a ``Scheduler`` (named so only by what it does, so that
    the scheduler and its thread do not import each other)."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def wait_stopped(self) -> None: ...
    @property
    def running(self) -> bool: ...


S = TypeVar("S", bound=Startable)


class _DaemonExecutor(ThreadPoolExecutor):
    """``ThreadPoolExecutor``'s threads are joined as the interpreter exits: a sync handler that
    the drain abandoned (it ignores ``ctx.abort_reason``) would keep the program alive until it
    returned. These are daemon threads, ending with the process as under ``brokersched run``;
    an idle one is reused (a Django connection lives per thread), and none waits for another.
    A ``ThreadPoolExecutor`` only for asyncio's type check: its own pool is not used."""

    def __init__(self, name: str) -> None:
        super().__init__(thread_name_prefix=name)
        self._name = name
        self._count = itertools.count()
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one release per thread waiting for work
        self._spawned = 0
        self._ended = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._ended:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future: Future[T] = Future()
        self._work.put(functools.partial(self._call, future, fn, *args, **kwargs))
        if not self._idle.acquire(blocking=False):  # no thread waits: one more
            self._spawned += 1
            name = f"{self._name}_{next(self._count)}"
            threading.Thread(target=self._worker, name=name, daemon=True).start()
        return future

    def _call(self, future: Future[T], fn: Callable[..., T], /, *args: Any, **kw: Any) -> None:
        if not future.set_running_or_notify_cancel():
            self._idle.release()
            return
        try:
            result = fn(*args, **kw)
        except BaseException as exc:
            self._idle.release()  # idle before the caller hears: its next call comes here
            future.set_exception(exc)
        else:
            self._idle.release()
            future.set_result(result)

    def _worker(self) -> None:
        while (call := self._work.get()) is not None:
            call()
            del call  # not kept alive by an idle thread

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Idle threads end; a busy one ends after its call (``wait`` is not honoured: a
        handler abandoned by the drain is not waited for)."""
        self._ended = True
        for _ in range(self._spawned):
            self._work.put(None)
        super().shutdown(wait=False)


class SchedulerThread(Generic[S]):
    """A started scheduler running in its own (non-daemon) thread and event loop.

    ``stop()`` stops it (drains running handlers, up to ``drain_timeout``) and waits for the
    thread; ``with scheduler.start_in_thread():`` does so on leaving. A program that ends without
    calling ``stop()`` is not kept alive: the scheduler stops and drains as the interpreter
    exits. Sync handlers run in worker threads, async ones on the thread's event loop.
    """

    def __init__(self, scheduler: S, *, name: str = "brokersched") -> None:
        self.scheduler = scheduler
        self.thread = threading.Thread(target=self._main, name=name, daemon=False)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requested: asyncio.Event | None = None

    def start(self) -> Self:
        """Start the thread and wait until the scheduler has started; its start error (a
        backend that cannot be reached) is raised here."""
        # The interpreter, exiting, first calls these hooks, then joins the handlers' worker
        # threads (concurrent.futures), then this non-daemon thread: a scheduler never stopped
        # is stopped and drained first, instead of keeping the process alive for ever. The hook
        # is the one concurrent.futures uses (private, present since Python 3.9).
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._stop_at_exit)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            self.thread.join()
            raise self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        # An executor of its own, that never waits for a sync handler abandoned by the drain:
        # stop() returns after drain_timeout, and the program exits, all the same.
        loop.set_default_executor(_DaemonExecutor(f"{self.thread.name}-handler"))
        try:
            loop.run_until_complete(self._serve())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._requested = asyncio.Event()
        try:
            await self.scheduler.start()
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        waits = {
            asyncio.ensure_future(self._requested.wait()),
            asyncio.ensure_future(self.scheduler.wait_stopped()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for each in waits:
                each.cancel()
            await self.scheduler.stop()

    def _stop_at_exit(self) -> None:
        if self.thread.is_alive():
            logger.info("the interpreter is exiting: stopping the scheduler's thread")
            self.stop()

    def run(self, awaitable: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``awaitable`` on the scheduler's event loop and return its result, from any other
        thread: ``thread.run(scheduler.get("report").trigger())``."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the scheduler's thread is not running (start_in_thread() first)")

        async def call() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and self.scheduler.running

    def stop(self, timeout: float | None = None) -> None:
        """Stop the scheduler and wait (at most ``timeout`` seconds; ``None``: until it has
        drained) for its thread to end. Called from a handler, it only asks: the drain waits
        for that handler."""
        self._request_stop()
        if self._in_scheduler_thread():
            return
        if self.thread.ident is not None:
            self.thread.join(timeout)

    def _request_stop(self) -> None:
        loop, requested = self._loop, self._requested
        if loop is not None and requested is not None and not loop.is_closed():
            # the loop may close meanwhile: the thread is ending anyway
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(requested.set)

    def _in_scheduler_thread(self) -> bool:
        current = threading.current_thread()
        return current is self.thread or current.name.startswith(f"{self.thread.name}-handler")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

"""``Scheduler(lifespan=...)`` around the scheduler's life (the CLI's too) and
``Scheduler(around_run=...)`` around each run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

from brokersched import (
    BackendUnavailableError,
    ConfigurationError,
    JobContext,
    MemoryBackend,
    RunEvent,
    Scheduler,
)
from brokersched.testing import TestClock

START = "2027-01-15T08:00:00+00:00"


class NotedBackend(MemoryBackend):
    def __init__(self, notes: list[str], *, failing: bool = False) -> None:
        super().__init__()
        self.notes = notes
        self.failing = failing

    async def start(self, clock: Any) -> None:
        if self.failing:
            raise BackendUnavailableError("cannot connect")
        self.notes.append("backend start")
        await super().start(clock)

    async def stop(self) -> None:
        self.notes.append("backend stop")
        await super().stop()


async def test_the_lifespan_surrounds_the_backend_and_every_run() -> None:
    notes: list[str] = []
    pool: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(scheduler: Scheduler[Any]) -> AsyncIterator[None]:
        notes.append(f"enter {scheduler.running}")
        pool["db"] = "open"
        yield
        pool.clear()
        notes.append("exit")

    clock = TestClock(START)
    sched = Scheduler(NotedBackend(notes), clock=clock, jitter=0, lifespan=lifespan)

    @sched.every("report", "1h")
    async def report(ctx: JobContext) -> None:
        notes.append(f"run with {pool['db']}")

    async with sched:
        record = await sched.get("report").trigger()  # type: ignore[union-attr]
        assert record is not None and record.outcome == "completed"
    assert notes == ["enter False", "backend start", "run with open", "backend stop", "exit"]
    async with sched:  # a second life: entered again
        pass
    assert notes[5:] == ["enter False", "backend start", "backend stop", "exit"]


async def test_a_failed_start_exits_the_lifespan_with_the_error() -> None:
    seen: list[BaseException | None] = []

    @asynccontextmanager
    async def lifespan(scheduler: Scheduler[Any]) -> AsyncIterator[None]:
        try:
            yield
        except BaseException as exc:
            seen.append(exc)
            raise

    sched = Scheduler(NotedBackend([], failing=True), lifespan=lifespan)
    with pytest.raises(BackendUnavailableError):
        await sched.start()
    assert [type(exc) for exc in seen] == [BackendUnavailableError]
    assert not sched.running


def test_a_lifespan_that_is_not_callable_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="Scheduler: lifespan 'pool' is not callable"):
        Scheduler(lifespan="pool")  # type: ignore[call-overload]


def test_a_context_manager_of_the_wrong_kind_is_refused_at_once() -> None:
    """Not a TypeError at every run (around_run) or at start (lifespan)."""

    @asynccontextmanager
    async def async_scope(ctx: JobContext) -> AsyncIterator[None]:
        yield

    async def coroutine_scope(ctx: JobContext) -> None: ...

    @contextmanager
    def sync_lifespan(scheduler: Scheduler[Any]) -> Iterator[None]:
        yield

    for scope in (async_scope, coroutine_scope):
        with pytest.raises(ConfigurationError) as caught:
            Scheduler(around_run=scope)  # type: ignore[arg-type]
        assert str(caught.value).endswith(
            "is async; around_run is entered in the handler's own thread: pass a context "
            "manager factory (@contextlib.contextmanager)"
        )
    with pytest.raises(ConfigurationError) as caught:
        Scheduler(lifespan=sync_lifespan)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "Scheduler: lifespan 'test_a_context_manager_of_the_wrong_kind_is_refused_at_once."
        "<locals>.sync_lifespan' makes a sync context manager; pass an async one "
        "(@contextlib.asynccontextmanager)"
    )


# -- around_run --------------------------------------------------------------------------


async def test_around_run_wraps_sync_handlers_in_their_own_thread() -> None:
    seen: list[tuple[str, int]] = []

    @contextmanager
    def connections(ctx: JobContext) -> Iterator[None]:
        seen.append((f"open {ctx.job}", threading.get_ident()))
        try:
            yield
        finally:
            seen.append(("close", threading.get_ident()))

    clock = TestClock(START)
    sched = Scheduler(clock=clock, jitter=0, around_run=connections)

    @sched.every("orm", "1h")
    def orm(ctx: JobContext) -> None:
        seen.append(("handler", threading.get_ident()))

    async with sched:
        await sched.get("orm").trigger()  # type: ignore[union-attr]
    assert [what for what, _ in seen] == ["open orm", "handler", "close"]
    threads = {ident for _, ident in seen}
    assert len(threads) == 1  # the handler's worker thread, for all three
    assert threads != {threading.get_ident()}


async def test_around_run_wraps_async_handlers_and_sees_their_exception() -> None:
    seen: list[str] = []

    @contextmanager
    def scope(ctx: JobContext) -> Iterator[None]:
        seen.append("enter")
        try:
            yield
        except Exception as exc:
            seen.append(f"saw {exc}")
            raise

    clock = TestClock(START)
    sched = Scheduler(clock=clock, jitter=0, around_run=scope)
    fails: list[RunEvent] = []
    sched.on("fail", fails.append)

    @sched.every("broken", "1h")
    async def broken(ctx: JobContext) -> None:
        await asyncio.sleep(0)
        raise RuntimeError("database is down")

    async with sched:
        record = await sched.get("broken").trigger()  # type: ignore[union-attr]
    assert seen == ["enter", "saw database is down"]
    assert record is not None and record.outcome == "failed"
    assert isinstance(fails[0].exception, RuntimeError)

"""A handler's signature is checked at registration: it is called with one positional argument,
the ``JobContext``."""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

import pytest

from brokersched import ConfigurationError, JobContext, Scheduler
from brokersched._registry import collect_errors

WHEN = datetime(2030, 1, 1, tzinfo=UTC)


def no_args() -> None: ...


def two_args(ctx: JobContext, extra: int) -> None: ...


def keyword_only(*, ctx: JobContext) -> None: ...


async def async_no_args() -> None: ...


@pytest.mark.parametrize("handler", [no_args, two_args, keyword_only, async_no_args])
@pytest.mark.parametrize("form", ["every", "cron", "at", "every-decorator", "at-decorator"])
def test_a_handler_that_cannot_take_the_context_is_refused(handler: Any, form: str) -> None:
    scheduler = Scheduler()
    register = {
        "every": lambda: scheduler.every("cleanup", "1m", handler),
        "cron": lambda: scheduler.cron("cleanup", "* * * * *", handler),
        "at": lambda: scheduler.at("cleanup", WHEN, handler),
        "every-decorator": lambda: scheduler.every("cleanup", "1m")(handler),
        "at-decorator": lambda: scheduler.at("cleanup", WHEN)(handler),
    }[form]
    with pytest.raises(ConfigurationError) as caught:
        register()
    message = str(caught.value)
    assert message.startswith(f"job 'cleanup': handler {handler.__qualname__}(")
    assert "one positional argument" in message
    assert caught.value.option == "handler" and caught.value.job == "cleanup"
    assert scheduler.jobs() == []


class AsyncCallable:
    async def __call__(self, ctx: JobContext) -> None: ...


class Task:
    def run(self, ctx: JobContext) -> None: ...


def with_default(ctx: JobContext, retries: int = 3) -> None: ...


def variadic(*args: Any, **kwargs: Any) -> None: ...


def two_args_partial(ctx: JobContext, extra: int) -> None: ...


@pytest.mark.parametrize(
    "handler",
    [
        lambda ctx: None,
        AsyncCallable(),
        Task().run,
        with_default,
        variadic,
        functools.partial(two_args_partial, extra=1),
        print,  # a builtin: accepts any positional argument
    ],
)
def test_handlers_that_take_one_positional_argument_are_accepted(handler: Any) -> None:
    scheduler = Scheduler()
    scheduler.every("job", "1m", handler)
    assert [job.name for job in scheduler.jobs()] == ["job"]


def test_a_callable_without_a_signature_is_accepted() -> None:
    class Opaque:
        __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("no signature")))

        def __call__(self, ctx: JobContext) -> None: ...

    scheduler = Scheduler()
    scheduler.every("job", "1m", Opaque())
    assert scheduler.get("job") is not None


def test_check_collects_a_wrong_signature_with_the_other_errors() -> None:
    scheduler = Scheduler()
    with collect_errors():
        scheduler.every("cleanup", "1m")(no_args)  # type: ignore[type-var]
        scheduler.every("bad", "1m", jitter="nope")(lambda ctx: None)
    errors = scheduler.check()
    assert [error.job for error in errors] == ["cleanup", "bad"]
    assert scheduler.jobs() == []


def test_the_direct_form_returns_a_job_or_raises_even_while_collecting() -> None:
    """It has no Job to return for a refused job (``every()`` is typed to return one)."""
    scheduler = Scheduler()
    with collect_errors():
        with pytest.raises(ConfigurationError, match="job 'cleanup': handler"):
            scheduler.every("cleanup", "1m", no_args)
        with pytest.raises(ConfigurationError, match="jitter"):
            scheduler.every("bad", "1m", lambda ctx: None, jitter="nope")
        job = scheduler.every("fine", "1m", lambda ctx: None)
    assert scheduler.jobs() == [job]
    assert scheduler.check() == []


def test_a_value_that_is_not_callable_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"job 'job': handler 42 is not callable"):
        Scheduler().every("job", "1m", 42)  # type: ignore[call-overload]

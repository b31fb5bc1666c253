"""``Retry``: the ``retry=`` job option, how a run whose handler failed is run again.

The runner owns a run's attempts (``_runner.Runner.execute``): a failed attempt is recorded,
then the next waits ``delay(n)`` on the scheduler's clock and runs under the same claim or
lease (``ctx.reason == "retry"``, ``ctx.attempt`` one more). Here only the policy: its values,
checked once, the waits and the worst case the registration checks against the next slot.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from ._durations import Duration, format_duration, parse_duration
from ._exceptions import ConfigurationError

__all__ = ["Retry", "parse_retry"]

# A wait doubles from ``backoff`` at most this many times (2**30 times 1 ms is 12 days): a
# large ``attempts`` without ``max_backoff`` never overflows a timedelta.
_MAX_DOUBLINGS = 30
_MAX_ATTEMPTS = 1000


@dataclass(frozen=True, slots=True, init=False, repr=False)
class Retry:
    """Run a failed handler again: up to ``attempts`` runs in all (the first included), the
    ``n``-th retry after ``backoff * 2**(n-1)`` (at most ``max_backoff``) plus up to ``jitter``
    at random, for the exceptions in ``on`` (a timeout counts as ``TimeoutError``). With
    ``deadline``, no retry starts later than ``deadline`` after the slot's instant.

    ``every("1h", sync, retry=Retry(attempts=5, backoff="30s", max_backoff="5m"))``
    """

    attempts: int
    backoff: timedelta
    max_backoff: timedelta | None
    jitter: timedelta
    on: tuple[type[Exception], ...]
    deadline: timedelta | None

    def __init__(
        self,
        *,
        attempts: int = 3,
        backoff: Duration = "10s",
        max_backoff: Duration | None = None,
        jitter: Duration = 0,
        on: type[Exception] | Sequence[type[Exception]] = (Exception,),
        deadline: Duration | None = None,
    ) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            _refuse(f"attempts ({attempts!r}) must be a whole number, 1 or more")
        if not 1 <= attempts <= _MAX_ATTEMPTS:
            _refuse(f"attempts ({attempts}) must be 1 to {_MAX_ATTEMPTS} (1: no retry)")
        wait = _duration(backoff, "backoff")
        cap = None if max_backoff is None else _duration(max_backoff, "max_backoff")
        if cap is not None and cap < wait:
            _refuse(
                f"max_backoff ({format_duration(cap)}) must be at least backoff "
                f"({format_duration(wait)})",
            )
        until = None if deadline is None else _duration(deadline, "deadline")
        if until is not None and until <= timedelta(0):
            _refuse(f"deadline ({format_duration(until)}) must be greater than 0")
        set_ = object.__setattr__
        set_(self, "attempts", attempts)
        set_(self, "backoff", wait)
        set_(self, "max_backoff", cap)
        set_(self, "jitter", _duration(jitter, "jitter"))
        set_(self, "on", _exceptions(on))
        set_(self, "deadline", until)

    def __repr__(self) -> str:
        shown = [f"attempts={self.attempts}", f"backoff='{format_duration(self.backoff)}'"]
        for name in ("max_backoff", "jitter", "deadline"):
            value = getattr(self, name)
            if value:
                shown.append(f"{name}='{format_duration(value)}'")
        if self.on != (Exception,):
            names = ", ".join(c.__name__ for c in self.on)
            shown.append(f"on=({names}{',' if len(self.on) == 1 else ''})")
        return f"Retry({', '.join(shown)})"

    def delay(self, retry: int, *, jittered: bool = True) -> timedelta:
        """The wait before retry number ``retry`` (1: the second run); ``jittered=False``: the
        longest it can be, jitter included (for the worst case)."""
        wait = self.backoff * (1 << min(retry - 1, _MAX_DOUBLINGS))
        if self.max_backoff is not None:
            wait = min(wait, self.max_backoff)
        if not jittered:
            return wait + self.jitter
        return wait + self.jitter * random.random()

    def catches(self, exception: BaseException | None) -> bool:
        """Whether a run that ended with ``exception`` is retried."""
        return exception is not None and isinstance(exception, self.on)

    def worst_case(self, timeout: timedelta | None) -> tuple[timedelta, str]:
        """How long after its first run began a slot's last retry can end, and the sum as a
        message says it: every wait at its longest, every run up to ``timeout`` (a run without
        one counts nothing), bounded by ``deadline`` plus one run."""
        retries = self.attempts - 1
        waits = sum((self.delay(n, jittered=False) for n in range(1, retries + 1)), timedelta())
        runs = (timeout or timedelta(0)) * self.attempts
        said = f"{retries} waits of up to {format_duration(waits)} in all"
        if timeout is not None:
            said += f" + {self.attempts} runs of up to {format_duration(timeout)} (timeout)"
        total = waits + runs
        if self.deadline is not None and self.deadline + (timeout or timedelta(0)) < total:
            total = self.deadline + (timeout or timedelta(0))
            said = f"deadline {format_duration(self.deadline)}"
            if timeout is not None:
                said += f" + a last run of up to {format_duration(timeout)} (timeout)"
        return total, f"{said} = {format_duration(total)}"


def _refuse(message: str) -> NoReturn:
    raise ConfigurationError(f"Retry: {message}", option="retry")


def _duration(value: Duration, name: str) -> timedelta:
    try:
        return parse_duration(value, name=name)
    except ConfigurationError as exc:
        raise ConfigurationError(f"Retry: {exc}", option="retry") from None


def _exceptions(on: object) -> tuple[type[Exception], ...]:
    classes = (on,) if isinstance(on, type) else on
    if isinstance(classes, str) or not isinstance(classes, Sequence) or not classes:
        _refuse(f"on ({on!r}) must be an exception class or a non-empty tuple of them")
    for each in classes:
        if not (isinstance(each, type) and issubclass(each, Exception)):
            _refuse(
                f"on: {each!r} is not an Exception subclass (a run cut short by a stop or a lost "
                "lease is never retried; catch Exception or narrower)",
            )
    return tuple(classes)


def parse_retry(value: Any) -> Retry | None:
    """The ``retry`` job option: a ``Retry``, its keywords as a mapping (an override from JSON),
    or ``None``."""
    if value is None or isinstance(value, Retry):
        return value
    if isinstance(value, dict):
        try:
            return Retry(**value)
        except TypeError as exc:
            raise ConfigurationError(f"Retry: {exc}", option="retry") from None
    raise ConfigurationError(
        f"option 'retry' = {value!r} is not a Retry: use Retry(attempts=3, backoff='10s', ...) "
        "or a mapping of its keywords",
        option="retry",
    )

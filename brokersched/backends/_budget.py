"""The server's budget, watched while a backend runs: what every backend shares.

A backend reads its server's limits and usage at ``start()`` and every ``budget_interval``
(30 s) through its own pure ``read_budget`` (RabbitMQ: the management API; Redis: ``INFO``;
NATS: the JetStream account; PostgreSQL: connections against ``max_connections``), which
maps the server's figures to a ``BrokerBudget``. ``BudgetWatch`` does the rest, the same way
for all:

- from ``WARN`` of the budget a warning is logged (RabbitMQ also stops declaring ahead);
- from ``SHED`` of a part whose exhaustion could run a slot twice or lock other clients out,
  the backend *sheds*: it makes no new claim (or claim queue, or connection), so those slots
  are skipped (``backend-error``, "shedding"), never run twice;
- it leaves shedding only once the reading is back under ``WARN`` (hysteresis);
- a reading that fails keeps the last state and is logged once until a reading succeeds.

SQLite has no server: its budget stays ``None``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from .._clock import Clock
from .._exceptions import BackendError
from ..abc import BrokerBudget

__all__ = [
    "PERIOD_S",
    "SHED",
    "WARN",
    "BudgetWatch",
    "Effects",
    "Part",
    "judge",
    "share",
]

WARN, SHED = 0.6, 0.8
PERIOD_S = 30.0

State = Literal["ok", "warn", "shed"]


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """One figure of a server's budget: what was read (``detail``), its share of the limit
    (``used``), and whether reaching ``SHED`` sheds (``False``: it only warns, the server
    failing closed on its own when it is exhausted)."""

    detail: str
    used: float
    sheds: bool = True


def judge(parts: Sequence[Part], *, alarms: Sequence[str] = (), unknown: str) -> BrokerBudget:
    """The budget of ``parts``: ``used`` the fullest part's share; ``shed`` under an alarm or
    when a part that sheds is at ``SHED`` or more; ``warn`` when any part is at ``WARN`` or
    more; the detail lists the parts, fullest first (``unknown`` when there is none)."""
    ordered = sorted(parts, key=lambda part: part.used, reverse=True)
    used = ordered[0].used if ordered else 0.0
    shed_used = max((part.used for part in parts if part.sheds), default=0.0)
    state: State = "shed" if alarms or shed_used >= SHED else "warn" if used >= WARN else "ok"
    details = [part.detail for part in ordered] or [unknown]
    return BrokerBudget(
        used=used, state=state, detail="; ".join([*details, *alarms]), shed_used=shed_used
    )


def share(used: object, limit: object) -> float | None:
    """``used / limit`` for two numbers with a positive limit (Redis, NATS and PostgreSQL say
    0 or -1 for no limit); ``None`` otherwise."""
    if isinstance(used, bool) or isinstance(limit, bool):
        return None
    if isinstance(used, int | float) and isinstance(limit, int | float) and limit > 0:
        return max(0.0, used / limit)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Effects:
    """What the backend does in each state, for its log lines: ``server`` (``broker``,
    ``server``, ``database``), ``warn`` (from WARN), ``shed`` (from SHED: what is no longer
    made and which slots are skipped), ``back`` (under WARN again), ``fix`` (for the
    operator)."""

    server: str
    warn: str
    shed: str
    back: str
    fix: str


class BudgetWatch:
    """Reads the budget with ``read`` at ``start()`` and every ``period`` seconds until
    ``close()``; ``reading`` is the last reading (``None`` before the first that succeeded)."""

    def __init__(
        self,
        backend: str,
        read: Callable[[], Awaitable[BrokerBudget]],
        effects: Effects,
        *,
        logger: logging.Logger,
        period: float = PERIOD_S,
    ) -> None:
        self._backend = backend
        self._read = read
        self._effects = effects
        self._log = logger
        self._period = period
        self.reading: BrokerBudget | None = None
        self._failing = self._unforeseen = False  # a failing read is said once
        self._task: asyncio.Task[None] | None = None

    @property
    def shedding(self) -> bool:
        return self.reading is not None and self.reading.state == "shed"

    @property
    def at_ease(self) -> bool:
        """Nothing read yet, or under ``WARN``: work ahead (RabbitMQ's declares) may go on."""
        return self.reading is None or self.reading.state == "ok"

    async def start(self, clock: Clock) -> None:
        await self._read_logged()
        self._task = asyncio.create_task(self._every_period(clock), name="brokersched-budget")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _every_period(self, clock: Clock) -> None:
        while True:
            await clock.sleep(self._period)
            await self._read_logged()

    async def _read_logged(self) -> None:
        try:
            await self.read()
        except Exception:  # an answer of a shape not foreseen: said once, read again later
            if not self._unforeseen:
                self._log.exception(
                    "%s: the %s's budget could not be read", self._backend, self._effects.server
                )
            self._unforeseen = True

    async def read(self) -> None:
        """One reading; its change of state logged."""
        try:
            reading = await self._read()
        except BackendError as exc:
            if not self._failing:
                self._log.warning(
                    "%s: the %s's budget could not be read: %s",
                    self._backend,
                    self._effects.server,
                    exc,
                )
            self._failing = True
            return
        self._failing = self._unforeseen = False
        was = "ok" if self.reading is None else self.reading.state
        shed_used = _shed_used(reading)
        if was == "shed" and reading.state == "warn" and shed_used >= WARN:
            reading = dataclasses.replace(reading, state="shed")  # until back under WARN
        self.reading = reading
        if reading.state == was:
            return
        effects = self._effects
        percent = (shed_used if reading.state == "shed" else reading.used) * 100
        if reading.state == "shed":
            self._log.error(
                "%s: shedding: the %s is at %.0f%% of its budget (%s): %s, until it is back "
                "under %.0f%%. %s",
                self._backend, effects.server, percent, reading.detail, effects.shed,
                WARN * 100, effects.fix,
            )  # fmt: skip
        elif reading.state == "warn":
            self._log.warning(
                "%s: the %s is at %.0f%% of its budget (%s); %s",
                self._backend, effects.server, percent, reading.detail, effects.warn,
            )  # fmt: skip
        else:
            self._log.warning(
                "%s: the %s is back at %.0f%% of its budget: %s",
                self._backend, effects.server, percent, effects.back,
            )  # fmt: skip

    def shed_error(self, what: str) -> BackendError:
        """The error of what shedding refuses (``what``: e.g. "claim queue 'q' is not
        declared"): the slot is skipped (``backend-error``), never run."""
        reading = self.reading
        assert reading is not None
        return BackendError(
            f"{self._backend}: shedding: {what}, the {self._effects.server} being at "
            f"{_shed_used(reading) * 100:.0f}% of its budget ({reading.detail}); the slot is "
            "skipped, not run"
        )

    def refuse_if_shedding(self, what: str) -> None:
        if self.shedding:
            raise self.shed_error(what)


def _shed_used(reading: BrokerBudget) -> float:
    return reading.used if reading.shed_used is None else reading.shed_used

"""``JobContext``: what a handler knows about the run it is doing."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Literal

from ._clock import Clock, SystemClock, ms_to_datetime
from .abc import RunReason

__all__ = ["AbortReason", "JobContext"]

AbortReason = Literal["timeout", "lock-lost", "removed", "shutdown"]

_logger = logging.getLogger("brokersched.job")


class _RunAdapter(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs.setdefault("extra", {}).update(extra)
        return f"[{extra.get('job')} {extra.get('run_id')}] {msg}", kwargs


class JobContext:
    """The run a handler is doing.

    ``abort_reason`` becomes ``"timeout"``, ``"lock-lost"``, ``"removed"`` or ``"shutdown"`` when
    the run must stop; async handlers are also cancelled at their next ``await``, sync handlers
    (run in a worker thread) should watch it.
    """

    __slots__ = (
        "_clock",
        "abort_reason",
        "attempt",
        "data",
        "instance_id",
        "job",
        "logger",
        "reason",
        "run_id",
        "slot_ms",
    )

    def __init__(
        self,
        *,
        job: str,
        run_id: str,
        slot_ms: int,
        reason: RunReason,
        attempt: int,
        data: Any,
        instance_id: str,
        clock: Clock | None = None,
    ) -> None:
        self.job = job
        self.run_id = run_id
        self.slot_ms = slot_ms
        self.reason: RunReason = reason
        self.attempt = attempt
        self.data = data
        self.instance_id = instance_id
        self.abort_reason: AbortReason | None = None
        self.logger: logging.LoggerAdapter[logging.Logger] = _RunAdapter(
            _logger, {"job": job, "run_id": run_id}
        )
        self._clock = clock or SystemClock()

    @property
    def scheduled_at(self) -> datetime:
        """The slot's instant, an aware UTC datetime."""
        return ms_to_datetime(self.slot_ms)

    @property
    def aborted(self) -> bool:
        return self.abort_reason is not None

    async def sleep(self, seconds: float) -> None:
        """Sleep on the scheduler's clock (virtual under ``TestClock``)."""
        await self._clock.sleep(seconds)

    def __repr__(self) -> str:
        return (
            f"JobContext(job={self.job!r}, run_id={self.run_id!r}, slot_ms={self.slot_ms}, "
            f"reason={self.reason!r}, attempt={self.attempt})"
        )

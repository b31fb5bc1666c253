"""``Host``: the scheduler as the rooms behind its façade see it (registration, life cycle, fleet
controls), so that none of them imports the façade."""

from __future__ import annotations

from typing import Protocol

from ._clock import Clock
from ._options import SchedulerOptions
from .abc import Backend

__all__ = ["Host"]


class Host(Protocol):
    """What the rooms read of their ``Scheduler``, each time as it is then: an application may
    set ``scheduler.backend`` after registering its jobs, and a fork gives the scheduler a new
    ``instance_id`` (written by the life cycle, ``_lifecycle``)."""

    instance_id: str

    @property
    def backend(self) -> Backend: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def options(self) -> SchedulerOptions: ...

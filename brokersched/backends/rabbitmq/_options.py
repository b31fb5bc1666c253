"""``RabbitMQBackend``'s options, declared and checked in one call (``backends/_options``); the
keywords handed on to ``aio_pika.connect_robust`` are checked by ``refuse_unknown``."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt

from .._options import BudgetPeriod, ClaimOptions, Flag, PositiveDuration, checked
from ._errors import check_urls
from ._names import check_prefix

__all__ = ["RabbitMQOptions"]


class RabbitMQOptions(ClaimOptions):
    #: The URLs of the cluster's nodes (one, when a single URL was given).
    url: Annotated[list[str], checked(check_urls)]
    prefix: Annotated[str, checked(check_prefix)]
    channels: Annotated[StrictInt, Field(ge=1, le=1000)]
    claim_timeout: PositiveDuration
    declare_ahead: Flag
    budget_interval: BudgetPeriod

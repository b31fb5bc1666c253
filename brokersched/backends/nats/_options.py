"""The options of the NATS backends, declared and checked in one call (``backends/_options``);
the keywords handed on to ``nats.connect`` are checked by ``refuse_unknown``."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from pydantic import Field, StrictInt, ValidationInfo, field_validator

from .._options import (
    BackendOptions,
    BudgetPeriod,
    ClaimOptions,
    LeaseOptions,
    checked,
    name_check,
    positive_duration,
)
from ._bucket import check_bucket
from ._errors import check_servers

__all__ = ["NATSLeaseOptions", "NATSOptions", "ServerOptions", "check_prefix"]

# How long a claim waits for a definite answer by default. On one server a claim that cannot be
# answered within 2 s means the server is down: fail closed, the slot is skipped. A replicated
# stream has no leader for seconds after its leader dies, and again after a partitioned node
# comes back (it has raised its Raft term while cut off, so the leader steps down and a new
# election runs; measured here on nats-server 2.9.10: 2-12 s). A claim that gives up after 2 s
# then loses every slot of the election (in one run, 84 slots lost just after the link came
# back); one that waits runs them late instead, within max_late, still exactly once.
_CLAIM_TIMEOUT = "2s"
_CLUSTER_CLAIM_TIMEOUT = "30s"


check_prefix = name_check(
    "prefix",
    r"[A-Za-z0-9_-]{1,64}",
    "1-64 letters, digits, '_' or '-' (it names streams and subjects)",
)


class ServerOptions(BackendOptions):
    """What both NATS backends take: the servers, the streams' replicas, the budget's period."""

    servers: Annotated[list[str], checked(check_servers)]
    replicas: Annotated[StrictInt, Field(ge=1, le=5)]
    budget_interval: BudgetPeriod


class NATSOptions(ClaimOptions, ServerOptions):
    """``NATSBackend``'s options."""

    prefix: Annotated[str, checked(check_prefix)]
    #: Unset: ``_CLAIM_TIMEOUT`` on one server, ``_CLUSTER_CLAIM_TIMEOUT`` with replicas.
    claim_timeout: timedelta

    @field_validator("claim_timeout", mode="before")
    @classmethod
    def _claim_timeout(cls, value: Any, info: ValidationInfo) -> timedelta:
        if value is None:
            value = _CLUSTER_CLAIM_TIMEOUT if info.data.get("replicas") != 1 else _CLAIM_TIMEOUT
        return positive_duration(value, info)


class NATSLeaseOptions(LeaseOptions, ServerOptions):
    """``NATSLeaseBackend``'s options."""

    bucket: Annotated[str, checked(check_bucket)]

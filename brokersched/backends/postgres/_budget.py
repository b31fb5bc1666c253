"""The PostgreSQL server's budget, read over the backend's own pool: the client
connections open (``pg_stat_activity``, ``backend_type = 'client backend'``; a role without
``pg_read_all_stats`` sees other roles' sessions with no type: counted when in a database)
against what ordinary roles may open, ``max_connections`` less
``superuser_reserved_connections`` (and PostgreSQL 16's ``reserved_connections``).

Near that limit every application of the server is refused new connections. From ``SHED`` the
backend's pool opens no new connection for a claim: a claim that finds no idle connection in
the pool is skipped (``backend-error``, "shedding"), never run twice; renewals, releases and
records go on (a run in progress keeps its lease).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from ...abc import BrokerBudget
from .._budget import SHED, BudgetWatch, Effects, Part, judge, share

__all__ = ["BUDGET_SQL", "EFFECTS", "postgres_budget_watch", "read_budget"]

_log = logging.getLogger("brokersched.backends.postgres")

#: One row: ``used``, ``max_connections``, ``superuser_reserved``, ``reserved``, ``version``.
BUDGET_SQL = """
SELECT (SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'client backend' OR (backend_type IS NULL AND datid IS NOT NULL))::int
           AS used,
       current_setting('max_connections')::int AS max_connections,
       current_setting('superuser_reserved_connections')::int AS superuser_reserved,
       coalesce(nullif(current_setting('reserved_connections', true), ''), '0')::int
           AS reserved,
       current_setting('server_version') AS version
"""

EFFECTS = Effects(
    server="database",
    warn=f"claims go on (from {SHED:.0%} the pool opens no new connection for a claim)",
    shed=(
        "the pool opens no new connection for a claim, so a slot whose claim finds no idle "
        "connection is skipped"
    ),
    back="claims open connections again",
    fix=(
        "Raise max_connections, put a pooler (PgBouncer) in front of the applications, or "
        "lower the pools' max_size"
    ),
)


def read_budget(
    *,
    used: int,
    max_connections: int,
    superuser_reserved: int = 0,
    reserved: int = 0,
    version: str | None = None,
) -> BrokerBudget:
    """The budget from the row of ``BUDGET_SQL``."""
    limit = max_connections - superuser_reserved - reserved
    server = f"; PostgreSQL {version}" if version else ""
    taken = share(used, limit)
    if taken is None:  # every connection reserved: nothing an ordinary role may open
        taken = 1.0
    part = Part(
        f"{used} client connections of the {limit} ordinary roles may open "
        f"(max_connections {max_connections} - {superuser_reserved + reserved} reserved)",
        taken,
    )
    budget = judge([part], unknown="")
    return dataclasses.replace(budget, detail=budget.detail + server)


def postgres_budget_watch(
    backend: str, read: Callable[[], Awaitable[BrokerBudget]], period: float
) -> BudgetWatch:
    return BudgetWatch(backend, read, EFFECTS, logger=_log, period=period)

"""A sync handler that ignores ``ctx.abort_reason``: the drain cannot stop it (SQLite backend).

``BROKERSCHED_TEST_DRAIN`` sets the scheduler's ``drain_timeout``.
"""

from __future__ import annotations

import os
import time

from brokersched import JobContext, Scheduler, SQLiteBackend

scheduler = Scheduler(
    SQLiteBackend(os.environ["BROKERSCHED_TEST_DB"], lease_ttl="5s"),
    jitter=0,
    drain_timeout=os.environ.get("BROKERSCHED_TEST_DRAIN", "500ms"),
)


@scheduler.every("stubborn", "500ms", catch_up=0, max_late="1s")
def stubborn(ctx: JobContext) -> None:
    ctx.logger.info("stubborn run started")
    time.sleep(30)  # blocking, and never looks at ctx.abort_reason

"""A fleet member for ``brokersched purge`` (tests/deploy/test_cli_ops.py): the backend of
``ops_app`` (the same variables), the instance id in ``BROKERSCHED_TEST_INSTANCE``, and one job
due in 2100 only. It claims, leases and records nothing: its presence is the only sign that it
runs."""

from __future__ import annotations

import os
from datetime import UTC, datetime

from brokersched import JobContext, Scheduler
from brokersched.abc import Backend
from tests.support.cli_apps.ops_app import make_backend


def create() -> Scheduler[Backend]:
    backend = make_backend(
        os.environ["BROKERSCHED_TEST_BACKEND"],
        os.environ["BROKERSCHED_TEST_URL"],
        os.environ["BROKERSCHED_TEST_PREFIX"],
    )
    scheduler = Scheduler(
        backend,
        jitter=0,
        max_late="5s",  # under ops_app's slot_ttl
        drain_timeout="1s",
        instance_id=os.environ.get("BROKERSCHED_TEST_INSTANCE"),
    )

    @scheduler.at("someday", datetime(2100, 1, 1, tzinfo=UTC))
    async def someday(ctx: JobContext) -> None:
        pass

    return scheduler

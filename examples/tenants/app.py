"""A SaaS app with a schedule per tenant: creating a tenant creates its report's schedule,
changing its plan changes it, removing the tenant removes it. The schedules are data, kept in
the backend; every worker of every instance runs the scheduler, and each slot of each tenant's
schedule runs once on the whole fleet.

    BROKERSCHED_URL=postgresql://... uvicorn examples.tenants.app:app --workers 3

``BROKERSCHED_URL``: ``postgresql://...`` or ``amqp://...`` (examples/fastapi takes the other
backends too); unset, an in-memory backend per process, only good for trying one worker out.
``REPORTS_FILE``: where each report's line goes (the tests count them), else the log.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from brokersched import ConfigurationError, JobContext, ScheduleConflictError, Scheduler
from brokersched.abc import Backend

logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"))
logger = logging.getLogger("tenants")


def _backend(url: str | None) -> Backend | None:
    if not url:
        return None
    if url.startswith("amqp"):
        from brokersched import RabbitMQBackend

        return RabbitMQBackend(url, prefix=os.environ.get("BROKERSCHED_PREFIX", "brokersched"))
    from brokersched import PostgresBackend

    return PostgresBackend(url, schema=os.environ.get("BROKERSCHED_SCHEMA", "brokersched"))


scheduler: Scheduler[Any] = Scheduler(_backend(os.environ.get("BROKERSCHED_URL")))


@scheduler.task("reports.send")
def send_report(ctx: JobContext) -> None:
    """One tenant's report: what the schedule's ``data`` says."""
    line = {"tenant": ctx.data["tenant"], "slot_ms": ctx.slot_ms, "pid": os.getpid()}
    path = os.environ.get("REPORTS_FILE")
    if path is None:
        ctx.logger.info("report of %s for %s", ctx.data["tenant"], ctx.scheduled_at)
        return
    with open(path, "a") as out:  # one short line per report: appends do not interleave
        out.write(json.dumps(line) + "\n")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with scheduler:
        yield


app = FastAPI(lifespan=lifespan)


class Plan(BaseModel):
    """When a tenant's report is sent: a cron expression in the tenant's time zone, or an
    interval (``"1h"``; short ones are for trying it out)."""

    cron: str | None = None
    every: str | None = None
    timezone: str | None = Field(default=None, description="the cron's (default: UTC)")
    version: int | None = Field(default=None, description="change only this version")


def _schedule_id(tenant: str) -> str:
    return f"tenant-{tenant}"


@app.put("/tenants/{tenant}")
async def put_tenant(tenant: str, plan: Plan) -> dict[str, Any]:
    """Create the tenant's schedule, or change it."""
    trigger: dict[str, Any] = {"every": plan.every}
    if plan.cron:
        trigger = {"cron": plan.cron, "timezone": plan.timezone}
    try:
        schedule = await scheduler.schedules.put(
            _schedule_id(tenant),
            task="reports.send",
            data={"tenant": tenant},
            if_version=plan.version,
            by="tenants-api",
            **trigger,
        )
    except ConfigurationError as exc:
        raise HTTPException(400, str(exc)) from None
    except ScheduleConflictError as exc:
        raise HTTPException(409, {"error": str(exc), "version": exc.version}) from None
    return schedule.to_json()


@app.delete("/tenants/{tenant}", status_code=204)
async def delete_tenant(tenant: str) -> None:
    if not await scheduler.schedules.delete(_schedule_id(tenant), by="tenants-api"):
        raise HTTPException(404, f"no tenant {tenant!r}")


@app.get("/tenants")
async def tenants() -> list[dict[str, Any]]:
    return [s.to_json() async for s in scheduler.schedules.list(prefix="tenant-")]

"""A FastAPI service that also runs scheduled jobs: the scheduler lives in the app's lifespan.

    uvicorn examples.fastapi.app:app --workers 3               # or, pre-forked:
    gunicorn -c examples/gunicorn/gunicorn.conf.py examples.fastapi.app:app

Every worker process runs the scheduler; each slot of ``report.build`` runs on one of them (and
on one instance of the whole fleet), claimed through the backend named by ``BROKERSCHED_URL``:
``amqp://...`` (RabbitMQ), ``postgresql://...``, ``nats://...``, ``redis://...``; unset, each
process has an in-memory backend of its own, which is only good for trying the app out.
``cache.refresh`` runs in every process (``claim=False``). ``/health`` answers 503 while a job
is overdue (a readiness probe); ``/metrics`` serves Prometheus metrics of all the workers (set
``PROMETHEUS_MULTIPROC_DIR``, see docs/operations.md, "Deploying").
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

from brokersched import JobContext, PrometheusMetrics, Scheduler, parse_duration
from brokersched.abc import Backend

logging.basicConfig(
    level=os.environ.get("LOG_LEVEL", "INFO"),
    format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
)
logger = logging.getLogger("app")


def backend_from_url(url: str | None) -> Backend | None:
    """The backend a URL names; ``None`` (the in-memory default) without one."""
    if not url:
        return None
    if url.startswith(("amqp://", "amqps://")):
        from brokersched import RabbitMQBackend

        return RabbitMQBackend(url, prefix=os.environ.get("BROKERSCHED_PREFIX", "brokersched"))
    if url.startswith(("postgres://", "postgresql://")):
        from brokersched import PostgresBackend

        return PostgresBackend(url, schema=os.environ.get("BROKERSCHED_SCHEMA", "brokersched"))
    if url.startswith(("nats://", "tls://")):
        from brokersched import NATSBackend

        return NATSBackend(url, prefix=os.environ.get("BROKERSCHED_PREFIX", "brokersched"))
    if url.startswith(("redis://", "rediss://")):
        from brokersched import RedisBackend

        return RedisBackend(url, prefix=os.environ.get("BROKERSCHED_PREFIX", "brokersched"))
    raise ValueError(f"BROKERSCHED_URL {url.split('://')[0]}://... is not a known backend")


# Made at import: under `gunicorn --preload` this happens once, in the master, before the fork;
# each worker still gets an instance_id and a jitter of its own when the scheduler starts.
# DRAIN_TIMEOUT: how long stop() lets running jobs finish; keep it under the platform's grace
# period (gunicorn's graceful_timeout, Kubernetes' terminationGracePeriodSeconds).
scheduler: Scheduler[Any] = Scheduler(
    backend_from_url(os.environ.get("BROKERSCHED_URL")),
    drain_timeout=os.environ.get("DRAIN_TIMEOUT", "10s"),
)
metrics = PrometheusMetrics().attach(scheduler)
REPORT_EVERY = os.environ.get("REPORT_EVERY", "2s")
# how long building a report takes (seconds, or a duration: "3s")
REPORT_WORK = parse_duration(os.environ.get("REPORT_WORK", "0")).total_seconds()


@scheduler.every("report.build", REPORT_EVERY)
async def build_report(ctx: JobContext) -> None:
    await ctx.sleep(REPORT_WORK)
    ctx.logger.info("report for %s built by %s", ctx.scheduled_at, ctx.instance_id)


@scheduler.every("cache.refresh", "2s", claim=False, jitter="900ms")
def refresh_cache(ctx: JobContext) -> None:
    """Per-process work: runs in every worker, in a thread (a sync handler)."""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # wait=False: the app serves (and /health says 503) while the backend is still unreachable
    await scheduler.start(wait=False)
    try:
        yield
    finally:
        await scheduler.stop()  # drains running jobs (drain_timeout < gunicorn's graceful_timeout)


app = FastAPI(lifespan=lifespan)


@app.get("/health")
def health(response: Response) -> dict[str, Any]:
    overdue = [job.name for job in scheduler.overdue()]
    if overdue or not scheduler.ready:
        response.status_code = 503
    return {
        "ready": scheduler.ready,
        "overdue": overdue,
        "instance_id": scheduler.instance_id,
        "pid": os.getpid(),
    }


@app.get("/metrics")
def prometheus() -> Response:
    """This worker's metrics; with ``PROMETHEUS_MULTIPROC_DIR`` set, those of every worker."""
    registry = metrics.registry
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

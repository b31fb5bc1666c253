"""``create_app(scheduler)``: the admin API and the dashboard, one Starlette application."""

from __future__ import annotations

import asyncio
import logging
import os
from importlib.resources import files
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .._json import record_json
from .._redact import redact_text
from .._scheduler import Job, Scheduler
from ..abc import RunRecord
from ._openapi import openapi_schema
from ._security import Authorize, Guard
from ._stream import EventHub
from ._views import backend_text, job_json, job_state, timeline_slots

__all__ = ["TOKEN_ENV", "create_app"]

TOKEN_ENV = "BROKERSCHED_ADMIN_TOKEN"
MAX_HISTORY = 1000
MAX_NAME = 128  # the longest job name (see check_name)
logger = logging.getLogger("brokersched.web")

_STATIC = files(__package__).joinpath("static")
# The page loads its script and style from this app only, and no other site may frame it (its
# buttons change the scheduler).
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def create_app(
    scheduler: Scheduler[Any],
    *,
    token: str | None = None,
    authorize: Authorize | None = None,
) -> Starlette:
    """The admin API and dashboard of ``scheduler``, an ASGI application to serve
    (``brokersched run app:scheduler --http 127.0.0.1:8080``) or to mount
    (``app.mount("/scheduler", create_app(scheduler))``).

    Reading is open to whoever reaches the app; every change (trigger, pause, resume) needs
    ``Authorization: Bearer <token>`` (``token``, by default ``$BROKERSCHED_ADMIN_TOKEN``) or
    ``authorize(request)`` returning True, and is refused from another site's page. With
    neither, changes are disabled. The app must run in the scheduler's event loop.
    """
    guard = Guard(token if token is not None else os.environ.get(TOKEN_ENV) or None, authorize)
    api = _AdminAPI(scheduler, guard)
    routes = [
        Route("/", api.page),
        Route("/dashboard.js", api.static("dashboard.js", "text/javascript")),
        Route("/dashboard.css", api.static("dashboard.css", "text/css")),
        Route("/openapi.json", api.openapi),
        Route("/health", api.health),
        Route("/events", api.events),
        Route("/jobs", api.jobs),
        Route("/jobs/{name}", api.job),
        Route("/jobs/{name}/history", api.history),
        Route("/jobs/{name}/trigger", api.trigger, methods=["POST"]),
        Route("/jobs/{name}/pause", api.pause, methods=["POST"]),
        Route("/jobs/{name}/resume", api.resume, methods=["POST"]),
    ]
    handlers = {HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.events = api.hub
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = exc.detail
    if exc.status_code == 404:
        message = f"no such route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    return JSONResponse({"error": message}, status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The server logs the exception (its traceback may name secrets): the client learns nothing.
    return _error(500, "internal error (the server's log has the details)")


def _limit(raw: str) -> int | JSONResponse:
    # ASCII digits only ("²".isdigit() too), and few of them (int() refuses 4300 and more)
    if raw.isascii() and raw.isdigit() and len(raw) <= 4 and 1 <= int(raw) <= MAX_HISTORY:
        return int(raw)
    shown = repr(raw) if len(raw) < 10 else f"{raw[:10]!r}..."
    return _error(400, f"limit {shown} is invalid: use a whole number from 1 to {MAX_HISTORY}")


def _shown_name(name: str) -> str:
    """A name from the path, quoted; not echoed whole when no job could have it."""
    if len(name) <= MAX_NAME:
        return repr(name)
    return f"{name[:MAX_NAME]!r}... ({len(name)} characters; job names have at most {MAX_NAME})"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _AdminAPI:
    def __init__(self, scheduler: Scheduler[Any], guard: Guard) -> None:
        self.scheduler = scheduler
        self.guard = guard
        self.hub = EventHub(scheduler)
        self._triggers: set[asyncio.Task[RunRecord | None]] = set()

    # -- reading -------------------------------------------------------------------------

    def _job(self, request: Request) -> Job | JSONResponse:
        name = request.path_params["name"]
        job = self.scheduler.get(name)
        if job is None:
            known = ", ".join(j.name for j in self.scheduler.jobs()) or "none"
            return _error(404, f"no job named {_shown_name(name)} (jobs: {known})")
        return job

    async def _last(self, job: Job) -> tuple[RunRecord | None, str | None]:
        """The job's latest record, or why it could not be read."""
        try:
            records = await job.history(1)
        except Exception as exc:  # one job's history must not take the whole list down
            return None, redact_text(f"{type(exc).__name__}: {exc}")
        return (records[0] if records else None), None

    async def _job_json(self, job: Job, runs: int) -> dict[str, Any]:
        last, error = await self._last(job)
        data = job_json(self.scheduler, job, last, runs=runs)
        if error is not None:
            data["history_error"] = error
        return data

    async def jobs(self, request: Request) -> Response:
        jobs = self.scheduler.jobs()
        listed = await asyncio.gather(*(self._job_json(job, 5) for job in jobs))
        return JSONResponse(
            {
                "instance_id": self.scheduler.instance_id,
                "backend": backend_text(self.scheduler),
                "running": self.scheduler.running,
                "changes_enabled": self.guard.configured,
                "jobs": listed,
            }
        )

    async def job(self, request: Request) -> Response:
        job = self._job(request)
        if isinstance(job, Response):
            return job
        return JSONResponse(await self._job_json(job, 10))

    async def history(self, request: Request) -> Response:
        job = self._job(request)
        if isinstance(job, Response):
            return job
        limit = _limit(request.query_params.get("limit", "50"))
        if isinstance(limit, Response):
            return limit
        try:
            records = await job.history(limit)
        except Exception as exc:
            message = redact_text(f"{type(exc).__name__}: {exc}")
            return _error(503, f"cannot read the history of job {job.name!r}: {message}")
        return JSONResponse(
            {
                "job": job.name,
                "records": [record_json(record, job) for record in records],
                "slots": timeline_slots(job, records, self.scheduler.clock.now_ms()),
                "now_ms": self.scheduler.clock.now_ms(),
            }
        )

    async def health(self, request: Request) -> Response:
        if not self.scheduler.running:
            return JSONResponse({"status": "stopped", "overdue": []}, status_code=503)
        overdue = [
            {"job": job.name, "schedule": job.describe(), "state": job_state(self.scheduler, job)}
            for job in self.scheduler.overdue()
        ]
        return JSONResponse(
            {
                "status": "degraded" if overdue else "ok",
                "instance_id": self.scheduler.instance_id,
                "overdue": overdue,
            }
        )

    async def events(self, request: Request) -> Response:
        if request.method == "HEAD":  # the headers only: a stream would hold the connection
            return Response(media_type="text/event-stream", headers=_STREAM_HEADERS)
        if self.hub.full:  # reading is open: nobody may hold every connection and queue
            return JSONResponse(
                {
                    "error": f"too many event-stream clients ({self.hub.clients}); close "
                    "another dashboard tab or try again later"
                },
                status_code=503,
                headers={"Retry-After": "10"},
            )
        return StreamingResponse(
            self.hub.stream(),
            media_type="text/event-stream",
            headers=_STREAM_HEADERS,
        )

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_schema())

    async def page(self, request: Request) -> Response:
        html = _STATIC.joinpath("dashboard.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html", headers=_PAGE_HEADERS)

    def static(self, name: str, media_type: str) -> Any:
        async def endpoint(request: Request) -> Response:
            text = _STATIC.joinpath(name).read_text(encoding="utf-8")
            return Response(text, media_type=media_type, headers=_PAGE_HEADERS)

        return endpoint

    # -- changing (authorised, same-origin) ----------------------------------------------

    async def _authorised_job(self, request: Request) -> Job | Response:
        if refusal := await self.guard.refuse(request):
            return refusal
        return self._job(request)

    async def trigger(self, request: Request) -> Response:
        job = await self._authorised_job(request)
        if isinstance(job, Response):
            return job
        if not self.scheduler.running:
            return _error(409, f"cannot trigger job {job.name!r}: the scheduler is not running")
        task = asyncio.create_task(job.trigger(), name=f"brokersched:web:trigger:{job.name}")
        self._triggers.add(task)
        task.add_done_callback(self._trigger_done)
        return JSONResponse(
            {
                "job": job.name,
                "accepted": True,
                "detail": "the run goes through the claim (another instance may hold the slot);"
                " watch /events or the job's history",
            },
            status_code=202,
        )

    def _trigger_done(self, task: asyncio.Task[RunRecord | None]) -> None:
        self._triggers.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("manual run of a job failed to start: %s", redact_text(str(exc)))

    async def pause(self, request: Request) -> Response:
        return await self._set_paused(request, True)

    async def resume(self, request: Request) -> Response:
        return await self._set_paused(request, False)

    async def _set_paused(self, request: Request, paused: bool) -> Response:
        job = await self._authorised_job(request)
        if isinstance(job, Response):
            return job
        if paused:
            job.pause()
        else:
            job.resume()
        return JSONResponse(
            {
                "job": job.name,
                "state": job_state(self.scheduler, job),
                "scope": f"this instance only ({self.scheduler.instance_id}); other instances "
                "are not affected",
            }
        )

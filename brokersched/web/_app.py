"""``create_app(scheduler)``: the admin API and the dashboard, one Starlette application."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from importlib.resources import files
from typing import Any, get_args

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._exceptions import BackendError
from .._redact import redact_text
from .._scheduler import Job, Scheduler
from ..abc import ControlAction, JobControl, RunRecord
from ._openapi import OPERATIONS, Handler, openapi_document
from ._params import parse_change
from ._query import QueryError
from ._reads import Reads
from ._reply import Reply, error
from ._schedules import ScheduleRoutes
from ._security import PROXIES_ENV, Authorize, Guard, TrustedProxies
from ._stream import EventHub, EventStreamResponse
from ._timeline import Pauses
from ._views import control_json, job_state
from ._vocabulary import VOCABULARY
from ._watch import BackendWatch

__all__ = ["READ_TOKEN_ENV", "TOKEN_ENV", "create_app"]

TOKEN_ENV = "BROKERSCHED_ADMIN_TOKEN"
READ_TOKEN_ENV = "BROKERSCHED_READ_TOKEN"
logger = logging.getLogger("brokersched.web")

_STATIC = files(__package__).joinpath("static")
_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# The page loads its scripts and style from this app only, and no other site may frame it (its
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
    read_token: str | None = None,
    authorize: Authorize | None = None,
    trusted_proxies: str | Sequence[str] | None = None,
) -> Starlette:
    """The admin API and dashboard of ``scheduler``, an ASGI application to serve
    (``brokersched run app:scheduler --http 127.0.0.1:8080``) or to mount
    (``app.mount("/scheduler", create_app(scheduler))``).

    Every change (trigger, pause, resume...) needs ``Authorization: Bearer <token>``
    (``token``, by default ``$BROKERSCHED_ADMIN_TOKEN``) or ``authorize(request)`` returning
    True, and is refused from another site's page. With neither, changes are disabled.
    Reading is open to whoever reaches the app, unless ``read_token`` (by default
    ``$BROKERSCHED_READ_TOKEN``) is set: then reads need it or the admin token, and the read
    token may change nothing. ``authorize(request, action)`` (two arguments) decides per
    action instead, reads included (``action`` is ``"read"``, ``"trigger"``, ``"pause"``,
    ``"resume"``, ``"disable"``, ``"enable"``, ``"skip"``, ``"abort"`` or ``"schedule"``: a
    write of a stored schedule, ``PUT`` or ``DELETE /schedules/{id}``). ``/health`` (its status
    only, to whoever may not read), ``/session``, ``/vocabulary`` and the page itself stay
    open. ``trusted_proxies`` (by default
    ``$BROKERSCHED_TRUSTED_PROXIES``): the reverse proxies, by address or network (``*``: any),
    whose ``X-Forwarded-Host`` names the host a browser asked for. The app must run in the
    scheduler's event loop.
    """
    if trusted_proxies is None:
        trusted_proxies = os.environ.get(PROXIES_ENV)
    guard = Guard(
        token if token is not None else os.environ.get(TOKEN_ENV) or None,
        authorize,
        TrustedProxies(trusted_proxies),
        read_token if read_token is not None else os.environ.get(READ_TOKEN_ENV) or None,
    )
    api = _AdminAPI(scheduler, guard)
    handlers = api.handlers()
    assert handlers.keys() == {op.key for op in OPERATIONS}, "every operation has its handler"
    # One route per path, whatever its methods: a 405 then lists them all in its Allow.
    by_path: dict[str, dict[str, Endpoint]] = {}
    for op in OPERATIONS:
        by_path.setdefault(op.path, {})[op.method.upper()] = op.endpoint(handlers[op.key])
    routes = [
        Route("/", api.page),
        Route("/static/{file}", api.static_file),
        Route("/openapi.json", api.openapi),
        *(
            Route(path, _by_method(endpoints), methods=list(endpoints))
            for path, endpoints in by_path.items()
        ),
    ]
    errors = {HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=errors)
    app.state.events = api.hub
    return app


Endpoint = Callable[[Request], Awaitable[Response]]


def _by_method(endpoints: dict[str, Endpoint]) -> Endpoint:
    """The endpoint of a path: its operation's of the request's method (``HEAD``: ``GET``'s)."""

    async def endpoint(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await endpoints[method](request)

    return endpoint


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
    return JSONResponse({"error": "internal error (the server's log has the details)"}, 500)


# The control actions on a job, each its own route (an abort is of a run: /runs/{run_id}/abort).
_JOB_ACTIONS: tuple[ControlAction, ...] = tuple(a for a in get_args(ControlAction) if a != "abort")
_NO_DATA: Any = object()
MAX_TRIGGER_BODY = 64 * 1024


def _change_here(job: Job, action: ControlAction, actor: str, extra: dict[str, Any]) -> None:
    """A change made through the job (applied here, written at start or kept here only)."""
    if action == "skip":
        job.skip(extra.pop("count"), by=actor, **extra)
    else:
        getattr(job, action)(by=actor, **extra)


async def _trigger_data(request: Request, job: Job) -> Any:
    """A trigger's JSON body (the run's ``ctx.data``), ``_NO_DATA`` when there is none, or the
    error response."""
    body = await request.body()
    if not body.strip():
        return _NO_DATA
    if len(body) > MAX_TRIGGER_BODY:
        return error(
            413, f"the trigger's data is {len(body)} bytes; at most {MAX_TRIGGER_BODY} are taken"
        )
    try:
        return json.loads(body)
    except ValueError as exc:
        return error(
            400,
            f"the body of a trigger of job {job.name!r} must be JSON (the run's ctx.data): {exc}",
        )


def _static_files() -> dict[str, str]:
    """The files the page may load, by name, with their media types."""
    return {
        item.name: _MEDIA_TYPES[suffix]
        for item in _STATIC.iterdir()
        if (suffix := "." + item.name.rpartition(".")[2]) in _MEDIA_TYPES
    }


class _AdminAPI:
    def __init__(self, scheduler: Scheduler[Any], guard: Guard) -> None:
        self.scheduler = scheduler
        self.guard = guard
        self.hub = EventHub(scheduler)
        self.pauses = Pauses()
        self.reads = Reads(scheduler, guard, self.hub, BackendWatch(scheduler), self.pauses)
        self._static = _static_files()
        self._triggers: set[asyncio.Task[RunRecord | None]] = set()
        self.schedules = ScheduleRoutes(scheduler, guard)

    def handlers(self) -> dict[tuple[str, str], Handler]:
        """The handler of each operation (``_openapi.OPERATIONS``), by method and path."""
        reads, read = self.reads, self.reading
        return {
            ("get", "/health"): reads.health,
            ("get", "/session"): reads.session,
            ("get", "/vocabulary"): self.vocabulary,
            ("get", "/overview"): read(reads.overview),
            ("get", "/events"): read(self.events),
            ("get", "/jobs"): read(reads.jobs),
            ("get", "/jobs/{name}"): read(reads.job),
            ("get", "/jobs/{name}/history"): read(reads.history),
            ("get", "/jobs/{name}/timeline"): read(reads.job_timeline),
            ("get", "/jobs/{name}/runs/{run_id}"): read(reads.run),
            ("post", "/jobs/{name}/trigger"): self.trigger,
            **{
                ("post", f"/jobs/{{name}}/{action}"): self.control_route(action)
                for action in _JOB_ACTIONS
            },
            ("get", "/jobs/{name}/audit"): read(reads.audit),
            ("get", "/instances"): read(reads.instances),
            ("get", "/runs"): read(reads.runs),
            ("post", "/runs/{run_id}/abort"): self.abort,
            ("get", "/schedules"): read(self.schedules.list),
            ("get", "/schedules/{id}"): read(self.schedules.get),
            ("put", "/schedules/{id}"): self.schedules.put,
            ("delete", "/schedules/{id}"): self.schedules.delete,
        }

    def reading(self, handler: Handler) -> Handler:
        """``handler``, for a request that may read (``Guard.refuse_read``)."""

        async def read(request: Request) -> Response | Reply:
            if refusal := await self.guard.refuse_read(request):
                return refusal
            return await handler(request)

        return read

    async def events(self, request: Request) -> Response | Reply:
        if request.method == "HEAD":  # the headers only: a stream would hold the connection
            return Response(media_type="text/event-stream", headers=_STREAM_HEADERS)
        client = self.hub.open()
        if client is None:  # reading is open: nobody may hold every connection and queue
            return error(
                503,
                f"too many event-stream clients ({self.hub.clients}); close another dashboard "
                "tab or try again later",
                headers={"Retry-After": "10"},
            )
        return EventStreamResponse(self.hub, client, _STREAM_HEADERS)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def vocabulary(self, request: Request) -> Reply:
        return Reply(VOCABULARY)

    async def page(self, request: Request) -> Response:
        html = _STATIC.joinpath("dashboard.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html", headers=_PAGE_HEADERS)

    async def static_file(self, request: Request) -> Response:
        name = request.path_params["file"]
        if name not in self._static:
            message = f"no such route: {request.method} {request.url.path}"
            return JSONResponse({"error": message}, 404)
        return self._file(name)

    def _file(self, name: str) -> Response:
        text = _STATIC.joinpath(name).read_text(encoding="utf-8")
        return Response(text, media_type=self._static[name], headers=_PAGE_HEADERS)

    def _job(self, request: Request) -> Job | Reply:
        return self.reads.job_of(request)

    # -- changing (authorised, same-origin) ----------------------------------------------

    async def _authorised_job(self, request: Request, action: ControlAction | str) -> Job | Reply:
        if refusal := await self.guard.refuse(request, action):
            return refusal
        return self._job(request)

    async def trigger(self, request: Request) -> Reply:
        job = await self._authorised_job(request, "trigger")
        if isinstance(job, Reply):
            return job
        if not self.scheduler.running:
            return error(409, f"cannot trigger job {job.name!r}: the scheduler is not running")
        if job.disabled:
            return error(409, f"cannot trigger job {job.name!r}: it is disabled (enable it first)")
        data = await _trigger_data(request, job)
        if isinstance(data, Reply):
            return data
        run = job.trigger() if data is _NO_DATA else job.trigger(data)
        task = asyncio.create_task(run, name=f"brokersched:web:trigger:{job.name}")
        self._triggers.add(task)
        task.add_done_callback(self._trigger_done)
        return Reply(
            {
                "job": job.name,
                "accepted": True,
                "detail": "the run goes through the claim (another instance may hold the slot);"
                " watch /events or the job's history",
            },
            202,
        )

    def _trigger_done(self, task: asyncio.Task[RunRecord | None]) -> None:
        self._triggers.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("manual run of a job failed to start: %s", redact_text(str(exc)))

    def control_route(self, action: ControlAction) -> Callable[[Request], Awaitable[Reply]]:
        async def route(request: Request) -> Reply:
            return await self.control(request, action)

        return route

    async def control(self, request: Request, action: ControlAction) -> Reply:
        """``POST /jobs/{name}/pause|resume|disable|enable|skip``: for the whole fleet, through the
        backend (this instance only on a backend that keeps no fleet records)."""
        job = await self._authorised_job(request, action)
        if isinstance(job, Reply):
            return job
        try:
            asked = parse_change(action, await request.body())
        except QueryError as exc:
            return error(400, str(exc))
        actor = self.guard.actor(request)
        scheduler = self.scheduler
        extra = asked.model_dump()
        control: JobControl | None = None
        fleet_wide = scheduler.running and scheduler.backend.fleet
        try:
            if fleet_wide:
                control = await scheduler.change_control(job.name, action, by=actor, **extra)
            else:
                _change_here(job, action, actor, extra)
        except ValueError as exc:  # well formed, but not now: a past until, no slot left
            return error(409, f"cannot {action} job {job.name!r}: {exc}")
        except BackendError as exc:
            return error(
                503,
                f"could not {action} job {job.name!r} for the fleet: {redact_text(str(exc))}",
            )
        if fleet_wide:
            scope = "the fleet"
        elif scheduler.backend.fleet:
            scope = f"the fleet, once this instance starts ({scheduler.instance_id})"
        else:
            scope = (
                f"this instance only ({scheduler.instance_id}): "
                f"{scheduler.backend.name} keeps no fleet records"
            )
        now_ms = scheduler.clock.now_ms()
        if action == "pause":
            self.pauses.paused(job.name, now_ms)
        elif action == "resume":
            self.pauses.resumed(job.name, now_ms)
        body: dict[str, Any] = {"job": job.name, "state": job_state(scheduler, job), "scope": scope}
        shown = control or job.control
        if shown is not None:
            body["control"] = control_json(shown, job, scheduler.clock.now())
        return Reply(body)

    async def abort(self, request: Request) -> Reply:
        """``POST /runs/{run_id}/abort``: ask the run to stop, wherever it runs (cooperative:
        its context is aborted when its instance next reads the fleet's controls)."""
        if refusal := await self.guard.refuse(request, "abort"):
            return refusal
        run_id = request.path_params["run_id"][:64]
        try:
            run = await self.scheduler.abort(run_id, by=self.guard.actor(request))
        except (BackendError, RuntimeError, KeyError) as exc:
            return error(503, f"could not abort run {run_id!r}: {redact_text(str(exc))}")
        if run is None:
            return error(
                404,
                f"no run {run_id!r} in progress on any instance (as the instances last "
                "published themselves)",
            )
        return Reply(
            {
                "run_id": run.run_id,
                "job": run.job,
                "requested": True,
                "detail": "the run's context is aborted when its instance next reads the "
                "fleet's controls (within a heartbeat); watch its history",
            },
            202,
        )

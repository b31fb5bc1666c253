"""The admin API's operations, and its OpenAPI 3.1 document (``GET /openapi.json``) made from
them: each operation names its query parameters (a model of ``_params``, which the route
validates its query with) and, per status code, the body type it answers with (``_bodies``).
Every answer of a route goes through ``Operation.render``, which validates and serialises it
with the type its document declares for that status, and refuses a status the document does not
declare: the document and the code cannot disagree."""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter
from starlette.requests import Request
from starlette.responses import Response

from .. import __version__
from . import _bodies as bodies
from ._params import (
    CHANGE_BODIES,
    SCHEDULE_ID_PATTERN,
    ChangeBody,
    DeleteScheduleParams,
    HistoryParams,
    RunsParams,
    ScheduleBody,
    SchedulesParams,
    WindowParams,
)
from ._reply import Reply
from ._vocabulary import Vocabulary

__all__ = ["OPERATIONS", "Handler", "Operation", "UndocumentedAnswerError", "openapi_document"]

Handler = Callable[[Request], Awaitable["Response | Reply"]]
Answers = Mapping[int, tuple[Any, str]]  # status: (body type, or None for no JSON; description)
_REF = "#/components/schemas/{model}"
_PATH_PARAMETERS = {
    "name": "The job's name, percent-encoded",
    "run_id": "The run's id",
    "id": "The stored schedule's id (a job name), percent-encoded",
}
_PATH_SCHEMAS: dict[str, dict[str, Any]] = {
    "id": {"type": "string", "pattern": SCHEDULE_ID_PATTERN},
}
_READ_FAILED = (bodies.Error, "The backend could not be read")
_NO_JOB = (bodies.Error, "No job has that name")
_BAD_QUERY = (bodies.Error, "A parameter is invalid; `error` names it and what would do")
_CHANGE_REFUSED = {
    401: (bodies.Error, "The admin token is missing or wrong"),
    403: (bodies.Error, "A cross-site request, or changes are disabled"),
}


class UndocumentedAnswerError(RuntimeError):
    """A route answered with a status its OpenAPI document does not declare (a bug)."""


@functools.cache
def _adapter(body: Any) -> TypeAdapter[Any]:
    return TypeAdapter(body)


@dataclass(frozen=True)
class Operation:
    method: Literal["get", "post", "put", "delete"]
    path: str
    summary: str
    answers: Answers
    params: type[BaseModel] | None = None
    changes: bool = False
    """It changes the scheduler: it needs the admin token (or the host's ``authorize``)."""
    body: str | None = None
    """What an optional JSON request body is."""
    body_model: type[BaseModel] | None = None
    """Its schema, when it has one."""
    body_required: bool = False
    reads: bool = False
    """It reads the scheduler: a deployment may protect it with a read token."""
    media_type: str = "application/json"

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path

    def render(self, reply: Reply) -> Response:
        """``reply`` through the body type declared for its status."""
        if reply.status not in self.answers:
            raise UndocumentedAnswerError(
                f"{self.method.upper()} {self.path} answered {reply.status}; its OpenAPI "
                f"document declares {', '.join(map(str, self.answers))}"
            )
        adapter = _adapter(self.answers[reply.status][0])
        content = adapter.dump_json(adapter.validate_python(reply.data))
        return Response(content, reply.status, reply.headers, media_type="application/json")

    def endpoint(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            reply = await handler(request)
            return reply if isinstance(reply, Response) else self.render(reply)

        return answer

    def describe(self, schemas: Mapping[Any, Any]) -> dict[str, Any]:
        described: dict[str, Any] = {"summary": self.summary, "operationId": self._id()}
        parameters = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "description": _PATH_PARAMETERS[name],
                "schema": _PATH_SCHEMAS.get(name, {"type": "string"}),
            }
            for name in re.findall(r"{(\w+)}", self.path)
        ]
        if self.params is not None:
            parameters += _query_parameters(self.params)
        if parameters:
            described["parameters"] = parameters
        if self.body is not None:
            described["requestBody"] = {
                "required": self.body_required,
                "description": self.body,
                "content": {"application/json": {"schema": self._body_schema()}},
            }
        if self.changes:
            described["security"] = [{"bearer": []}]
        elif self.reads:  # open, unless a read token is configured
            described["security"] = [{}, {"bearer": []}]
        described["responses"] = {
            str(status): _response(description, schemas.get(body), self.media_type)
            for status, (body, description) in sorted(self.answers.items())
        }
        return described

    def _body_schema(self) -> dict[str, Any]:
        if self.body_model is None:
            return {}
        return self.body_model.model_json_schema(ref_template=_REF)

    def _id(self) -> str:
        words = [w.strip("{}") for w in self.path.split("/") if w]
        return "_".join([self.method, *words]) if words else self.method


def _response(description: str, schema: Any, media_type: str) -> dict[str, Any]:
    if schema is None:
        return {"description": description, "content": {media_type: {}}}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    """The model's fields as query parameters: a list is comma-separated (``form``, not
    exploded), a field that may be ``None`` is simply left out."""
    schema = model.model_json_schema(ref_template=_REF)
    parameters = []
    for name, prop in schema["properties"].items():
        prop = {k: v for k, v in prop.items() if k != "title"}
        description = prop.pop("description", None)
        if "anyOf" in prop:  # X | None: a query parameter is absent, never null
            (present,) = [p for p in prop.pop("anyOf") if p.get("type") != "null"]
            prop.pop("default", None)
            prop = {**present, **prop}
        parameter: dict[str, Any] = {"name": name, "in": "query", "schema": prop}
        if description:
            parameter["description"] = description
        if prop.get("type") == "array":
            parameter.update(style="form", explode=False)
        parameters.append(parameter)
    return parameters


def _job_reading(summary: str, body: Any, *, params: type[BaseModel] | None = None) -> Answers:
    answers: dict[int, tuple[Any, str]] = {200: (body, summary), 404: _NO_JOB, 503: _READ_FAILED}
    if params is not None:
        answers[400] = _BAD_QUERY
    return answers


def _change(
    action: str, summary: str, body: str = "`note`: why (kept in the audit trail)"
) -> Operation:
    return Operation(
        "post",
        f"/jobs/{{name}}/{action}",
        summary,
        {
            200: (bodies.Change, "Done; `scope` says for whom"),
            400: (bodies.Error, "The body is not a change this action takes; `error` says why"),
            **_CHANGE_REFUSED,
            404: _NO_JOB,
            409: (bodies.Error, "Not now: a pause `until` an instant past, no slot left to skip"),
            503: (bodies.Error, "The backend could not record the change for the fleet"),
        },
        changes=True,
        body=body,
        body_model=CHANGE_BODIES.get(action, ChangeBody),
    )


#: The reads open to anyone, a read token configured or not: a probe's, and the page's own.
OPEN_READS = frozenset({"/health", "/session", "/vocabulary"})
_READ_REFUSED = (
    bodies.Error,
    "A read token is configured (or the host application decides reads) and this request "
    "carries no credentials that may read",
)


def _guarded(op: Operation) -> Operation:
    """A read declares the 401 a protected deployment answers, and the optional token."""
    if op.method != "get" or op.path in OPEN_READS:
        return op
    return replace(op, answers={**op.answers, 401: _READ_REFUSED}, reads=True)


_OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "get",
        "/health",
        "ok, or degraded with the overdue jobs (200); 503 when stopped, or when the backend is "
        "unreachable (known within seconds: the backend is read when nothing was heard of it "
        "for 5 s)",
        {
            200: (bodies.Health, "Running"),
            503: (bodies.Health, "Stopped, or the backend unreachable"),
        },
    ),
    Operation(
        "get",
        "/session",
        "What the caller may change: with the token it sends, or the host application's "
        "authorize() (a cookie session)",
        {200: (bodies.Session, "The session")},
    ),
    Operation(
        "get",
        "/vocabulary",
        "Every word the API answers with, by kind: outcomes, reasons, slot and job states, "
        "liveness, control actions, events, job options",
        {200: (Vocabulary, "The words")},
    ),
    Operation(
        "get",
        "/overview",
        "The fleet at a glance: every job with its timeline over the window, failures of the "
        "last hour, the next runs, the instances",
        {200: (bodies.Overview, "The overview"), 400: _BAD_QUERY},
        params=WindowParams,
    ),
    Operation(
        "get",
        "/events",
        "Server-Sent Events: each message's `event` is one of the vocabulary's `events`, its "
        "`data` JSON",
        {
            200: (None, "The stream"),
            503: (bodies.Error, "Too many event-stream clients (Retry-After)"),
        },
        media_type="text/event-stream",
    ),
    Operation(
        "get",
        "/jobs",
        "Every job: schedule, options, state here, next runs, last run",
        {200: (bodies.Jobs, "The jobs")},
    ),
    Operation(
        "get",
        "/jobs/{name}",
        "One job",
        {200: (bodies.JobEntry, "The job"), 404: _NO_JOB},
    ),
    Operation(
        "get",
        "/jobs/{name}/history",
        "The job's runs on every instance, newest first (from the backend); filtered and paged "
        "over its newest 1000 records",
        _job_reading("The runs", bodies.History, params=HistoryParams),
        params=HistoryParams,
    ),
    Operation(
        "get",
        "/jobs/{name}/timeline",
        "The job's runs in a window, the lanes of the instances that ran them, and what became "
        "of the slots nobody ran",
        _job_reading("The timeline", bodies.Timeline, params=WindowParams),
        params=WindowParams,
    ),
    Operation(
        "get",
        "/jobs/{name}/runs/{run_id}",
        "One run (found among the job's newest 1000 records), the attempts at its slot, its "
        "neighbours",
        _job_reading("The run", bodies.RunPage),
    ),
    Operation(
        "post",
        "/jobs/{name}/trigger",
        "Run the job now, through the claim, in the background; refused (409) while the job is "
        "disabled or the scheduler is not running",
        {
            202: (bodies.TriggerAccepted, "Accepted"),
            400: (bodies.Error, "The body is not JSON"),
            **_CHANGE_REFUSED,
            404: _NO_JOB,
            409: (bodies.Error, "The job is disabled, or the scheduler is not running"),
            413: (bodies.Error, "The body is larger than 64 KiB"),
        },
        changes=True,
        body="The run's ctx.data: any JSON value, at most 64 KiB",
    ),
    _change(
        "pause",
        "Pause the job for the whole fleet (through the backend; this instance only on a "
        "backend that keeps no fleet records): no instance runs its slots",
        "`note`: why; `until`: the pause ends by itself at that instant (its slots before it "
        "are skipped, the first at or after it runs)",
    ),
    _change(
        "skip",
        "Skip the job's next slots for the whole fleet; a later skip replaces a pending one",
        "`count`: how many of the next slots (default 1; 0 cancels a pending skip); `note`: why",
    ),
    _change("resume", "Resume the job for the whole fleet"),
    _change(
        "disable",
        "Disable the job for the whole fleet: as a pause, and manual runs are refused",
    ),
    _change("enable", "Enable the job again for the whole fleet"),
    Operation(
        "get",
        "/jobs/{name}/audit",
        "The job's fleet-wide control (paused, disabled) and its changes, newest first: who "
        "(actor), what (action), when (at)",
        _job_reading("The control record, or null", bodies.Audit),
    ),
    Operation(
        "get",
        "/instances",
        "The fleet's instances as they publish themselves through the backend every heartbeat: "
        "host, pid, version, started, last seen, liveness (alive, late after 1.5 heartbeats, "
        "dead after 3, stopped), runs in progress",
        {200: (bodies.Instances, "The instances"), 503: _READ_FAILED},
    ),
    Operation(
        "get",
        "/runs",
        "The runs in progress anywhere in the fleet, oldest first, with their instance's "
        "liveness; a leased run of a dead instance is `held` until its slot is taken over "
        "(then, recorded `interrupted`, it is no longer listed)",
        {200: (bodies.Runs, "The runs"), 400: _BAD_QUERY, 503: _READ_FAILED},
        params=RunsParams,
    ),
    Operation(
        "post",
        "/runs/{run_id}/abort",
        "Abort a run wherever it runs: its context is aborted (ctx.abort_reason == 'aborted', "
        "an async handler cancelled at its next await) when its instance next reads the "
        "fleet's controls",
        {
            202: (bodies.AbortRequested, "Requested"),
            **_CHANGE_REFUSED,
            404: (bodies.Error, "No instance shows that run in progress"),
            503: (bodies.Error, "The backend could not record the request"),
        },
        changes=True,
    ),
)


_NO_SCHEDULE = (bodies.Error, "No stored schedule has that id")
_STORE_FAILED = (
    bodies.Error,
    "The backend could not be read or written, keeps no stored schedules, or the scheduler is "
    "not running",
)
_SCHEDULES: tuple[Operation, ...] = (
    Operation(
        "get",
        "/schedules",
        "The fleet's stored schedules (schedules as data), by id, read from the backend",
        {200: (bodies.ScheduleList, "The schedules"), 400: _BAD_QUERY, 503: _STORE_FAILED},
        params=SchedulesParams,
    ),
    Operation(
        "get",
        "/schedules/{id}",
        "One stored schedule's latest version",
        {200: (bodies.Schedule, "The schedule"), 404: _NO_SCHEDULE, 503: _STORE_FAILED},
    ),
    Operation(
        "put",
        "/schedules/{id}",
        "Write a stored schedule (create it, or its next version) for the whole fleet: it "
        "applies to the slots from 3 s after (`effective_at`); every instance that has its task "
        "runs each slot once for the fleet",
        {
            200: (bodies.Schedule, "Written: its version and when it applies from"),
            400: (
                bodies.Error,
                "The body is not a schedule, or the scheduler refuses it (a trigger, an option, "
                "a time zone): `error` names the value and what would do; nothing is written",
            ),
            **_CHANGE_REFUSED,
            409: (
                bodies.ScheduleConflict,
                "`if_version` does not match: `version` is the schedule's (0: there is none)",
            ),
            413: (bodies.Error, "The body is larger than 64 KiB"),
            503: _STORE_FAILED,
        },
        changes=True,
        body="The schedule (at most 64 KiB): `task`, one of `every`, `cron` or `at`, `timezone`, "
        "`data` (the task's ctx.data), `options` (job options), `if_version`, `by` (who; "
        "default: the caller)",
        body_model=ScheduleBody,
        body_required=True,
    ),
    Operation(
        "delete",
        "/schedules/{id}",
        "Delete a stored schedule for the whole fleet: no slot of it from 3 s after",
        {
            200: (bodies.ScheduleDeleted, "Deleted"),
            400: _BAD_QUERY,
            **_CHANGE_REFUSED,
            404: _NO_SCHEDULE,
            409: (
                bodies.ScheduleConflict,
                "`if_version` does not match: `version` is the schedule's (0: there is none)",
            ),
            503: _STORE_FAILED,
        },
        params=DeleteScheduleParams,
        changes=True,
    ),
)

OPERATIONS: tuple[Operation, ...] = tuple(_guarded(op) for op in (*_OPERATIONS, *_SCHEDULES))


@functools.cache
def openapi_document() -> dict[str, Any]:
    types = list(
        dict.fromkeys(
            body for op in OPERATIONS for body, _ in op.answers.values() if body is not None
        )
    )
    schemas, definitions = TypeAdapter.json_schemas(
        [(body, "validation", _adapter(body)) for body in types], ref_template=_REF
    )
    by_type = {body: schemas[(body, "validation")] for body in types}
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = op.describe(by_type)
    return {
        "openapi": "3.1.0",
        "info": {"title": "brokersched admin API", "version": __version__},
        "components": {
            "schemas": definitions.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": paths,
    }

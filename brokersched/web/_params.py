"""The query parameters of the admin API's routes, as pydantic models: the routes validate
their query with them (``parse``), and the OpenAPI document describes each parameter from the
same field (``_openapi``). The validators are ``_query``'s parsers, so an error names the
parameter, the value and what would do; each field's type and constraints say exactly what the
parser takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
)

from .._fleetrecords import NOTE_MAX, SKIP_MAX
from .._options import NAME_PATTERN
from .._stored import TriggerKind
from ..abc import Outcome, RunReason
from ._query import (
    CURSOR_PATTERN,
    MAX_HISTORY,
    MAX_INSTANCE,
    OUTCOMES,
    REASONS,
    WINDOW_PATTERN,
    QueryError,
    choices,
    parse_before,
    parse_instances,
    parse_limit,
    parse_state,
    parse_window,
)

__all__ = [
    "CHANGE_BODIES",
    "SCHEDULE_ID_PATTERN",
    "ChangeBody",
    "DeleteScheduleParams",
    "HistoryParams",
    "PauseBody",
    "RunsParams",
    "ScheduleBody",
    "SchedulesParams",
    "SkipBody",
    "WindowParams",
    "parse",
    "parse_change",
    "parse_schedule",
]

M = TypeVar("M", bound=BaseModel)
_CONFIG = ConfigDict(extra="ignore", frozen=True)


class HistoryParams(BaseModel):
    model_config = _CONFIG

    limit: Annotated[
        int,
        Field(ge=1, le=MAX_HISTORY, description="Records per page"),
        BeforeValidator(parse_limit),
    ] = 50
    outcome: Annotated[
        list[Outcome],
        Field(description="Only these outcomes (comma-separated)"),
        BeforeValidator(lambda raw: choices("outcome", raw, OUTCOMES)),
    ] = []
    reason: Annotated[
        list[RunReason],
        Field(description="Only these reasons (comma-separated)"),
        BeforeValidator(lambda raw: choices("reason", raw, REASONS)),
    ] = []
    instance: Annotated[
        list[Annotated[str, Field(max_length=MAX_INSTANCE)]],
        Field(description="Only runs of these instances (comma-separated)"),
        BeforeValidator(parse_instances),
    ] = []
    before: Annotated[
        str | None,
        Field(
            pattern=CURSOR_PATTERN,
            description="The `next` of the previous page: the runs older than it",
        ),
        BeforeValidator(parse_before),
    ] = None


class WindowParams(BaseModel):
    model_config = _CONFIG

    window: Annotated[
        str,
        Field(
            pattern=WINDOW_PATTERN,
            description="How far back: a whole number of minutes (m), hours (h), days (d) or "
            "weeks (w), from 1m to 7d",
            examples=["15m", "1h", "24h"],
        ),
        BeforeValidator(parse_window),
    ] = "1h"


class RunsParams(BaseModel):
    model_config = _CONFIG

    state: Annotated[
        Literal["running"],
        Field(description="The runs in progress (finished runs: a job's history)"),
        BeforeValidator(parse_state),
    ] = "running"


class SchedulesParams(BaseModel):
    model_config = _CONFIG

    prefix: Annotated[
        str,
        Field(max_length=128, description="Only the schedules whose id starts with this"),
    ] = ""


def _a_version(value: object) -> object:
    """A query's ``"2"`` is the version 2; anything else is named."""
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit() or len(text) > 30:
            raise QueryError(
                f"if_version {value[:40]!r} is not a version: a whole number, 0 or more "
                "(0: only if there is none)"
            )
        return int(text)
    return value


class DeleteScheduleParams(BaseModel):
    model_config = _CONFIG

    if_version: Annotated[
        int | None,
        Field(
            ge=0,
            le=10**18,
            description="Only if the schedule is at this version (else 409, with its version)",
        ),
        BeforeValidator(_a_version),
    ] = None


def parse(model: type[M], params: Mapping[str, str]) -> M:
    """``params`` validated by ``model``; a ``QueryError`` naming the first bad parameter."""
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, QueryError):
            raise cause from None
        name = ".".join(str(part) for part in first["loc"])
        raise QueryError(f"{name} is invalid: {first['msg']}") from None


class ChangeBody(BaseModel):
    """The optional JSON body of a change of a job's control (``POST
    /jobs/{name}/resume|disable|enable``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    note: Annotated[str | None, Field(max_length=NOTE_MAX)] = None
    """Why, kept beside who in the job's audit trail."""


class PauseBody(ChangeBody):
    """The optional JSON body of ``POST /jobs/{name}/pause``."""

    until: AwareDatetime | None = None
    """The pause ends by itself at this instant (ISO 8601 with an offset): its slots before it
    are skipped, the first at or after it runs."""


def _a_number(value: object) -> object:
    """JSON's ``2.0`` is the integer 2 (as JSON Schema has it); ``true`` and ``"2"`` are not
    numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("a whole number of slots")
    return int(value) if isinstance(value, float) and value.is_integer() else value


class SkipBody(ChangeBody):
    """The optional JSON body of ``POST /jobs/{name}/skip``."""

    # The bounds before the validator: after it, they were keys no JSON Schema reads, and the
    # document let any count through.
    count: Annotated[int, Field(ge=0, le=SKIP_MAX), BeforeValidator(_a_number)] = 1
    """How many of the next slots to skip (0 cancels a pending skip)."""


#: The body each change takes.
CHANGE_BODIES: dict[str, type[ChangeBody]] = {"pause": PauseBody, "skip": SkipBody}


def parse_change(action: str, body: bytes) -> ChangeBody:
    """The body of a change ``action`` (empty: nothing asked); a ``QueryError`` naming the
    first bad field."""
    model = CHANGE_BODIES.get(action, ChangeBody)
    if not body.strip():
        return model()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"]) or "the body"
        raise QueryError(f"{name} is invalid: {first['msg']}") from None


#: A stored schedule's id: a job's name.
SCHEDULE_ID_PATTERN = f"^{NAME_PATTERN.pattern}$"


def _a_whole_number(value: object) -> object:
    """JSON's ``2.0`` is the integer 2 (as JSON Schema has it); the rest is for the field's
    own (strict) validation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_TRIGGERS: tuple[TriggerKind, ...] = get_args(TriggerKind)


def _given(trigger: str) -> dict[str, Any]:
    """The schema of a body whose ``trigger`` is given (not null): exactly one is."""
    return {"required": [trigger], "properties": {trigger: {"type": "string"}}}


class ScheduleBody(BaseModel):
    """The JSON body of ``PUT /schedules/{id}``: the schedule's next version. Exactly one of
    ``every``, ``cron`` and ``at``; the values as ``scheduler.schedules.put`` takes them, the
    same rules (a value the scheduler refuses: 400, naming it; nothing written)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        use_attribute_docstrings=True,
        json_schema_extra={"oneOf": [_given(trigger) for trigger in _TRIGGERS]},
    )

    task: Annotated[str, Field(min_length=1, max_length=200)]
    """The task it runs (``@scheduler.task(name)``)."""
    every: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    """Run every this long: ``10s``, ``5m``, ``1h30m``."""
    cron: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    """Run on this cron expression (5 or 6 fields), in ``timezone``."""
    at: Annotated[AwareDatetime, Field(strict=False)] | None = None
    """Run once at this instant (ISO 8601 with an offset)."""
    timezone: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    """The cron expression's time zone (``Europe/Paris``)."""
    data: JsonValue = None
    """The task's ``ctx.data``."""
    options: dict[str, JsonValue] = Field(default_factory=dict)
    """Job options: ``{"timeout": "30s", "max_late": "1m"}`` (as ``scheduler.every`` takes
    them; durations as text)."""
    if_version: Annotated[int, Field(ge=0, le=10**18), BeforeValidator(_a_whole_number)] | None = (
        None
    )
    """Only if the schedule is at this version (0: only if there is none); else 409."""
    by: Annotated[str, Field(min_length=1, max_length=NOTE_MAX)] | None = None
    """Who writes it (default: the caller, as the audit trail of the other changes says it)."""


def parse_schedule(body: bytes) -> ScheduleBody:
    """The body of ``PUT /schedules/{id}``; a ``QueryError`` naming the first bad field."""
    if not body.strip():
        raise QueryError(
            "the body is required: a JSON object with task and one of every, cron or at"
        )
    try:
        parsed = ScheduleBody.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"]) or "the body"
        raise QueryError(f"{name} is invalid: {first['msg']}") from None
    given = [name for name in _TRIGGERS if getattr(parsed, name) is not None]
    if len(given) != 1:
        raise QueryError(
            f"give exactly one of every, cron or at (given: {', '.join(given) or 'none'})"
        )
    return parsed

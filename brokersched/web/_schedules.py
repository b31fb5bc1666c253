"""The admin API's routes of the fleet's stored schedules (``scheduler.schedules``): ``GET
/schedules``, ``GET``, ``PUT`` and ``DELETE /schedules/{id}``. A write is a change like a
pause: it needs the admin token (the per-action ``authorize`` is asked with ``"schedule"``),
is refused from another site's page, and says who made it (``by``, by default the caller as
the audit trail of the other changes names it). What is answered passes through
``redact_text``: a URL's password in a schedule's data or options is shown as ``***``."""

from __future__ import annotations

import inspect
from datetime import UTC
from typing import Any

from starlette.requests import Request

from .._exceptions import BackendError, ConfigurationError
from .._redact import redact_json, redact_text
from .._scheduler import Scheduler
from .._schedules import ScheduleConflictError, Schedules
from .._stored import StoredSchedule
from ..triggers.spec import trigger_from_spec
from ._params import DeleteScheduleParams, SchedulesParams, parse, parse_schedule
from ._query import QueryError
from ._reply import Reply, error
from ._security import Guard

__all__ = ["MAX_SCHEDULE_BODY", "SCHEDULE_ACTION", "ScheduleRoutes", "schedule_json"]

#: The largest body of a write (its data and options are kept in every instance's memory).
MAX_SCHEDULE_BODY = 64 * 1024

#: The action a per-action ``authorize`` is asked with for a write of a stored schedule.
SCHEDULE_ACTION = "schedule"
#: ``Schedules.put``'s own arguments, which the body gives as fields: not job options.
_OWN = frozenset(
    name
    for name, parameter in inspect.signature(Schedules.put).parameters.items()
    if parameter.kind is not parameter.VAR_KEYWORD and name != "self"
)


def _described(schedule: StoredSchedule) -> str:
    trigger = dict(schedule.trigger)
    if "error" in trigger:
        return f"{trigger.get('kind')} {trigger.get('schedule')} (not valid here)"
    try:
        return trigger_from_spec(trigger).describe()
    except ConfigurationError:
        return str(trigger.get("kind"))


def schedule_json(schedule: StoredSchedule) -> dict[str, Any]:
    """``StoredSchedule.to_json`` and its trigger in words, secrets in URLs masked."""
    masked: dict[str, Any] = redact_json({**schedule.to_json(), "describe": _described(schedule)})
    return masked


def _conflict(exc: ScheduleConflictError) -> Reply:
    return error(409, str(exc), version=exc.version)


class ScheduleRoutes:
    """The routes, on ``scheduler``'s store, guarded by ``guard``."""

    def __init__(self, scheduler: Scheduler[Any], guard: Guard) -> None:
        self.scheduler = scheduler
        self.guard = guard

    def _store(self) -> Schedules | Reply:
        scheduler = self.scheduler
        if not scheduler.backend.fleet:
            return error(
                503,
                f"{scheduler.backend.name} keeps no fleet records: it holds no stored schedules",
            )
        if not scheduler.running:
            return error(503, "the scheduler is not running: its backend is not connected")
        return scheduler.schedules

    @staticmethod
    def _failed(exc: BackendError, doing: str) -> Reply:
        return error(503, f"could not {doing}: {redact_text(str(exc))}")

    async def list(self, request: Request) -> Reply:
        """``GET /schedules``."""
        try:
            params = parse(SchedulesParams, request.query_params)
        except QueryError as exc:
            return error(400, str(exc))
        store = self._store()
        if isinstance(store, Reply):
            return store
        try:
            found = [schedule_json(s) async for s in store.list(params.prefix)]
        except BackendError as exc:
            return self._failed(exc, "read the stored schedules")
        return Reply({"schedules": found})

    async def get(self, request: Request) -> Reply:
        """``GET /schedules/{id}``."""
        schedule_id = request.path_params["id"]
        store = self._store()
        if isinstance(store, Reply):
            return store
        try:
            found = await store.get(schedule_id)
        except ConfigurationError:  # no schedule can have that id
            found = None
        except BackendError as exc:
            return self._failed(exc, f"read schedule {schedule_id[:128]!r}")
        if found is None:
            return error(404, f"no stored schedule {schedule_id[:128]!r}")
        return Reply(schedule_json(found))

    async def put(self, request: Request) -> Reply:
        """``PUT /schedules/{id}``."""
        if refusal := await self.guard.refuse(request, SCHEDULE_ACTION):
            return refusal
        schedule_id = request.path_params["id"]
        raw = await request.body()
        if len(raw) > MAX_SCHEDULE_BODY:
            return error(
                413, f"the schedule is {len(raw)} bytes; at most {MAX_SCHEDULE_BODY} are taken"
            )
        try:
            body = parse_schedule(raw)
        except QueryError as exc:
            return error(400, str(exc))
        if taken := sorted(_OWN & body.options.keys()):
            return error(
                400,
                f"options.{taken[0]} is not a job option: give it as the body's own field",
            )
        at = body.at
        if at is not None:
            try:
                at = at.astimezone(UTC)
            except OverflowError:
                return error(400, f"at {at.isoformat()} is out of range (years 1 to 9999, UTC)")
        store = self._store()
        if isinstance(store, Reply):
            return store
        try:
            written = await store.put(
                schedule_id,
                task=body.task,
                every=body.every,
                cron=body.cron,
                at=at,
                timezone=body.timezone,
                data=body.data,
                if_version=body.if_version,
                by=body.by or self.guard.actor(request),
                **body.options,
            )
        except ConfigurationError as exc:
            return error(400, redact_text(str(exc)))
        except ScheduleConflictError as exc:
            return _conflict(exc)
        except BackendError as exc:
            return self._failed(exc, f"write schedule {schedule_id!r}")
        return Reply(schedule_json(written))

    async def delete(self, request: Request) -> Reply:
        """``DELETE /schedules/{id}``."""
        if refusal := await self.guard.refuse(request, SCHEDULE_ACTION):
            return refusal
        schedule_id = request.path_params["id"]
        try:
            params = parse(DeleteScheduleParams, request.query_params)
        except QueryError as exc:
            return error(400, str(exc))
        store = self._store()
        if isinstance(store, Reply):
            return store
        actor = self.guard.actor(request)
        try:
            deleted = await store.delete(schedule_id, if_version=params.if_version, by=actor)
        except ConfigurationError:  # no schedule can have that id
            deleted = False
        except ScheduleConflictError as exc:
            return _conflict(exc)
        except BackendError as exc:
            return self._failed(exc, f"delete schedule {schedule_id[:128]!r}")
        if not deleted:
            return error(404, f"no stored schedule {schedule_id[:128]!r}")
        return Reply(
            {
                "id": schedule_id,
                "deleted": True,
                "detail": f"no slot of it from 3 s after, on every instance (by {actor})",
            }
        )

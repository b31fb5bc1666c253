"""The admin API against its own OpenAPI document: Schemathesis generates requests from the
document (every operation; valid and invalid parameters and bodies, and the boundaries of its
coverage phase) and sends them through the ASGI app in this process, on the embedded backend,
with every check it has: no server error, documented status codes, content types, headers and
bodies matching their schemas, valid data accepted, invalid data refused, authentication
enforced. A disagreement between the document and the code fails here."""

from __future__ import annotations

import copy
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import jsonschema_rs
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS
from schemathesis.specs.openapi.checks import positive_data_acceptance
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock
from brokersched.web import create_app
from brokersched.web._openapi import openapi_document

TOKEN = "test-admin-token-0123456789"
START = "2026-03-02T12:00:00+00:00"
# The jobs the requests name (and names no job has): one that runs, one that fails, one disabled
# for the fleet (a trigger is refused), one whose name needs percent-encoding.
JOBS = ("outbox.flush", "flaky", "off", "report:daily$eu")
# The stored schedules the requests name (beside the ids it makes up): one written at start, one
# whose id needs percent-encoding.
SCHEDULES = ("acme", "tenant:42$eu")


async def noop(ctx: JobContext) -> None:
    pass


async def fail(ctx: JobContext) -> None:
    raise RuntimeError("the mail server said no")


class AdminApp:
    """The admin app of a new scheduler at each start of its lifespan (Schemathesis ends the
    lifespan after each test): jobs with a quarter of an hour of history, run in the event loop
    Schemathesis serves the app from."""

    def __init__(self) -> None:
        self.admin: ASGIApp | None = None
        self.starter = Starlette(lifespan=self.lifespan)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.starter(scope, receive, send)
        else:
            assert self.admin is not None
            await self.admin(scope, receive, send)

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        clock = TestClock(START)
        scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0, instance_id="instance-a")
        scheduler.every("outbox.flush", "1m", noop, timeout="30s", data={"api_key": "sk-x"})
        scheduler.every("flaky", "5m", fail)
        scheduler.every("off", "1m", noop)
        scheduler.cron("report:daily$eu", "0 8 * * *", noop, timezone="Europe/Paris")
        scheduler.task("reports.send")(noop)
        async with scheduler:
            await clock.advance("15m")
            await scheduler.change_control("off", "disable", by="test")
            await scheduler.schedules.put("acme", task="reports.send", every="10m", data={"n": 1})
            self.admin = create_app(scheduler, token=TOKEN)
            yield


def with_jobs_as_examples(document: dict[str, Any]) -> dict[str, Any]:
    """The document with ``JOBS`` as the examples of each job name in a path, ``SCHEDULES`` of
    each schedule id: Schemathesis sends each of them (its examples phase), beside the names it
    makes up."""
    document = copy.deepcopy(document)
    examples = {"name": list(JOBS), "id": list(SCHEDULES)}
    for operations in document["paths"].values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] in examples and parameter["in"] == "path":
                    parameter["schema"]["examples"] = examples[parameter["name"]]
    return document


# The admin token for the operations that change things (the scheme ``bearer`` of the document):
# Schemathesis sends it, and checks that the operations refuse a request without it.
CONFIG = schemathesis.Config.from_dict({"auth": {"openapi": {"bearer": {"bearer": TOKEN}}}})
schema = schemathesis.openapi.from_dict(with_jobs_as_examples(openapi_document()), config=CONFIG)
schema.app = AdminApp()


#: A body the document allows may still be a schedule the scheduler refuses, by rules no JSON
#: Schema holds (a cron expression, a duration's text, a time zone, a job option and its value):
#: 400, naming it. For that operation "valid data accepted" is this instead: a body valid by the
#: document (checked here with its own schema, formats included) answers 2xx, 409, or a 400 from
#: the scheduler's rules, never one that finds the body malformed (the model the route
#: validates with and the document would disagree).
SCHEDULE_WRITE = ("PUT", "/schedules/{id}")
MALFORMED = re.compile(r"^([\w.]+ is invalid: |the body is required|give exactly one of )")


def body_validator() -> Any:
    document = openapi_document()
    operation = document["paths"]["/schedules/{id}"]["put"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.Draft202012Validator(
        {**body, "components": document["components"]}, validate_formats=True
    )


SCHEDULE_BODY = body_validator()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_does_what_its_openapi_document_says(case: Any) -> None:
    checks = list(CHECKS.get_all())
    writes_a_schedule = (case.method.upper(), case.path) == SCHEDULE_WRITE
    if writes_a_schedule:
        checks = [check for check in checks if check is not positive_data_acceptance]
    response = case.call_and_validate(checks=checks)
    allowed = isinstance(case.body, dict) and SCHEDULE_BODY.is_valid(case.body)
    if writes_a_schedule and response.status_code == 400 and allowed:
        said = response.json()["error"]
        assert not MALFORMED.match(said), f"a body the document allows was found malformed: {said}"

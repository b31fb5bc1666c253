"""The admin API's OpenAPI 3.1 description, written by hand (GET /openapi.json)."""

from __future__ import annotations

from typing import Any

from .. import __version__

__all__ = ["openapi_schema"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR = _json(_ref("Error"), "An error; `error` says what and why")
_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "The job's name, percent-encoded",
    "schema": {"type": "string"},
}
_NULLABLE_STRING = {"type": ["string", "null"]}

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "properties": {"error": {"type": "string"}}},
    "Record": {
        "type": "object",
        "description": "One run of a slot, on whichever instance ran it",
        "properties": {
            "job": {"type": "string"},
            "slot_ms": {"type": "integer", "description": "The slot, Unix milliseconds"},
            "slot": {"type": "string", "format": "date-time"},
            "run_id": {"type": "string"},
            "instance_id": {"type": "string"},
            "reason": {"enum": ["schedule", "catch-up", "retry", "manual", "start"]},
            "attempt": {"type": "integer"},
            "started_at": {"type": "string", "format": "date-time"},
            "finished_at": {"type": ["string", "null"], "format": "date-time"},
            "late_ms": {"type": "integer", "description": "started_at - slot"},
            "outcome": {"enum": ["completed", "failed", "timed-out", "interrupted"]},
            "error": _NULLABLE_STRING,
        },
    },
    "Job": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kind": {"enum": ["every", "cron", "at", "after"]},
            "schedule": {"type": "string"},
            "zone": {"type": "string"},
            "options": {
                "type": "object",
                "description": "Resolved options; `data` is never shown, only `***`",
            },
            "state": {"enum": ["armed", "paused", "running", "idle", "disabled"]},
            "next_runs": {"type": "array", "items": {"type": "string", "format": "date-time"}},
            "last": {"oneOf": [_ref("Record"), {"type": "null"}]},
            "history_error": {"type": "string"},
        },
    },
    "Change": {
        "type": "object",
        "properties": {
            "job": {"type": "string"},
            "state": {"type": "string"},
            "scope": {"type": "string"},
        },
    },
}

_CHANGE_ERRORS = {
    "401": _ERROR,
    "403": _json(_ref("Error"), "A cross-site request, or changes are disabled"),
    "404": _ERROR,
}


def _change(summary: str, ok: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [_NAME],
            "security": [{"bearer": []}],
            "responses": {ok: body, **_CHANGE_ERRORS},
        }
    }


def openapi_schema() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "brokersched admin API", "version": __version__},
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            "/jobs": {
                "get": {
                    "summary": "Every job: schedule, options, state here, next runs, last run",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "instance_id": {"type": "string"},
                                    "backend": {"type": "string"},
                                    "running": {"type": "boolean"},
                                    "changes_enabled": {"type": "boolean"},
                                    "jobs": {"type": "array", "items": _ref("Job")},
                                },
                            },
                            "The jobs",
                        )
                    },
                }
            },
            "/jobs/{name}": {
                "get": {
                    "summary": "One job",
                    "parameters": [_NAME],
                    "responses": {"200": _json(_ref("Job"), "The job"), "404": _ERROR},
                }
            },
            "/jobs/{name}/history": {
                "get": {
                    "summary": "The job's runs on every instance, newest first (from the backend)",
                    "parameters": [
                        _NAME,
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "job": {"type": "string"},
                                    "records": {"type": "array", "items": _ref("Record")},
                                    "slots": {
                                        "type": "array",
                                        "items": {"type": "integer"},
                                        "description": "The schedule's slots since the oldest "
                                        "record that should have run by now",
                                    },
                                    "now_ms": {"type": "integer"},
                                },
                            },
                            "The runs",
                        ),
                        "400": _ERROR,
                        "404": _ERROR,
                        "503": _json(_ref("Error"), "The backend could not be read"),
                    },
                }
            },
            "/jobs/{name}/trigger": _change(
                "Run the job now, through the claim, in the background",
                "202",
                _json({"type": "object"}, "Accepted"),
            ),
            "/jobs/{name}/pause": _change(
                "Stop arming the job's slots on this instance only",
                "200",
                _json(_ref("Change"), "Paused here"),
            ),
            "/jobs/{name}/resume": _change(
                "Arm the job's slots again on this instance",
                "200",
                _json(_ref("Change"), "Resumed here"),
            ),
            "/health": {
                "get": {
                    "summary": "ok, or degraded with the overdue jobs (200); 503 when stopped",
                    "responses": {"200": _json({"type": "object"}, "Running"), "503": _ERROR},
                }
            },
            "/events": {
                "get": {
                    "summary": "Server-Sent Events: skip, start, complete, fail (JSON data)",
                    "responses": {
                        "200": {"description": "text/event-stream"},
                        "503": _json(_ref("Error"), "Too many event-stream clients"),
                    },
                }
            },
        },
    }

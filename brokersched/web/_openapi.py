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
_NULLABLE_INT = {"type": ["integer", "null"]}
_WINDOW = {
    "name": "window",
    "in": "query",
    "description": "How far back: a duration from 1m to 7d (default 1h)",
    "schema": {"type": "string", "default": "1h", "examples": ["15m", "1h", "24h"]},
}


def _list_param(name: str, description: str, values: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if values:
        description += f"; any of: {', '.join(values)}"
    return {"name": name, "in": "query", "description": description, "schema": schema}


_OUTCOMES = ["completed", "failed", "timed-out", "interrupted"]
_REASONS = ["schedule", "catch-up", "retry", "manual", "start", "backfill"]

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
            "reason": {"enum": _REASONS},
            "attempt": {"type": "integer"},
            "started_at": {"type": "string", "format": "date-time"},
            "finished_at": {"type": ["string", "null"], "format": "date-time"},
            "late_ms": {"type": "integer", "description": "started_at - slot"},
            "duration_ms": {**_NULLABLE_INT, "description": "finished_at - started_at"},
            "outcome": {"enum": _OUTCOMES},
            "error": _NULLABLE_STRING,
            "traceback": {
                **_NULLABLE_STRING,
                "description": "A failed or timed-out run's, redacted and size-capped",
            },
        },
    },
    "BackendStatus": {
        "type": "object",
        "description": "What this instance knows of its backend: from its own reads (bounded "
        "to 2 s) and its events (a claim that failed, a record dropped, a claimed run)",
        "properties": {
            "reachable": {"type": ["boolean", "null"], "description": "null: not known yet"},
            "since_ms": {**_NULLABLE_INT, "description": "When it last changed"},
            "error": _NULLABLE_STRING,
            "checked_s_ago": {"type": ["number", "null"]},
        },
    },
    "CompactRun": {
        "type": "object",
        "description": "A run as a timeline draws it",
        "properties": {
            "run_id": {"type": "string"},
            "slot_ms": {"type": "integer"},
            "started_ms": {"type": "integer"},
            "finished_ms": _NULLABLE_INT,
            "instance_id": {"type": "string"},
            "outcome": {"enum": _OUTCOMES},
            "reason": {"enum": _REASONS},
            "attempt": {"type": "integer"},
            "late_ms": {"type": "integer"},
            "error": _NULLABLE_STRING,
        },
    },
    "Timeline": {
        "type": "object",
        "properties": {
            "job": {"type": "string"},
            "from_ms": {"type": "integer"},
            "to_ms": {"type": "integer"},
            "now_ms": {"type": "integer"},
            "here": {"type": "string", "description": "This instance's id"},
            "lanes": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The instances that ran the job in the window, and this one",
            },
            "first_ms": {**_NULLABLE_INT, "description": "The oldest record's slot"},
            "known_from_ms": {
                **_NULLABLE_INT,
                "description": "The oldest record's slot when older ones may be trimmed",
            },
            "runs": {"type": "array", "items": _ref("CompactRun")},
            "slots": {
                "type": "array",
                "description": "The schedule's slots in the window that no instance ran (from "
                "the oldest record on, once max_late has passed), and why: `missed` (nobody "
                "ran it), `overlap` (a run of the job was still going: overlap='skip'), "
                "`paused`, `late`, `backend-error`, `clock-skew` (this instance skipped it), "
                "`not-acquired` (another instance claimed it; no record); and `double`: a slot "
                "run twice with the same attempt number",
                "items": {
                    "type": "object",
                    "properties": {
                        "slot_ms": {"type": "integer"},
                        "state": {
                            "enum": [
                                "missed",
                                "overlap",
                                "paused",
                                "late",
                                "backend-error",
                                "clock-skew",
                                "not-acquired",
                                "double",
                            ]
                        },
                        "detail": {"type": "string"},
                    },
                },
            },
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
            "control": {
                "type": ["object", "null"],
                "description": "The job's fleet-wide control as last read here: `paused`, "
                "`disabled`, and its `latest` change (`action`, `actor`, `at`); the whole "
                "trail is GET /jobs/{name}/audit",
            },
        },
    },
    "Session": {
        "type": "object",
        "properties": {
            "changes_enabled": {"type": "boolean"},
            "token_accepted": {
                "type": "boolean",
                "description": "Whether an admin token is configured (the page asks for it)",
            },
            "authorized": {"type": "boolean"},
            "via": {"enum": ["token", "host", None]},
            "instance_id": {"type": "string"},
            "backend": {"type": "string"},
        },
    },
    "Change": {
        "type": "object",
        "properties": {
            "job": {"type": "string"},
            "state": {"type": "string"},
            "scope": {"type": "string", "description": "the fleet, or this instance only"},
            "control": {
                "type": "object",
                "description": "The job's fleet-wide control record: paused, disabled, changes",
            },
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
                                    "backend_status": _ref("BackendStatus"),
                                    "running": {"type": "boolean"},
                                    "changes_enabled": {"type": "boolean"},
                                    "now_ms": {"type": "integer"},
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
                    "summary": "The job's runs on every instance, newest first (from the "
                    "backend); filtered and paged over its newest 1000 records",
                    "parameters": [
                        _NAME,
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                        _list_param("outcome", "Only these outcomes (comma-separated)", _OUTCOMES),
                        _list_param("reason", "Only these reasons (comma-separated)", _REASONS),
                        _list_param("instance", "Only runs of these instances (comma-separated)"),
                        _list_param("before", "The `next` of the previous page: older runs"),
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
                                    "next": {
                                        **_NULLABLE_STRING,
                                        "description": "Pass as `before` for the next page",
                                    },
                                    "matched": {
                                        "type": "integer",
                                        "description": "With filters or `before`: the records "
                                        "that match, of those scanned",
                                    },
                                    "scanned": {"type": "integer"},
                                    "choices": {
                                        "type": "object",
                                        "description": "The values `outcome` and `reason` accept",
                                    },
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
            "/jobs/{name}/timeline": {
                "get": {
                    "summary": "The job's runs in a window, the lanes of the instances that ran "
                    "them, and what became of the slots nobody ran",
                    "parameters": [_NAME, _WINDOW],
                    "responses": {
                        "200": _json(_ref("Timeline"), "The timeline"),
                        "400": _ERROR,
                        "404": _ERROR,
                        "503": _json(_ref("Error"), "The backend could not be read"),
                    },
                }
            },
            "/jobs/{name}/runs/{run_id}": {
                "get": {
                    "summary": "One run (found among the job's newest 1000 records), the "
                    "attempts at its slot, its neighbours",
                    "parameters": [
                        _NAME,
                        {
                            "name": "run_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "job": _ref("Job"),
                                    "run": _ref("Record"),
                                    "attempts": {"type": "array", "items": _ref("Record")},
                                    "newer": _NULLABLE_STRING,
                                    "older": _NULLABLE_STRING,
                                    "max_attempts": _NULLABLE_INT,
                                },
                            },
                            "The run",
                        ),
                        "404": _ERROR,
                        "503": _json(_ref("Error"), "The backend could not be read"),
                    },
                }
            },
            "/overview": {
                "get": {
                    "summary": "The fleet at a glance: every job with its timeline over the "
                    "window, failures of the last hour, the next runs, the instances seen",
                    "parameters": [_WINDOW],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "instance_id": {"type": "string"},
                                    "backend": {"type": "string"},
                                    "backend_status": _ref("BackendStatus"),
                                    "running": {"type": "boolean"},
                                    "changes_enabled": {"type": "boolean"},
                                    "now_ms": {"type": "integer"},
                                    "window": {"type": "object"},
                                    "jobs": {
                                        "type": "array",
                                        "description": "Job, plus `timeline` (a Timeline of "
                                        "the window) and `counts` (outcomes in the window)",
                                        "items": _ref("Job"),
                                    },
                                    "failures": {
                                        "type": "object",
                                        "description": "Failed, timed-out and interrupted runs "
                                        "of the last hour: `count`, `runs` (newest first, 50 "
                                        "at most), `groups` (failures alike: one job, outcome "
                                        "and error; `count`, `instances`, the `latest` run); "
                                        "`complete` is false when a job ran more often than "
                                        "the records read cover (as many as its schedule "
                                        "needs for the window or the hour, at most 1000)",
                                    },
                                    "next_runs": {
                                        "type": "array",
                                        "description": "Each armed job's next slot, soonest "
                                        "first: `job`, `at_ms`",
                                        "items": {"type": "object"},
                                    },
                                    "instances": {
                                        "type": "array",
                                        "description": "This instance, and those seen in the "
                                        "runs read",
                                        "items": {"type": "object"},
                                    },
                                },
                            },
                            "The overview",
                        ),
                        "400": _ERROR,
                    },
                }
            },
            "/session": {
                "get": {
                    "summary": "What the caller may change: with the token it sends, or the "
                    "host application's authorize() (a cookie session)",
                    "responses": {"200": _json(_ref("Session"), "The session")},
                }
            },
            "/jobs/{name}/trigger": _change(
                "Run the job now, through the claim, in the background; a JSON body is the "
                "run's ctx.data (at most 64 KiB); refused (409) while the job is disabled",
                "202",
                _json({"type": "object"}, "Accepted"),
            ),
            "/jobs/{name}/pause": _change(
                "Pause the job for the whole fleet (through the backend; this instance only "
                "on a backend that keeps no fleet records): no instance runs its slots",
                "200",
                _json(_ref("Change"), "Paused"),
            ),
            "/jobs/{name}/resume": _change(
                "Resume the job for the whole fleet",
                "200",
                _json(_ref("Change"), "Resumed"),
            ),
            "/jobs/{name}/disable": _change(
                "Disable the job for the whole fleet: as a pause, and manual runs are refused",
                "200",
                _json(_ref("Change"), "Disabled"),
            ),
            "/jobs/{name}/enable": _change(
                "Enable the job again for the whole fleet",
                "200",
                _json(_ref("Change"), "Enabled"),
            ),
            "/jobs/{name}/audit": {
                "get": {
                    "summary": "The job's fleet-wide control (paused, disabled) and its changes,"
                    " newest first: who (actor), what (action), when (at)",
                    "parameters": [_NAME],
                    "responses": {
                        "200": _json({"type": "object"}, "The control record, or null"),
                        "404": _ERROR,
                        "503": _ERROR,
                    },
                }
            },
            "/instances": {
                "get": {
                    "summary": "The fleet's instances as they publish themselves through the "
                    "backend every heartbeat: host, pid, version, started, last seen, liveness "
                    "(alive, late after 1.5 heartbeats, dead after 3, stopped), runs in progress",
                    "responses": {"200": _json({"type": "object"}, "The instances"), "503": _ERROR},
                }
            },
            "/runs": {
                "get": {
                    "summary": "The runs in progress anywhere in the fleet (state=running), "
                    "oldest first, with their instance's liveness; a leased run of a dead "
                    "instance is `held` until its lease expires",
                    "parameters": [_list_param("state", "Only `running`", ["running"])],
                    "responses": {
                        "200": _json({"type": "object"}, "The runs"),
                        "400": _ERROR,
                        "503": _ERROR,
                    },
                }
            },
            "/runs/{run_id}/abort": {
                "post": {
                    "summary": "Abort a run wherever it runs: its context is aborted "
                    "(ctx.abort_reason == 'aborted', an async handler cancelled at its next "
                    "await) when its instance next reads the fleet's controls",
                    "parameters": [
                        {
                            "name": "run_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "security": [{"bearer": []}],
                    "responses": {
                        "202": _json({"type": "object"}, "Requested"),
                        "404": _ERROR,
                        **_CHANGE_ERRORS,
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "ok, or degraded with the overdue jobs (200); 503 when stopped, "
                    "or when the backend is unreachable (status `unreachable`, known within "
                    "seconds: the backend is read when nothing was heard of it for 5 s)",
                    "responses": {
                        "200": _json({"type": "object"}, "Running"),
                        "503": _json({"type": "object"}, "Stopped, or the backend unreachable"),
                    },
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

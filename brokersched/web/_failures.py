"""The overview's failures alike: one row per job, outcome and kind of error, however many ids
the messages carry ("batch 33", "batch 34", "run 9f2c4e1a" are one kind), with how many, on
which instances, and the latest run as the example."""

from __future__ import annotations

import re
from typing import Any

from .._clock import datetime_to_ms
from .._scheduler import Job
from ..abc import RunRecord
from ._views import record_json

__all__ = ["FAILURE_GROUPS_SHOWN", "error_pattern", "failure_groups"]

FAILURE_GROUPS_SHOWN = 20
_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
# Hex ids: 0x..., or 6 hex digits or more with a digit among them (not a word like "facade").
_HEX = re.compile(r"\b(?:0x[0-9a-f]+|(?=[a-f]*[0-9])[0-9a-f]{6,})\b", re.I)
_NUMBER = re.compile(r"[0-9]+")


def error_pattern(error: str | None) -> str | None:
    """``error`` with its ids and numbers replaced (``<id>``, ``<n>``): the kind of error."""
    if error is None:
        return None
    return _NUMBER.sub("<n>", _HEX.sub("<id>", _UUID.sub("<id>", error)))


def failure_groups(failures: list[tuple[RunRecord, Job]]) -> list[dict[str, Any]]:
    """Failures alike (one job, one outcome, one kind of error), newest first, at most
    ``FAILURE_GROUPS_SHOWN``: how many, on which instances, the latest run (``error`` is its
    message; ``pattern`` what the group's messages share)."""
    groups: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    for record, job in failures:  # newest first
        latest = record_json(record, job)
        pattern = error_pattern(latest["error"])
        key = (job.name, record.outcome, pattern)
        group = groups.get(key)
        if group is None:
            if len(groups) == FAILURE_GROUPS_SHOWN:
                continue
            group = groups[key] = {
                "job": job.name,
                "outcome": record.outcome,
                "error": latest["error"],
                "pattern": pattern,
                "count": 0,
                "instances": set(),
                "latest": latest,
                "first_ms": 0,
            }
        group["count"] += 1
        group["instances"].add(record.instance_id)
        group["first_ms"] = datetime_to_ms(record.finished_at or record.started_at)
    return [{**group, "instances": sorted(group["instances"])} for group in groups.values()]

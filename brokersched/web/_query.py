"""What a request asks of a job's history: filters (outcome, reason, instance), a page of it
(``limit`` records older than the cursor ``before``), a time window. Parsing says what is wrong
with a parameter; applying is a pure function of the records read."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from .._clock import datetime_to_ms
from .._durations import parse_duration, to_ms
from .._exceptions import ConfigurationError
from ..abc import Outcome, RunReason, RunRecord

__all__ = [
    "FAILED",
    "MAX_HISTORY",
    "MAX_WINDOW_MS",
    "OUTCOMES",
    "REASONS",
    "Page",
    "Query",
    "QueryError",
    "cursor_of",
    "parse_limit",
    "parse_query",
    "parse_window",
]

MAX_HISTORY = 1000  # records per answer, and records scanned to filter, page or find a run
MAX_WINDOW_MS = 7 * 86_400_000
OUTCOMES: tuple[str, ...] = get_args(Outcome)
REASONS: tuple[str, ...] = get_args(RunReason)
FAILED = frozenset({"failed", "timed-out", "interrupted"})
_CURSOR = re.compile(r"(\d{1,16})-([0-9A-Za-z_.:-]{1,128})")
_MAX_INSTANCE = 256


class QueryError(ValueError):
    """A parameter that cannot be used; the message names it, the value and what would do."""


def _shown(raw: str) -> str:
    return repr(raw) if len(raw) < 10 else f"{raw[:10]!r}..."


def parse_limit(raw: str) -> int:
    # ASCII digits only ("²".isdigit() too), and few of them (int() refuses 4300 and more)
    if raw.isascii() and raw.isdigit() and len(raw) <= 4 and 1 <= int(raw) <= MAX_HISTORY:
        return int(raw)
    raise QueryError(f"limit {_shown(raw)} is invalid: use a whole number from 1 to {MAX_HISTORY}")


def parse_window(raw: str) -> int:
    """A window (``15m``, ``1h``, ``24h``) in ms: from 1 minute to 7 days."""
    try:
        window = to_ms(parse_duration(raw[:32], name="window"))
    except ConfigurationError:
        window = -1
    if not 60_000 <= window <= MAX_WINDOW_MS:
        raise QueryError(
            f"window {_shown(raw)} is invalid: use a duration from 1m to 7d, e.g. 15m, 1h, 24h"
        )
    return window


def _choices(params: Mapping[str, str], name: str, accepted: Sequence[str]) -> frozenset[str]:
    raw = params.get(name, "")
    chosen = frozenset(value.strip() for value in raw.split(",") if value.strip())
    if unknown := sorted(chosen - set(accepted)):
        raise QueryError(
            f"{name} {_shown(unknown[0])} is invalid: use one or more of {', '.join(accepted)} "
            "(comma-separated)"
        )
    return chosen


def cursor_of(record: RunRecord) -> str:
    """Where a page ends: the record's start (ms) and run id."""
    return f"{datetime_to_ms(record.started_at)}-{record.run_id}"


@dataclass(frozen=True, slots=True)
class Page:
    records: list[RunRecord]
    next: str | None  # the cursor of the next (older) page
    matched: int  # records of the scanned ones that pass the filters
    scanned: int


@dataclass(frozen=True, slots=True)
class Query:
    limit: int = 50
    outcomes: frozenset[str] = frozenset()
    reasons: frozenset[str] = frozenset()
    instances: frozenset[str] = frozenset()
    before: tuple[int, str] | None = None

    @property
    def scans(self) -> bool:
        """Whether the answer needs every kept record (filters, or a page after the first)."""
        return bool(self.outcomes or self.reasons or self.instances or self.before)

    def matches(self, record: RunRecord) -> bool:
        return (
            (not self.outcomes or record.outcome in self.outcomes)
            and (not self.reasons or record.reason in self.reasons)
            and (not self.instances or record.instance_id in self.instances)
        )

    def page(self, records: Sequence[RunRecord]) -> Page:
        """The page of ``records`` (newest first, as the backend gives them) this query asks
        for. The cursor is anchored on its run id; when that record is gone (trimmed), on its
        start time."""
        start = 0
        if self.before is not None:
            started_ms, run_id = self.before
            found = next((i for i, r in enumerate(records) if r.run_id == run_id), None)
            if found is not None:
                start = found + 1
            else:
                start = next(
                    (i for i, r in enumerate(records) if datetime_to_ms(r.started_at) < started_ms),
                    len(records),
                )
        matching = [r for r in records[start:] if self.matches(r)]
        shown = matching[: self.limit]
        more = len(matching) > self.limit
        matched = sum(1 for r in records if self.matches(r))
        return Page(shown, cursor_of(shown[-1]) if more else None, matched, len(records))


def parse_query(params: Mapping[str, str]) -> Query:
    limit = parse_limit(params.get("limit", "50"))
    before = None
    if raw := params.get("before"):
        found = _CURSOR.fullmatch(raw)
        if found is None:
            raise QueryError(
                f"before {_shown(raw)} is invalid: pass the `next` value of the previous page"
            )
        before = (int(found.group(1)), found.group(2))
    instances = frozenset(
        value.strip() for value in params.get("instance", "").split(",") if value.strip()
    )
    if any(len(value) > _MAX_INSTANCE for value in instances):
        raise QueryError(f"instance is invalid: an instance id has at most {_MAX_INSTANCE} chars")
    return Query(
        limit=limit,
        outcomes=_choices(params, "outcome", OUTCOMES),
        reasons=_choices(params, "reason", REASONS),
        instances=instances,
        before=before,
    )

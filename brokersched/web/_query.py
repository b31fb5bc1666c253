"""What a request asks of a job's history: filters (outcome, reason, instance), a page of it
(``limit`` records older than the cursor ``before``), a time window. Parsing says what is wrong
with a parameter; applying is a pure function of the records read."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from .._clock import datetime_to_ms
from .._durations import parse_duration, to_ms
from ..abc import Outcome, RunReason, RunRecord

__all__ = [
    "CURSOR_PATTERN",
    "MAX_HISTORY",
    "MAX_INSTANCE",
    "OUTCOMES",
    "REASONS",
    "WINDOW_PATTERN",
    "Page",
    "Query",
    "QueryError",
    "choices",
    "cursor",
    "cursor_of",
    "parse_before",
    "parse_instances",
    "parse_limit",
    "parse_state",
    "parse_window",
    "window_ms",
]

MAX_HISTORY = 1000  # records per answer, and records scanned to filter, page or find a run
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
REASONS: tuple[RunReason, ...] = get_args(RunReason)
#: A page's cursor: the start (ms) and the run id of the last record of the previous page.
CURSOR_PATTERN = r"^([0-9]{1,16})-([0-9A-Za-z_.:-]{1,128})$"
#: A window: a whole number of minutes, hours, days or weeks, from 1 minute to 7 days (1-10080
#: minutes, 1-168 hours, 1-7 days, 1 week), without leading zeros.
WINDOW_PATTERN = (
    r"^(?:(?:[1-9][0-9]{0,3}|100[0-7][0-9]|10080)m|(?:[1-9][0-9]?|1[0-5][0-9]|16[0-8])h"
    r"|[1-7]d|1w)$"
)
MAX_INSTANCE = 256
_CURSOR = re.compile(CURSOR_PATTERN)
_WINDOW = re.compile(WINDOW_PATTERN)


class QueryError(ValueError):
    """A parameter that cannot be used; the message names it, the value and what would do."""


def _shown(raw: str) -> str:
    return repr(raw) if len(raw) < 10 else f"{raw[:10]!r}..."


def parse_limit(raw: str) -> int:
    # ASCII digits only ("²".isdigit() too), and few of them (int() refuses 4300 and more)
    if raw.isascii() and raw.isdigit() and len(raw) <= 4 and 1 <= int(raw) <= MAX_HISTORY:
        return int(raw)
    raise QueryError(f"limit {_shown(raw)} is invalid: use a whole number from 1 to {MAX_HISTORY}")


def parse_window(raw: str) -> str:
    """A window (``15m``, ``1h``, ``24h``): a whole number of minutes, hours, days or weeks,
    from 1 minute to 7 days."""
    if not _WINDOW.fullmatch(raw):
        raise QueryError(
            f"window {_shown(raw)} is invalid: use a duration from 1m to 7d, e.g. 15m, 1h, 24h "
            "(a whole number of m, h, d or w)"
        )
    return raw


def window_ms(window: str) -> int:
    return to_ms(parse_duration(window, name="window"))


def choices(name: str, raw: str, accepted: Sequence[str]) -> list[str]:
    """A comma-separated list of ``accepted`` words (empty: none)."""
    chosen = raw.split(",") if raw else []
    if unknown := [value for value in chosen if value not in accepted]:
        raise QueryError(
            f"{name} {_shown(unknown[0])} is invalid: use one or more of {', '.join(accepted)} "
            "(comma-separated)"
        )
    return chosen


def parse_instances(raw: str) -> list[str]:
    instances = [value.strip() for value in raw.split(",") if value.strip()]
    if any(len(value) > MAX_INSTANCE for value in instances):
        raise QueryError(f"instance is invalid: an instance id has at most {MAX_INSTANCE} chars")
    return instances


def parse_before(raw: str) -> str:
    if _CURSOR.fullmatch(raw) is None:
        raise QueryError(
            f"before {_shown(raw)} is invalid: pass the `next` value of the previous page"
        )
    return raw


def parse_state(raw: str) -> str:
    if raw != "running":
        raise QueryError(
            f"state={raw[:32]!r} is not supported: the fleet's runs in progress are "
            "state=running (finished runs: GET /jobs/{name}/history)"
        )
    return raw


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


def cursor(raw: str | None) -> tuple[int, str] | None:
    """A cursor checked by ``parse_before``, as (started ms, run id)."""
    found = _CURSOR.fullmatch(raw) if raw else None
    return (int(found.group(1)), found.group(2)) if found else None

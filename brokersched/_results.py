"""The result a run record keeps (``RunRecord.result``): the handler's return value as JSON,
redacted like a traceback and capped so that a record stays small on every backend.

A value that is not JSON (a set, a datetime, NaN, a cycle) is kept as ``None``: the run still
completes, and the job's first such value is logged at warning. A value whose JSON is longer
than the cap is kept as a marker object (``cut_marker``) saying how large it was, with the start
of its JSON text as a string (masked first; none for a value over 64 times the cap): still
JSON, never a value cut in its middle.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ._redact import MASK, redact_text, scrub
from ._tracebacks import printable

__all__ = ["CUT_KEY", "RESULT_LIMIT", "cut_marker", "dumps_result", "mask_result", "run_result"]

#: The most a record's result holds: its JSON text, in bytes (ASCII, non-ASCII escaped: as the
#: record's own JSON carries it).
RESULT_LIMIT = 4096
#: The key of the object a result over the cap is replaced with.
CUT_KEY = "$cut"
# How much of a cut result's JSON text the marker keeps (escaped once more inside the marker,
# so at most twice as long there: under the cap).
_HEAD = RESULT_LIMIT // 4
# A result whose JSON is over this many times the cap is cut without being masked first: its
# marker keeps no start.
_MASKED_MOST = 64
# A key naming a password: its value is masked whole, as ``password=...`` is in text.
_SECRET_KEY = re.compile(r"pass(?:word|wd)", re.IGNORECASE)


def dumps_result(value: Any) -> str:
    """``value`` as the JSON text a record carries: compact, non-ASCII escaped. Raises
    ``ValueError`` or ``TypeError`` for a value that is not JSON (NaN and infinities
    included: no backend's JSON reader takes them)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def run_result(
    value: Any, secrets: Iterable[str] = (), *, limit: int = RESULT_LIMIT
) -> tuple[Any, bool]:
    """What a record keeps of a handler's return ``value``, and whether the value was JSON.

    The JSON value read back from ``value``'s JSON (tuples become lists, as every backend would
    return them) with, in every string (keys too), URLs' passwords, ``password=`` values and
    each of ``secrets`` (the job's data) masked, and the value of every key naming a password
    masked whole; replaced by ``cut_marker`` when its JSON is over ``limit`` bytes.
    ``(None, True)`` for ``None``; ``(None, False)`` for a value that is not JSON."""
    if value is None:
        return None, True
    try:
        text = dumps_result(value)
    except (TypeError, ValueError, RecursionError):
        return None, False
    if len(text) > _MASKED_MOST * limit:
        # Masking it all to keep its start would cost the event loop more than it is worth; a
        # start cut from the unmasked text could end inside a secret.
        return cut_marker(text, limit, head=False), True
    masked = mask_result(json.loads(text), secrets)
    masked_text = dumps_result(masked)
    if len(masked_text) <= limit:
        return masked, True
    return cut_marker(masked_text, limit), True


def cut_marker(text: str, limit: int = RESULT_LIMIT, *, head: bool = True) -> dict[str, Any]:
    """What stands for a result whose JSON ``text`` is over ``limit`` bytes: its size, the
    limit, and the start of its text (``{"$cut": {"bytes": 9000, "limit": 4096}, "head":
    "[1,2,..."}``; ``head=False``: ``""``)."""
    start = text[: min(_HEAD, limit // 4)] if head else ""
    return {CUT_KEY: {"bytes": len(text), "limit": limit}, "head": start}


def mask_result(value: Any, secrets: Iterable[str] = ()) -> Any:
    """The JSON ``value`` with its secrets masked as ``run_result`` masks them: what is shown
    of a record's result (the job's data may hold secrets a record's writer did not know)."""
    return _masked(value, list(secrets))


def _masked(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        return _masked_text(value, secrets)
    if isinstance(value, list):
        return [_masked(item, secrets) for item in value]
    if isinstance(value, dict):
        return {
            _masked_text(key, secrets): MASK
            if _SECRET_KEY.search(key) and item is not None
            else _masked(item, secrets)
            for key, item in value.items()
        }
    return value


def _masked_text(text: str, secrets: list[str]) -> str:
    return scrub(redact_text(printable(text)), secrets)

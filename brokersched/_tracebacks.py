"""The traceback a run record keeps (``RunRecord.traceback``): the formatted exception with its
cause chain, redacted, and capped so that a record stays small on every backend."""

from __future__ import annotations

import asyncio
import os
import traceback
from collections.abc import Iterable

from ._redact import redact_text, scrub

__all__ = ["TRACEBACK_LIMIT", "cap_traceback", "error_text", "printable", "run_traceback"]

#: The most a record's traceback holds, in UTF-8 bytes.
TRACEBACK_LIMIT = 4096


def run_traceback(
    exc: BaseException, secrets: Iterable[str] = (), *, limit: int = TRACEBACK_LIMIT
) -> str:
    """``exc`` as Python prints it (causes and contexts first, then the exception itself), with
    every URL's password, every ``password=`` value and each of ``secrets`` (the job's data)
    masked, cut to ``limit`` bytes."""
    formatted = traceback.TracebackException.from_exception(exc)
    _drop_our_frames(formatted, set())
    text = printable("".join(formatted.format()))
    return cap_traceback(scrub(redact_text(text), secrets), limit)


def error_text(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """A run record's ``error``: ``Type: message``, redacted as ``run_traceback`` is. An
    exception whose ``str()`` raises is named as such (it failed the run's outcome before)."""
    try:
        message = str(exc)
    except Exception:
        message = "<exception str() failed>"
    return scrub(redact_text(printable(f"{type(exc).__name__}: {message}")), secrets)


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot hold escaped: lone surrogates, as a file name of bytes
    that are not UTF-8 decodes to (``os.listdir``), which no backend can store."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# The runner's own frames, and the thread pool's that carry a sync handler, come before the
# handler's in every traceback: left out, so that the 4 KiB hold the application's frames.
_OURS = (os.path.dirname(__file__) + os.sep, os.path.dirname(asyncio.__file__) + os.sep)
_THREAD_POOL = os.path.join("concurrent", "futures", "thread.py")


def _drop_our_frames(exc: traceback.TracebackException, seen: set[int]) -> None:
    if id(exc) in seen:
        return
    seen.add(id(exc))
    frames = list(exc.stack)
    start = 0
    while start < len(frames) - 1 and _is_ours(frames[start].filename):
        start += 1
    if start:
        exc.stack = traceback.StackSummary.from_list(frames[start:])
    for chained in (exc.__cause__, exc.__context__):
        if chained is not None:
            _drop_our_frames(chained, seen)


def _is_ours(filename: str) -> bool:
    return filename.startswith(_OURS) or filename.endswith(_THREAD_POOL)


def cap_traceback(text: str, limit: int = TRACEBACK_LIMIT) -> str:
    """``text`` if it fits in ``limit`` bytes, else its end (the innermost frames and the
    exception line, which come last), from a line's start when one is near, after a line that
    says how much was cut. A last line too long for half the limit is cut in its middle."""
    data = text.encode()
    if len(data) <= limit:
        return text
    body_limit = limit - 64  # room for the marker line
    head, newline, last = text.rstrip("\n").rpartition("\n")
    if len(last.encode()) > body_limit // 2:  # a huge exception message
        keep = body_limit // 4
        last_bytes = last.encode()
        last = (
            last_bytes[:keep].decode(errors="ignore")
            + " [...] "
            + last_bytes[-keep:].decode(errors="ignore")
        )
    room = body_limit - len(last.encode()) - 1
    before = (head + newline).encode()
    kept = before[-room:].decode(errors="ignore") if room > 0 else ""
    start = kept.find("\n")
    if 0 <= start < len(kept) // 4:
        kept = kept[start + 1 :]  # from the start of a line
    body = kept + last
    cut = len(data) - len(body.encode())
    return f"[traceback cut: {cut} of {len(data)} bytes left out]\n{body}"

"""Log formatting for ``brokersched run``: one JSON object per line, or plain text.

The scheduler logs one line per run and per skip on the ``brokersched`` logger, with the fields
in ``extra`` (``job``, ``run_id``, ``slot``, ``reason``, ``attempt``, ``outcome``,
``duration_ms``, ``late_ms``, ``instance_id``). ``JsonFormatter`` puts every such field in the
object, so a log pipeline can filter on ``job`` or ``outcome`` without parsing the message.

Credentials never reach the output: both formatters pass the text through
``brokersched._redact.redact_text``, which hides the password of any
``scheme://user:password@host`` URL (up to its last ``@``) and of ``password=...`` /
``sslpassword=...`` pairs (libpq DSNs, query strings), wherever they appear (message, extra
fields, tracebacks).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TextIO, TypeGuard, cast

from ._redact import redact_text

__all__ = ["JsonFormatter", "LogFormat", "TextFormatter", "configure_logging"]

LogFormat = Literal["json", "text"]

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        key: value
        for key, value in vars(record).items()
        if key not in _STANDARD_ATTRS and not key.startswith("_")
    }


def _is_mapping(value: object) -> TypeGuard[Mapping[Any, Any]]:
    return isinstance(value, Mapping)


def _jsonable(value: Any) -> Any:
    """``value`` with its strings redacted if JSON can hold it, else its redacted ``str``."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in cast("list[Any]", value)]
    if _is_mapping(value):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return redact_text(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, the ``extra``
    fields of the record, and ``exc_info`` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact_text(record.getMessage()),
        }
        for key, value in _extra_fields(record).items():
            entry.setdefault(key, _jsonable(value))  # an extra never hides a standard key
        if record.exc_info:
            entry["exc_info"] = redact_text(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack_info"] = redact_text(self.formatStack(record.stack_info))
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``2027-01-15 08:00:00,123 INFO brokersched: run job=... outcome=...``, redacted."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


# The broker and database clients log their own connection errors; a one-shot command reports
# the same failure in its one error line.
CLIENT_LOGGERS = ("aiormq", "aio_pika", "nats", "asyncpg", "aiosqlite")


def configure_logging(
    log_format: LogFormat = "text",
    level: str | int = "INFO",
    stream: TextIO | None = None,
    *,
    quiet_clients: bool = False,
) -> logging.Handler:
    """Send every logger's records (the application's too) to ``stream`` (default stderr).

    Replaces the root logger's handlers: this is for a process that the CLI owns. With
    ``quiet_clients`` (and a level above DEBUG), the client libraries' own logs are dropped.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    if quiet_clients and root.level > logging.DEBUG:
        for name in CLIENT_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    return handler

"""What a route answers: a ``Reply`` (a status, a JSON body, headers), rendered by the route's
``Operation`` (``_openapi``) through the body type its OpenAPI document declares for that
status, so that no route answers what its document does not say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Reply", "error"]


@dataclass(frozen=True, slots=True)
class Reply:
    data: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> Reply:
    """An error: ``error`` says what and why (and ``extra``, e.g. what is known of the
    backend)."""
    return Reply({"error": message, **extra}, status, headers or {})

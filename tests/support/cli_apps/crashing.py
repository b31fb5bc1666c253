"""An application whose import fails with a bug of its own."""

from __future__ import annotations

settings: dict[str, str] = {}
DATABASE = settings["database"]

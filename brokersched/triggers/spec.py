"""A trigger as plain JSON data and back: what ``brokersched jobs --json`` prints of a job's
schedule, so that a saved listing can be read again (``brokersched plan``) and give the very
slots the application gives.

``{"kind": "every", "interval_ms": 300000, "offset_ms": 0}``,
``{"kind": "cron", "expression": "0 8 * * *", "timezone": "Europe/Paris", "dst": null}``,
``{"kind": "at", "at": "2027-01-01T00:00:00.000Z"}``, ``{"kind": "after", "delay_ms": 0}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from .._exceptions import ConfigurationError
from .._json import iso
from .after import AfterTrigger
from .at import AtTrigger, parse_when
from .base import Trigger
from .cron import CronTrigger, parse_cron, parse_dst
from .interval import IntervalTrigger

__all__ = ["trigger_from_spec", "trigger_spec"]


def trigger_spec(trigger: Trigger) -> dict[str, Any]:
    """``trigger`` as JSON-serialisable data (see the module docstring); a stored schedule's,
    its latest version's."""
    from .._stored import VersionedTrigger

    if isinstance(trigger, VersionedTrigger) and trigger.current is not None:
        trigger = trigger.current
    if isinstance(trigger, CronTrigger):
        return {
            "kind": "cron",
            "expression": trigger.expression,
            "timezone": trigger.timezone_name,
            "dst": trigger.dst,
        }
    if isinstance(trigger, IntervalTrigger):
        return {
            "kind": "every",
            "interval_ms": trigger.interval // _ONE_MS,
            "offset_ms": trigger.offset // _ONE_MS,
        }
    if isinstance(trigger, AtTrigger):
        return {"kind": "at", "at": iso(trigger.when)}
    if isinstance(trigger, AfterTrigger):
        return {"kind": "after", "delay_ms": trigger.delay_ms}
    raise TypeError(f"no JSON form for {trigger!r}")


def trigger_from_spec(spec: Mapping[str, Any]) -> Trigger:
    """The trigger ``spec`` describes; raises ``ConfigurationError`` (``option="trigger"``,
    or the option of the value that is wrong) when it describes none."""
    kind = spec.get("kind")
    try:
        if kind == "cron":
            dst = spec.get("dst")
            return parse_cron(
                _field(spec, "expression", str),
                _field(spec, "timezone", str),
                dst=None if dst is None else parse_dst(dst),
            )
        if kind == "every":
            interval = timedelta(milliseconds=_field(spec, "interval_ms", int))
            offset = timedelta(milliseconds=spec.get("offset_ms") or 0)
            return IntervalTrigger(interval, offset)
        if kind == "at":
            return AtTrigger(parse_when(datetime.fromisoformat(_field(spec, "at", str))))
        if kind == "after":
            return AfterTrigger(timedelta(milliseconds=_field(spec, "delay_ms", int)))
    except ConfigurationError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"trigger {dict(spec)!r} is not valid: {exc}", option="trigger"
        ) from None
    raise ConfigurationError(
        f"trigger {dict(spec)!r} has no kind 'every', 'cron', 'at' or 'after'", option="trigger"
    )


_ONE_MS = timedelta(milliseconds=1)


def _field(spec: Mapping[str, Any], name: str, kind: type[Any]) -> Any:
    value = spec.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"'{name}' must be {kind.__name__}, not {value!r}")
    return value

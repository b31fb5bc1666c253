"""An OpenTelemetry span per executed run, when opentelemetry-api is installed; else nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._context import JobContext

__all__ = ["finish_span", "run_span"]

try:
    from opentelemetry import trace
except ImportError:  # the "otel" extra is optional
    trace = None  # type: ignore[assignment]


@contextmanager
def run_span(ctx: JobContext) -> Iterator[Any]:
    """A span around one run; the caller sets ``brokersched.outcome`` on it when done."""
    if trace is None:
        yield None
        return
    tracer = trace.get_tracer("brokersched")
    attributes: dict[str, str | int] = {
        "brokersched.job": ctx.job,
        "brokersched.run_id": ctx.run_id,
        "brokersched.slot_ms": ctx.slot_ms,
        "brokersched.reason": ctx.reason,
        "brokersched.attempt": ctx.attempt,
        "brokersched.instance_id": ctx.instance_id,
    }
    with tracer.start_as_current_span(
        f"brokersched.run {ctx.job}", attributes=attributes, record_exception=False
    ) as span:
        yield span


def finish_span(
    span: Any, outcome: str, error: str | None, exception: BaseException | None = None
) -> None:
    """Set the outcome; a handler's exception is recorded on the span (an ``exception`` event
    with its type, message and stack, which error trackers read)."""
    if span is None or trace is None:
        return
    span.set_attribute("brokersched.outcome", outcome)
    if exception is not None:
        span.record_exception(exception)
    if outcome != "completed":
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))

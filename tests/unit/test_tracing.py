"""One OpenTelemetry span per executed run (opentelemetry-sdk's in-memory exporter)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.testing import TestClock

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def provider() -> None:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(tracer_provider)  # once per process: the API allows no reset


async def test_each_run_is_a_span_with_its_outcome() -> None:
    EXPORTER.clear()
    clock = TestClock("2027-01-15T08:00:30+00:00")
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    inside: list[bool] = []

    async def ok(ctx: JobContext) -> None:
        inside.append(trace.get_current_span().is_recording())

    async def broken(ctx: JobContext) -> None:
        raise ValueError("nope")

    sched.every("ok", "1m", ok)
    sched.every("broken", "1m", broken)
    await sched.start()
    await clock.advance("1m")
    await sched.stop()
    spans = {span.name: span for span in EXPORTER.get_finished_spans()}
    assert set(spans) == {"brokersched.run ok", "brokersched.run broken"}
    assert inside == [True]  # the handler runs inside its span
    good, bad = spans["brokersched.run ok"], spans["brokersched.run broken"]
    assert good.attributes is not None and bad.attributes is not None
    assert good.attributes["brokersched.outcome"] == "completed"
    assert good.attributes["brokersched.slot_ms"] == 1_800_000_060_000
    assert good.attributes["brokersched.reason"] == "schedule"
    assert bad.attributes["brokersched.outcome"] == "failed"
    assert bad.status.status_code is StatusCode.ERROR
    assert bad.status.description == "ValueError: nope"


async def test_a_handler_exception_is_recorded_on_its_span() -> None:
    EXPORTER.clear()
    clock = TestClock("2027-01-15T08:00:30+00:00")
    sched = Scheduler(MemoryBackend(), clock=clock, jitter=0)

    def broken(ctx: JobContext) -> None:
        raise RuntimeError("database is down")

    sched.every("broken", "1m", broken)
    async with sched:
        await clock.advance("1m")
    (span,) = EXPORTER.get_finished_spans()
    (event,) = span.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "RuntimeError"
    assert event.attributes["exception.message"] == "database is down"
    assert "in broken" in str(event.attributes["exception.stacktrace"])

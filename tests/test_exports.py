"""The public surface is exactly what DESIGN.md names (and a few documented extras)."""

import brokersched


def test_all_is_the_public_surface() -> None:
    assert set(brokersched.__all__) == {
        "BackendError",
        "BackendUnavailableError",
        "BrokerschedError",
        "ConfigurationError",
        "Job",
        "JobContext",
        "LeaseLostError",
        "MemoryBackend",
        "NATSBackend",
        "PostgresBackend",
        "PrometheusMetrics",
        "RabbitMQBackend",
        "RunEvent",
        "RunRecord",
        "SQLiteBackend",
        "Scheduler",
        "SkipEvent",
        "StartEvent",
        "parse_cron",
        "parse_duration",
    }
    for name in brokersched.__all__:
        assert getattr(brokersched, name) is not None, name


def test_importing_needs_no_extras() -> None:
    import subprocess
    import sys

    code = (
        "import sys, brokersched\n"
        "assert not {'aio_pika', 'nats', 'asyncpg', 'aiosqlite'} & set(sys.modules), sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

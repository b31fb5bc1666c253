"""The public surface is exactly the documented one (the README's API)."""

from pathlib import Path

import brokersched


def test_all_is_the_public_surface() -> None:
    assert set(brokersched.__all__) == {
        "BackendError",
        "BackendUnavailableError",
        "BrokerschedError",
        "ClaimEvent",
        "RecordDroppedEvent",
        "Clock",
        "ClockSkewError",
        "ConfigurationError",
        "ControlChange",
        "Instance",
        "Job",
        "JobContext",
        "JobControl",
        "JobOptions",
        "JobSettings",
        "MemoryBackend",
        "MissedEvent",
        "NATSBackend",
        "NATSLeaseBackend",
        "PostgresBackend",
        "PrometheusMetrics",
        "RabbitMQBackend",
        "RedisBackend",
        "RedisLeaseBackend",
        "Retry",
        "RunEvent",
        "RunInProgress",
        "RunRecord",
        "SQLiteBackend",
        "ScheduleConflictError",
        "Scheduler",
        "Schedules",
        "StoredSchedule",
        "SchedulerThread",
        "SkipEvent",
        "StartEvent",
        "SystemClock",
        "Timer",
        "parse_cron",
        "parse_duration",
    }
    for name in brokersched.__all__:
        assert getattr(brokersched, name) is not None, name


def test_the_namespace_holds_the_public_names_and_the_package_parts_only() -> None:
    public = {name for name in vars(brokersched) if not name.startswith("_")}
    packages = {"abc", "backends", "triggers", "testing", "cli", "web", "contrib"}
    assert public - packages <= set(brokersched.__all__)
    assert not {"Any", "TYPE_CHECKING", "importlib", "annotations"} & set(vars(brokersched))
    assert set(dir(brokersched)) == {*brokersched.__all__, "__version__"}
    assert isinstance(brokersched.__version__, str)


def test_the_package_version_is_the_one_in_the_code() -> None:
    from importlib.metadata import version

    assert version("brokersched") == brokersched.__version__


def test_the_package_says_it_is_typed_and_where_to_read_more() -> None:
    from importlib.metadata import metadata

    meta = metadata("brokersched")
    assert "Typing :: Typed" in meta.get_all("Classifier", [])
    labels = {entry.partition(",")[0] for entry in meta.get_all("Project-URL", [])}
    assert labels >= {"Homepage", "Documentation", "Issues", "Changelog"}
    assert Path(brokersched.__file__).with_name("py.typed").is_file()  # the wheel takes it


def test_public_objects_say_where_they_are_imported_from() -> None:
    for name in brokersched.__all__:
        assert getattr(brokersched, name).__module__ == "brokersched", name
    assert repr(brokersched.Scheduler) == "<class 'brokersched.Scheduler'>"

"""Per-deployment overrides: ``Scheduler(overrides=...)``, ``BROKERSCHED_OVERRIDES`` and
``--override``; validated as registration is, the kind of a job never changes."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from brokersched import (
    BackendUnavailableError,
    ConfigurationError,
    JobContext,
    MemoryBackend,
    RabbitMQBackend,
    Scheduler,
)
from brokersched._registry import collect_errors
from brokersched.cli import cli
from brokersched.testing import TestClock
from brokersched.web._views import job_state

START = "2027-01-15T08:00:30+00:00"


class Runs:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (job, reason)

    async def __call__(self, ctx: JobContext) -> None:
        self.seen.append((ctx.job, ctx.reason))


def register(scheduler: Scheduler[Any], runs: Runs) -> None:
    scheduler.cron("digest.daily", "0 8 * * MON-FRI", runs, timezone="Europe/Paris")
    scheduler.every("purge", "1m", runs)
    scheduler.every("sync", "1m", runs, jitter="1s")
    scheduler.after("warm", "2s", runs, claim=False)


def test_overrides_replace_schedules_and_options() -> None:
    scheduler = Scheduler(
        overrides={
            "digest.daily": {"cron": "0 * * * *"},
            "sync": {"every": "5m", "jitter": "10s", "key": "sync-v2"},
            "warm": {"delay": "30s"},
        }
    )
    register(scheduler, Runs())
    digest, sync, warm = (scheduler.get(n) for n in ("digest.daily", "sync", "warm"))
    assert digest is not None and sync is not None and warm is not None
    assert digest.describe() == "cron '0 * * * *' (Europe/Paris)"  # the zone stays
    assert digest.overrides == {"cron": "0 * * * *"}
    assert (sync.describe(), sync.settings.jitter_ms, sync.key) == ("every 5m", 10_000, "sync-v2")
    assert warm.describe() == "once, 30s after start"
    purge = scheduler.get("purge")
    assert purge is not None and purge.overrides == {} and purge.enabled


def test_at_takes_an_iso_instant_from_configuration() -> None:
    scheduler = Scheduler(overrides={"migrate": {"at": "2030-01-01T00:00:00+00:00"}})
    job = scheduler.at("migrate", datetime(2029, 1, 1, tzinfo=UTC), Runs())
    assert job.describe() == "at 2030-01-01T00:00:00+00:00"
    with pytest.raises(ConfigurationError, match="at 'soon' is not an ISO 8601 instant"):
        Scheduler(overrides={"m": {"at": "soon"}}).at("m", datetime(2029, 1, 1, tzinfo=UTC), Runs())


@pytest.mark.parametrize(
    ("register_job", "override", "message"),
    [
        (
            lambda s: s.every("purge", "1m", Runs()),
            {"cron": "0 * * * *"},
            "job 'purge' is an every() job: override 'cron' does not apply (its schedule is "
            "'every'); the kind of a job never changes",
        ),
        (
            lambda s: s.cron("purge", "0 * * * *", Runs()),
            {"every": "1h"},
            "job 'purge' is a cron() job: override 'every' does not apply (its schedule is "
            "'cron'); the kind of a job never changes",
        ),
        (
            lambda s: s.after("purge", "1s", Runs()),
            {"every": "1h"},
            "job 'purge' is an after() job: override 'every' does not apply (its schedule is "
            "'delay'); the kind of a job never changes",
        ),
        (
            lambda s: s.every("purge", "1m", Runs()),
            {"enabled": "no"},
            "job 'purge': override 'enabled' = 'no' must be true or false",
        ),
    ],
)
def test_the_kind_never_changes(register_job: Any, override: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        register_job(Scheduler(overrides={"purge": override}))
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("enable", "; did you mean 'enabled'?"),
        ("evry", "; did you mean 'every'?"),
        ("jiter", "; did you mean 'jitter'?"),
        ("colour", ""),
    ],
)
def test_an_unknown_override_key_is_named_with_every_key_it_takes(key: str, hint: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Scheduler(overrides={"purge": {key: "5m"}}).every("purge", "1m", Runs())
    assert str(caught.value) == (
        f"job 'purge': override '{key}' is not an option{hint} (an override of this job takes: "
        "every, enabled, jitter, max_late, timeout, overlap, max_attempts, catch_up, "
        "history_size, history_ttl, offset, timezone, dst, data, claim, key, run_on_start, retry)"
    )
    assert (caught.value.option, caught.value.job) == (key, "purge")


@pytest.mark.parametrize(
    ("schedule", "options"),
    [
        ("0 25 * * *", {}),
        ("* * 31 2 *", {}),
        ("0 * * * *", {"jitter": "1h"}),
        ("0 * * * *", {"timezone": "Mars/Olympus"}),
    ],
)
def test_an_override_is_refused_with_the_message_of_registration(
    schedule: str, options: dict[str, Any]
) -> None:
    with pytest.raises(ConfigurationError) as registered:
        Scheduler().cron("digest.daily", schedule, Runs(), **options)
    overridden = Scheduler(overrides={"digest.daily": {"cron": schedule, **options}})
    with pytest.raises(ConfigurationError) as caught:
        overridden.cron("digest.daily", "0 8 * * *", Runs())
    assert str(caught.value) == str(registered.value)
    assert caught.value.option == registered.value.option


def test_a_lease_option_override_is_refused_on_a_claim_only_backend() -> None:
    backend = RabbitMQBackend("amqp://127.0.0.1/")
    with pytest.raises(ConfigurationError) as caught:
        Scheduler(backend, overrides={"sync": {"overlap": "allow"}}).every("sync", "1m", Runs())
    assert str(caught.value).startswith(
        "job 'sync': option 'overlap' ('allow') needs a lease backend; RabbitMQBackend only "
        "claims slots"
    )
    assert caught.value.backend == "RabbitMQBackend"


async def test_an_override_naming_no_job_is_refused_at_start_with_a_suggestion() -> None:
    scheduler = Scheduler(overrides={"digets.daily": {"cron": "0 * * * *"}, "zzz": {}})
    register(scheduler, Runs())
    errors = [str(error) for error in scheduler.check()]
    assert errors == [
        "overrides: no job 'digets.daily'; did you mean 'digest.daily'?",
        "overrides: no job 'zzz' (jobs: digest.daily, purge, sync, warm)",
    ]
    with pytest.raises(ConfigurationError, match=r"did you mean 'digest\.daily'"):
        await scheduler.start()
    assert not scheduler.running


async def test_a_disabled_job_is_listed_not_armed_and_runs_on_trigger() -> None:
    clock, runs = TestClock(START), Runs()
    scheduler = Scheduler(
        MemoryBackend(),
        clock=clock,
        jitter=0,
        overrides={"purge": {"enabled": False}, "warm": {"enabled": False}},
    )
    register(scheduler, runs)
    purge = scheduler.get("purge")
    assert purge is not None and not purge.enabled
    async with scheduler:
        await clock.advance("3m")
        assert sorted(set(runs.seen)) == [("sync", "schedule")]  # neither purge nor warm
        assert purge.next_run is None
        assert job_state(scheduler, purge) == "disabled"
        record = await purge.trigger()
        assert record is not None and record.reason == "manual"


def test_overrides_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROKERSCHED_OVERRIDES", json.dumps({"purge": {"every": "5m"}}))
    scheduler = Scheduler()
    assert scheduler.every("purge", "1m", Runs()).describe() == "every 5m"
    explicit = Scheduler(overrides={})  # the argument wins over the environment
    assert explicit.every("purge", "1m", Runs()).describe() == "every 1m"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "BROKERSCHED_OVERRIDES is not valid JSON (Expecting property name"),
        ("[1]", "BROKERSCHED_OVERRIDES must map job names to their overrides"),
        ('{"purge": 3}', "BROKERSCHED_OVERRIDES['purge'] must be a mapping of options"),
    ],
)
def test_bad_overrides_in_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("BROKERSCHED_OVERRIDES", value)
    with pytest.raises(ConfigurationError) as caught:
        Scheduler()
    assert str(caught.value).startswith(message)


def test_check_collects_override_errors() -> None:
    runs = Runs()
    with collect_errors():  # the decorator form collects (the direct form raises)
        scheduler = Scheduler(overrides={"purge": {"cron": "* * * * *"}, "sync": {"jitter": "1h"}})
        scheduler.every("purge", "1m")(runs)
        scheduler.every("sync", "1m", jitter="1s")(runs)
    errors = [str(error) for error in scheduler.check()]
    assert errors[0].startswith("job 'purge' is an every() job: override 'cron' does not apply")
    assert errors[1].startswith("job 'sync': jitter (1h) must be under half the time")


# -- the CLI ----------------------------------------------------------------------------------

APP = """
from brokersched import Scheduler

scheduler = Scheduler(overrides={"digest.daily": {"jitter": "5s"}})


async def work(ctx):
    pass


scheduler.cron("digest.daily", "0 8 * * *", work)
scheduler.every("purge", "1m", work, key="purge-v2")
"""

APP_AT = """
from datetime import UTC, datetime, timedelta

from brokersched import Scheduler

scheduler = Scheduler(
    overrides={"migrate": {"at": datetime(2030, 1, 1, tzinfo=UTC), "timeout": timedelta(hours=1)}}
)


async def work(ctx):
    pass


scheduler.at("migrate", datetime(2029, 1, 1, tzinfo=UTC), work)
"""


@pytest.fixture
def app(tmp_path: Path) -> str:
    path = tmp_path / f"overrides_app_{secrets.token_hex(4)}.py"  # imported in process: unique
    path.write_text(APP)
    return f"{path}:scheduler"


def row(output: str, name: str) -> list[str]:
    line = next(line for line in output.splitlines() if line[2:].startswith(f"{name} "))
    return [cell.strip() for cell in line.replace("┃", "│").strip("│ ").split("│")]


def test_jobs_shows_keys_overrides_and_the_enabled_state(app: str) -> None:
    result = jobs_in_process(
        app,
        "-n",
        "1",
        "--override",
        "digest.daily.cron=0 * * * *",
        "--override",
        "purge.enabled=false",
        env={"BROKERSCHED_OVERRIDES": ""},
    )
    assert result.exit_code == 0, result.stderr
    header = row(result.stdout, "name")
    assert header[:8] == [
        "name",
        "key",
        "kind",
        "schedule",
        "zone",
        "options",
        "overrides",
        "state",
    ]
    digest = row(result.stdout, "digest.daily")
    assert digest[:3] == ["digest.daily", "digest.daily", "cron"]
    assert digest[3] == "cron '0 * * * *' (UTC)"
    assert digest[6] == 'jitter="5s"'  # the first line of the cell; the cron one follows
    assert digest[7] == "enabled"
    purge = row(result.stdout, "purge")
    assert purge[:2] == ["purge", "purge-v2"]
    assert (purge[6], purge[7], purge[8]) == ("enabled=false", "disabled", "-")
    assert 'cron="0 * * * *"' in result.stdout


def test_jobs_shows_overrides_that_are_not_json(tmp_path: Path) -> None:
    path = tmp_path / f"overrides_at_{secrets.token_hex(4)}.py"
    path.write_text(APP_AT)
    result = jobs_in_process(f"{path}:scheduler")
    assert result.exit_code == 0, result.stderr
    assert row(result.stdout, "migrate")[6] == 'at="2030-01-01 00:00:00+00:00"'


def jobs_in_process(*args: str, env: dict[str, str] | None = None) -> Result:
    """``brokersched jobs ...`` in this process (the same code as a subprocess, faster)."""
    return CliRunner().invoke(cli, ["jobs", *args], env={"COLUMNS": "250", **(env or {})})


def test_jobs_shows_no_password_of_a_url_in_data(app: str) -> None:
    data = '{"dsn": "postgresql://report:s3cret@db/reports"}'
    result = jobs_in_process(app, "--override", f"purge.data={data}")
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output
    assert 'data={"dsn":"postgresql://report:***@db/reports"}' in result.output
    assert 'data={"dsn": "postgresql://report:***@db/reports"}' in result.output


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "digets.daily.cron=0 * * * *",
            "overrides: no job 'digets.daily'; did you mean 'digest.daily'?",
        ),
        ("purge.cron=0 * * * *", "job 'purge' is an every() job: override 'cron' does not apply"),
        ("purge", "--override 'purge' is not JOB.OPTION=VALUE"),
        ("purge.jitter=1h", "job 'purge': jitter (1h) must be under half the time between runs"),
        ("purge.timeout=1e300", "job 'purge': timeout 1e+300 is too long; a duration must be at"),
        ("purge.every=99999999999d", "job 'purge': interval '99999999999d' is too long"),
    ],
)
def test_cli_overrides_are_validated(app: str, override: str, message: str) -> None:
    result = jobs_in_process(app, "--override", override)
    assert result.exit_code == 2
    assert message in result.stderr


def test_check_reports_an_override_naming_no_job(app: str) -> None:
    check = CliRunner().invoke(cli, ["check", app, "--override", "purg.jitter=1"])
    assert check.exit_code == 1
    assert "error: overrides: no job 'purg'; did you mean 'purge'?" in check.stderr


def test_check_reports_every_refused_cli_override_at_once(app: str) -> None:
    """As for overrides from the environment: each error listed, exit 1 (not the first one
    alone with exit 2)."""
    check = CliRunner().invoke(
        cli,
        ["check", app, "--override", "purge.jitter=1h", "--override", "digest.daily.key=purge-v2"],
    )
    assert check.exit_code == 1, check.output
    assert check.stderr.splitlines() == [
        "error: job 'purge': jitter (1h) must be under half the time between runs (1m), i.e. "
        "under 30s",
        "error: job 'purge': max_late (1m) must be greater than jitter (1h)",
        "error: job 'digest.daily': key 'purge-v2' is taken by job 'purge'; two jobs of "
        "one scheduler need different keys (claims and history are kept under the key)",
        "3 configuration errors",
    ]


def test_the_environment_reaches_the_cli(tmp_path: Path) -> None:
    path = tmp_path / f"overrides_plain_{secrets.token_hex(4)}.py"
    path.write_text(APP.replace('overrides={"digest.daily": {"jitter": "5s"}}', ""))
    env = {"BROKERSCHED_OVERRIDES": '{"purge": {"every": "5m"}}'}
    result = jobs_in_process(f"{path}:scheduler", env=env)
    assert result.exit_code == 0, result.stderr
    assert row(result.stdout, "purge")[3] == "every 5m"
    again = path.with_name(f"overrides_plain_{secrets.token_hex(4)}.py")  # imported afresh
    again.write_text(path.read_text())
    bad = jobs_in_process(f"{again}:scheduler", env={"BROKERSCHED_OVERRIDES": "{"})
    assert bad.exit_code == 2
    assert "BROKERSCHED_OVERRIDES is not valid JSON" in bad.stderr


class DownBackend(MemoryBackend):
    """A backend that never answers (a broker that is not there yet)."""

    async def start(self, clock: Any) -> None:
        raise BackendUnavailableError("connection refused")


async def test_a_disabled_job_is_never_overdue_even_while_connecting() -> None:
    clock = TestClock(START)
    scheduler = Scheduler(
        DownBackend(), clock=clock, jitter=0, max_late="10s", overrides={"off": {"enabled": False}}
    )
    scheduler.every("on", "5s", Runs())
    scheduler.every("off", "5s", Runs())
    await scheduler.start(wait=False)  # the backend does not answer: every slot is missed
    await clock.advance("30s")
    assert [job.name for job in scheduler.overdue()] == ["on"]
    await scheduler.stop()


async def test_overrides_are_added_before_start_only() -> None:
    """After start() an override would reach a job only after its armed slot (a job switched
    off ran once more); a running job changes with update(), pause() and resume()."""
    clock, runs = TestClock(START), Runs()
    scheduler = Scheduler(MemoryBackend(), clock=clock, jitter=0)
    purge = scheduler.every("purge", "1m", runs)
    async with scheduler:
        with pytest.raises(RuntimeError, match=r"must be called before start\(\)"):
            scheduler.add_overrides({"purge": {"enabled": False, "every": "10s"}})
        assert purge.enabled and purge.describe() == "every 1m" and purge.overrides == {}
    scheduler.add_overrides({"purge": {"enabled": False}})  # stopped: allowed again
    assert not purge.enabled


def test_a_refused_override_changes_nothing() -> None:
    scheduler = Scheduler(overrides={"purge": {"every": "5m"}})
    purge = scheduler.every("purge", "1m", Runs())
    sync = scheduler.every("sync", "1m", Runs())
    for bad in ({"purge": {"jitter": "1h"}}, {"sync": {"key": "purge"}}):
        with pytest.raises(ConfigurationError):
            scheduler.add_overrides(bad)
    assert (purge.overrides, sync.overrides) == ({"every": "5m"}, {})
    scheduler.add_overrides({"sync": {"jitter": "1s"}})  # the refused ones are not merged in
    assert sync.overrides == {"jitter": "1s"} and sync.key == "sync"
    scheduler.add_overrides({"purge": {"enabled": False}})
    assert purge.overrides == {"every": "5m", "enabled": False}
    assert purge.settings.jitter_ms == 2000

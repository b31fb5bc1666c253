"""``brokersched simulate APP``: the application's own jobs through the fleet simulator, its
report per job, and a broken promise found in an application with the seed that replays it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from brokersched import (
    MemoryBackend,
    NATSBackend,
    NATSLeaseBackend,
    RedisBackend,
    RedisLeaseBackend,
    Scheduler,
    SQLiteBackend,
)
from brokersched.backends import _lease
from brokersched.cli import cli
from brokersched.testing import _sim_app
from brokersched.testing._sim_app import KINDS, classify, read_app, simulate_app
from brokersched.testing._sim_ledger import Ledger, Run
from tests.support.cli_apps import simulated_app

APP = Path(simulated_app.__file__)
OUTBOX, LEDGER = f"{APP}:outbox", f"{APP}:ledger"
PER_INSTANCE, UPDATED, MIGRATION = f"{APP}:per_instance", f"{APP}:updated", f"{APP}:migration"


def simulate(*args: str) -> Any:
    wide = {"COLUMNS": "240"}  # a table row on one line, whatever the terminal running pytest
    return CliRunner().invoke(cli, ["simulate", *args], catch_exceptions=False, env=wide)


def test_the_report_names_each_job_what_ran_and_that_every_promise_held() -> None:
    result = simulate(OUTBOX, "--seeds", "2", "--hours", "0.05")
    assert result.exit_code == 0, result.output
    assert "on RabbitMQBackend (model: rabbitmq), 3 instances, 0.05 h from" in result.output
    for name in ("outbox.flush", "digest"):
        assert name in result.output
    assert "2 seeds: every promise held" in result.output
    assert "secret-password" not in result.output


def test_the_json_report_counts_the_runs_of_each_job_by_reason() -> None:
    result = simulate(LEDGER, "--seeds", "2", "--hours", "0.05", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["model"], report["seeds"], report["ok"]) == ("lease", [0, 1], True)
    sync = report["jobs"]["sync"]
    assert sync["runs"]["schedule"] > 0
    assert all(sync[kind.replace(" ", "_")] == [] for kind in KINDS)


def test_a_broken_promise_is_reported_for_its_job_with_the_seed_that_replays_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A take-over that ignores the job's overlap rule (as the lease store's rule once did)
    lets a dead runner's slot restart beside a manual run of ``report``, an overlap="skip"
    job: found in seed 20 of this application."""
    take_over = _lease._take_over

    def ignoring_overlap(job: str, row: Any, take: Any, store: Any) -> Any:
        allow = replace(take, policy=replace(take.policy, overlap="allow"))
        return take_over(job, row, allow, store)

    assert simulate(LEDGER, "--seed", "20", "--hours", "0.05").exit_code == 0
    monkeypatch.setattr(_lease, "_take_over", ignoring_overlap)
    result = simulate(LEDGER, "--seeds", "1", "--first", "20", "--hours", "0.05", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["jobs"]["report"]["overlapped"] == [20]
    assert report["jobs"]["sync"]["overlapped"] == []
    text = simulate(LEDGER, "--seed", "20", "--hours", "0.05")
    assert "replay one with its steps: brokersched simulate" in text.stdout
    assert "--seed 20" in text.stdout
    assert "runs of report overlap" in text.stderr  # the ledger's words, with the steps


def test_real_handlers_are_called_and_a_failing_one_stops_nothing() -> None:
    simulated_app.CALLS.clear()
    result = simulate(OUTBOX, "--seed", "0", "--hours", "0.1", "--real-handlers")
    assert result.exit_code == 0, result.output
    assert simulated_app.CALLS["outbox.flush"] > 10
    assert simulated_app.CALLS["digest"] >= 3  # the third failed, and more ran after it


def test_an_override_reaches_the_simulated_fleet() -> None:
    result = simulate(
        LEDGER, "--seeds", "1", "--hours", "0.05", "--json", "--override", "sync.enabled=false"
    )
    assert result.exit_code == 0, result.output
    assert "schedule" not in json.loads(result.stdout)["jobs"]["sync"]["runs"]


def test_a_job_every_instance_runs_is_counted_not_judged() -> None:
    """``claim=False``: each instance runs every slot; two runs of a slot are the promise."""
    result = simulate(PER_INSTANCE, "--seeds", "2", "--hours", "0.05", "--json")
    assert result.exit_code == 0, result.output
    jobs = json.loads(result.stdout)["jobs"]
    assert jobs["cache.refresh"]["claimed"] is False
    assert jobs["cache.refresh"]["runs"]["schedule"] > 0
    assert jobs["cache.warm"]["runs"]["start"] >= 2  # at each instance's start
    assert jobs["outbox.flush"]["claimed"] is True
    text = simulate(PER_INSTANCE, "--seeds", "1", "--hours", "0.05")
    assert "not judged" in text.stdout and "claim=False: on every instance" in text.stdout


def test_the_options_a_job_update_set_are_the_simulated_ones() -> None:
    """A ``timeout`` set by ``job.update()`` after registration cuts the 5 s runs."""
    simulated_app.CALLS.clear()
    result = simulate(UPDATED, "--seed", "0", "--hours", "0.05", "--real-handlers", "--json")
    assert result.exit_code == 0, result.output
    export = json.loads(result.stdout)["jobs"]["export"]
    assert export["failed"] == sum(export["runs"].values()) > 0  # every run timed out
    assert simulated_app.CALLS["export completed"] == 0


def test_the_start_brings_an_at_job_into_the_simulated_hours() -> None:
    later = simulate(MIGRATION, "--seeds", "1", "--hours", "0.05", "--json")
    assert json.loads(later.stdout)["jobs"]["migrate"]["due_per_seed"] == 0
    assert "0: no slot in the simulated hours" in simulate(MIGRATION, "--seeds", "1").stdout
    before = simulate(  # seeds in which no pause, disable or removal kept it from running
        MIGRATION, "--seeds", "2", "--first", "10", "--hours", "0.05",
        "--start", "2026-12-31T23:59:00Z", "--json",
    )  # fmt: skip
    report = json.loads(before.stdout)
    assert report["start"] == "2026-12-31T23:59:00+00:00"
    assert report["jobs"]["migrate"]["due_per_seed"] == 1
    assert (
        report["jobs"]["migrate"]["runs"].get("schedule", 0)
        + report["jobs"]["migrate"]["runs"].get("catch-up", 0)
        >= 1
    )
    assert simulate(MIGRATION, "--start", "2027-01-01").exit_code == 2  # no UTC offset


def test_a_seed_stopped_by_the_step_bound_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sim_app, "_MAX_STEPS", 20)
    result = simulate(OUTBOX, "--seeds", "1", "--hours", "1")
    assert "1 seed(s) stopped at the bound of 20 steps before the hours ran out" in result.stdout


def test_one_seed_in_json_carries_its_steps() -> None:
    report = json.loads(simulate(LEDGER, "--seed", "2", "--hours", "0.02", "--json").stdout)
    assert report["steps"]["2"][0].startswith("start i1")


@pytest.mark.parametrize(
    ("app", "said"),
    [
        (f"{APP}:empty", "registers no job"),
        (f"{APP}:nowhere", "has no attribute 'nowhere'"),
    ],
)
def test_an_application_that_cannot_be_simulated_is_refused_saying_why(app: str, said: str) -> None:
    result = simulate(app)
    assert result.exit_code == 2
    assert said in result.output


@pytest.mark.parametrize(
    ("backend", "model"),
    [
        (MemoryBackend(), "lease"),
        (SQLiteBackend(":memory:"), "lease"),
        (RedisLeaseBackend("redis://127.0.0.1:6379/0"), "lease"),
        (NATSLeaseBackend("nats://127.0.0.1:4222"), "natslease"),
        (RedisBackend("redis://127.0.0.1:6379/0"), "redis"),
        (NATSBackend("nats://127.0.0.1:4222"), "nats"),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, str) else value,
)
def test_each_backend_is_simulated_on_its_own_model(backend: Any, model: str) -> None:
    scheduler = Scheduler(backend)
    scheduler.every("tick", "5s", lambda ctx: None, key="tick.key")
    app = read_app(scheduler)
    assert app.model == model
    assert [(job.name, job.key, job.kind) for job in app.jobs] == [("tick", "tick.key", "every")]


def test_a_backend_without_a_model_is_refused_naming_the_models() -> None:
    class Custom(MemoryBackend):
        pass

    assert read_app(_with_job(Scheduler(Custom()))).model == "lease"
    scheduler = _with_job(Scheduler())
    scheduler.backend = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="has no model in the simulator; it models MemoryBackend"):
        read_app(scheduler)


def _with_job(scheduler: Scheduler[Any]) -> Scheduler[Any]:
    scheduler.every("tick", "5s", lambda ctx: None)
    return scheduler


# -- the ledger's words, per job --------------------------------------------------------------


def _run(instance: str, start: int, end: int | None) -> Run:
    how = "returned" if end is not None else ""
    return Run("a.b:c", 1000, "schedule", 1, instance, "skip", 3, start, 30_000, 1, "schedule",
               leased=True, end=end, how=how)  # fmt: skip


def test_each_violation_the_ledger_words_is_told_for_its_job() -> None:
    twice = Ledger(lease=False, runs=[_run("i1", 1000, 2000), _run("i2", 5000, 6000)])
    at_once = Ledger(lease=True, runs=[_run("i1", 1000, None), _run("i2", 1500, None)])
    found = [
        classify(f"after step 3: {violation}")
        for ledger in (twice, at_once)
        for violation in ledger.violations(now=10_000)
    ]
    assert {(finding.key, finding.kind) for finding in found} == {
        ("a.b:c", "ran twice"),
        ("a.b:c", "overlapped"),
    }
    words = {
        "slot job:5000 was refused to every instance as not-acquired and nobody won it": (
            "job", "never ran"
        ),
        "slot job:5000 was won by i2 and ran nowhere, with no skip to say why": (
            "job", "never ran"
        ),
        "job:start:5000 ran while paused (paused at 1, its read of the controls from 2): x": (
            "job", "ran while halted"
        ),
        "i1 started job:5000 attempt 1 at 9 on a lease that expired at 8": ("job", "ran twice"),
        "i3 refused a valid configuration Deploy(...)": (None, "other"),
    }  # fmt: skip
    for text, expected in words.items():
        finding = classify(text)
        assert (finding.key, finding.kind) == expected, text


def test_a_seed_of_an_application_replays_the_same_run() -> None:
    app = read_app(simulated_app.ledger)
    first, again = (simulate_app(app, [3], hours=0.03, instances=2) for _ in range(2))
    assert first.runs == again.runs and first.runs

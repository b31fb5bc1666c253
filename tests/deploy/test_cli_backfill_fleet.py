"""``brokersched backfill`` beside a live fleet, on every backend: a fleet member runs in a
process of its own, the backfill (a dry run, then a real one) in another, as an operator runs
it during an incident. The backfill changes nothing of the fleet's controls, the fleet goes on
running its slots, and no slot the fleet ran or runs meanwhile runs again."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from brokersched import Scheduler
from brokersched.abc import Backend, JobControl
from tests.support.cli_apps.ops_app import make_backend
from tests.support.cli_apps.process import RunningCLI, brokersched
from tests.support.names import unique

APP = "tests.support.cli_apps.ops_app:create"  # one job, tick, every second
LONG_APP = "tests.support.cli_apps.backfill_app:create"  # long, every 3 s, runs of 8 s
CLAIM_ONLY = ["rabbitmq", "nats", "redis"]
LEASES = ["nats-lease", "redis-lease", "postgres", "sqlite"]


@pytest.fixture(params=CLAIM_ONLY)
def fleet_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    return env_of(request.param, request, tmp_path)


@pytest.fixture(params=LEASES)
def lease_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    return env_of(request.param, request, tmp_path)


def env_of(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    fixture = {"rabbitmq": "amqp_url", "postgres": "postgres_dsn", "sqlite": None}.get(
        kind, "nats_url" if kind.startswith("nats") else "redis_url"
    )
    if fixture is None:
        url = str(tmp_path / "fleet.db")
        with contextlib.closing(sqlite3.connect(url)):
            pass
    else:
        url = request.getfixturevalue(fixture)
    prefix = unique("bf").lower()
    return {"BROKERSCHED_TEST_BACKEND": kind, "BROKERSCHED_TEST_URL": url,
            "BROKERSCHED_TEST_PREFIX": prefix}  # fmt: skip


@contextlib.asynccontextmanager
async def observer(env: dict[str, str], job: str = "tick") -> AsyncIterator[Scheduler[Backend]]:
    """A scheduler of the fleet's prefix that schedules nothing: the test's view of the store."""
    backend = make_backend(
        env["BROKERSCHED_TEST_BACKEND"], env["BROKERSCHED_TEST_URL"], env["BROKERSCHED_TEST_PREFIX"]
    )
    scheduler = Scheduler(backend, enabled=False, jitter=0, max_late="5s")
    scheduler.every(job, "1s", lambda ctx: None)
    async with scheduler:
        yield scheduler


def slot_of(line: str, job: str = "tick") -> int | None:
    """The slot of a fleet member's log line of a completed run of ``job``, if it is one."""
    if f"run job={job}" not in line or "outcome=completed" not in line:
        return None
    return int(line.split(" slot=")[1].split(" ")[0])


async def backfill(
    env: dict[str, str], *args: str, app: str = APP, job: str = "tick", exit_code: int = 0
) -> list[str]:
    done = await asyncio.to_thread(brokersched, "backfill", app, job, *args, env=env, timeout=90)
    assert done.returncode == exit_code, done.stdout + done.stderr
    return done.stdout.splitlines()


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def iso_z(ms: int) -> str:
    """An instant as the backfill's lines show it."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M:%SZ")


async def test_a_backfill_beside_a_live_claim_only_fleet_changes_nothing_of_it(
    fleet_env: dict[str, str],
) -> None:
    member = RunningCLI("run", APP, env=fleet_env)
    try:
        ran: list[int] = []
        while len(ran) < 10:  # ten seconds of slots run by the fleet
            found = slot_of(member.wait_for_line(lambda line: slot_of(line) is not None, 30))
            assert found is not None
            ran.append(found)
        # Slots the fleet ran, old enough for a lease backend's backfill (jitter + max_late + 1
        # s) and young enough for a claim-only backend's memory (slot_ttl 20 s, less its margin).
        start_ms, end_ms = ran[1], ran[3]
        assert end_ms < time.time() * 1000 - 6000
        dry = await backfill(fleet_env, "--from", iso(start_ms), "--to", iso(end_ms), "--dry-run")
        real = await backfill(fleet_env, "--from", iso(start_ms), "--to", iso(end_ms))
        assert dry[-1] == "would backfill job 'tick': 3 already-run", dry
        assert real[-1] == "backfilled job 'tick': 3 already-run", real
        after_ms = int(time.time() * 1000)
        later = member.wait_for_line(lambda line: (slot_of(line) or 0) > after_ms, 30)
        assert "reason=schedule" in later  # the fleet goes on
        async with observer(fleet_env) as view:
            controls = await view.backend.controls()
            assert all(not c.paused and not c.disabled for c in controls.values()), controls
            history = await view.get("tick").history(200)  # type: ignore[union-attr]
        assert not [record for record in history if record.reason == "backfill"]
        slots = [record.slot_ms for record in history if record.reason != "manual"]
        assert len(slots) == len(set(slots)), "a slot ran twice"
    finally:
        member.stop()
        member.kill()
        await asyncio.to_thread(brokersched, "purge", APP, "--force", env=fleet_env, timeout=90)


async def test_a_backfill_never_runs_a_slot_the_fleet_runs_or_ran_meanwhile(
    lease_env: dict[str, str],
) -> None:
    """By slot, the fleet's runs of ``long`` last 0.2 s, until it stops, or 8 s, without a
    timeout. Right after a short one, a backfill (one slot every 2.5 s) takes the slots from
    before the fleet started, then the fleet's own: the 8 s run going when it read the history
    has ended by its turn (its record landed before its lease ended: ``already-run``), the
    endless one still holds its lease (``not-acquired``). The fleet's controls are as they
    were and it goes on. Then the job is disabled for the fleet: a backfill of it runs nothing
    and says so."""
    before_ms = int(time.time() * 1000)  # the slots up to now the fleet never runs (no catch-up)
    member = RunningCLI("run", LONG_APP, env=lease_env)
    try:
        shorts = 0
        while shorts < 2:  # the second: the fleet ran the two slots before it
            line = member.wait_for_line(lambda line: slot_of(line, "long") is not None, 30)
            shorts += (slot_of(line, "long") or 0) // 3000 % 3 == 0
        first = before_ms // 3000 * 3000 - 3000
        end_ms = int(time.time() * 1000) - 2500  # the 10 s run's slot, not the short one's
        steps = await backfill(
            lease_env, "--from", iso(first), "--to", iso(end_ms),
            "--rate", "0.4/s", app=LONG_APP, job="long",
        )  # fmt: skip
        said = [line.split(" ")[3].rstrip(":") for line in steps[:-1]]
        ran = said.index("already-run") if "already-run" in said else len(said)
        assert said[:2] == ["ran", "ran"], steps  # before the fleet started
        assert set(said[ran:]) == {"already-run", "not-acquired"}, steps
        assert said[-2:] == ["not-acquired", "already-run"], steps  # the endless, the 8 s one
        after_ms = int(time.time() * 1000)
        member.wait_for_line(lambda line: (slot_of(line, "long") or 0) > after_ms, 30)
        async with observer(lease_env, "long") as view:
            job = view.get("long")
            assert job is not None
            history = await job.history(200)
            slots = [record.slot_ms for record in history]
            assert len(set(slots)) == len(slots), f"a slot ran twice: {sorted(slots)}"
            assert not (await view.backend.controls()).get("long", JobControl("long")).stopped
            await job.disable(by="test")
            refused = await backfill(
                lease_env, "--from", iso(first - 9000), "--to", iso(first - 6000),
                app=LONG_APP, job="long", exit_code=1,
            )  # fmt: skip
            assert refused[-1] == "backfilled job 'long': 2 skipped", refused
            assert "disabled" in refused[0], refused
            await job.enable(by="test")
    finally:
        member.stop()
        member.kill()
        await asyncio.to_thread(
            brokersched, "purge", LONG_APP, "--force", env=lease_env, timeout=90
        )

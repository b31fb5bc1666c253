"""Seams of exactly-once on the real servers, where the servers' own timers decide: each fleet
member a process of its own (``tests/support/seam_worker.py``): killed with SIGKILL, frozen with
SIGSTOP (as a paused VM, or a claim late by its jitter), or run fast under libfaketime where the
seam needs it, and ``brokersched trigger`` for a manual run.

Every member appends its runs and skips to one JSON-lines file; a test waits (bounded) until
each member has decided the slots it cares about, then counts the runs. Real time is used
because the servers' own timers are the point: a claim key's or queue's expiry, NATS's duplicate
window, a lease's expiry and the take-over sweep.

Each test fails on code without the rule it checks (to see it fail: the file and
``seam_worker.py`` copied into a worktree of a commit without the rule, run there with
``PYTHONPATH`` at it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio

from brokersched import PostgresBackend, RedisLeaseBackend, SQLiteBackend
from brokersched._clock import SystemClock
from brokersched.abc import JobPolicy, LeaseBackend, Slot
from brokersched.backends.redis import claim_key
from tests.support.seam_worker import SPEC_ENV
from tests.support.seams import (
    LEAD_MS,
    ROOT,
    Fleet,
    Member,
    at,
    claim_store,
    nats_store,
    now_ms,
    postgres_store,
    redis_store,
    starts_by_slot,
    until_ms,
    with_ttl,
)

# -- the fleet: worker processes and their shared log -----------------------------------------


# -- the stores: a backend spec for the workers, deleted after the test ------------------------


# -- a manual run granted while a dead runner's slot waits for the take-over sweep -------------

LEASE_TTL = "3s"
MANUAL_HOLD_S = 5.0  # long enough for the sweeper to start, and sweep, while it runs


def lease_store(
    fleet: Fleet, request: pytest.FixtureRequest, kind: str
) -> tuple[dict[str, Any], Callable[[], LeaseBackend]]:
    """A lease backend's spec for the workers, and a factory of the same backend here (to read
    the job's history)."""
    if kind == "postgres":
        dsn = request.getfixturevalue("postgres_dsn")
        store = postgres_store(fleet, dsn, lease_ttl=LEASE_TTL)
        schema = store["options"]["schema"]
        return store, lambda: PostgresBackend(dsn, schema=schema, lease_ttl=LEASE_TTL)
    if kind == "redis-lease":
        url = request.getfixturevalue("redis_url")
        store = redis_store(fleet, url, "redis-lease", lease_ttl=LEASE_TTL)
        prefix = store["options"]["prefix"]
        return store, lambda: RedisLeaseBackend(url, prefix=prefix, lease_ttl=LEASE_TTL)
    path = str(fleet.tmp / "leases.db")
    store = {"kind": "sqlite", "url": path, "options": {"lease_ttl": LEASE_TTL}}
    return store, lambda: SQLiteBackend(path, lease_ttl=LEASE_TTL)


def intervals(fleet: Fleet, job: str) -> list[tuple[str, int, int]]:
    """Each run of ``job`` as (who, from, to) on the host's clock: a run never ended lasts
    until its process was killed (or to this day, if it was not)."""
    ends = {e["run"]: e["host_ms"] for e in fleet.events("end", job=job)}
    return [
        (
            f"{run['instance']} {run['reason']} attempt {run['attempt']}",
            run["host_ms"],
            ends.get(run["run"], fleet.killed_ms.get(run["instance"], 2**62)),
        )
        for run in fleet.runs(job)
    ]


async def trigger_until_granted(fleet: Fleet, spec: dict[str, Any], job: str) -> list[str]:
    """``brokersched trigger`` until its manual run starts (it is refused as ``overlap``
    while the dead runner's lease has not expired); the refusals, as the CLI said them."""
    refusals: list[str] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        name = f"{spec['instance']}-cli{len(refusals)}"
        stderr = fleet.tmp / f"{name}.stderr"
        with stderr.open("wb") as sink:
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "brokersched", "trigger",
                "tests.support.seam_worker:from_env", job,
                cwd=ROOT, env=fleet.env(**{SPEC_ENV: json.dumps(spec)}),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=sink, start_new_session=True,
            )  # fmt: skip
        fleet.members[name] = Member(name, cli, stderr)
        while cli.returncode is None and not fleet.has("start", instance=spec["instance"]):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await cli.wait()
        if fleet.has("start", instance=spec["instance"]):
            return refusals
        said = stderr.read_text(errors="replace").strip().splitlines()
        refusals.append(said[-1] if said else f"exit {cli.returncode}")
        assert "overlap" in refusals[-1], f"trigger failed otherwise:\n{fleet.diagnostics()}"
    pytest.fail(f"no manual run was granted within 20s: {refusals}\n{fleet.diagnostics()}")


@pytest.mark.parametrize("kind", ["postgres", "sqlite", "redis-lease"])
async def test_a_manual_run_granted_while_a_dead_slot_waits_never_overlaps_its_restart(
    fleet: Fleet, request: pytest.FixtureRequest, kind: str
) -> None:
    """A runs the job's slot and is killed (SIGKILL). Once its lease has expired, and before
    any instance sweeps, ``brokersched trigger`` is granted a manual run (``overlap='skip'``
    sees no live lease). B then starts and sweeps while the manual run is live: the dead slot
    must wait, and be restarted (attempt 2) once the manual run has ended, A's attempt
    recorded ``interrupted``. Restarted at once, it would overlap the manual run."""
    store, backend = lease_store(fleet, request, kind)
    slot = now_ms() // 1000 * 1000 + 3000
    job = [at("report", slot, max_late="30s")]
    await fleet.start(fleet.spec("A", store, job, hold={"schedule": 120}))
    await fleet.wait("A runs the slot", lambda: fleet.has("start", instance="A"), 15)
    await fleet.kill("A")

    manual = fleet.spec("M", store, job, hold={"manual": MANUAL_HOLD_S})
    refusals = await trigger_until_granted(fleet, manual, "report")
    # B has the job too (another day's instant): it sweeps the job's dead slots.
    later = [at("report", slot + 86_400_000, max_late="30s")]
    await fleet.start(fleet.spec("B", store, later, hold={"retry": 0.3}))
    await fleet.wait("B up", lambda: fleet.has("ready", instance="B"), 15)
    assert not fleet.has("end", instance="M"), "B started after the manual run: nothing shown"
    await fleet.wait(
        "the dead slot restarted after the manual run",
        lambda: fleet.has("end", instance="B", reason="retry"),
        MANUAL_HOLD_S + 15,
    )

    runs = intervals(fleet, "report")
    overlaps = [(a, b) for a, b in itertools.combinations(runs, 2) if a[1] < b[2] and b[1] < a[2]]
    assert not overlaps, f"runs overlapped: {overlaps} (refused triggers: {refusals})"
    [retry] = fleet.events("start", instance="B")
    assert (retry["slot"], retry["attempt"]) == (slot, 2)
    lease_backend = backend()
    await lease_backend.start(SystemClock())
    try:
        history = await lease_backend.history(JobPolicy("report"), 10)
    finally:
        await lease_backend.stop()
    assert sorted((r.reason, r.attempt, r.outcome) for r in history) == [
        ("manual", 1, "completed"),
        ("retry", 2, "completed"),
        ("schedule", 1, "interrupted"),
    ]


# -- NATS, an at() slot across a rolling deploy that raises slot_ttl -------------------------


async def test_an_at_slot_is_not_claimed_again_after_the_old_window_forgot_it(
    fleet: Fleet, nats_url: str
) -> None:
    """OLD (slot_ttl 3 s) runs an at() slot; NEW (slot_ttl 60 s, max_late 30 s) starts once
    the old window has forgotten the slot's id, raises the window and reaches the slot late;
    OLD is stopped (a rolling deploy). NEW must not claim it: the raise is noted in the claims
    stream, so the slot is claimed at most the old window late. Otherwise it runs twice."""
    store = nats_store(fleet, nats_url)
    old = fleet.spec("OLD", with_ttl(store, "3s"), [at("report", LEAD_MS, max_late="1s")])
    await fleet.start({**old, "relative": True})
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait("OLD runs the slot", lambda: fleet.has("start", instance="OLD"), 15)
    # A second and a half after the window (3 s) has passed: nats-server has forgotten the id.
    new = fleet.spec(
        "NEW", with_ttl(store, "60s"), [at("report", slot, max_late="30s")], start_at_ms=slot + 4500
    )
    await fleet.start(new)
    await fleet.wait("NEW up", lambda: fleet.has("ready", instance="NEW"), 20)
    await fleet.stop("OLD")
    await fleet.wait("NEW decides the slot", lambda: fleet.decided("NEW", "report", slot), 15)
    assert [run["instance"] for run in fleet.runs()] == ["OLD"], fleet.diagnostics()
    [skip] = fleet.events("skip", instance="NEW")
    assert skip["reason"] == "late", skip


# -- boot runs of instances whose slot_ttl differ, after() with a short slot_ttl --------------

CLAIM_ONLY = ["nats", "redis", "rabbitmq"]
# Pairs of slot_ttl, each pair a fleet whose members start 1 s apart: the shorter
# first in one, the longer first in the other.
BOOT_PAIRS = [("20s", "5m"), ("4m", "1m")]
BOOT_SCHEDULER = {"jitter": 0, "max_late": "5s"}


def boot_job(boot: str) -> dict[str, Any]:
    if boot == "run_on_start":
        return {"kind": "every", "name": "sweep", "every": "1h", "options": {"run_on_start": True}}
    return {"kind": "after", "name": "sweep", "delay": "100ms"}


async def boot_fleets(
    fleet: Fleet,
    request: pytest.FixtureRequest,
    backend: str,
    boot: str,
    pairs: list[tuple[str, str]],
    scheduler: dict[str, Any] = BOOT_SCHEDULER,
) -> list[tuple[str, str]]:
    """Each pair of slot_ttl a fleet of its own (a prefix), its members 1 s apart; every
    member started, and each has run or skipped its boot run. The members' names, by pair."""
    specs: list[dict[str, Any]] = []
    names: list[tuple[str, str]] = []
    for n, (first, second) in enumerate(pairs):
        store = claim_store(fleet, request, backend)
        pair = (f"P{n}-{first}", f"P{n}-{second}")
        names.append(pair)
        for k, (name, ttl) in enumerate(zip(pair, (first, second), strict=True)):
            ttl_store, jobs = with_ttl(store, ttl), [boot_job(boot)]
            specs.append(fleet.spec(name, ttl_store, jobs, offset_ms=1000 * k, scheduler=scheduler))
    await fleet.start_together(*specs)
    await fleet.wait(
        "every member ran or skipped its boot run",
        lambda: all(fleet.decided(spec["instance"], "sweep") for spec in specs),
        20,
    )
    return names


@pytest.mark.parametrize("boot", ["run_on_start", "after"])
@pytest.mark.parametrize("backend", CLAIM_ONLY)
async def test_a_boot_run_of_members_whose_slot_ttl_differ_runs_once_per_fleet(
    fleet: Fleet, request: pytest.FixtureRequest, backend: str, boot: str
) -> None:
    """Members 1 s apart, one with slot_ttl 20 s and one with 5 m (and 4 m, then 1 m): their
    boot runs share one-minute windows whatever their slot_ttl, so each fleet runs it once.
    Windows that followed each member's slot_ttl let both run it, every round."""
    pairs = await boot_fleets(fleet, request, backend, boot, BOOT_PAIRS)
    runs = fleet.runs("sweep")
    assert all(run["reason"] == "start" for run in runs), runs
    for pair in pairs:
        ran = [run["instance"] for run in runs if run["instance"] in pair]
        assert len(ran) == 1, f"{pair}: the boot run ran on {ran}\n{fleet.diagnostics()}"


@pytest.mark.parametrize("backend", CLAIM_ONLY)
async def test_after_with_a_slot_ttl_of_62s_or_less_runs_once_per_fleet(
    fleet: Fleet, request: pytest.FixtureRequest, backend: str
) -> None:
    """``after()`` on members with slot_ttl 5 s and 62 s and the scheduler's defaults runs
    once between them. It is not held at registration to the scheduler's jitter (2 s) +
    max_late (1 m) under slot_ttl: a boot run has no slot to be late on."""
    [pair] = await boot_fleets(fleet, request, backend, "after", [("5s", "62s")], {})
    ran = [run["instance"] for run in fleet.runs("sweep")]
    assert ran in ([pair[0]], [pair[1]]), f"ran on {ran}\n{fleet.diagnostics()}"


# -- clock skew within max_clock_skew, and a slot_ttl raise just before a slot ----------------

SLOTS = 20


@dataclass(frozen=True)
class Skew:
    """FAST runs ``offset`` ahead (libfaketime) on slot_ttl ``old``; SLOW, on the host's clock
    with slot_ttl 60 s, raises the fleet's memory ``raise_ms`` before the slot and claims it
    up to ``jitter`` late: later than FAST's claim is remembered under ``old`` (before the
    fix it won it again). ``old`` is long enough for the skew (an eighth of it at most)."""

    offset: str
    old: str
    jitter_s: int
    raise_ms: int


SKEWS = {
    "1s": Skew(offset="+1", old="8s", jitter_s=10, raise_ms=500),
    "300ms": Skew(offset="+0.3", old="3s", jitter_s=5, raise_ms=200),
}


@pytest.mark.parametrize("skew", list(SKEWS))
@pytest.mark.parametrize("backend", ["rabbitmq", "redis"])
async def test_a_fast_clock_and_a_raise_just_before_a_slot_never_run_it_twice(
    fleet: Fleet, request: pytest.FixtureRequest, backend: str, skew: str
) -> None:
    """20 at() jobs fall due at one instant. FAST (a clock ``skew`` ahead, as max_clock_skew
    allows) claims them all before it, under the old slot_ttl; SLOW starts just before the
    instant, raising slot_ttl to 60 s, and claims each with jitter. No slot may run twice:
    SLOW claims a slot at most the old memory late, less the skew and a claim's flight."""
    case = SKEWS[skew]
    store = claim_store(fleet, request, backend)
    names = [f"t{n:02}" for n in range(SLOTS)]
    fast = [at(name, LEAD_MS, max_late="1s") for name in names]
    jitter = {"jitter": f"{case.jitter_s}s", "max_late": f"{case.jitter_s + 2}s"}
    slow = [at(name, LEAD_MS, **jitter) for name in names]
    fast_spec = fleet.spec("FAST", with_ttl(store, case.old), fast, relative=True)
    await fleet.start(fast_spec, skew=case.offset)
    start = LEAD_MS - case.raise_ms
    await fleet.start(
        fleet.spec("SLOW", with_ttl(store, "60s"), slow, start_at_ms=start, relative=True)
    )
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait(
        "FAST ran every slot and SLOW decided each",
        lambda: len(fleet.runs()) >= SLOTS and all(fleet.decided("SLOW", n, slot) for n in names),
        case.jitter_s + 15,
    )
    twice = {key: n for key, n in starts_by_slot(fleet.runs()).items() if n > 1}
    assert not twice, f"{len(twice)} of {SLOTS} slots ran twice\n{fleet.diagnostics()}"
    assert {run["instance"] for run in fleet.runs()} == {"FAST"}


async def test_redis_a_skew_of_1s_with_an_old_slot_ttl_of_3s_never_runs_a_slot_twice(
    fleet: Fleet, redis_url: str
) -> None:
    """As above with the old slot_ttl 3 s (FAST: max_late 1 s, so the README's bound on the
    clocks, slot_ttl - (jitter + max_late), is 2 s; the skew is 1 s = max_clock_skew). FAST's
    claims, made 1 s before the slot, are forgotten 2 s after it; SLOW's deadline is 2.375 s
    after it (3 s less an eighth for the skew and an eighth for the flight). SLOW is frozen
    across the slot and thawed between the two (as its jitter could place its claims): it
    wins every slot again."""
    store = redis_store(fleet, redis_url, "redis")
    names = [f"t{n:02}" for n in range(SLOTS)]
    fast = [at(name, LEAD_MS, max_late="1s") for name in names]
    slow = [at(name, LEAD_MS, max_late="5s") for name in names]
    await fleet.start(fleet.spec("FAST", with_ttl(store, "3s"), fast, relative=True), skew="+1")
    slow_spec = fleet.spec("SLOW", with_ttl(store, "60s"), slow, start_at_ms=LEAD_MS - 800)
    await fleet.start({**slow_spec, "relative": True})
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait("SLOW up", lambda: fleet.has("ready", instance="SLOW"), 15)
    assert now_ms() < slot - 200, "SLOW started too late to be frozen before the slot"
    await until_ms(slot - 200)
    fleet.freeze("SLOW")
    try:
        await until_ms(slot + 2150)
    finally:
        fleet.thaw("SLOW")
    await fleet.wait(
        "FAST ran every slot and SLOW decided each",
        lambda: len(fleet.runs()) >= SLOTS and all(fleet.decided("SLOW", n, slot) for n in names),
        15,
    )
    twice = {key: n for key, n in starts_by_slot(fleet.runs()).items() if n > 1}
    assert not twice, f"{len(twice)} of {SLOTS} slots ran twice\n{fleet.diagnostics()}"


# -- Redis, the fleet's record deleted by hand ----------------------------------------------


async def test_a_record_deleted_then_a_shorter_member_never_runs_an_at_slot_twice(
    fleet: Fleet, redis_url: str
) -> None:
    """LONG (slot_ttl 20 s) has an at() slot; its process is frozen across the slot (as a VM
    paused, or jitter), so it claims the slot late. Meanwhile the record is deleted by hand and
    SHORT (slot_ttl 3 s) starts just after the slot: it makes the record again, and must not
    claim the slot late, as it may have been claimed under the lost record. Were it claimed,
    SHORT would win it under 3 s and LONG, thawed after Redis forgot that, would win it again."""
    store = redis_store(fleet, redis_url, "redis")
    prefix = store["options"]["prefix"]
    long = [at("report", LEAD_MS, max_late="10s")]
    await fleet.start(fleet.spec("LONG", with_ttl(store, "20s"), long, relative=True))
    short = [at("report", LEAD_MS, max_late="2s")]
    short_spec = fleet.spec("SHORT", with_ttl(store, "3s"), short, start_at_ms=LEAD_MS + 300)
    await fleet.start({**short_spec, "relative": True})
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait("LONG up", lambda: fleet.has("ready", instance="LONG"), 15)
    assert now_ms() < slot - 300, "LONG started too late to be frozen before the slot"
    await until_ms(slot - 300)
    fleet.freeze("LONG")
    try:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            assert await client.delete(f"{prefix}:slot-memory") == 1
        finally:
            await client.aclose()
        await fleet.wait("SHORT decides the slot", lambda: fleet.decided("SHORT", "report"), 15)
        await until_ms(slot + 300 + 3000 + 500)  # a claim of SHORT's would be forgotten by now
    finally:
        fleet.thaw("LONG")
    await fleet.wait("LONG decides the slot", lambda: fleet.decided("LONG", "report"), 15)
    ran_at_most_once_or_failed_closed(fleet)


def ran_at_most_once_or_failed_closed(fleet: Fleet) -> None:
    """The slot ran once, or nowhere with a documented reason on every member: it fell due
    before the record was made again, so no claim of it is known to be remembered (the
    README's Limits)."""
    ran = [run["instance"] for run in fleet.runs()]
    assert len(ran) <= 1, f"the slot ran on {ran}\n{fleet.diagnostics()}"
    if not ran:
        reasons = {event["reason"] for event in fleet.events("skip")}
        assert reasons <= {"late", "backend-error"}, fleet.diagnostics()


async def test_a_record_deleted_while_a_longer_member_runs_never_runs_an_at_slot_twice(
    fleet: Fleet, redis_url: str
) -> None:
    """As above, but SHORT starts a second before the slot: it makes the record again (3 s)
    before the slot falls due and claims it on time, under 3 s. LONG, frozen across the slot
    (or late by its jitter) and still believing 20 s, claims it after Redis forgot SHORT's
    claim."""
    store = redis_store(fleet, redis_url, "redis")
    prefix = store["options"]["prefix"]
    long = [at("report", LEAD_MS, max_late="10s")]
    await fleet.start(fleet.spec("LONG", with_ttl(store, "20s"), long, relative=True))
    short = [at("report", LEAD_MS, max_late="2s")]
    short_spec = fleet.spec("SHORT", with_ttl(store, "3s"), short, start_at_ms=LEAD_MS - 1000)
    await fleet.start({**short_spec, "relative": True})
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait("LONG up", lambda: fleet.has("ready", instance="LONG"), 15)
    assert now_ms() < slot - 300, "LONG started too late to be frozen before the slot"
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        assert await client.delete(f"{prefix}:slot-memory") == 1
    finally:
        await client.aclose()
    await until_ms(slot - 300)
    fleet.freeze("LONG")
    try:
        await fleet.wait("SHORT decides the slot", lambda: fleet.decided("SHORT", "report"), 15)
        await until_ms(slot + 3000 + 500)  # SHORT's claim (3 s) is forgotten by now
    finally:
        fleet.thaw("LONG")
    await fleet.wait("LONG decides the slot", lambda: fleet.decided("LONG", "report"), 15)
    ran = [run["instance"] for run in fleet.runs()]
    assert ran == ["SHORT"], f"the slot ran on {ran}\n{fleet.diagnostics()}"


async def test_lowering_slot_ttl_the_readme_way_takes_effect_on_the_running_members(
    fleet: Fleet, redis_url: str
) -> None:
    """The README's way to lower slot_ttl on Redis: deploy the shorter slot_ttl everywhere,
    then ``DEL <prefix>:slot-memory``. The running members adopt the record made again (3 s),
    and claim under it: were they to restore the 20 s they believed, the lowering would have no
    effect. Every slot runs once throughout."""
    store = redis_store(fleet, redis_url, "redis")
    prefix = store["options"]["prefix"]
    tick = [{"kind": "every", "name": "tick", "every": "500ms", "options": {"max_late": "1s"}}]
    await fleet.start(fleet.spec("OLD", with_ttl(store, "20s"), tick))
    await fleet.wait("OLD runs", lambda: fleet.has("start", instance="OLD"), 15)
    await fleet.stop("OLD")  # the rolling deploy: now every member has slot_ttl 3 s
    await fleet.start_together(
        *(fleet.spec(name, with_ttl(store, "3s"), tick) for name in ("X", "Y"))
    )
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        record = f"{prefix}:slot-memory"
        assert await client.hget(record, "memory_ms") == b"20000"
        both = ("X", "Y")
        await fleet.wait(
            "X and Y up", lambda: all(fleet.has("ready", instance=n) for n in both), 15
        )
        deleted = now_ms()
        assert await client.delete(record) == 1

        def lowered_slots() -> list[int]:
            return sorted({run["slot"] for run in fleet.runs() if run["slot"] > deleted + 1000})

        await fleet.wait("4 slots after the deletion", lambda: len(lowered_slots()) >= 4, 15)
        assert await client.hget(record, "memory_ms") == b"3000", fleet.diagnostics()
        latest = claim_key(prefix, Slot("tick", lowered_slots()[-1]))
        assert 0 < await client.pttl(latest) <= 3000
    finally:
        await client.aclose()
    twice = {key: n for key, n in starts_by_slot(fleet.runs()).items() if n > 1}
    assert not twice, f"slots ran twice: {twice}\n{fleet.diagnostics()}"

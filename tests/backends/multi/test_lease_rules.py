"""The lease rules on every lease backend against the real thing (the ``fleet``
fixture: MemoryBackend, a SQLite file, the PostgreSQL server of ``postgres_dsn``, the Redis server
of ``redis_url`` and the Redis Cluster of ``redis_cluster_url``):

* a slot far ahead of the backend's clock is refused, so a fast clock cannot fence a job, and
  the refusal names the clock that moved;
* manual runs never move the fence scheduled slots must pass, and are restarted only while they
  are the job's latest run;
* a take-over leaves a slot that waited longer than the job's retry window for a runner;
* fencing: an older slot, a stale token, a hand-over that is no longer the latest slot, racing
  claimers and racing takers.

On SQLite and PostgreSQL only (``sql_fleet``), what is a database's: a lock wait must fit in a
third of the lease, and a release answers within it; a lost attempt is recorded in the
take-over's own transaction; tables of version 1 are upgraded; and, end to end, a Scheduler 2
minutes fast beside an honest one. What only Redis has (the optimistic take-over's
commit, a stalled link, a killed runner process) is in tests/backends/redis/test_redis_lease.py.

Slot times are built from the backend's clock (the host's: the servers run here), with margins
of seconds against bounds of seconds; a lease that expired long ago is made so by moving its
expiry back in the backend's storage (``backdate``), one that expired a moment ago by stopping
the store's clock (``Fleet.set_store_time``); the few remaining lease expiries wait for the
lease to pass, as the conformance suite does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import asyncpg
import pytest

from brokersched import (
    BackendError,
    BackendUnavailableError,
    ClockSkewError,
    ConfigurationError,
    JobContext,
    Scheduler,
)
from brokersched._clock import datetime_to_ms
from brokersched._durations import format_duration
from brokersched.abc import JobPolicy, Lease, Slot
from brokersched.backends._sql import SCHEMA_VERSION
from brokersched.backends.memory import MemoryBackend
from brokersched.backends.postgres import PostgresBackend
from brokersched.backends.postgres._statements import Statements as PostgresStatements
from brokersched.backends.redis import RedisLeaseBackend, runs_key
from brokersched.backends.sqlite import SQLiteBackend
from brokersched.backends.sqlite._statements import Statements as SQLiteStatements
from tests.support.leases import (
    SLOT,
    TTL,
    Fleet,
    SkewedClock,
    acquire,
    expire,
    fleet_of,
    hold_write_lock,
    lease_of,
    now_ms,
    race,
    schema_version,
)
from tests.support.redis_helpers import redis_cluster_url
from tests.support.wait import until

__all__ = ["redis_cluster_url"]

AHEAD_MS = 120_000  # a member's machine 2 minutes fast
OLD_MS = 32_000  # a slot handed over, restarted 32 s late...
WINDOW = timedelta(seconds=5)  # ... with catch_up=0, max_late=5s
TTL_MS = TTL // timedelta(milliseconds=1)
RACERS = 8


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis", "redis-cluster"])
async def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with fleet_of(request.param, request, tmp_path) as fleet:
        yield fleet


@pytest.fixture(params=["sqlite", "postgres"])
async def sql_fleet(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with fleet_of(request.param, request, tmp_path) as fleet:
        yield fleet


# -- 6: the backend's clock bounds the slot it accepts --------------------------------------


@pytest.mark.parametrize("reason", ["schedule", "manual", "catch-up"])
async def test_a_slot_far_ahead_of_the_backends_clock_is_refused(fleet: Fleet, reason: str) -> None:
    """A machine 2 minutes fast (a fleet member, or ``brokersched trigger``) claims a slot 2
    minutes ahead: refused, and the fleet's next slot is still free."""
    backend = await fleet.start()
    now = now_ms()
    await backend.release(lease_of(await acquire(backend, Slot("job", now - 60_000))))
    with pytest.raises(ClockSkewError) as caught:
        await acquire(backend, Slot("job", now + AHEAD_MS), reason=reason)
    error = caught.value
    assert isinstance(error, BackendError)  # the scheduler skips the slot: it fails closed
    assert error.ahead_ms > AHEAD_MS - 10_000
    message = str(error)
    assert f"job:{now + AHEAD_MS}" in message
    assert "max_clock_skew (5s)" in message and "NTP" in message
    assert f"ahead of {backend.clock_name.name}" in message  # type: ignore[attr-defined]
    # Nothing was fenced: the slot that falls due now is granted to an honest instance.
    assert isinstance(await acquire(backend, Slot("job", now), instance="honest"), Lease)


async def test_the_bound_reads_the_backends_clock_not_the_instances(fleet: Fleet) -> None:
    """A fleet member 2 minutes fast (its scheduler's clock): the slots its clock says are due
    are refused, and an honest slot is granted to it; the store's clock decides."""
    fast_clock = SkewedClock(timedelta(milliseconds=AHEAD_MS))
    fast = await fleet.start(clock=fast_clock)
    with pytest.raises(ClockSkewError):
        await acquire(fast, Slot("job", fast_clock.now_ms()))
    assert isinstance(await acquire(fast, Slot("job", now_ms())), Lease)


async def test_a_fast_fleet_member_no_longer_silences_the_job(sql_fleet: Fleet) -> None:
    """A member 2 minutes fast claimed every slot 2 minutes ahead, and the honest members were
    refused every slot. Its claims (scheduled, and manual as from ``brokersched trigger``) are
    skipped with the reason, and the honest member runs the job. On the SQL stores only: a
    Scheduler test of seconds, whose store rule the two tests around it check on every
    backend."""
    ran: dict[str, list[int]] = {"honest": [], "fast": []}
    skips: list[tuple[str, str | None]] = []
    members = {
        "honest": Scheduler(sql_fleet.build(lease_ttl=TTL), instance_id="honest", jitter=0),
        "fast": Scheduler(
            sql_fleet.build(lease_ttl=TTL),
            instance_id="fast",
            jitter=0,
            clock=SkewedClock(timedelta(milliseconds=AHEAD_MS)),
        ),
    }
    for name, member in members.items():

        def tick(ctx: JobContext, name: str = name) -> None:
            ran[name].append(ctx.slot_ms)

        member.every("tick", "500ms", tick, catch_up=0, max_late="1s")
    members["fast"].on("skip", lambda event: skips.append((event.reason, event.detail)))
    for member in members.values():
        await member.start()
    try:
        job = members["fast"].get("tick")
        assert job is not None
        assert await job.trigger() is None  # brokersched trigger from the fast machine
        await until(lambda: len(ran["honest"]) >= 3 and len(skips) >= 2, timeout=20)
        # the fast member's health check fails (it handles nothing); the honest one's passes
        await until(lambda: bool(members["fast"].overdue()), timeout=20)
        assert members["honest"].overdue() == []
    finally:
        for member in members.values():
            await member.stop()
    assert ran["fast"] == []
    reason, detail = skips[0]
    assert reason == "clock-skew" and detail is not None and "max_clock_skew" in detail
    assert len(ran["honest"]) == len(set(ran["honest"]))


async def test_max_clock_skew_is_the_allowance(fleet: Fleet) -> None:
    tolerant = await fleet.start()
    strict = await fleet.start(max_clock_skew=0)
    now = now_ms()
    policy = JobPolicy("job", overlap="allow")
    assert isinstance(await acquire(tolerant, Slot("job", now + 2_000), policy), Lease)
    with pytest.raises(ClockSkewError, match=r"max_clock_skew \(0s\)"):
        await acquire(strict, Slot("job", now + 60_000), policy)
    assert tolerant.max_clock_skew == timedelta(seconds=5)  # type: ignore[attr-defined]


def test_max_clock_skew_is_validated(tmp_path: Path) -> None:
    for make in (
        lambda: MemoryBackend(max_clock_skew="-1s"),
        lambda: SQLiteBackend(tmp_path / "x.db", max_clock_skew=-1),
        lambda: PostgresBackend("postgresql://x/y", max_clock_skew=-1),
        lambda: RedisLeaseBackend("redis://127.0.0.1", max_clock_skew=-1),
    ):
        with pytest.raises(ConfigurationError) as caught:
            make()
        assert caught.value.option == "max_clock_skew"


# -- the refusal names the clock that moved -------------------------------------------------


async def test_a_store_clock_stepped_back_is_named(fleet: Fleet) -> None:
    """The store's clock stepped back 10 s: every claim is refused, and the warning names the
    store's clock, not the instance's (whose clocks kept time), so the operator fixes the right
    one."""
    backend = await fleet.start()
    await backend.release(lease_of(await acquire(backend, Slot("job", now_ms()))))
    await fleet.set_store_time(now_ms() - 10_000)  # this instance's clocks keep time
    with pytest.raises(ClockSkewError) as caught:
        await acquire(backend, Slot("job", now_ms()))
    error, name = caught.value, backend.clock_name  # type: ignore[attr-defined]
    message = str(error)
    assert error.moved == "store", message
    assert f"{name.name} appears to have stepped back by ~10s" in message
    assert f"fix the time sync (NTP) of {name.host}" in message
    assert "this instance's clock kept time with its monotonic clock" in message
    assert "this instance's clock is fast" not in message


async def test_an_instance_clock_stepped_forward_is_named(fleet: Fleet) -> None:
    clock = SkewedClock(timedelta(0))
    backend = await fleet.start(clock=clock)
    await backend.release(lease_of(await acquire(backend, Slot("job", clock.now_ms()))))
    clock.offset_ms += 10_000  # its wall clock steps, its monotonic clock does not
    with pytest.raises(ClockSkewError) as caught:
        await acquire(backend, Slot("job", clock.now_ms()))
    message = str(caught.value)
    assert caught.value.moved == "instance", message
    assert "this instance's clock stepped forward by ~10s" in message
    assert "fix this instance's time sync (NTP)" in message


async def test_a_clock_fast_from_the_start_names_both_candidates(fleet: Fleet) -> None:
    """No claim of this instance ever passed: it cannot tell which clock is wrong."""
    clock = SkewedClock(timedelta(0))
    backend = await fleet.start(clock=clock)
    clock.offset_ms += AHEAD_MS
    with pytest.raises(ClockSkewError) as caught:
        await acquire(backend, Slot("job", clock.now_ms()))
    message = str(caught.value)
    assert caught.value.moved is None, message
    name = backend.clock_name.name  # type: ignore[attr-defined]
    assert f"this instance's clock is fast, or {name} is slow" in message


# -- manual runs -----------------------------------------------------------------------------


async def test_a_manual_run_does_not_fence_scheduled_slots(fleet: Fleet) -> None:
    """A manual run claims the instant it is asked for; a scheduled slot just before it (still
    in its jitter window) or just after it runs all the same."""
    backend = await fleet.start()
    now = now_ms()
    manual = lease_of(await acquire(backend, Slot("job", now), reason="manual"))
    assert manual.reason == "manual"
    await backend.release(manual)  # ends its grant: the next claim need not wait for it
    earlier = await acquire(backend, Slot("job", now - 1_000), instance="i2")
    assert isinstance(earlier, Lease)
    await backend.release(earlier)
    assert await acquire(backend, Slot("job", now - 1_000)) == "not-acquired"  # ran once


async def test_manual_runs_are_fenced_among_themselves_and_respect_overlap(
    fleet: Fleet,
) -> None:
    one, two = await fleet.start(), await fleet.start()
    now = now_ms()
    manual = lease_of(await acquire(one, Slot("job", now - 5_000), reason="manual"))
    # A live manual run blocks the scheduled slots (overlap='skip') and other manual runs.
    assert await acquire(two, Slot("job", now - 4_000), instance="i2") == "overlap"
    assert await acquire(two, Slot("job", now - 3_000), reason="manual") == "overlap"
    await one.release(manual)
    assert await acquire(two, Slot("job", now - 5_000), reason="manual") == "not-acquired"
    # Only manual runs so far: the job has missed nothing, no catch-up.
    assert await acquire(two, Slot("job", now - 2_000), reason="catch-up") == "not-acquired"
    scheduled = lease_of(await acquire(two, Slot("job", now - 6_000), instance="i2"))
    assert await acquire(one, Slot("job", now - 1_000), reason="manual") == "overlap"
    await two.release(scheduled)
    assert isinstance(await acquire(one, Slot("job", now - 1_000), reason="manual"), Lease)


async def test_a_manual_run_at_a_running_slots_instant_is_refused(fleet: Fleet) -> None:
    """The instant is taken: a manual run asked for at the very slot a run (overlap='allow')
    is running, is not a second run of it."""
    backend = await fleet.start()
    now = now_ms() - 1_000
    allow = JobPolicy("job", overlap="allow")
    lease_of(await acquire(backend, Slot("job", now), allow))
    assert await acquire(backend, Slot("job", now), allow, reason="manual") == "not-acquired"


async def test_a_dead_manual_run_is_restarted_while_it_is_the_latest(fleet: Fleet) -> None:
    """A manual run whose runner died is retried like a scheduled one, unless a scheduled slot
    was claimed after it (the job has run since); either way its taker records it once."""
    runner, taker = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3)
    now = now_ms()
    lease_of(await acquire(runner, Slot("job", now - 10_000), policy, reason="manual"))
    await expire()
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt, retry.reason) == (now - 10_000, 2, "retry")
    await expire()  # the retry dies too, and a scheduled slot is claimed meanwhile
    lease_of(await acquire(runner, Slot("job", now - 5_000), policy, instance="runner"))
    assert await taker.take_over([policy], instance_id="taker") == []
    history = await taker.history(policy, 10)
    assert [(r.outcome, r.reason, r.attempt, r.error) for r in history] == [
        ("interrupted", "retry", 2, "runner lost its lease"),
        ("interrupted", "manual", 1, "runner lost its lease"),
    ]


# -- 7: a take-over respects the job's retry window -----------------------------------------


async def backdate(fleet: Fleet, slot: Slot, ms: int) -> None:
    """Time moves on: the lease of ``slot`` expired (or was handed over) ``ms`` earlier on the
    backend's clock than it did."""
    if fleet.kind == "memory":
        row = fleet.store.jobs[slot.job]
        lease = row.leases[slot.slot_ms]
        leases = {**row.leases, slot.slot_ms: replace(lease, expires_ms=lease.expires_ms - ms)}
        fleet.store.jobs[slot.job] = replace(row, leases=leases)
    elif fleet.kind == "sqlite":

        def shift() -> None:
            with sqlite3.connect(fleet.path) as conn:
                conn.execute(
                    "UPDATE brokersched_leases SET expires_ms = expires_ms - ? "
                    "WHERE job = ? AND slot_ms = ?",
                    (ms, slot.job, slot.slot_ms),
                )

        await asyncio.to_thread(shift)
    elif fleet.kind == "postgres":
        conn = await asyncpg.connect(fleet.dsn)
        try:
            await conn.execute(
                f'UPDATE "{fleet.namespace}".leases '
                "SET expires_at = expires_at - $3 * interval '1 millisecond' "
                "WHERE job = $1 AND slot_ms = $2",
                slot.job,
                slot.slot_ms,
                ms,
            )
        finally:
            await conn.close()
    else:  # Redis: the run's entry in the job's runs hash
        client = fleet.redis()
        try:
            key, field = runs_key(fleet.namespace, slot.job), str(slot.slot_ms)
            run = json.loads(await client.hget(key, field))
            run["expires"] = str(int(run["expires"]) - ms)
            await client.hset(key, field, json.dumps(run))
        finally:
            await client.aclose()


async def test_a_slot_handed_over_at_a_full_fleet_stop_is_not_rerun_later(
    fleet: Fleet,
) -> None:
    """The whole fleet stopped, handing the slot over; nobody took it; the next start
    comes 32 s later, with catch_up=0 and max_late=5s: it is not restarted (its runner
    recorded it interrupted when it stopped)."""
    stopping, starting = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - 1_000)
    await stopping.release(lease_of(await acquire(stopping, slot, policy)), handover=True)
    await backdate(fleet, slot, OLD_MS)
    assert await starting.take_over([policy], instance_id="starting") == []
    assert await starting.history(policy, 10) == []
    assert await starting.take_over([policy], instance_id="again") == []  # dropped for good


async def test_a_long_run_handed_over_by_a_rolling_restart_is_resumed(fleet: Fleet) -> None:
    """The window counts from the hand-over, not from the slot: a 20-minute run cut short by a
    rolling restart is resumed at once by the next instance."""
    stopping, starting = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - 20 * 60_000)
    await stopping.release(lease_of(await acquire(stopping, slot, policy)), handover=True)
    (taken,) = await starting.take_over([policy], instance_id="starting")
    assert (taken.slot_ms, taken.attempt, taken.reason) == (slot.slot_ms, 1, "retry")


async def test_a_dead_runners_slot_left_longer_than_the_retry_window_is_recorded_interrupted(
    fleet: Fleet,
) -> None:
    runner, taker = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - 1_000)
    lease_of(await acquire(runner, slot, policy, instance="dead"))
    await backdate(fleet, slot, OLD_MS)  # its lease expired 31 s ago: the fleet was down
    assert await taker.take_over([policy], instance_id="taker") == []
    (record,) = await taker.history(policy, 10)
    assert (record.slot_ms, record.outcome, record.instance_id) == (
        slot.slot_ms,
        "interrupted",
        "dead",
    )
    assert record.error is not None
    assert record.error.startswith("runner lost its lease; not restarted: it waited 3")
    assert record.error.endswith("for a runner, longer than its retry window (5s)")
    assert await taker.take_over([policy], instance_id="taker") == []


async def test_a_dead_runners_slot_within_the_retry_window_is_restarted(
    fleet: Fleet,
) -> None:
    runner, taker = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3, retry_window=WINDOW)
    slot = Slot("job", now_ms() - OLD_MS)  # an old slot: only the wait since expiry counts
    lease_of(await acquire(runner, slot, policy))
    await backdate(fleet, slot, 3_000)  # its lease expired 2 s ago
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt) == (slot.slot_ms, 2)
    ((outcome, error),) = [(r.outcome, r.error) for r in await taker.history(policy, 10)]
    assert (outcome, error) == ("interrupted", "runner lost its lease")


async def test_the_retry_window_is_never_shorter_than_the_lease(fleet: Fleet) -> None:
    """While the fleet runs it sweeps every lease_ttl/2: a dead runner's slot found by the next
    sweep is restarted even with a retry window of 0 (catch_up=0 and a tiny max_late). The
    lease expired half a second ago on the store's clock, which is set, not waited for: the
    outcome must not depend on how long the calls take."""
    runner, taker = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3, retry_window=timedelta(0))
    granted = now_ms()
    slot = Slot("job", granted - 1_000)
    await fleet.set_store_time(granted)
    lease_of(await acquire(runner, slot, policy))
    await fleet.set_store_time(granted + TTL_MS + 500)
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt) == (slot.slot_ms, 2)


async def test_an_interrupted_run_ends_at_its_runners_last_renewal(fleet: Fleet) -> None:
    """A runner renews its lease, then dies: the take-over comes a lease and a sweep later,
    but the run it records ``interrupted`` ends at the last renewal, its runner's last sign
    of life, not at the take-over."""
    runner, taker = await fleet.start(), await fleet.start()
    policy = JobPolicy("job", max_attempts=3)
    slot = Slot("job", now_ms() - 1_000)
    lease = lease_of(await acquire(runner, slot, policy, instance="dead"))
    await asyncio.sleep(0.4)
    for _ in range(3):  # a renewal timed out here (a loaded machine) is asked again: the last wins
        before = now_ms()
        with contextlib.suppress(BackendUnavailableError):
            assert await runner.renew(lease)
            break
    after = now_ms()
    await asyncio.sleep(TTL.total_seconds() + 0.8)  # the runner is gone; its lease expires
    taken = now_ms()
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert retry.attempt == 2
    (record,) = await taker.history(policy, 10)
    assert (record.outcome, record.instance_id) == ("interrupted", "dead")
    assert record.finished_at is not None
    ended = datetime_to_ms(record.finished_at)
    assert before - 150 <= ended <= after + 150, (before, ended, after)
    assert taken - ended >= TTL_MS, "recorded as lasting until the take-over"


# -- fencing: older slots, stale tokens, hand-overs, races -----------------------------------


async def test_an_older_slot_is_refused_after_a_newer_ones_lease_expired(fleet: Fleet) -> None:
    one, two = await fleet.many(2)
    policy = JobPolicy("job")
    lease_of(await acquire(one, Slot("job", SLOT + 60_000), policy))
    await expire()  # its runner died: nobody renewed, nobody released
    assert await acquire(two, Slot("job", SLOT), policy, instance="i2") == "not-acquired"
    assert await acquire(two, Slot("job", SLOT), policy, reason="catch-up") == "not-acquired"
    (retry,) = await two.take_over([policy], instance_id="i2")
    assert (retry.slot_ms, retry.attempt) == (SLOT + 60_000, 2)


async def test_a_stale_token_never_touches_the_newer_lease(fleet: Fleet) -> None:
    dead, alive = await fleet.many(2)
    policy = JobPolicy("job")
    old = lease_of(await acquire(dead, Slot("job", SLOT), policy))
    await expire()
    (new,) = await alive.take_over([policy], instance_id="i2")
    await dead.release(old, handover=True)  # a stale hand-over...
    await dead.release(old)  # ... and a stale release change nothing
    assert await alive.take_over([policy], instance_id="i3") == []
    assert await acquire(dead, Slot("job", SLOT + 1000), policy) == "overlap"
    assert await dead.renew(old) is False
    assert await alive.renew(new) is True


async def test_a_handed_over_slot_not_latest_is_dropped(fleet: Fleet) -> None:
    backend = await fleet.start()
    policy = JobPolicy("job")
    lease = lease_of(await acquire(backend, Slot("job", SLOT), policy))
    await backend.release(lease, handover=True)
    lease_of(await acquire(backend, Slot("job", SLOT + 1000), policy))
    assert await backend.take_over([policy], instance_id="i2") == []
    assert await backend.history(policy, 10) == []


async def test_racing_claimers_of_newer_slots_respect_a_just_granted_lease(fleet: Fleet) -> None:
    """Each claimer asks for a different, newer slot with overlap='skip': the first grant must
    block every other, although they all read the job before it existed (the race that a
    check of the leases table from before the lock wait would lose)."""
    backends = await fleet.many(RACERS)
    for n in range(6):
        calls = [
            partial(acquire, b, Slot("skip", SLOT + n * 1000 + i + 1), instance=f"i{i}")
            for i, b in enumerate(backends)
        ]
        results = await race(calls)
        leases = [r for r in results if isinstance(r, Lease)]
        assert len(leases) == 1, results
        await backends[0].release(leases[0])


async def test_racing_takers_share_dead_slots_exactly_once_and_record_each_once(
    fleet: Fleet,
) -> None:
    backends = await fleet.many(RACERS)
    policies = [JobPolicy(f"job{n}") for n in range(4)]  # on several nodes of a cluster
    # the store's clock stands still: eight takers spread over more than a lease's lifetime
    # (a loaded machine) would otherwise take a slot over twice, rightly
    now = now_ms()
    await fleet.set_store_time(now)
    for policy in policies:
        lease_of(await acquire(backends[0], Slot(policy.name, SLOT), policy))
    await fleet.set_store_time(now + TTL_MS * 3 // 2)
    calls = [partial(b.take_over, policies, instance_id=f"i{i}") for i, b in enumerate(backends)]
    taken = [lease for leases in await race(calls) for lease in leases]
    assert sorted(lease.job for lease in taken) == [p.name for p in policies]
    assert {lease.attempt for lease in taken} == {2}
    for policy in policies:
        history = await backends[0].history(policy, 10)
        assert [(r.outcome, r.attempt) for r in history] == [("interrupted", 1)]


# -- 8: a lock wait fits in the lease --------------------------------------------------------


def test_a_lock_wait_longer_than_a_third_of_the_lease_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        SQLiteBackend(tmp_path / "x.db", lease_ttl="1s", busy_timeout="5s")
    error = caught.value
    assert (error.option, error.backend) == ("busy_timeout", "SQLiteBackend")
    message = str(error)
    assert "busy_timeout (5s)" in message and "lease_ttl (1s)" in message
    assert "raise lease_ttl to 15s or more" in message and "333ms or less" in message
    # Unset, the lock wait is 5 s, or a third of the lease when that is shorter.
    assert SQLiteBackend(tmp_path / "x.db").busy_timeout == timedelta(seconds=5)
    short = SQLiteBackend(tmp_path / "x.db", lease_ttl="1s")
    assert short.busy_timeout == timedelta(seconds=1) / 3
    exact = SQLiteBackend(tmp_path / "x.db", lease_ttl="15s", busy_timeout="5s")
    assert exact.busy_timeout == timedelta(seconds=5)


async def test_a_release_answers_within_a_third_of_the_lease(sql_fleet: Fleet) -> None:
    """Another client holds what a release needs, until the release has answered: the release
    gives up on its own bound, a third of the ttl, while the lease is still held (the runner
    then retries it), never landing after the lease expired. (A release that waited for the
    lock would never answer: the test's timeout fails it. How long it took is not asserted: a
    process starved of CPU answers late whatever its bound, seen at 1.4 s under stress; the
    error names the bound that cut it.)"""
    backend = await sql_fleet.start()
    lease = lease_of(await acquire(backend, Slot("job", SLOT)))
    third = f"timed out after {format_duration(TTL / 3)}"
    async with hold_write_lock(sql_fleet):
        with pytest.raises(BackendUnavailableError, match=third):
            await backend.release(lease)
    await backend.release(lease)  # the lock is free: the runner's retry goes through
    assert isinstance(await acquire(backend, Slot("job", SLOT + 1_000)), Lease)


# -- 9: a lost attempt is recorded once, by its taker ----------------------------------------


@asynccontextmanager
async def history_unwritable(fleet: Fleet) -> AsyncIterator[None]:
    """The history table is gone for a while (renamed away)."""
    if fleet.kind == "sqlite":

        def rename(old: str, new: str) -> None:
            with sqlite3.connect(fleet.path) as conn:
                conn.execute(f"ALTER TABLE {old} RENAME TO {new}")

        # In a thread: the failed take-over's rollback needs the event loop to let go.
        await asyncio.to_thread(rename, "brokersched_history", "brokersched_gone")
        try:
            yield
        finally:
            await asyncio.to_thread(rename, "brokersched_gone", "brokersched_history")
        return
    conn = await asyncpg.connect(fleet.dsn)
    try:
        await conn.execute(f'ALTER TABLE "{fleet.namespace}".history RENAME TO gone')
        try:
            yield
        finally:
            await conn.execute(f'ALTER TABLE "{fleet.namespace}".gone RENAME TO history')
    finally:
        await conn.close()


async def test_a_take_over_and_its_record_are_one(sql_fleet: Fleet) -> None:
    """The taker records the lost attempt in the take-over's own transaction: if the record
    cannot be written, nothing is taken over, and the next sweep does both, once."""
    runner, taker = await sql_fleet.start(), await sql_fleet.start()
    policy = JobPolicy("job", max_attempts=3)
    lease_of(await acquire(runner, Slot("job", SLOT), policy, instance="lost"))
    await expire()
    async with history_unwritable(sql_fleet):
        with pytest.raises(BackendError):
            await taker.take_over([policy], instance_id="taker")
    (retry,) = await taker.take_over([policy], instance_id="taker")
    assert (retry.slot_ms, retry.attempt) == (SLOT, 2)
    assert await runner.take_over([policy], instance_id="runner") == []
    history = await taker.history(policy, 10)
    assert [(r.outcome, r.instance_id, r.attempt) for r in history] == [("interrupted", "lost", 1)]


# -- the schema: version 1 is upgraded in place ----------------------------------------------


async def test_version_1_tables_are_upgraded_in_place(sql_fleet: Fleet) -> None:
    """A database written by the previous release keeps its fences and its grants."""
    await create_version_1(sql_fleet)
    backend = await sql_fleet.start()
    assert await schema_version(sql_fleet) == SCHEMA_VERSION == 2
    assert await acquire(backend, Slot("job", SLOT)) == "not-acquired"  # the fence stays
    lease = lease_of(await acquire(backend, Slot("job", SLOT + 1_000)))
    await backend.release(lease)
    assert isinstance(await acquire(backend, Slot("job", SLOT + 2_000)), Lease)


async def create_version_1(fleet: Fleet) -> None:
    if fleet.kind == "sqlite":
        sql = SQLiteStatements("brokersched_")
        with sqlite3.connect(fleet.path) as conn:
            for statement in sql.migrations[0]:
                conn.execute(statement)
            conn.execute(f"CREATE TABLE {sql.version_table} (version INTEGER NOT NULL)")
            conn.execute(f"INSERT INTO {sql.version_table} VALUES (1)")
            conn.execute("INSERT INTO brokersched_jobs VALUES ('job', ?, 0)", (SLOT,))
        return
    pg = PostgresStatements(fleet.namespace)
    conn = await asyncpg.connect(fleet.dsn)
    try:
        await conn.execute(f"CREATE SCHEMA {pg.schema}")
        await conn.execute(pg.migrations[0])
        await conn.execute(f"CREATE TABLE {pg.version_table} (version integer NOT NULL)")
        await conn.execute(f"INSERT INTO {pg.version_table} VALUES (1)")
        await conn.execute(f"INSERT INTO {pg.schema}.jobs VALUES ('job', $1, now())", SLOT)
    finally:
        await conn.close()

"""RedisLeaseBackend: leases in Redis, each decision one Lua script on the job's keys."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Literal, cast

from ..._clock import Clock
from ..._durations import Duration, to_ms
from ..._exceptions import BackendError
from ...abc import (
    Claim,
    JobPolicy,
    Lease,
    LeaseOutcome,
    LeaseState,
    RunReason,
    RunRecord,
)
from .._keywords import own_options
from .._lease import (
    DEFAULT_MAX_CLOCK_SKEW,
    ClockName,
    Ending,
    Granted,
    JobRow,
    LeaseBackendBase,
    LeaseRow,
    TakenOver,
    TakeOver,
    decide,
    new_token,
    outcome,
)
from . import _ops
from ._connection import RedisConnection
from ._fleet import FleetRecords
from ._history import history_entry, history_ttl_args
from ._keys import evictions_key, history_key, job_key, runs_key
from ._options import RedisLeaseOptions, check_client_options

__all__ = ["RedisLeaseBackend"]

logger = logging.getLogger("brokersched.backends.redis")


class RedisLeaseBackend(_ops.Operations, FleetRecords, LeaseBackendBase):
    """Leases in Redis (or a Redis Cluster), with occurrence fencing, overlap control,
    take-over of dead runners and catch-up, judged on the server's clock.

    ``url``, ``prefix``, ``cluster``, ``require_persistence`` and other keyword arguments as
    for ``RedisBackend``. ``lease_ttl``: how long a lease lives unless renewed.
    ``max_clock_skew``: how far ahead of the server's clock a claimed slot may be.
    ``budget_interval``: as for ``RedisBackend``; while shedding no new lease is taken.
    """

    clock_name = ClockName("the Redis server's clock (TIME)", "the Redis server")
    _log = logger

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        lease_ttl: Duration = "30s",
        prefix: str = "brokersched",
        cluster: bool = False,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
        require_persistence: bool = False,
        budget_interval: Duration | None = "30s",
        **client_options: Any,
    ) -> None:
        options = RedisLeaseOptions.parse(self.name, locals())
        super().__init__(options)
        check_client_options(
            self.name, own_options(RedisLeaseBackend), client_options, cluster=options.cluster
        )
        self._redis: RedisConnection = RedisConnection(self.name, options, client_options)

    def __repr__(self) -> str:
        cluster = ", cluster=True" if self._redis.cluster else ""
        return f"{self.name}({self._redis.redacted!r}, prefix={self.prefix!r}{cluster})"

    @property
    def prefix(self) -> str:
        return self._redis.prefix

    @property
    def store_time(self) -> int | None:
        """For tests: the scripts judge time as if the server's clock read this (ms);
        ``None`` (always, in production): the server's ``TIME``."""
        return self._redis.store_time

    @store_time.setter
    def store_time(self, now_ms: int | None) -> None:
        self._redis.store_time = now_ms

    async def _open(self, clock: Clock) -> None:
        await self._redis.open(clock)

    async def _close(self) -> None:
        await self._redis.close()

    def _refuse_if_shedding(self, what: str) -> None:
        """No new lease while Redis could evict it (``_budget``): renewals, releases and
        take-overs go on (they write keys that exist)."""
        if (budget := self._redis.budget) is not None:
            budget.refuse_if_shedding(what)

    def _keys(self, job: str, *, history: bool = False, guard: bool = False) -> list[str]:
        """The job's fences and runs, then its history (``history``), then its eviction
        record (``guard``: for the scripts that pass the eviction guard)."""
        keys = [job_key(self.prefix, job), runs_key(self.prefix, job)]
        if history:
            keys.append(history_key(self.prefix, job))
        if guard:
            keys.append(evictions_key(self.prefix, job))
        return keys

    # -- leases ------------------------------------------------------------------------------

    async def _acquire(self, claim: Claim, instance_id: str, timeout: float) -> Granted:
        slot = claim.slot
        self._refuse_if_shedding(f"the lease of {slot.key} is not taken")
        token = new_token()
        args = self._acquire_args(claim, token, instance_id)
        answer = await self._redis.script(
            "ACQUIRE", "claim " + slot.key, self._keys(slot.job, guard=True), args, timeout
        )
        return self._granted(claim, token, answer)

    def _acquire_args(self, claim: Claim, token: str, instance_id: str) -> list[str | int]:
        return [
            claim.slot.slot_ms, claim.reason, "1" if claim.policy.overlap == "allow" else "0",
            self._ttl_ms, to_ms(self._max_clock_skew), token, claim.run_id, instance_id,
            self._redis.now_ms(),
        ]  # fmt: skip

    def _granted(self, claim: Claim, token: str, answer: list[bytes]) -> Granted:
        slot = claim.slot
        if (refused := self._redis.refusal(answer, f"the lease of {slot.key}")) is not None:
            raise refused
        status, now = answer
        granted = status == b"granted"
        self._check_slot_time(slot, int(now), self._redis.clock, granted=granted)
        if granted:
            return Lease(slot.job, slot.slot_ms, token, claim.run_id, 1, claim.reason)
        return "overlap" if status == b"overlap" else "not-acquired"

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """One pipelined round trip of the claims' scripts (each decides its job alone, as
        ``acquire()`` does); on a cluster, the claims concurrently."""
        if (budget := self._redis.budget) is not None and budget.shedding:
            error = budget.shed_error(f"the leases of {len(claims)} slots are not taken")
            return [error for _ in claims]
        if self._redis.cluster:
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        tokens = [new_token() for _ in claims]
        calls = [
            (self._keys(claim.slot.job, guard=True), self._acquire_args(claim, token, instance_id))
            for claim, token in zip(claims, tokens, strict=True)
        ]
        try:
            answers = await self._redis.scripts(
                "ACQUIRE", f"claim {len(claims)} slots", calls, timeout
            )
        except BackendError as exc:
            return [exc for _ in claims]
        outcomes: list[LeaseOutcome] = []
        for claim, token, answer in zip(claims, tokens, answers, strict=True):
            if isinstance(answer, Exception):
                key = claim.slot.key
                outcomes.append(BackendError(f"{self.name} could not claim {key}: {answer}"))
            else:  # a ClockSkewError, the eviction guard's refusal: that claim's outcome
                outcomes.append(outcome(self._granted, claim, token, answer))
        return outcomes

    async def renew(self, lease: Lease) -> bool:
        """Answers within a third of ``lease_ttl``."""
        args: list[str | int] = [lease.slot_ms, lease.token, self._ttl_ms]
        renewed = await self._redis.script(
            "RENEW",
            "renew " + lease.slot.key,
            [runs_key(self.prefix, lease.job)],
            args,
            self._renew_timeout,
        )
        return bool(renewed)

    async def _end_lease(self, lease: Lease, handover: bool, record: Ending) -> None:
        """With ``record``, in one script, unless the record is another job's (a backfill's
        fence lease): then the record first (a cluster keeps the two jobs on other nodes)."""
        keys = [runs_key(self.prefix, lease.job)]
        args: list[str | int] = [lease.slot_ms, lease.token, "1" if handover else "0"]
        if record is not None and record[0].name == lease.job:
            policy, run = record
            keys.append(history_key(self.prefix, policy.name))
            args += [
                history_entry(run),
                policy.history_size,
                *history_ttl_args(self._redis, policy),
            ]
        elif record is not None:
            await self._redis.record(*record)
        await self._redis.script(
            "RELEASE", "release " + lease.slot.key, keys, args, self._renew_timeout
        )

    async def lease_state(self, job: str) -> LeaseState:
        row, now_ms, _ = await self._scan(job, f"read the leases of {job}")
        return row.state(now_ms)

    async def _scan(self, job: str, what: str) -> tuple[JobRow, int, list[str | int]]:
        """The job's row (``SCAN_RUNS``: its fences and runs), the server's clock, and the
        fences as stored (``COMMIT_TAKE_OVER`` writes nothing if they changed since)."""
        scan = await self._redis.script("SCAN_RUNS", what, self._keys(job), [])
        now_ms, fence, manual, *runs = scan
        leases = {int(slot): _lease_row(json.loads(run)) for slot, run in _pairs(runs)}
        row = JobRow(_int_or_none(fence), _int_or_none(manual), leases)
        return row, int(now_ms), [fence.decode(), manual.decode()]

    async def _take_over_job(self, policy: JobPolicy, instance_id: str) -> list[Lease]:
        """One script reads the job's runs (and the server's clock), the lease protocol
        decides (``_lease.decide``), one script commits what changed if nothing else did."""
        keys = self._keys(policy.name, history=True, guard=True)
        row, now_ms, fences = await self._scan(policy.name, f"look for dead runs of {policy.name}")
        dead = {slot: lease for slot, lease in row.leases.items() if not lease.live(now_ms)}
        if not dead:
            return []
        started = self._redis.now_ms()
        request = TakeOver(policy, instance_id, started)
        after, taken = decide(policy.name, row, request, self._store(now_ms))
        assert isinstance(taken, TakenOver)
        restarts = {lease.slot_ms: lease for lease in taken.leases}
        records = {record.slot_ms: record for record in taken.records}
        args: list[str | int] = [
            *fences, self._ttl_ms, policy.history_size,
            *history_ttl_args(self._redis, policy), "1" if policy.exclusive else "0",
        ]  # fmt: skip
        for slot_ms, lease in dead.items():
            if slot_ms in after.leases and slot_ms not in restarts:
                continue  # left for a later sweep: a run of the job is live
            restart = restarts.get(slot_ms)
            record = records.get(slot_ms)
            args += [
                slot_ms, lease.token, restart.token if restart else "",
                restart.run_id if restart else "", instance_id,
                restart.attempt if restart else 0, started,
                "" if record is None else history_entry(record),
            ]  # fmt: skip
        answer = await self._redis.script(
            "COMMIT_TAKE_OVER", f"take over the slots of {policy.name}", keys, args
        )
        what = f"the take-over of {', '.join(lease.slot.key for lease in taken.leases)}"
        if (refused := self._redis.refusal(answer, what)) is not None:
            raise refused
        return [restarts[int(slot)] for slot in answer[1:] if int(slot) in restarts]

    # -- history -----------------------------------------------------------------------------

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self._redis.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await self._redis.history(job, limit)


def _int_or_none(value: bytes) -> int | None:
    return int(value) if value else None


def _pairs(flat: list[bytes]) -> zip[tuple[bytes, bytes]]:
    return zip(flat[::2], flat[1::2], strict=True)


def _lease_row(run: dict[str, str]) -> LeaseRow:
    state: Literal["running", "handover"] = "handover" if run["state"] == "handover" else "running"
    return LeaseRow(
        token=run["token"],
        run_id=run["run_id"],
        instance_id=run["instance_id"],
        reason=cast(RunReason, run["reason"]),
        attempt=int(run["attempt"]),
        state=state,
        started_ms=int(run["started"]),
        expires_ms=int(run["expires"]),
    )

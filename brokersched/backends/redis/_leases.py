"""RedisLeaseBackend: leases in Redis, each decision one Lua script on the job's keys."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

from ..._clock import Clock, datetime_to_ms, ms_to_datetime
from ..._durations import Duration, to_ms
from ..._exceptions import BackendError
from ...abc import Claim, JobPolicy, Lease, LeaseOutcome, RunReason, RunRecord, Slot
from .._lease import (
    DEFAULT_MAX_CLOCK_SKEW,
    DeadRun,
    LeaseBackendBase,
    check_slot_time,
    interrupted,
    is_latest,
    new_run_id,
    new_token,
    restart_attempt,
    retry_window_ms,
)
from ._base import RedisConnection, history_entry, history_key, job_key, runs_key

__all__ = ["RedisLeaseBackend"]

logger = logging.getLogger("brokersched.backends.redis")

_CLOCK = "the Redis server's clock (TIME)"


class RedisLeaseBackend(LeaseBackendBase):
    """Leases in Redis (or a Redis Cluster), with occurrence fencing, overlap control,
    take-over of dead runners and catch-up, judged on the server's clock.

    ``url``, ``prefix``, ``cluster``, ``require_persistence`` and other keyword arguments as
    for ``RedisBackend``. ``lease_ttl``: how long a lease lives unless renewed.
    ``max_clock_skew``: how far ahead of the server's clock a claimed slot may be.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        lease_ttl: Duration = "30s",
        prefix: str = "brokersched",
        cluster: bool = False,
        max_clock_skew: Duration = DEFAULT_MAX_CLOCK_SKEW,
        require_persistence: bool = False,
        **client_options: Any,
    ) -> None:
        super().__init__(lease_ttl=lease_ttl, max_clock_skew=max_clock_skew)
        self._redis = RedisConnection(
            self.name,
            url,
            prefix=prefix,
            cluster=cluster,
            require_persistence=require_persistence,
            client_options=client_options,
        )

    def __repr__(self) -> str:
        cluster = ", cluster=True" if self._redis.cluster else ""
        return f"{self.name}({self._redis.redacted!r}, prefix={self.prefix!r}{cluster})"

    @property
    def prefix(self) -> str:
        return self._redis.prefix

    async def _open(self, clock: Clock) -> None:
        await self._redis.open(clock)

    async def _close(self) -> None:
        await self._redis.close()

    def _keys(self, job: str, *, history: bool = False) -> list[str]:
        keys = [job_key(self.prefix, job), runs_key(self.prefix, job)]
        return [*keys, history_key(self.prefix, job)] if history else keys

    # -- leases ------------------------------------------------------------------------------

    async def acquire(
        self,
        slot: Slot,
        *,
        policy: JobPolicy,
        instance_id: str,
        run_id: str,
        reason: RunReason,
        timeout: float,
    ) -> Lease | Literal["overlap", "not-acquired"]:
        token, claim = new_token(), Claim(slot, run_id, policy, reason)
        args = self._acquire_args(claim, token, instance_id)
        status, now = await self._redis.script(
            "ACQUIRE", "claim " + slot.key, self._keys(slot.job), args, timeout
        )
        return self._granted(claim, token, status, now)

    def _acquire_args(self, claim: Claim, token: str, instance_id: str) -> list[str | int]:
        return [
            claim.slot.slot_ms, claim.reason, "1" if claim.policy.overlap == "allow" else "0",
            self._ttl_ms, to_ms(self._max_clock_skew), token, claim.run_id, instance_id,
            self._redis.now_ms(),
        ]  # fmt: skip

    def _granted(
        self, claim: Claim, token: str, status: bytes, now: bytes
    ) -> Lease | Literal["overlap", "not-acquired"]:
        slot = claim.slot
        match status:
            case b"granted":
                return Lease(slot.job, slot.slot_ms, token, claim.run_id, 1, claim.reason)
            case b"overlap":
                return "overlap"
            case b"skew":
                check_slot_time(
                    slot, int(now), self._max_clock_skew, backend=self.name, clock=_CLOCK
                )
        return "not-acquired"

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """One pipelined round trip of the claims' scripts (each decides its job alone, as
        ``acquire()`` does); on a cluster, the claims concurrently."""
        if self._redis.cluster:
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        tokens = [new_token() for _ in claims]
        calls = [
            (self._keys(claim.slot.job), self._acquire_args(claim, token, instance_id))
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
                continue
            try:
                outcomes.append(self._granted(claim, token, *answer))
            except BackendError as exc:  # ClockSkewError
                outcomes.append(exc)
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

    async def release(self, lease: Lease, *, handover: bool = False) -> None:
        args: list[str | int] = [lease.slot_ms, lease.token, "1" if handover else "0"]
        await self._redis.script(
            "RELEASE",
            "release " + lease.slot.key,
            [runs_key(self.prefix, lease.job)],
            args,
            self._renew_timeout,
        )

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """Per job: one script reads its dead runs (on the server's clock), the shared lease
        rules decide, one script commits the decisions if nothing changed meanwhile."""
        leases: list[Lease] = []
        by_job = {policy.name: policy for policy in policies}
        for policy in by_job.values():
            try:
                leases += await self._take_over_job(policy, instance_id)
            except BackendError:
                if not leases:
                    raise
                # Leases already granted must reach their runner; the rest waits for the
                # next sweep.
                logger.warning(
                    "%s could not take over the slots of %s", self.name, policy.name, exc_info=True
                )
        return leases

    async def _take_over_job(self, policy: JobPolicy, instance_id: str) -> list[Lease]:
        keys = self._keys(policy.name, history=True)
        scan = await self._redis.script(
            "SCAN_DEAD", f"look for dead runs of {policy.name}", keys[:2], []
        )
        now_ms, fence, manual, *pairs = scan
        if not pairs:
            return []
        window_ms = retry_window_ms(policy, self._lease_ttl)
        now = ms_to_datetime(self._redis.now_ms())
        latest = (_int_or_none(fence), _int_or_none(manual))
        args: list[str | int] = [
            fence.decode(), manual.decode(), self._ttl_ms, policy.history_size,
            *self._redis.history_ttl_args(policy),
        ]  # fmt: skip
        retries: dict[int, Lease] = {}
        for raw_slot, raw_run in zip(pairs[::2], pairs[1::2], strict=True):
            slot_ms, run = int(raw_slot), json.loads(raw_run)
            dead = _dead_run(policy.name, slot_ms, run, int(now_ms))
            attempt = restart_attempt(
                dead, latest=is_latest(slot_ms, *latest), policy=policy, window_ms=window_ms
            )
            record = interrupted(
                dead,
                now,
                restarted=attempt is not None,
                window_ms=window_ms,
                max_attempts=policy.max_attempts,
            )
            token = run_id = ""
            if attempt is not None:
                token, run_id = new_token(), new_run_id()
                retries[slot_ms] = dead.retried(token, run_id, attempt)
            args += [
                slot_ms, run["token"], token, run_id, instance_id, attempt or 0,
                datetime_to_ms(now), "" if record is None else history_entry(record),
            ]  # fmt: skip
        committed = await self._redis.script(
            "COMMIT_TAKE_OVER", f"take over the slots of {policy.name}", keys, args
        )
        return [retries[int(slot)] for slot in committed if int(slot) in retries]

    # -- history -----------------------------------------------------------------------------

    async def record(self, job: JobPolicy, record: RunRecord) -> None:
        await self._redis.record(job, record)

    async def history(self, job: JobPolicy, limit: int) -> list[RunRecord]:
        return await self._redis.history(job, limit)


def _int_or_none(value: bytes) -> int | None:
    return int(value) if value else None


def _dead_run(job: str, slot_ms: int, run: dict[str, str], now_ms: int) -> DeadRun:
    return DeadRun(
        job=job,
        slot_ms=slot_ms,
        run_id=run["run_id"],
        instance_id=run["instance_id"],
        reason=run["reason"],
        attempt=int(run["attempt"]),
        state=run["state"],
        started_at=ms_to_datetime(int(run["started"])),
        waited_ms=now_ms - int(run["expires"]),
    )

"""The leases of ``PostgresBackend``: claims (one at a time, or a batch of scheduled slots
in one statement), renewals, releases (with their run's record), take-overs of dead runners'
slots, and the read of a job's fences; each decision is one statement (``_statements``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from ..._exceptions import BackendError, BackendUnavailableError
from ...abc import (
    Claim,
    JobPolicy,
    Lease,
    LeaseOutcome,
    LeaseState,
    RunReason,
    RunRecord,
    Slot,
)
from .._lease import (
    BATCH_CHUNK,
    DeadRun,
    JobState,
    in_chunks,
    interrupted,
    new_token,
    refusal,
    retry_window_ms,
)
from .._sql import NO_SLOT
from ._connection import Connection, Row
from ._history import PostgresHistory

__all__ = ["PostgresLeases"]

logger = logging.getLogger("brokersched.backends.postgres")


class PostgresLeases(PostgresHistory):
    """The lease protocol in SQL; a release or a take-over writes its records through
    ``PostgresHistory``."""

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
        token = new_token()
        sql = {"catch-up": self._sql.acquire_catch_up, "manual": self._sql.acquire_manual}.get(
            reason, self._sql.acquire
        )
        allow = policy.overlap == "allow"
        args = (
            slot.job, slot.slot_ms, self._ttl_ms, allow, token, run_id, instance_id, reason,
            self._now(), self._skew_ms,
        )  # fmt: skip

        async def claim(conn: Connection) -> Row | None:
            return await conn.fetchrow(sql, *args)

        with self._claiming(f"the claim of {slot.key}"):
            row = await self._call("claim " + slot.key, claim, timeout)
        assert row is not None  # the SELECT always returns its one row
        self._check_slot_time(slot, row["now_ms"], self._clock, granted=row["granted"])
        if row["granted"]:
            return Lease(slot.job, slot.slot_ms, token, run_id, 1, reason)
        return refusal(reason, slot.slot_ms, _job_state(row), policy)

    async def acquire_many(
        self, claims: Sequence[Claim], *, instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """Scheduled slots of distinct jobs in one statement (``_ACQUIRE_MANY``); any other
        batch, or one that PostgreSQL refused as a whole (a deadlock with a take-over, say:
        nothing of it was done), claims each slot on its own."""
        jobs = {claim.slot.job for claim in claims}
        shedding = self._budget is not None and self._budget.shedding
        if (
            shedding  # each claim on its own, refused when it finds no idle connection
            or len(claims) < 2
            or len(jobs) < len(claims)
            or any(c.reason != "schedule" for c in claims)
        ):
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        if len(claims) > BATCH_CHUNK:  # each instance gets its share of the instant's slots

            async def chunk(part: list[Claim]) -> list[LeaseOutcome]:
                return await self.acquire_many(part, instance_id=instance_id, timeout=timeout)

            return await in_chunks(claims, chunk)
        tokens = [new_token() for _ in claims]
        args = (
            [c.slot.job for c in claims], [c.slot.slot_ms for c in claims], self._ttl_ms,
            [c.policy.overlap == "allow" for c in claims], tokens, [c.run_id for c in claims],
            instance_id, self._now(), self._skew_ms,
        )  # fmt: skip

        async def claim_all(conn: Connection) -> list[Row]:
            return await conn.fetch(self._sql.acquire_many, *args)

        try:
            rows = await self._call(f"claim {len(claims)} slots", claim_all, timeout)
        except BackendError as exc:
            if isinstance(exc, BackendUnavailableError) or not self._refused(exc.__cause__):
                raise
            logger.warning("a batch of %d claims was refused (%s): claiming each", len(jobs), exc)
            return await super().acquire_many(claims, instance_id=instance_id, timeout=timeout)
        return [
            self._outcome(claim, token, row)
            for claim, token, row in zip(claims, tokens, rows, strict=True)
        ]

    def _refused(self, cause: BaseException | None) -> bool:
        """Whether the server answered with an error: the statement did nothing."""
        return self._asyncpg is not None and isinstance(cause, self._asyncpg.PostgresError)

    def _outcome(self, claim: Claim, token: str, row: Row) -> LeaseOutcome:
        slot = claim.slot
        try:
            self._check_slot_time(slot, row["now_ms"], self._clock, granted=row["granted"])
        except BackendError as exc:
            return exc
        if row["granted"]:
            return Lease(slot.job, slot.slot_ms, token, claim.run_id, 1, claim.reason)
        return refusal(claim.reason, slot.slot_ms, _job_state(row), claim.policy)

    async def renew(self, lease: Lease) -> bool:
        """Answers within a third of ``lease_ttl`` (see ``_renew_timeout``)."""
        args = (lease.job, lease.slot_ms, lease.token, self._ttl_ms)

        async def renew(conn: Connection) -> bool:
            return bool(await conn.fetchval(self._sql.renew, *args))

        return await self._call("renew " + lease.slot.key, renew, self._renew_timeout)

    async def release(
        self,
        lease: Lease,
        *,
        handover: bool = False,
        record: tuple[JobPolicy, RunRecord] | None = None,
    ) -> None:
        sql = self._sql.hand_over if handover else self._sql.release

        async def release(conn: Connection) -> None:
            if record is None:
                await conn.execute(sql, lease.job, lease.slot_ms, lease.token)
            else:
                args = self._release_args(lease, record, handover=handover)
                await conn.execute(self._sql.release_recorded, *args)

        # Within a third of the ttl (see _renew_timeout): a stuck release gives way to the
        # runner's next try, in time to land before the lease expires.
        await self._call("release " + lease.slot.key, release, self._renew_timeout)

    async def release_many(
        self,
        leases: Sequence[Lease],
        records: Sequence[tuple[JobPolicy, RunRecord] | None] | None = None,
    ) -> list[Exception | None]:
        """One pipelined round trip, in one transaction (all or none), in the order of job
        names: each release locks its job's row until the commit."""
        ends = records if records is not None else [None] * len(leases)
        ordered = sorted(zip(leases, ends, strict=True), key=lambda e: (e[0].job, e[0].slot_ms))
        args = [self._release_args(lease, record) for lease, record in ordered]

        async def release(conn: Connection) -> None:
            await conn.executemany(self._sql.release_recorded, args)

        try:
            await self._call(f"release {len(args)} leases", release, self._renew_timeout)
        except BackendError as exc:
            return [exc for _ in leases]
        return [None for _ in leases]

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """One read when no lease is dead (most sweeps); else, in one transaction, the jobs'
        rows locked (``_LOCK_JOBS``), the decision (``_TAKE_OVER``) and the dead attempts'
        records: a slot is taken over only together with its record, so it is recorded exactly
        once, and a record that fails leaves the slot to the next sweep."""
        by_job = {policy.name: policy for policy in policies}
        if not by_job:
            return []
        now = self._now()

        async def take_over(conn: Connection) -> list[Row]:
            dead = await conn.fetch(self._sql.dead_jobs, list(by_job))
            if not dead:
                return []
            jobs = [by_job[row["job"]] for row in dead]
            windows = {job.name: retry_window_ms(job, self._lease_ttl) for job in jobs}
            args = (
                [job.name for job in jobs], [job.max_attempts for job in jobs], instance_id,
                self._ttl_ms, now, list(windows.values()), [job.overlap == "skip" for job in jobs],
            )  # fmt: skip
            async with conn.transaction():
                await conn.fetch(self._sql.lock_jobs, args[0])
                rows = await conn.fetch(self._sql.take_over, *args)
                for row in rows:
                    if row["leased"]:
                        continue
                    policy = by_job[row["job"]]
                    record = interrupted(
                        _dead_run(row),
                        now,
                        restarted=row["restarted"],
                        window_ms=windows[row["job"]],
                        ttl_ms=self._ttl_ms,
                        max_attempts=policy.max_attempts,
                    )
                    if record is not None:
                        await conn.execute(self._sql.record, *self._record_args(policy, record))
                return rows

        rows = await self._call("take over slots", take_over)
        return [
            Lease(row["job"], row["slot_ms"], row["token"], row["run_id"], row["attempt"], "retry")
            for row in rows
            if row["leased"]
        ]

    async def lease_state(self, job: str) -> LeaseState:
        async def read(conn: Connection) -> Row | None:
            return await conn.fetchrow(self._sql.lease_state, job)

        row = await self._call(f"read the leases of {job}", read)
        assert row is not None  # the SELECT always returns its one row
        fence = row["last_slot_ms"]
        return LeaseState(
            None if fence in (None, NO_SLOT) else fence,
            row["manual_slot_ms"],
            frozenset(row["leased"]),
            row["now_ms"],
        )


def _dead_run(row: Row) -> DeadRun:
    return DeadRun(
        job=row["job"],
        slot_ms=row["slot_ms"],
        run_id=row["run_id"],
        instance_id=row["instance_id"],
        reason=row["reason"],
        attempt=row["attempt"],
        state=row["state"],
        started_at=row["started_at"],
        waited_ms=row["waited_ms"],
    )


def _job_state(row: Row) -> JobState | None:
    """The job's columns of ``_ACQUIRE``'s answer (``None``: no row)."""
    fence = row["last_slot_ms"]
    if fence is None:
        return None
    fence = None if fence == NO_SLOT else fence
    return JobState(fence, row["manual_slot_ms"], bool(row["live"]), bool(row["taken"]))

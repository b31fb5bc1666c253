"""The leases of ``PostgresBackend``: claims (one at a time, or a batch of scheduled slots
in one statement), renewals, releases (with their run's record), take-overs of dead runners'
slots, and the read of a job's fences; each decision is one statement (``_statements``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..._exceptions import BackendError
from ...abc import Claim, JobPolicy, Lease, LeaseOutcome, LeaseState
from .._lease import (
    DeadRun,
    Ending,
    Granted,
    JobState,
    interrupted,
    new_token,
    outcome,
    refusal,
    retry_window_ms,
)
from .._sql import fence
from ._connection import Connection, Row
from ._history import PostgresHistory

__all__ = ["PostgresLeases"]

logger = logging.getLogger("brokersched.backends.postgres")


class PostgresLeases(PostgresHistory):
    """The lease protocol in SQL; a release or a take-over writes its records through
    ``PostgresHistory``."""

    async def _acquire(self, claim: Claim, instance_id: str, timeout: float) -> Granted:
        slot, reason, token = claim.slot, claim.reason, new_token()
        sql = {"catch-up": self._sql.acquire_catch_up, "manual": self._sql.acquire_manual}.get(
            reason, self._sql.acquire
        )
        allow = claim.policy.overlap == "allow"
        args = (
            slot.job, slot.slot_ms, self._ttl_ms, allow, token, claim.run_id, instance_id,
            reason, self._now(), self._skew_ms,
        )  # fmt: skip

        async def decide(conn: Connection) -> Row | None:
            return await conn.fetchrow(sql, *args)

        with self._claiming(f"the claim of {slot.key}"):
            row = await self._call("claim " + slot.key, decide, timeout)
        assert row is not None  # the SELECT always returns its one row
        return self._granted(claim, token, row)

    def _batchable(self, claims: Sequence[Claim]) -> bool:
        """Scheduled slots of distinct jobs (``_ACQUIRE_MANY``); while shedding, each claim
        on its own, refused when it finds no idle connection."""
        shedding = self._budget is not None and self._budget.shedding
        return (
            not shedding
            and len(claims) >= 2
            and len({claim.slot.job for claim in claims}) == len(claims)
            and all(c.reason == "schedule" for c in claims)
        )

    async def _acquire_batch(
        self, claims: Sequence[Claim], instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """One statement (``_ACQUIRE_MANY``)."""
        tokens = [new_token() for _ in claims]
        args = (
            [c.slot.job for c in claims], [c.slot.slot_ms for c in claims], self._ttl_ms,
            [c.policy.overlap == "allow" for c in claims], tokens, [c.run_id for c in claims],
            instance_id, self._now(), self._skew_ms,
        )  # fmt: skip

        async def claim_all(conn: Connection) -> list[Row]:
            return await conn.fetch(self._sql.acquire_many, *args)

        rows = await self._call(f"claim {len(claims)} slots", claim_all, timeout)
        return [
            outcome(self._granted, claim, token, row)
            for claim, token, row in zip(claims, tokens, rows, strict=True)
        ]

    def _refused(self, exc: BackendError, claims: Sequence[Claim]) -> bool:
        """Whether the server answered with an error (a deadlock with a take-over, say): the
        statement did nothing."""
        cause = exc.__cause__
        if self._asyncpg is None or not isinstance(cause, self._asyncpg.PostgresError):
            return False
        logger.warning("a batch of %d claims was refused (%s): claiming each", len(claims), exc)
        return True

    def _granted(self, claim: Claim, token: str, row: Row) -> Granted:
        """The answer of ``_ACQUIRE`` (or a row of ``_ACQUIRE_MANY``) to ``claim``."""
        slot = claim.slot
        self._check_slot_time(slot, row["now_ms"], self._clock, granted=row["granted"])
        if row["granted"]:
            return Lease(slot.job, slot.slot_ms, token, claim.run_id, 1, claim.reason)
        return refusal(claim.reason, slot.slot_ms, _job_state(row), claim.policy)

    async def renew(self, lease: Lease) -> bool:
        """Answers within a third of ``lease_ttl`` (see ``_renew_timeout``)."""
        args = (lease.job, lease.slot_ms, lease.token, self._ttl_ms)

        async def renew(conn: Connection) -> bool:
            return bool(await conn.fetchval(self._sql.renew, *args))

        return await self._call("renew " + lease.slot.key, renew, self._renew_timeout)

    async def _end_lease(self, lease: Lease, handover: bool, record: Ending) -> None:
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

    async def _release_all(self, ends: list[tuple[Lease, Ending]]) -> None:
        """One pipelined round trip, in the order of job names: each release locks its job's
        row until the commit."""
        ordered = sorted(ends, key=lambda e: (e[0].job, e[0].slot_ms))
        args = [self._release_args(lease, record) for lease, record in ordered]

        async def release(conn: Connection) -> None:
            await conn.executemany(self._sql.release_recorded, args)

        await self._call(f"release {len(args)} leases", release, self._renew_timeout)

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """One read when no lease is dead (most sweeps); else, in one transaction, the jobs'
        rows locked (``_LOCK_JOBS``), the decision (``_TAKE_OVER``) and the dead attempts'
        records: a slot is taken over only together with its record, so it is recorded exactly
        once, and a record that fails leaves the slot to the next sweep."""
        by_job = {policy.name: policy for policy in policies}
        if not by_job:
            return []

        async def take_over(conn: Connection) -> list[Row]:
            dead = await conn.fetch(self._sql.dead_jobs, list(by_job))
            if not dead:
                return []
            jobs = [by_job[row["job"]] for row in dead]
            names = [job.name for job in jobs]
            windows = {job.name: retry_window_ms(job, self._lease_ttl) for job in jobs}
            async with conn.transaction():
                await conn.fetch(self._sql.lock_jobs, names)
                # Read once the locks are held, next to the statement that measures how long
                # each lease has been expired: a taker that waited for a lock or a connection
                # would otherwise date the dead run's last renewal that much too early.
                now = self._now()
                args = (
                    names, [job.max_attempts for job in jobs], instance_id, self._ttl_ms, now,
                    list(windows.values()), [job.exclusive for job in jobs],
                )  # fmt: skip
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
        slots = frozenset(row["leased"])
        return LeaseState(fence(row["last_slot_ms"]), row["manual_slot_ms"], slots, row["now_ms"])


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
    if row["last_slot_ms"] is None:
        return None
    live, taken = bool(row["live"]), bool(row["taken"])
    return JobState(fence(row["last_slot_ms"]), row["manual_slot_ms"], live, taken)

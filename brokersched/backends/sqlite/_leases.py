"""The leases of ``SQLiteBackend``: claims (one, or a batch in one transaction), renewals,
releases (with their run's record), take-overs of dead runners' slots (the lease protocol of
``backends/_lease.py`` applied to a job's rows read under the write lock), and the read of a
job's fences."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._clock import datetime_to_ms
from ..._exceptions import BackendError
from ...abc import Claim, JobPolicy, Lease, LeaseOutcome, LeaseState
from .._lease import (
    Ending,
    Granted,
    JobRow,
    JobState,
    LeaseRow,
    TakenOver,
    TakeOver,
    decide,
    new_token,
    refusal,
)
from .._sql import NO_SLOT, datetime_to_us, fence
from ._history import SQLiteHistory

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["SQLiteLeases"]


class SQLiteLeases(SQLiteHistory):
    """The lease protocol in SQLite, each write decision under the write lock; a release or a
    take-over writes its records through ``SQLiteHistory``."""

    async def _acquire(self, claim: Claim, instance_id: str, timeout: float) -> Granted:
        params = self._claim_params(claim, instance_id)

        async def decide(conn: aiosqlite.Connection) -> Granted:
            now_ms = self._store_now_ms()  # under the write lock: after any wait for it
            self._check_slot_time(claim.slot, now_ms, self._clock)
            return await self._decide(conn, claim, params | {"now": now_ms})

        key = claim.slot.key
        return await self._run("claim " + key, decide, timeout=timeout, transaction=True)

    async def _acquire_batch(
        self, claims: Sequence[Claim], instance_id: str, timeout: float
    ) -> list[LeaseOutcome]:
        """The claims one after the other in one transaction (one write lock, one commit)."""
        batch = [(claim, self._claim_params(claim, instance_id)) for claim in claims]

        async def decide_all(conn: aiosqlite.Connection) -> list[LeaseOutcome]:
            now_ms = self._store_now_ms()
            outcomes: list[LeaseOutcome] = []
            for claim, params in batch:
                try:
                    self._check_slot_time(claim.slot, now_ms, self._clock)
                except BackendError as exc:
                    outcomes.append(exc)
                    continue
                outcomes.append(await self._decide(conn, claim, params | {"now": now_ms}))
            return outcomes

        action = f"claim {len(claims)} slots"
        return await self._run(action, decide_all, timeout=timeout, transaction=True)

    def _refused(self, exc: BackendError, claims: Sequence[Claim]) -> bool:
        return isinstance(exc.__cause__, sqlite3.Error)

    def _claim_params(self, claim: Claim, instance_id: str) -> dict[str, Any]:
        return {
            "job": claim.slot.job,
            "slot_ms": claim.slot.slot_ms,
            "ttl_ms": self._ttl_ms,
            "allow": claim.policy.overlap == "allow",
            "token": new_token(),
            "run_id": claim.run_id,
            "instance_id": instance_id,
            "reason": claim.reason,
            "started_us": datetime_to_us(self._now()),
            "no_slot": NO_SLOT,
        }

    async def _decide(
        self, conn: aiosqlite.Connection, claim: Claim, params: dict[str, Any]
    ) -> Granted:
        """Grant or refuse one claim, inside the caller's transaction."""
        grant = {"catch-up": self._sql.grant_catch_up, "manual": self._sql.grant_manual}.get(
            claim.reason, self._sql.grant
        )
        slot = claim.slot
        rows = list(await conn.execute_fetchall(grant, params))
        if rows:
            await conn.execute(self._sql.insert_lease, {**params, "expires_ms": rows[0][0]})
            return Lease(slot.job, slot.slot_ms, params["token"], claim.run_id, 1, claim.reason)
        state = list(await conn.execute_fetchall(self._sql.job_state, params))
        return refusal(
            claim.reason, slot.slot_ms, _job_state(state[0]) if state else None, claim.policy
        )

    async def renew(self, lease: Lease) -> bool:
        params = _lease_params(lease) | {"ttl_ms": self._ttl_ms}

        async def renew(conn: aiosqlite.Connection) -> bool:
            # Read before the statement waits for the write lock: the new expiry can only be
            # earlier than the statement's time, never later than the runner counts on, and a
            # take-over, under the write lock, reads its own.
            now = {"now": self._store_now_ms()}
            return bool(await conn.execute_fetchall(self._sql.renew, params | now))

        # Within a third of the ttl, not busy_timeout + 5 s (see _renew_timeout): a renewal
        # waiting that long for another process's write lock would outlive the lease.
        return await self._run("renew " + lease.slot.key, renew, timeout=self._renew_timeout)

    async def _end_lease(self, lease: Lease, handover: bool, record: Ending) -> None:
        end = self._sql.hand_over if handover else self._sql.delete_lease

        async def release(conn: aiosqlite.Connection) -> None:
            await self._end(conn, lease, end, record)

        # Within a third of the ttl (see _renew_timeout): a stuck release gives way to the
        # runner's next try, in time to land before the lease expires.
        await self._run(
            "release " + lease.slot.key, release, timeout=self._renew_timeout, transaction=True
        )

    async def _release_all(self, ends: list[tuple[Lease, Ending]]) -> None:
        async def release(conn: aiosqlite.Connection) -> None:
            for lease, record in ends:
                await self._end(conn, lease, self._sql.delete_lease, record)

        action = f"release {len(ends)} leases"
        await self._run(action, release, timeout=self._renew_timeout, transaction=True)

    async def _end(
        self,
        conn: aiosqlite.Connection,
        lease: Lease,
        end: str,
        record: Ending,
    ) -> None:
        """End ``lease`` (``end``: delete or hand over), inside the caller's transaction, and
        write ``record`` if that took effect (the lease was still this token's)."""
        params = _lease_params(lease) | {"now": self._store_now_ms()}
        await conn.execute(self._sql.end_grant, params)
        ended = await conn.execute(end, params)
        if record is not None and ended.rowcount:
            await self._append(conn, *record)

    async def take_over(self, policies: Sequence[JobPolicy], *, instance_id: str) -> list[Lease]:
        """In one transaction, each job with a dead lease: its row read, the lease protocol's
        take-over (``_lease.decide``), what changed written back with the dead attempts'
        records."""
        by_job = {policy.name: policy for policy in policies}
        params = {"jobs": json.dumps(list(by_job))}

        async def find(conn: aiosqlite.Connection) -> list[str]:
            now = {"now": self._store_now_ms()}
            dead = await conn.execute_fetchall(self._sql.dead_jobs, params | now)
            return [job for (job,) in dead]

        async def take(conn: aiosqlite.Connection) -> list[Lease]:
            leases: list[Lease] = []
            for job in await find(conn):
                leases += await self._take_over_row(conn, by_job[job], instance_id)
            return leases

        # Every instance sweeps often and almost always finds nothing: look before taking the
        # write lock (and look again under it).
        if not by_job or not await self._run("look for dead runners", find):
            return []
        return await self._run("take over slots", take, transaction=True)

    async def _take_over_row(
        self, conn: aiosqlite.Connection, policy: JobPolicy, instance_id: str
    ) -> list[Lease]:
        """``take_over()`` of one job's row, inside the caller's transaction."""
        key = {"job": policy.name}
        now_ms = self._store_now_ms()
        stored, manual_fence = next(iter(await conn.execute_fetchall(self._sql.job_row, key)))
        leases = {
            row[0]: _lease_row(row)
            for row in await conn.execute_fetchall(self._sql.job_leases, key)
        }
        row = JobRow(fence(stored), manual_fence, leases)
        started = self._now()
        request = TakeOver(policy, instance_id, datetime_to_ms(started))
        after, taken = decide(policy.name, row, request, self._store(now_ms))
        assert isinstance(taken, TakenOver)
        for record in taken.records:
            await self._append(conn, policy, record)
        for slot_ms in row.leases.keys() - after.leases.keys():
            await conn.execute(self._sql.drop_lease, key | {"slot_ms": slot_ms})
            ended = key | {"slot_ms": slot_ms, "no_slot": NO_SLOT}
            await conn.execute(self._sql.drop_grant, ended)
        for lease in taken.leases:
            expires_ms = after.leases[lease.slot_ms].expires_ms
            await conn.execute(
                self._sql.retry,
                key | {
                    "slot_ms": lease.slot_ms, "token": lease.token, "run_id": lease.run_id,
                    "instance_id": instance_id, "attempt": lease.attempt,
                    "started_us": datetime_to_us(started), "expires_ms": expires_ms,
                },
            )  # fmt: skip
        if taken.leases:
            latest = max(taken.leases, key=lambda lease: lease.slot_ms)
            expires_ms = after.leases[latest.slot_ms].expires_ms
            grant = key | {"slot_ms": latest.slot_ms, "expires_ms": expires_ms}
            await conn.execute(self._sql.retry_grant, grant)
        return taken.leases

    async def lease_state(self, job: str) -> LeaseState:
        key = {"job": job}

        async def read(conn: aiosqlite.Connection) -> LeaseState:
            fences = list(await conn.execute_fetchall(self._sql.job_row, key))
            leases = await conn.execute_fetchall(self._sql.job_leases, key)
            stored, manual_fence = fences[0] if fences else (None, None)
            slots = frozenset(r[0] for r in leases)
            return LeaseState(fence(stored), manual_fence, slots, self._store_now_ms())

        return await self._run(f"read the leases of {job}", read)


def _lease_row(row: Sequence[Any]) -> LeaseRow:
    """A row of ``_JOB_LEASES``."""
    _, token, run_id, instance_id, reason, attempt, state, started_us, expires_ms = row
    started_ms = started_us // 1000
    return LeaseRow(token, run_id, instance_id, reason, attempt, state, started_ms, expires_ms)


def _job_state(row: Sequence[Any]) -> JobState:
    """A row of ``_JOB_STATE``."""
    stored, manual_fence, live, taken = row
    return JobState(fence(stored), manual_fence, bool(live), bool(taken))


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"job": lease.job, "slot_ms": lease.slot_ms, "token": lease.token, "no_slot": NO_SLOT}

"""The fleet's presence as it is shown (``Scheduler.instances()``, ``runs_in_progress()``, the
admin API, ``brokersched instances``): without the runs that are over.

An instance publishes its runs in progress with every heartbeat. One that stops beating
(killed, frozen) keeps listing the runs of its last record until the record is forgotten
(``FORGET``, 10 minutes), long after another instance took their slots over and recorded them
``interrupted``. So the runs of an instance that is not alive are checked against the backend:
a run recorded in its job's history, or (lease backends) whose slot holds no lease any more,
is over and left out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from ._fleetrecords import Instance, RunInProgress
from .abc import Backend, JobPolicy, LeaseBackend

__all__ = ["without_ended_runs"]

logger = logging.getLogger("brokersched")

#: The newest records of a job searched for a run that is over: its ``interrupted`` record is
#: written at the take-over, and (overlap="skip") the job ran little since, a restart at most.
_RECORDS_READ = 50


@dataclass(frozen=True, slots=True)
class _Ended:
    """What the backend says of one job's runs: the run ids recorded (over), and (lease
    backends) the slots that still hold a lease (``None``: not a lease backend)."""

    recorded: frozenset[str]
    leased: frozenset[int] | None


async def without_ended_runs(
    instances: Sequence[Instance],
    now: datetime,
    backend: Backend,
    policies: Mapping[str, JobPolicy],
) -> list[Instance]:
    """``instances`` with the runs that are over left out of the records of those not alive
    (``liveness(now)``). ``policies``: the jobs known here, by name; a run of another job, or
    of a job whose reads fail, stays listed as its instance published it."""
    silent = {
        run.job
        for instance in instances
        if instance.liveness(now) != "alive"
        for run in instance.running
        if run.job in policies
    }
    if not silent:
        return list(instances)
    names = sorted(silent)
    reads = await asyncio.gather(*(_ended(backend, policies[name]) for name in names))
    ended = dict(zip(names, reads, strict=True))
    return [
        _left_out(instance, ended) if instance.liveness(now) != "alive" else instance
        for instance in instances
    ]


def _left_out(instance: Instance, ended: Mapping[str, _Ended | None]) -> Instance:
    running = tuple(run for run in instance.running if not _over(run, ended.get(run.job)))
    return instance if running == instance.running else replace(instance, running=running)


def _over(run: RunInProgress, ended: _Ended | None) -> bool:
    """Recorded, or its lease is gone. A boot run's lease is not at its slot under the job's
    key (``_boot``): only its record tells."""
    if ended is None:
        return False
    if run.run_id in ended.recorded:
        return True
    if not run.leased or ended.leased is None or run.reason == "start":
        return False
    return run.slot_ms not in ended.leased


async def _ended(backend: Backend, policy: JobPolicy) -> _Ended | None:
    """The job's recent records and leased slots (``None``: they could not be read)."""
    try:
        records = await backend.history(policy, _RECORDS_READ)
        leased = None
        if isinstance(backend, LeaseBackend):
            leased = (await backend.lease_state(policy.name)).leased
    except Exception as exc:  # the presence is still worth showing, as published
        logger.debug("cannot tell which runs of %s are over: %s", policy.name, exc)
        return None
    return _Ended(frozenset(record.run_id for record in records), leased)

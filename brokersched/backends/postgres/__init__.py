"""The PostgreSQL lease backend: a fleet of instances sharing one database.

Each decision is one statement, so a race is settled by PostgreSQL's row locks, never by a
read-then-write in the client:

* a claim is an ``INSERT ... ON CONFLICT (job) DO UPDATE ... WHERE <fence and overlap>`` on the
  job's row, chained (in a CTE) to the insert of the slot's lease. N claimers inserting a job
  row that does not exist yet collide on its primary key; all but one then take the
  ``DO UPDATE`` path, which re-reads the row as committed by the winner and is refused.
* a take-over locks the dead lease rows ``FOR UPDATE SKIP LOCKED`` and re-grants through the
  job's row, so each slot goes to exactly one taker and a claim of a newer slot cannot slip in.

Expiry is judged on ``clock_timestamp()`` (the time when the row is examined, after any lock
wait; ``now()`` is frozen at the transaction's start), never on an instance's clock; so is a
slot's time: a claim for a slot further ahead of ``clock_timestamp()`` than ``max_clock_skew`` is
refused (a fast instance would otherwise fence the job's slots for the whole fleet), and a
take-over restarts a slot only within the job's retry window.

Every call is bounded on the client (a claim by its caller's timeout, a renewal and a release by
a third of ``lease_ttl``), whatever the server's ``statement_timeout`` or ``lock_timeout``: a

Modules: ``_backend`` (``PostgresBackend``: its configuration, its life, the schema's creation
and upgrades, error translation), ``_connection`` (the pool and the bounded call every part
makes on it), ``_statements`` (the SQL of every decision, for one schema), ``_leases``
(claims, renewals, releases, take-overs), ``_history`` (the run records), ``_fleet`` (the
fleet's presence and controls), ``_ops`` (``brokersched purge`` and ``doctor``), ``_budget``
(the server's connections against ``max_connections``).
"""

from __future__ import annotations

from ._backend import PostgresBackend

__all__ = ["PostgresBackend"]

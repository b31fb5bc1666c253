"""The SQLite lease backend: several processes on one host sharing one database file.

Every write that decides something runs in a ``BEGIN IMMEDIATE`` transaction, which takes
SQLite's single write lock before reading: claims, hand-overs and take-overs are serialised
across processes, and a deferred transaction's "read, then fail to upgrade" (``SQLITE_BUSY``
that ``busy_timeout`` cannot wait out) never happens.

The store's clock is the host's (``_store_now_ms``): the kernel's ``CLOCK_REALTIME``, read by a
direct system call under the write lock (after ``BEGIN IMMEDIATE``; a lone statement reads it
just before it runs), and passed to the statements as ``:now``. Every process sharing the file
runs on this host and reads that one clock, even a process whose C library's time is faked
(libfaketime): SQLite's own ``julianday('now')`` reads the calling process's time, so a process
40 s fast would be judged on its own clock and claim slots 40 s ahead for the whole fleet.
Lease expiry and the time check of a claimed slot (``max_clock_skew``) are judged on it;
history times come from the scheduler's clock (as in every backend).

``busy_timeout`` (how long a statement waits for another process's write lock) must fit in a
third of ``lease_ttl``: a release or renewal waiting longer could land after the lease expired,
when another process has already restarted the slot. A transaction refused the lock after
``busy_timeout`` asks again until its call's own bound (a claim's timeout, a third of
``lease_ttl`` for a release).

The database runs in WAL mode with ``synchronous=NORMAL``: durable against a crashed or killed
process, which is what leases guard against; a power cut may lose the last commits.

Modules: ``_backend`` (``SQLiteBackend``: its configuration, its life, the tables' creation
and upgrades, error translation), ``_connection`` (the one connection, its lock and the
transactions every part runs on it), ``_statements`` (the SQL of every decision, for one
table prefix), ``_leases`` (claims, renewals, releases, take-overs), ``_history`` (the run
records), ``_fleet`` (the fleet's presence and controls), ``_ops`` (``brokersched purge`` and
``doctor``).
"""

from __future__ import annotations

from ._backend import SQLiteBackend

__all__ = ["SQLiteBackend"]

"""Django: ``pip install 'brokersched[django]'``.

Add ``"brokersched.contrib.django"`` to ``INSTALLED_APPS`` and name the scheduler in the
settings, as the CLI names it::

    BROKERSCHED_SCHEDULER = "reports.jobs:scheduler"

then ``python manage.py brokersched run|jobs|check|trigger JOB|history JOB``: the ``brokersched``
CLI, after ``django.setup()``, so a jobs module may import models at its top. Give the scheduler
``around_run=db_connections``: every sync handler (the ORM is sync) then runs between two
``close_old_connections()`` calls in its own worker thread, as a Django request does, so a
connection the database closed (a restart, a failover, ``pg_terminate_backend``) or one past
``CONN_MAX_AGE`` is replaced instead of failing every later run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import close_old_connections

from ..._context import JobContext

__all__ = ["db_connections"]


@contextmanager
def db_connections(ctx: JobContext) -> Iterator[None]:
    """``Scheduler(around_run=db_connections)``: ``close_old_connections()`` before and after
    each sync run. Async handlers are left alone: the ORM does not run on the event loop (its
    ``a*`` methods run in threads of their own, whose connections Django manages)."""
    sync = _in_worker_thread()
    if sync:
        close_old_connections()
    try:
        yield
    finally:
        if sync:
            close_old_connections()


def _in_worker_thread() -> bool:
    """True in a sync handler's worker thread: no event loop runs there."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False

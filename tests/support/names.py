"""The names tests give what they make on the servers: ``unique()``.

Every queue, stream, key prefix, schema and table prefix a test makes starts with ``bst``
(brokersched test) and this run's tag, so the end-of-run check (``tests/support/leftovers.py``)
finds exactly what this run left behind, never another run's objects nor anything else on a
shared server. The tag comes from ``BROKERSCHED_TEST_RUN`` when set (the processes a test
starts inherit it), else it is drawn once per pytest process.
"""

from __future__ import annotations

import os
import secrets

TEST_PREFIX = "bst"
RUN_ENV = "BROKERSCHED_TEST_RUN"
RUN = os.environ.setdefault(RUN_ENV, secrets.token_hex(3))
RUN_PREFIX = f"{TEST_PREFIX}{RUN}"


def unique(stem: str = "t") -> str:
    """A new name of this run: letters, digits and ``_``, valid as a RabbitMQ, NATS or Redis
    prefix, a PostgreSQL schema and a SQLite table prefix (``stem`` says what it is for)."""
    return f"{RUN_PREFIX}{stem}{secrets.token_hex(4)}"

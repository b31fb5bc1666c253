"""RabbitMQ: a claim-only backend on the broker the application already has.

Every slot is claimed through a queue of its own that takes one message: the first claim's
publish is acked (won), every later one nacked (lost), for as long as the fleet's slot memory.

Modules: the layout every backend package shares (``docs/contributing.md``); RabbitMQ's own:
``_slotmemory`` (the fleet's slot memory: its record, lock and fences), ``_names`` (queue and
exchange names), ``_errors`` (URLs and client errors), ``_files`` (what spends a node's open
files, by its version).
"""

from __future__ import annotations

from ._backend import RabbitMQBackend
from ._claims import claim_margin_ms
from ._fleet import fleet_lock_name, fleet_queue_name
from ._names import (
    claim_queue_name,
    fence_exchange_name,
    history_queue_name,
    history_stream_name,
    lock_queue_name,
    record_queue_name,
)

__all__ = [
    "RabbitMQBackend",
    "claim_margin_ms",
    "claim_queue_name",
    "fence_exchange_name",
    "fleet_lock_name",
    "fleet_queue_name",
    "history_queue_name",
    "history_stream_name",
    "lock_queue_name",
    "record_queue_name",
]

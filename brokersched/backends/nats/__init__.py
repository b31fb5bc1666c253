"""NATS JetStream claim backend.

Claims: one file-storage stream (``<prefix>-claims``, subjects ``<prefix>.claim.>``) whose
``duplicate_window`` and ``max_age`` are ``slot_ttl``. A claim publishes a small JSON body with
the header ``Nats-Msg-Id: <job>:<slot_ms>``; JetStream stores the first message with that id and
acknowledges every later one with ``duplicate: true``. Not a duplicate: this claim won.

Ambiguous claims. A publish whose ack never arrives (timeout, connection cut, nats-py replaying
its buffer after a reconnect) may still have been stored. Retrying blindly would read our own
stored message as someone else's (a false loss: the slot runs nowhere). So a claim retries with
the same message id until its deadline, and when a *retry* comes back as a duplicate it reads the
stored message by the ack's sequence and compares the claim token in its body (unique to each
``claim()`` call) with its own. Only a definite answer is returned; anything else raises
``BackendError``. A claim never publishes while disconnected: it waits for the connection (until
its deadline) rather than let nats-py buffer a message that could be stored after we gave up.

History: one file-storage stream (``<prefix>-history``, a subject per job) whose
``max_msgs_per_subject`` is the largest ``history_size`` of the jobs seen (NATS keeps one size
for all jobs); reads are trimmed to each job's own size.

Streams are created when missing and updated when a setting must grow (the claims stream's
duplicate_window and max_age grow to the longest ``slot_ttl`` that starts, never shrink); they
are never deleted or recreated (that would forget claimed slots and allow double runs). An
existing stream that cannot work fails ``start()`` with a ``ConfigurationError`` that names each
setting, its value and how to fix it (see ``_streams``).

Modules: the layout every backend package shares (``docs/contributing.md``), ``_leases``
holding ``NATSLeaseBackend`` (on a KV bucket); NATS's own: ``_errors`` (URLs, secrets, errors),
``_streams`` and ``_stream_settings`` (stream set-up and checks), ``_names`` (stream and subject
names), ``_rows`` and ``_bucket`` (the lease rows and their bucket), ``_link`` (``KVLink``, what
``NATSLeaseBackend`` asks of its bucket: the simulator's model implements it too).
"""

from __future__ import annotations

from ._backend import NATSBackend
from ._errors import redact
from ._leases import NATSLeaseBackend
from ._names import subject_token

__all__ = ["NATSBackend", "NATSLeaseBackend", "redact", "subject_token"]

"""``Recorder``: a scheduler's run records, written to the backend in the background, in order.

Recording a run never holds up the next one: a backend that is away (a broker restarting, a
network partition) would otherwise keep each run busy for as long as the write takes to fail,
and a ``claim=False`` job would skip its next slots as ``overlap``. Records wait in a bounded
buffer (``record_buffer``) while the backend is away; beyond it they are dropped, each one
counted and logged. ``stop()`` writes what it can within ``drain_timeout``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque

from ._clock import Clock
from ._events import Events, RecordDroppedEvent
from ._exceptions import BackendError
from .abc import Backend, JobPolicy, RunRecord

__all__ = ["Recorder"]

logger = logging.getLogger("brokersched")

_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 5.0)  # then every 5 s while the backend stays away
#: The most records one write takes (``Backend.record_many``).
_BATCH = 64


class Recorder:
    """The run records of one scheduler on their way to its backend."""

    def __init__(self, clock: Clock, backend: Backend, size: int, events: Events) -> None:
        self._clock = clock
        self._events = events
        self._backend = backend
        self.size = size
        self._queue: deque[tuple[JobPolicy, RunRecord]] = deque()
        self._writer: asyncio.Task[None] | None = None
        # Only a backend that writes a batch in one round trip gets records together.
        batches = type(backend).record_many is not Backend.record_many
        self._most = _BATCH if batches else 1
        self._batch = self._most
        self.dropped = 0  # records never written, since this scheduler was made

    @property
    def pending(self) -> int:
        """Records waiting to be written."""
        return len(self._queue)

    def put(self, policy: JobPolicy, record: RunRecord) -> None:
        """Queue ``record``; drop it (counted, logged) when ``size`` records wait already."""
        if len(self._queue) >= self.size:
            self._drop(record, f"{len(self._queue)} records wait already (record_buffer)")
            return
        self._queue.append((policy, record))
        if self._writer is None or self._writer.done():
            # Not a task of the scheduler's TaskSet: stop() flushes it itself, after the drain.
            loop = asyncio.get_running_loop()
            self._writer = loop.create_task(self._write(), name="brokersched:record")

    def _drop(self, record: RunRecord, why: str) -> None:
        self.dropped += 1
        logger.warning(
            "run record dropped: job=%s run_id=%s outcome=%s; backend %s is not answering and "
            "%s; %d dropped so far",
            record.job,
            record.run_id,
            record.outcome,
            self._backend.name,
            why,
            self.dropped,
            extra={"event": "record-dropped", "job": record.job, "dropped": self.dropped},
        )
        event = RecordDroppedEvent(
            record.job, record.slot_ms, record.run_id, record.outcome, self.dropped
        )
        self._events.emit("record-dropped", event)

    async def _write(self) -> None:
        delays = itertools.chain(_RETRY_DELAYS_S, itertools.repeat(_RETRY_DELAYS_S[-1]))
        failing = False
        while self._queue:
            # The records that queued while the last write was going, in one write where the
            # backend can (one statement or transaction: all or none); else one at a time.
            count = min(len(self._queue), self._batch)
            batch = [self._queue[n] for n in range(count)]
            try:
                if count == 1:
                    await self._backend.record(*batch[0])
                else:
                    await self._backend.record_many(batch)
            except BackendError as exc:
                if not failing:
                    logger.warning(
                        "cannot record runs on %s (%s): retrying; %d record(s) wait",
                        self._backend.name,
                        exc,
                        len(self._queue),
                    )
                failing = True
                await self._clock.sleep(next(delays))
                continue
            except Exception:  # not an outage: one of these records would never be written
                if count > 1:
                    self._batch = 1  # write them one by one: the bad one alone is lost
                    continue
                _, record = batch[0]
                logger.exception("could not record run %s of %s", record.run_id, record.job)
            else:
                if failing:
                    logger.info("recording runs on %s again", self._backend.name)
                    failing = False
                    delays = itertools.chain(_RETRY_DELAYS_S, itertools.repeat(5.0))
            for _ in range(count):
                self._queue.popleft()
            self._batch = self._most

    async def wait_written(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s`` seconds on the scheduler's clock, until the records
        queued so far are written (``job.history()`` then shows the runs that have finished)."""
        writer = self._writer
        if writer is not None and not writer.done():
            await self._clock.wait({writer}, timeout_s)

    async def flush(self, timeout_s: float) -> None:
        """Write what can be written within ``timeout_s`` (on the scheduler's clock); the
        records still waiting then are dropped, counted and logged."""
        writer = self._writer
        if writer is not None and not writer.done():
            await self._clock.wait({writer}, timeout_s)
            if not writer.done():
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
        for _, record in self._queue:
            self._drop(record, f"stop() could not write it within {timeout_s:g}s")
        self._queue.clear()
        self._writer = None

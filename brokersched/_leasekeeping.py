"""A run's lease, kept while its handler runs (``Renewer``) and ended after (``ReleaseRetries``),
both by one rule: a lease is counted on only until ``valid_ms`` after the request that granted
or extended it was *sent* (the store set its expiry later than that, never earlier)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import timedelta

from ._clock import Clock, Timer
from ._durations import format_duration, to_ms
from ._job import Run
from ._tasks import TaskSet
from .abc import Backend, Lease, LeaseBackend

__all__ = ["ReleaseRetries", "Renewer", "release_attempt_s", "release_delays", "valid_ms"]

logger = logging.getLogger("brokersched")

# A failed release is retried after _RELEASE_RETRY_S, doubling, up to a tenth of lease_ttl
# within these bounds (see release_delays).
_RELEASE_RETRY_S = 0.2
_RELEASE_ATTEMPT_S = 1.0  # one release attempt is waited for at most this long
_RELEASE_RETRY_MIN_S = 0.01
_RELEASE_RETRY_MAX_S = 1.0


class Renewer:
    """Keeps a run's lease: renews it every ``lease_ttl / 3`` until the run is released.

    A renewal that fails or is refused aborts the run (``lock-lost``). So does silence: the lease
    is known to be valid only until ``lease_ttl`` after the last renewal that succeeded was *sent*
    (the database extended it later than that), so the run is aborted shortly before then even if
    the backend never answers, before another instance could take the slot over.

    Once the handler has finished, ``Runner.release`` stops it: from then on the lease only
    needs to end, and the release is retried on its own terms.
    """

    def __init__(
        self,
        clock: Clock,
        backend: Backend,
        tasks: TaskSet,
        run: Run,
        leased_ms: int,
        lose: Callable[[], None],
    ) -> None:
        assert isinstance(backend, LeaseBackend)
        assert run.lease is not None
        self._clock = clock
        self._backend = backend
        self._tasks = tasks
        self._abort = lose  # the run is told its lease is lost (``lock-lost``)
        self._run = run
        self._lease = run.lease
        self._ttl_ms = to_ms(backend.lease_ttl)
        self._period_ms = max(self._ttl_ms // 3, 10)
        self._valid_ms = valid_ms(self._ttl_ms)
        self.lost = False
        self._cancelled = False  # released, or given up by stop()
        self._deadline: Timer | None = None
        self._schedule(leased_ms)

    def _schedule(self, valid_from_ms: int) -> None:
        """The next renewal, for a lease known valid from ``valid_from_ms``: a period after
        that, not after its answer came, so a lease answered late is renewed at once, before
        the deadline its lateness brought near. The deadline is armed only when it would come
        before that renewal, else when the renewal is sent: most runs end before their first
        renewal, and a timer per run that never fires costs the event loop."""
        self._valid_from_ms = valid_from_ms
        now = self._clock.monotonic_ms()
        due_ms = max(valid_from_ms + self._period_ms, now)
        self._timer = self._clock.call_later(due_ms - now, self._due)
        if valid_from_ms + self._valid_ms <= due_ms:
            self._deadline = self._lose_at(valid_from_ms)

    def _due(self) -> None:
        if not self._cancelled:
            if self._deadline is None:
                self._deadline = self._lose_at(self._valid_from_ms)
            name = f"renew:{self._lease.slot.key}"
            self._tasks.spawn(self._renew(), name=name, drained=False)

    async def _renew(self) -> None:
        sent_ms = self._clock.monotonic_ms()
        try:
            ok = await self._backend.renew(self._lease)
        except Exception as exc:
            logger.warning("lease renewal of %s failed: %s", self._lease.slot.key, exc)
            ok = False
        if self._cancelled or self.lost:
            return
        if not ok:
            self._lose()
            return
        self._deadline = self._cancel(self._deadline)
        self._schedule(sent_ms)

    @staticmethod
    def _cancel(timer: Timer | None) -> None:
        if timer is not None:
            timer.cancel()

    def _lose_at(self, sent_ms: int) -> Timer:
        """Abort shortly before the lease granted by a request sent at ``sent_ms`` (monotonic)
        can have expired in the store (``valid_ms``)."""
        due = sent_ms + self._valid_ms
        return self._clock.call_later(due - self._clock.monotonic_ms(), self._lose)

    def _lose(self) -> None:
        if self._cancelled or self.lost:
            return
        self.lost = True
        self._timer.cancel()
        self._deadline = self._cancel(self._deadline)
        self._abort()

    @property
    def expires_ms(self) -> int:
        """The earliest the lease can have expired in the store (monotonic): ``lease_ttl``
        after the request that last extended it was sent."""
        return self._valid_from_ms + self._ttl_ms

    def cancel(self) -> None:
        self._cancelled = True
        self._timer.cancel()
        self._deadline = self._cancel(self._deadline)


class ReleaseRetries:
    """The retries of one lease's release: when to try again, when to give up, and the log
    lines (one warning at the first failure, one error if it never lands)."""

    def __init__(
        self, clock: Clock, lease: Lease, handover: bool, ttl_ms: int, expires_ms: int
    ) -> None:
        self._clock = clock
        self._lease = lease
        self._handover = handover
        self._began_ms = clock.monotonic_ms()
        self._expires_ms = expires_ms
        # One lease_ttl past the expiry: the fleet has swept for dead runners twice by then.
        self._give_up_ms = expires_ms + ttl_ms
        self._delays = release_delays(ttl_ms)
        self._last: Exception | None = None
        self.tries = 0  # failed so far

    async def wait_after(self, error: Exception) -> bool:
        """Note a failed try and wait before the next; ``False``: give up now."""
        self.tries, self._last = self.tries + 1, error
        key = self._lease.slot.key
        left_ms = self._give_up_ms - self._clock.monotonic_ms()
        if left_ms <= 0:
            self._lost("gave up")
            return False
        if self.tries == 1:
            left = format_duration(timedelta(milliseconds=left_ms))
            logger.warning("release of %s failed (%s); retrying for up to %s", key, error, left)
        else:
            logger.debug("release of %s failed again: %s", key, error)
        await self._clock.sleep(min(next(self._delays), left_ms / 1000))
        return True

    def landed(self) -> None:
        if not self.tries:
            return
        key, now_ms = self._lease.slot.key, self._clock.monotonic_ms()
        took = format_duration(timedelta(milliseconds=now_ms - self._began_ms))
        if now_ms < self._expires_ms:
            logger.info("released the lease of %s after %d tries (%s)", key, self.tries, took)
            return
        logger.warning(
            "released the lease of %s after %d tries (%s), after the lease may have expired: "
            "if another instance took the slot over meanwhile, it runs it again",
            key,
            self.tries,
            took,
        )

    def stopped(self) -> None:
        """Cancelled (the stop's grace ran out): said only if a try had failed."""
        if self._last is not None:
            self._lost("the scheduler stopped before it landed")

    def _lost(self, why: str) -> None:
        lease = self._lease
        then = (
            "it is taken over once its lease expires, counted as a new attempt"
            if self._handover
            else "once its lease expires another instance may take the slot over and run it "
            f"again (attempt {lease.attempt + 1}), though this run has ended"
        )
        logger.error(
            "could not release the lease of %s (%d tries, %s; last error: %s): %s",
            lease.slot.key,
            self.tries,
            why,
            self._last,
            then,
        )


def valid_ms(ttl_ms: int) -> int:
    """How long a lease is counted on after the request that granted or extended it was sent
    (monotonic): ``lease_ttl`` (the store set its expiry on receiving the request, so never
    earlier than that), less a tenth of it (at least 5 ms) for the clocks' drift and for an
    abort to reach the handler before another instance can take the slot over."""
    return ttl_ms - max(ttl_ms // 10, 5)


def release_attempt_s(ttl_ms: int) -> float:
    """How long one release attempt is waited for: a second, or a third of lease_ttl if less
    (the backends bound a release to that themselves)."""
    return min(_RELEASE_ATTEMPT_S, max(ttl_ms / 3000, _RELEASE_RETRY_S))


def release_delays(ttl_ms: int) -> Iterator[float]:
    """The pauses between a failed release's tries: 0.2 s, then twice as long each time, up
    to a tenth of ``lease_ttl`` (at most 1 s), so that a release lands within that of the
    store coming back, well before the fleet's next sweep (every ``lease_ttl / 2``)."""
    cap = min(_RELEASE_RETRY_MAX_S, max(ttl_ms / 10_000, _RELEASE_RETRY_MIN_S))
    delay = min(_RELEASE_RETRY_S, cap)
    while True:
        yield delay
        delay = min(delay * 2, cap)

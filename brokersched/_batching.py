"""What the runner sends to the backend in batches: the claims of the slots due at one instant
(``ClaimBatches``), the leases ended within one turn of the event loop (``ReleaseBatches``), and
the preparation of the next slots' claims after a win (``ClaimPrepares``). Each is used only
with a backend that has its own batch method (one round trip for many); with any other the
runner sends each call on its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from ._clock import Clock
from ._exceptions import BackendError
from ._job import JobState
from ._tasks import TaskSet
from .abc import Backend, Claim, ClaimBackend, JobPolicy, Lease, LeaseBackend, RunRecord, Slot

__all__ = ["ClaimBatches", "ClaimOne", "ClaimPrepares", "Ending", "ReleaseBatches"]

logger = logging.getLogger("brokersched")

# The winner of a job's slot prepares the claims of its next slot this long before it (a
# backend that creates something for a slot's first claim then creates it ahead of the instant).
_PREPARE_AHEAD_MS = 500
# A run's record, written with its lease's release (``LeaseBackend.release``), if any.
Ending = tuple[JobPolicy, RunRecord] | None
#: One claim sent on its own: a lease (lease backends), ``None`` (a won claim), or the skip reason.
ClaimOne = Callable[[Claim, float], Coroutine[Any, Any, Lease | str | None]]


def _overrides(backend: Backend, base: type, method: str) -> bool:
    """Whether ``backend`` is a ``base`` whose class has its own ``method`` (a batch method, a
    hook): the runner uses it only then."""
    return isinstance(backend, base) and getattr(type(backend), method) is not getattr(base, method)


_Answer = Lease | str | None | Exception
_Waiting = tuple[Claim, float, "asyncio.Future[Lease | str | None]"]


class ClaimBatches:
    """Scheduled claims made within one turn of the event loop (the slots of several jobs due
    at one instant) go to the backend together, as one ``acquire_many``/``claim_many``.

    Each claim keeps its own outcome and its own error; a claimer that stopped waiting (its
    timeout, a stop) is answered nothing, and a lease granted to it is handed over at once.
    """

    def __init__(
        self,
        backend: Backend,
        clock: Clock,
        tasks: TaskSet,
        instance_id: str,
        claim_one: ClaimOne,
        hand_over: Callable[[Lease], Coroutine[Any, Any, None]],
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._tasks = tasks
        self._instance_id = instance_id
        self._claim_one = claim_one  # a batch of one is a claim of one
        self._hand_over = hand_over  # a lease granted to a claimer that stopped waiting
        #: Only a backend that claims a batch in fewer round trips than its claims gets them
        #: batched; with any other, each slot's task claims its slot (as concurrently).
        self.enabled = _overrides(backend, LeaseBackend, "acquire_many") or _overrides(
            backend, ClaimBackend, "claim_many"
        )
        self._waiting: list[_Waiting] = []
        self._sending = False

    async def claim(self, claim: Claim, timeout: float) -> Lease | str | None:
        """The claim's answer; the batch leaves at the end of this turn of the loop, with every
        claim made in it (the scheduler fires slots due within a moment of each other in one
        turn: see ``Timers._on_timer``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Lease | str | None] = loop.create_future()
        self._waiting.append((claim, timeout, future))
        if not self._sending:
            self._sending = True
            loop.call_soon(self._send)
        with self._clock.blocking():  # a virtual clock: the batch's answer wakes it
            return await future

    def _send(self) -> None:
        """Send what waits, one claim per job (a job's later slot goes in the next batch)."""
        self._sending = False
        batch: dict[str, _Waiting] = {}
        later = []
        for waiting in self._waiting:
            if waiting[2].done():
                continue  # the claimer stopped waiting before it was sent
            if waiting[0].slot.job in batch:
                later.append(waiting)
            else:
                batch[waiting[0].slot.job] = waiting
        self._waiting = later
        if later:
            self._sending = True
            asyncio.get_running_loop().call_soon(self._send)
        if batch:
            self._tasks.spawn(self._exchange(list(batch.values())), name="claim-batch")

    async def _exchange(self, batch: list[_Waiting]) -> None:
        claims = [claim for claim, _, _ in batch]
        timeout = min(timeout for _, timeout, _ in batch)
        try:
            answers = await self._ask(claims, timeout)
        except BaseException as exc:  # the whole batch failed (or this task was cancelled)
            for _, _, future in batch:
                self._answer(future, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), answer in zip(batch, answers, strict=True):
            self._answer(future, answer)

    async def _ask(self, claims: list[Claim], timeout: float) -> list[_Answer]:
        """Per claim: a lease, ``None`` (a won claim), the skip reason, or the claim's error."""
        backend, instance_id = self._backend, self._instance_id
        if len(claims) == 1:
            try:
                return [await self._claim_one(claims[0], timeout)]
            except Exception as exc:
                return [exc]
        answers: list[_Answer] = []
        if isinstance(backend, LeaseBackend):
            answers.extend(
                await backend.acquire_many(claims, instance_id=instance_id, timeout=timeout)
            )
        else:
            assert isinstance(backend, ClaimBackend)
            won = await backend.claim_many(claims, instance_id=instance_id, timeout=timeout)
            answers.extend(
                w if isinstance(w, Exception) else None if w else "not-acquired" for w in won
            )
        if len(answers) != len(claims):
            raise BackendError(f"{backend.name} answered {len(answers)} of {len(claims)} claims")
        return answers

    def _answer(
        self, future: asyncio.Future[Lease | str | None], answer: _Answer | BaseException
    ) -> None:
        if future.done():  # the claimer stopped waiting: a slot leased to it is handed over
            if isinstance(answer, Lease):
                name = f"handover:{answer.slot.key}"
                self._tasks.spawn(self._hand_over(answer), name=name)
            return
        if isinstance(answer, Exception):
            future.set_exception(answer)
        elif isinstance(answer, BaseException):
            future.cancel()  # the batch was cancelled: so is each claim
        else:
            future.set_result(answer)


class ClaimPrepares:
    """After a won claim, the claims of the job's next slot are prepared (``prepare_claims``)
    ``_PREPARE_AHEAD_MS`` before it, those of one moment together, in the background."""

    def __init__(
        self, backend: Backend, clock: Clock, tasks: TaskSet, stopping: Callable[[], bool]
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._tasks = tasks
        self._stopping = stopping  # the runner's drain has begun: nothing new is prepared
        self.enabled = _overrides(backend, ClaimBackend, "prepare_claims")
        self._due: dict[int, list[Slot]] = {}  # the slots to prepare, by when

    def after_win(self, job: JobState) -> None:
        armed_ms = job.arming.armed_ms
        if armed_ms is None:
            return  # no next slot (an at() job, paused, removed)
        slot = Slot(job.settings.key, armed_ms)
        when_ms = slot.slot_ms - _PREPARE_AHEAD_MS
        due = self._due.get(when_ms)
        if due is None:  # one timer per moment, whatever the number of its slots
            due = self._due[when_ms] = []
            delay_ms = when_ms - self._clock.now_ms()
            self._clock.call_later(max(delay_ms, 0), lambda: self._send(when_ms))
        due.append(slot)

    def _send(self, when_ms: int) -> None:
        slots = self._due.pop(when_ms, [])
        if slots and not self._stopping():
            name = "prepare-claims"
            self._tasks.spawn(self._prepare(slots), name=name, drained=False)

    async def _prepare(self, slots: list[Slot]) -> None:
        backend = self._backend
        assert isinstance(backend, ClaimBackend)
        try:
            await backend.prepare_claims(slots)
        except Exception as exc:  # only a head start was lost: the claims work without it
            logger.debug("could not prepare the claims of %d slots: %r", len(slots), exc)


class ReleaseBatches:
    """Leases ended within one turn of the event loop (the runs of one instant finish
    together) go to the backend together, as one ``release_many``; each gets its own answer,
    and ``Runner.release`` retries one that failed on its own."""

    def __init__(self, backend: Backend, clock: Clock, tasks: TaskSet) -> None:
        self._backend = backend
        self._clock = clock
        self._tasks = tasks
        self.enabled = _overrides(backend, LeaseBackend, "release_many")
        self._waiting: list[tuple[Lease, Ending, asyncio.Future[None]]] = []

    async def release(self, lease: Lease, record: Ending) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._send)
        self._waiting.append((lease, record, future))
        with self._clock.blocking():  # a virtual clock: the backend answers
            await future

    def _send(self) -> None:
        batch, self._waiting = self._waiting, []
        self._tasks.spawn(self._exchange(batch), name="release-batch")

    async def _exchange(self, batch: list[tuple[Lease, Ending, asyncio.Future[None]]]) -> None:
        backend = self._backend
        assert isinstance(backend, LeaseBackend)
        try:
            if len(batch) == 1:
                await backend.release(batch[0][0], record=batch[0][1])
                answers: list[Exception | None] = [None]
            else:
                leases, records = [lease for lease, _, _ in batch], [r for _, r, _ in batch]
                answers = await backend.release_many(leases, records)
        except BaseException as exc:  # the whole batch failed (or this task was cancelled)
            for _, _, future in batch:
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        if len(answers) != len(batch):
            error = BackendError(f"{backend.name} answered {len(answers)} of {len(batch)}")
            answers = [error for _ in batch]
        for (_, _, future), answer in zip(batch, answers, strict=True):
            if future.done():
                continue  # its run was cancelled meanwhile
            if answer is None:
                future.set_result(None)
            else:
                future.set_exception(answer)

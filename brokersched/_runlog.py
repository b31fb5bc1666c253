"""What a slot leaves behind on this instance: a skip's event and log line, a run's start
event, and a run's end (its record, queued for the history or handed to its lease's release;
its log line; its event). One voice for the runner, and for the boot runs and backfills that go
through it."""

from __future__ import annotations

import logging
from typing import Any

from ._clock import Clock, ms_to_datetime
from ._events import Events, RunEvent, SkipEvent, SkipReason, StartEvent
from ._job import JobState, Run
from ._recorder import Recorder
from ._redact import data_secrets
from ._results import run_result
from ._tracebacks import run_traceback
from .abc import Outcome, RunReason, RunRecord

__all__ = ["RunLog"]

logger = logging.getLogger("brokersched")


class RunLog:
    """The skips, starts and ends of one scheduler's runs: events for the listeners, a line each
    in the log, and the runs' records."""

    def __init__(
        self,
        clock: Clock,
        instance_id: str,
        events: Events,
        recorder: Recorder,
        *,
        record_results: bool = True,
    ) -> None:
        self.clock = clock
        self.instance_id = instance_id
        self.events = events
        self.recorder = recorder
        self.record_results = record_results  # Scheduler(record_results=...)
        self._not_json: set[str] = set()  # jobs whose value that is not JSON was logged

    def skip(
        self,
        job: JobState,
        slot_ms: int,
        reason: SkipReason,
        detail: str | None = None,
        *,
        run: RunReason = "schedule",
    ) -> None:
        """Log and emit a skip of a run for ``run`` (a slot, a boot run, a manual run...);
        ``not-acquired`` is at debug level (the fleet has the slot)."""
        level = logging.DEBUG if reason == "not-acquired" else logging.INFO
        if reason in ("backend-error", "clock-skew"):
            level = logging.WARNING
        if reason == "not-acquired":  # another instance has it: the fleet is handling the job
            job.last_ok_ms = max(job.last_ok_ms or slot_ms, slot_ms)
        self.events.emit("skip", SkipEvent(job.name, slot_ms, reason, detail, run))
        if not logger.isEnabledFor(level):
            return  # the common case on every instance that lost the claim: nothing to build
        late_ms = self.clock.now_ms() - slot_ms
        logger.log(
            level,
            "skip job=%s slot=%d reason=%s late_ms=%d instance_id=%s%s",
            job.name,
            slot_ms,
            reason,
            late_ms,
            self.instance_id,
            f" detail={detail}" if detail else "",
            extra={
                "event": "skip",
                "job": job.name,
                "slot": slot_ms,
                "reason": reason,
                "late_ms": late_ms,
                "instance_id": self.instance_id,
            },
        )

    def started(self, run: Run) -> None:
        """A run's attempt begins: its ``start`` event."""
        ctx = run.ctx
        self.events.emit(
            "start", StartEvent(run.job.name, ctx.slot_ms, ctx.run_id, ctx.reason, ctx.attempt)
        )

    def finished(
        self, job: JobState, run: Run, outcome: Outcome, error: str | None, *, record: bool = True
    ) -> RunRecord:
        """The run's record, logged and told to the listeners; ``record``: queued for the
        history (else its lease's release writes it)."""
        ctx = run.ctx
        finished_ms = self.clock.now_ms()
        duration_ms = self.clock.monotonic_ms() - run.started_mono
        entry = RunRecord(
            job=job.settings.key,  # the history is the key's: a renamed job keeps it
            slot_ms=ctx.slot_ms,
            run_id=ctx.run_id,
            instance_id=ctx.instance_id,
            reason=ctx.reason,
            attempt=ctx.attempt,
            started_at=ms_to_datetime(run.started_ms),
            finished_at=ms_to_datetime(finished_ms),
            outcome=outcome,
            error=error,
            traceback=_traceback(run, outcome),
            result=self._result(job, run),
        )
        if record:
            self.recorder.put(job.settings.policy, entry)  # written in the background, in order
        if outcome == "completed":
            job.last_ok_ms = finished_ms
        self._log(job, entry, duration_ms, run.started_ms - ctx.slot_ms, run.exception)
        event = RunEvent(
            job.name,
            ctx.slot_ms,
            ctx.run_id,
            ctx.reason,
            ctx.attempt,
            outcome,
            error,
            duration_ms,
            run.exception,
        )
        self.events.emit("complete" if outcome == "completed" else "fail", event)
        return entry

    def _result(self, job: JobState, run: Run) -> Any:
        """What the record keeps of the handler's return value (``_results``); a value that is
        not JSON is kept as ``None`` and said once per job, at warning: the run still counts
        as it ended."""
        if not self.record_results or run.returned is None:
            return None
        result, is_json = run_result(run.returned, data_secrets(run.ctx.data))
        if not is_json and job.name not in self._not_json:
            self._not_json.add(job.name)
            logger.warning(
                "job %s returned a %s, which is not JSON: its run records keep no result "
                "(return a JSON value: dict, list, str, int, float, bool or None; said once)",
                job.name,
                type(run.returned).__name__,
                extra={"event": "result-not-json", "job": job.name},
            )
        return result

    def _log(
        self,
        job: JobState,
        record: RunRecord,
        duration_ms: int,
        late_ms: int,
        exception: BaseException | None,
    ) -> None:
        """One line per run; a handler's exception adds its traceback to that line (the history
        record keeps it redacted and capped). The job is named by its name (the record has its
        key)."""
        level = logging.INFO if record.outcome == "completed" else logging.WARNING
        if not logger.isEnabledFor(level):
            return
        fields = {
            "event": "run",
            "job": job.name,
            "run_id": record.run_id,
            "slot": record.slot_ms,
            "reason": record.reason,
            "attempt": record.attempt,
            "outcome": record.outcome,
            "duration_ms": duration_ms,
            "late_ms": late_ms,
            "instance_id": record.instance_id,
        }
        text = " ".join(f"{key}={value}" for key, value in fields.items() if key != "event")
        if record.error:
            text += f" error={record.error!r}"
        fields["error"] = record.error
        logger.log(level, "run %s", text, extra=fields, exc_info=exception)


def _traceback(run: Run, outcome: Outcome) -> str | None:
    """What a failed or timed-out run's record keeps of its exception (a timed-out async
    handler: the cancellation, which shows where it was waiting), redacted and capped."""
    if outcome not in ("failed", "timed-out"):
        return None
    exc = run.exception or (run.cancelled if outcome == "timed-out" else None)
    if exc is None:
        return None  # a sync handler that is still running in its thread
    return run_traceback(exc, data_secrets(run.ctx.data))

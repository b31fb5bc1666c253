"""``GET /vocabulary``: every word the admin API answers with, listed from the one definition of
each (a ``Literal`` type where the word is made, read with ``typing.get_args``). The dashboard
builds its filters, legends and event subscriptions from it and has no list of its own."""

from __future__ import annotations

from typing import get_args

from typing_extensions import TypedDict

from .._context import AbortReason
from .._events import SkipReason
from .._options import JobOptions, Kind
from ..abc import FAILURES, ControlAction, Liveness, Outcome, RunReason
from ._stream import StreamEvent
from ._timeline import SlotState
from ._views import JobState

__all__ = ["VOCABULARY", "Vocabulary"]


class Vocabulary(TypedDict):
    """The words of each kind, in their order of definition."""

    outcomes: list[Outcome]
    failures: list[Outcome]
    """The outcomes that are failures."""
    run_reasons: list[RunReason]
    skip_reasons: list[SkipReason]
    slot_states: list[SlotState]
    """What became of a slot no instance ran (a timeline's ``slots``)."""
    job_states: list[JobState]
    job_kinds: list[Kind]
    liveness: list[Liveness]
    control_actions: list[ControlAction]
    abort_reasons: list[AbortReason]
    events: list[StreamEvent]
    """The events of ``GET /events``."""
    job_options: list[str]


VOCABULARY = Vocabulary(
    outcomes=list(get_args(Outcome)),
    failures=[outcome for outcome in get_args(Outcome) if outcome in FAILURES],
    run_reasons=list(get_args(RunReason)),
    skip_reasons=list(get_args(SkipReason)),
    slot_states=list(get_args(SlotState)),
    job_states=list(get_args(JobState)),
    job_kinds=list(get_args(Kind)),
    liveness=list(get_args(Liveness)),
    control_actions=list(get_args(ControlAction)),
    abort_reasons=list(get_args(AbortReason)),
    events=list(get_args(StreamEvent)),
    job_options=list(JobOptions.model_fields),
)

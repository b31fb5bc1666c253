"""The JSON bodies the admin API answers with, as ``TypedDict``s: the routes build them, every
answer is validated and serialised through its type (``_openapi.Operation``), and the OpenAPI
document's schemas are made from the same types (pydantic's ``TypeAdapter``). A key a route adds
or forgets fails validation: the document cannot disagree with what is sent.

Words read from the backend (a run's ``outcome``, ``reason``, a control change's ``action``)
may come from an instance of a newer release: they are one of this release's words or another
string, never refused."""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import ConfigDict, Field, JsonValue, with_config
from typing_extensions import TypedDict

from .._options import Kind
from ..abc import ControlAction, Liveness, Outcome, Overlap, RunReason
from ._timeline import SlotState
from ._views import JobState

__all__ = [
    "AbortRequested",
    "ActiveRun",
    "Audit",
    "Change",
    "Error",
    "Health",
    "History",
    "InstanceEntry",
    "Instances",
    "JobEntry",
    "Jobs",
    "Overview",
    "RunPage",
    "Runs",
    "Schedule",
    "ScheduleConflict",
    "ScheduleDeleted",
    "ScheduleList",
    "Session",
    "Timeline",
    "TriggerAccepted",
]

_closed = with_config(ConfigDict(extra="forbid", use_attribute_docstrings=True))
_NEWER = "one of these, or a word of a newer release"
OutcomeWord = Annotated[Outcome | str, Field(description=f"The run's outcome: {_NEWER}")]
ReasonWord = Annotated[RunReason | str, Field(description=f"Why it ran: {_NEWER}")]
ActionWord = Annotated[ControlAction | str, Field(description=f"The change: {_NEWER}")]
Time = Annotated[str, Field(description="ISO 8601, UTC", json_schema_extra={"format": "date-time"})]
Ms = Annotated[int, Field(description="Unix time, milliseconds")]


@_closed
class Error(TypedDict):
    """An error: ``error`` says what and why."""

    error: str
    backend: NotRequired[BackendStatus]


@_closed
class BackendStatus(TypedDict):
    """What this instance knows of its backend: from its own reads (bounded to 2 s) and its
    events (a claim that failed, a record dropped, a claimed run)."""

    reachable: bool | None
    """``null``: not known yet."""
    since_ms: Ms | None
    """When it last changed."""
    error: str | None
    checked_s_ago: float | None


@_closed
class Record(TypedDict):
    """One run of a slot, on whichever instance ran it."""

    job: str
    slot_ms: Ms
    slot: Time
    run_id: str
    instance_id: str
    reason: ReasonWord
    attempt: int
    started_at: Time
    finished_at: Time | None
    duration_ms: int | None
    """``finished_at - started_at``."""
    late_ms: int
    """``started_at - slot``."""
    outcome: OutcomeWord
    error: str | None
    traceback: str | None
    """A failed or timed-out run's, redacted and size-capped."""
    result: JsonValue
    """What the handler returned, a JSON value, redacted; at most 4 KiB of JSON, a larger one
    replaced by ``{"$cut": {"bytes": n, "limit": 4096}, "head": "<its start>"}``. ``null``:
    none (it returned nothing, or a value that is not JSON; results off; an earlier release)."""


@_closed
class ControlChange(TypedDict):
    action: ActionWord
    actor: str
    at: Time
    run_id: NotRequired[str]
    """The run an ``abort`` asked to stop."""
    note: NotRequired[str]
    """Why, in the words of whoever made the change."""
    until: NotRequired[Time]
    """A ``pause`` that ends by itself at this instant."""
    count: NotRequired[int]
    """The slots a ``skip`` skips (0: a pending skip cancelled)."""
    through_ms: NotRequired[Ms]
    """The last slot a ``skip`` skips."""


@_closed
class Skip(TypedDict):
    """``skip(n)``: the slots after ``after_ms`` up to and including ``through_ms``."""

    after_ms: Ms
    through_ms: Ms
    count: int
    left: int
    """How many of them are still ahead."""


@_closed
class LatestControl(TypedDict):
    """The job's fleet-wide control as last read here (the whole trail: ``GET
    /jobs/{name}/audit``)."""

    paused: bool
    """Paused now (a pause ``until`` an instant that has passed is over)."""
    disabled: bool
    until: Time | None
    note: str | None
    """Why it is paused or disabled (the note of the change that did it)."""
    skip: Skip | None
    latest: ControlChange | None
    halted_by: ControlChange | None
    """The change that paused or disabled it, while it is (the latest may be a skip since)."""


@_closed
class Control(TypedDict):
    """A job's fleet-wide control record: paused (now), disabled, until when a pause lasts,
    the slots a skip skips, its changes (newest first)."""

    paused: bool
    disabled: bool
    until: Time | None
    note: str | None
    """Why it is paused or disabled (the note of the change that did it)."""
    skip: Skip | None
    changes: list[ControlChange]


@_closed
class ShownOptions(TypedDict):
    """A job's options resolved against the defaults; ``data`` is never shown, only ``***``;
    ``overlap``, ``max_attempts`` and ``catch_up`` on a lease backend."""

    jitter: str
    max_late: str
    timeout: str | None
    claim: bool
    history_size: int
    overlap: NotRequired[Overlap]
    max_attempts: NotRequired[int]
    catch_up: NotRequired[str]
    retry: NotRequired[str]
    data: NotRequired[Literal["***"]]


@_closed
class JobEntry(TypedDict):
    name: str
    kind: Kind
    schedule: str
    zone: str
    options: ShownOptions
    state: JobState
    next_runs: list[Time]
    last: Record | None
    control: LatestControl | None
    history_error: NotRequired[str]
    """Why its last run could not be read."""


@_closed
class About(TypedDict):
    """This instance and its scheduler."""

    instance_id: str
    backend: str
    backend_status: BackendStatus
    running: bool
    changes_enabled: bool
    now_ms: Ms


@_closed
class Jobs(About):
    jobs: list[JobEntry]


@_closed
class Choices(TypedDict):
    """The values the filters take."""

    outcome: list[Outcome]
    reason: list[RunReason]


@_closed
class History(TypedDict):
    job: str
    records: list[Record]
    choices: Choices
    slots: list[Ms]
    """The schedule's slots since the oldest record that should have run by now."""
    now_ms: Ms
    next: str | None
    """Pass as ``before`` for the next (older) page."""
    matched: NotRequired[int]
    """With filters or ``before``: the records that match, of those scanned."""
    scanned: NotRequired[int]


@_closed
class CompactRun(TypedDict):
    """A run as a timeline draws it."""

    run_id: str
    slot_ms: Ms
    started_ms: Ms
    finished_ms: Ms | None
    instance_id: str
    outcome: OutcomeWord
    reason: ReasonWord
    attempt: int
    late_ms: int
    error: str | None


@_closed
class SlotMark(TypedDict):
    """A slot of the schedule no instance ran, and why."""

    slot_ms: Ms
    state: SlotState
    detail: str


@_closed
class Timeline(TypedDict):
    job: str
    from_ms: Ms
    to_ms: Ms
    now_ms: Ms
    here: str
    """This instance's id."""
    lanes: list[str]
    """The instances that ran the job in the window, and this one."""
    first_ms: Ms | None
    """The oldest record's slot."""
    known_from_ms: Ms | None
    """The oldest record's slot when older ones may be trimmed."""
    runs: list[CompactRun]
    slots: list[SlotMark]


@_closed
class RunPage(TypedDict):
    job: JobEntry
    run: Record
    attempts: list[Record]
    """The attempts at its slot."""
    newer: str | None
    older: str | None
    max_attempts: int | None
    """Attempts at a slot whose runner died (lease backends): not a retry of a failure."""
    next_attempt: NextAttempt | None
    """What follows this run, when it failed."""


@_closed
class NextAttempt(TypedDict):
    """Whether a failed run is run again: by ``retry=`` (a handler that failed), or by another
    instance taking over its slot (``max_attempts``, a runner that died)."""

    retried: bool | None
    """``null``: not known yet (it may be)."""
    summary: str
    detail: str


@_closed
class RunningHere(TypedDict):
    """A run going on an instance, as it published it."""

    job: str
    run_id: str
    slot_ms: Ms
    started_at: Time
    reason: ReasonWord
    attempt: int
    leased: bool
    held: bool
    """A leased run of a dead instance: its lease keeps the slot until it expires."""


@_closed
class InstanceEntry(TypedDict):
    id: str
    host: str
    pid: int
    version: str
    started_at: Time
    last_seen: Time
    heartbeat_ms: int
    running: list[RunningHere]
    stopped: bool
    jobs: int
    liveness: Liveness
    age_ms: int
    here: bool


@_closed
class FleetRun(RunningHere):
    instance_id: str
    liveness: Liveness


@_closed
class ActiveRun(FleetRun):
    host: str


@_closed
class Fleet(TypedDict):
    supported: bool
    instances: list[InstanceEntry]
    runs: list[FleetRun]
    error: NotRequired[str]


@_closed
class OverviewJob(JobEntry):
    timeline: Timeline
    counts: dict[str, int]
    """Runs in the window by outcome."""


@_closed
class Window(TypedDict):
    from_ms: Ms
    to_ms: Ms


@_closed
class FailureGroup(TypedDict):
    """Failures alike: one job, outcome and kind of error (its message with ids and numbers
    replaced)."""

    job: str
    outcome: OutcomeWord
    error: str | None
    """The latest run's error: an example of the group."""
    pattern: str | None
    """What the group's errors share: ids and numbers replaced by ``<id>`` and ``<n>``."""
    count: int
    instances: list[str]
    latest: Record
    first_ms: Ms


@_closed
class Failures(TypedDict):
    """Failed, timed-out and interrupted runs of the last hour; ``complete`` is false when a
    job ran more often than the records read cover, or its history could not be read."""

    since_ms: Ms
    count: int
    """Of the histories read: unknown for the jobs in ``unread``."""
    complete: bool
    unread: list[str]
    """The jobs whose history could not be read (the backend is unreachable)."""
    error: NotRequired[str]
    """Why, when some history could not be read."""
    runs: list[Record]
    """Newest first, 50 at most."""
    groups: list[FailureGroup]


@_closed
class NextRun(TypedDict):
    job: str
    at_ms: Ms


@_closed
class SeenInstance(TypedDict):
    """An instance seen in the runs read."""

    instance_id: str
    last_run_ms: Ms | None
    runs: int
    failures: int
    here: bool


@_closed
class Overview(About):
    window: Window
    jobs: list[OverviewJob]
    failures: Failures
    next_runs: list[NextRun]
    instances: list[SeenInstance]
    fleet: Fleet


@_closed
class Instances(TypedDict):
    supported: bool
    """Whether the backend keeps the fleet's presence."""
    now_ms: Ms
    instances: list[InstanceEntry]


@_closed
class Runs(TypedDict):
    supported: bool
    now_ms: Ms
    runs: list[ActiveRun]


@_closed
class Audit(TypedDict):
    job: str
    scope: Literal["fleet", "instance"]
    control: Control | None


@_closed
class Change(TypedDict):
    job: str
    state: JobState
    scope: str
    """The fleet, or this instance only."""
    control: NotRequired[Control]


@_closed
class TriggerAccepted(TypedDict):
    job: str
    accepted: bool
    detail: str


@_closed
class AbortRequested(TypedDict):
    run_id: str
    job: str
    requested: bool
    detail: str


@_closed
class Session(TypedDict):
    changes_enabled: bool
    token_accepted: bool
    """Whether a token is configured (the page asks for it): the admin one, or a read one."""
    authorized: bool
    """Whether these credentials may make any change (``actions``)."""
    via: Literal["token", "read-token", "host"] | None
    can_read: bool
    reads_protected: bool
    """Reading needs credentials (a read token, or the host application's check per action)."""
    actions: list[str]
    """The changes these credentials may make: trigger, pause, resume... abort."""
    instance_id: NotRequired[str]
    """Only to those who may read."""
    backend: NotRequired[str]


@_closed
class Overdue(TypedDict):
    job: str
    schedule: str
    state: JobState


@_closed
class Health(TypedDict):
    status: Literal["ok", "degraded", "unreachable", "stopped"]
    instance_id: NotRequired[str]
    backend: NotRequired[BackendStatus]
    overdue: list[Overdue]
    now_ms: Ms


@_closed
class Schedule(TypedDict):
    """A stored schedule's latest version (``StoredSchedule.to_json``; what ``brokersched
    schedules APP export`` prints). A password in a URL of its data or options is shown as
    ``***``."""

    id: str
    task: str
    trigger: dict[str, JsonValue]
    """The schedule as data: ``{"kind": "every", "interval_ms": ..., "offset_ms": ...}``,
    ``{"kind": "cron", "expression": ..., "timezone": ..., "dst": ...}`` or ``{"kind": "at",
    "at": ...}``; one written by a newer release that this one cannot read: ``kind``,
    ``schedule`` (as written) and ``error``."""
    options: dict[str, JsonValue]
    """The job options as written."""
    data: JsonValue
    """The task's ``ctx.data``."""
    version: int
    updated_at: Time
    updated_by: str | None
    effective_at: Time
    """Its slots from this instant are this version's (the earlier ones, the previous
    version's)."""
    describe: str
    """Its trigger in words, as ``brokersched jobs`` says it."""


@_closed
class ScheduleList(TypedDict):
    schedules: list[Schedule]
    """By id."""


@_closed
class ScheduleDeleted(TypedDict):
    id: str
    deleted: bool
    detail: str


@_closed
class ScheduleConflict(TypedDict):
    """``if_version`` did not match: ``version`` is the schedule's (0: there is none)."""

    error: str
    version: int

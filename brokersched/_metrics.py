"""Prometheus metrics of a scheduler (``pip install 'brokersched[prometheus]'``).

```python
metrics = PrometheusMetrics().attach(scheduler)
prometheus_client.start_http_server(9464, "127.0.0.1", registry=metrics.registry)
```

Series (``job`` is capped, see ``max_jobs``):

- ``brokersched_runs_total{job,outcome}``: finished runs (``completed``, ``failed``,
  ``timed-out``, ``interrupted``, ``replaced``: ``Outcome``)
- ``brokersched_retries_total{job}``: runs started again (``reason == "retry"``): after a
  failed attempt (``retry=``), or on taking over a dead runner's slot
- ``brokersched_skips_total{job,reason}``: skipped slots (``late``, ``overlap``,
  ``not-acquired``, ``paused``, ``backend-error``, ``clock-skew``: ``SkipReason``)
- ``brokersched_run_duration_seconds{job}``: how long handlers ran (histogram)
- ``brokersched_run_lateness_seconds{job}``: start minus slot, on the scheduler's clock, for
  scheduled runs only (jitter plus claim time; catch-up, retries and manual runs are late or
  early by design and would drown the signal)
- ``brokersched_active_runs{job}``: runs going on in this process
- ``brokersched_last_success_timestamp_seconds{job}``: when a run last completed here (Unix
  time on the scheduler's clock); alert on ``time() - ...`` growing
- ``brokersched_claim_duration_seconds{backend}``: how long claims took (histogram);
  ``backend`` is ``rabbitmq``, ``nats``, ``redis``, ``postgres``, ``sqlite`` or ``memory`` (a
  backend of your own: its class name, lower case, without ``Backend``)
- ``brokersched_slots_missed_total{job}``: scheduled slots that no instance ran within
  ``max_late``, counted by the one instance that reports each for the fleet (sum the series of
  every instance: each missed slot is counted once)
- ``brokersched_records_dropped_total{job}``: run records never written to the backend (it was
  away while ``record_buffer`` records waited, or ``stop()`` could not write them in time)
- ``brokersched_broker_budget_used{backend}``: the share of its budget the backend's server
  uses, as last read (``Backend.budget``: ``RabbitMQBackend`` with ``management_url``,
  the Redis, NATS and PostgreSQL backends), and
  ``brokersched_broker_shedding{backend}``: 1 while the backend creates no new server object
  (its slots that need one are skipped); both absent where the budget is not read

The registry: by default a new ``CollectorRegistry`` of its own, so that several schedulers
(or tests) in one process never collide on metric names; ``metrics.registry`` is what to serve.
Pass ``registry=prometheus_client.REGISTRY`` to join the process-wide registry, as
``brokersched run --metrics-port`` does, so the application's own metrics are served as well.

Several worker processes (``gunicorn``, ``uvicorn --workers``): with ``PROMETHEUS_MULTIPROC_DIR``
set, prometheus-client keeps every process's values in that directory and a
``multiprocess.MultiProcessCollector`` adds them up at each scrape: counters and histograms are
summed, ``brokersched_active_runs`` over the live processes (``livesum``) and
``brokersched_last_success_timestamp_seconds`` is the latest of all (``max``). docs/operations.md,
"Deploying", has the recipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, get_args

from ._events import ClaimEvent, Event, RunEvent, SkipEvent, StartEvent
from ._exceptions import ConfigurationError
from .abc import Outcome

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ._scheduler import Scheduler
    from .abc import Backend

__all__ = ["OTHER_JOB", "PrometheusMetrics", "backend_label"]

OTHER_JOB = "_other"

# Handlers run from milliseconds (a flush) to an hour (a nightly batch).
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# Lateness is jitter (seconds) plus the claim (milliseconds); max_late is 60 s by default.
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
# A claim is one round trip to the broker or database.
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


# A backend's label is its class name without "Backend", in lower case; both Redis backends
# are "redis", both NATS backends "nats".
_BACKEND_LABELS = {"RedisLeaseBackend": "redis", "NATSLeaseBackend": "nats"}


def backend_label(name: str) -> str:
    """The ``backend`` label of a backend's ``name``: ``"RabbitMQBackend"`` → ``"rabbitmq"``."""
    return _BACKEND_LABELS.get(name) or name.removesuffix("Backend").lower() or name.lower()


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "metrics need prometheus-client: pip install 'brokersched[prometheus]'",
            option="metrics",
        ) from exc
    return prometheus_client


class PrometheusMetrics:
    """Counts runs and skips of the schedulers it is attached to.

    ``max_jobs`` caps the ``job`` label: the first ``max_jobs`` job names get their own series,
    later ones share ``job="_other"``, so an application that registers jobs with generated
    names cannot blow up the cardinality. Jobs registered before ``attach()`` are counted first.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, max_jobs: int = 200) -> None:
        prom = _prometheus()
        if max_jobs < 1:
            raise ConfigurationError(f"max_jobs ({max_jobs}) must be at least 1", option="max_jobs")
        self.registry: CollectorRegistry = (
            registry if registry is not None else prom.CollectorRegistry()
        )
        self.max_jobs = max_jobs
        self._jobs: set[str] = set()
        into = {"registry": self.registry}
        self.runs = prom.Counter(
            "brokersched_runs", "Finished runs, by outcome.", ["job", "outcome"], **into
        )
        self.skips = prom.Counter(
            "brokersched_skips", "Skipped slots, by reason.", ["job", "reason"], **into
        )
        self.retries = prom.Counter(
            "brokersched_retries", "Runs started again (after a failure or a dead runner).",
            ["job"], **into,
        )  # fmt: skip
        self.duration = prom.Histogram(
            "brokersched_run_duration_seconds",
            "How long handlers ran.",
            ["job"],
            buckets=DURATION_BUCKETS,
            **into,
        )
        self.lateness = prom.Histogram(
            "brokersched_run_lateness_seconds",
            "Start of a scheduled run minus its slot.",
            ["job"],
            buckets=LATENESS_BUCKETS,
            **into,
        )
        # multiprocess_mode: how PROMETHEUS_MULTIPROC_DIR adds up the workers' gauges (ignored
        # otherwise): the runs going on in the live workers; the latest success of any worker.
        self.active = prom.Gauge(
            "brokersched_active_runs",
            "Runs going on in this process.",
            ["job"],
            multiprocess_mode="livesum",
            **into,
        )
        self.last_success = prom.Gauge(
            "brokersched_last_success_timestamp_seconds",
            "Unix time of the last completed run in this process.",
            ["job"],
            multiprocess_mode="max",
            **into,
        )
        self.records_dropped = prom.Counter(
            "brokersched_records_dropped",
            "Run records never written to the backend.",
            ["job"],
            **into,
        )
        self.missed = prom.Counter(
            "brokersched_slots_missed",
            "Scheduled slots no instance ran within max_late (counted by the instance that "
            "reported each).",
            ["job"],
            **into,
        )
        self.claim_duration = prom.Histogram(
            "brokersched_claim_duration_seconds",
            "How long claims took, by backend.",
            ["backend"],
            buckets=CLAIM_BUCKETS,
            **into,
        )
        self._budgets = _Budgets()
        self.registry.register(self._budgets)

    def job_label(self, job: str) -> str:
        """``job``, or ``"_other"`` once ``max_jobs`` names have been seen."""
        if job in self._jobs:
            return job
        if len(self._jobs) < self.max_jobs:
            self._jobs.add(job)
            return job
        return OTHER_JOB

    def attach(self, scheduler: Scheduler[Any]) -> PrometheusMetrics:
        """Listen to ``scheduler``'s events and claims; returns ``self``."""
        for job in scheduler.jobs():
            self._declare(self.job_label(job.name))
        clock = scheduler.clock

        def on_start(event: Event) -> None:
            assert isinstance(event, StartEvent)
            label = self.job_label(event.job)
            self.active.labels(label).inc()
            if event.reason == "retry":
                self.retries.labels(label).inc()
            if event.reason == "schedule":
                # emitted as the run starts, so the clock still reads the start time
                late_s = (clock.now_ms() - event.slot_ms) / 1000
                self.lateness.labels(label).observe(max(late_s, 0.0))

        def on_finish(event: Event) -> None:
            assert isinstance(event, RunEvent)
            label = self.job_label(event.job)
            self.active.labels(label).dec()
            self.runs.labels(label, event.outcome).inc()
            self.duration.labels(label).observe(event.duration_ms / 1000)
            if event.outcome == "completed":
                self.last_success.labels(label).set(clock.now_ms() / 1000)

        def on_skip(event: Event) -> None:
            assert isinstance(event, SkipEvent)
            self.skips.labels(self.job_label(event.job), event.reason).inc()

        self._budgets.backends.append(scheduler.backend)
        scheduler.on("start", on_start)
        scheduler.on("complete", on_finish)
        scheduler.on("fail", on_finish)
        scheduler.on("skip", on_skip)
        scheduler.on("claim", self._observe_claim)
        scheduler.on("missed", lambda event: self.missed.labels(self.job_label(event.job)).inc())
        scheduler.on(
            "record-dropped",
            lambda event: self.records_dropped.labels(self.job_label(event.job)).inc(),
        )
        return self

    def _declare(self, label: str) -> None:
        """Create a known job's series at zero: ``increase()`` then sees its first run."""
        for outcome in get_args(Outcome):
            if outcome != "missed":  # not a run: counted by brokersched_slots_missed
                self.runs.labels(label, outcome)
        self.retries.labels(label)
        self.missed.labels(label)
        self.active.labels(label)

    def _observe_claim(self, event: ClaimEvent) -> None:
        self.claim_duration.labels(backend_label(event.backend)).observe(event.seconds)


class _Budgets:
    """A collector of the attached schedulers' ``Backend.budget``, read at each scrape."""

    def __init__(self) -> None:
        self.backends: list[Backend] = []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        used = GaugeMetricFamily(
            "brokersched_broker_budget_used",
            "Share of its budget the backend's server uses, as last read.",
            labels=["backend"],
        )
        shedding = GaugeMetricFamily(
            "brokersched_broker_shedding",
            "1 while the backend creates no new server object (slots needing one are skipped).",
            labels=["backend"],
        )
        for backend in dict.fromkeys(self.backends):  # a backend shared by schedulers: once
            if (budget := backend.budget) is not None:
                label = backend_label(backend.name)
                used.add_metric([label], budget.used)
                shedding.add_metric([label], float(budget.state == "shed"))
        yield used
        yield shedding

"""The jobs of one scheduler, by name: ``every()``, ``cron()``, ``at()`` and ``after()`` add one
(its schedule and options validated by the ``Registry`` first, all at once, never at the first
run), ``remove()`` takes one out. The only owner of the scheduler's ``Job`` handles."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ._exceptions import ConfigurationError
from ._host import Host
from ._job import Handler, JobState, check_handler, is_async_handler
from ._jobhandle import Job, state_of
from ._options import Kind
from ._overrides import Overrides
from ._registry import MakeTrigger, Registry, past_at
from ._stored import Spec
from .triggers.base import Trigger

__all__ = ["Registration"]

H = TypeVar("H", bound=Handler)

logger = logging.getLogger("brokersched")


def _unchanged(function: H) -> H:
    return function


class Registration:
    """Registers, finds and removes the jobs of ``host``. ``make_job`` makes the handle the
    application holds; ``added`` is told of each job registered (the life cycle arms it when
    the scheduler is running)."""

    def __init__(
        self,
        host: Host,
        overrides: Overrides,
        make_job: Callable[[JobState], Job],
        added: Callable[[JobState], None],
    ) -> None:
        self._host = host
        self._jobs: dict[str, Job] = {}
        self._make_job = make_job
        self._added = added
        self._registry = Registry(
            lambda: (host.options, host.backend), overrides, self.states_by_name
        )

    def register(
        self,
        name: str,
        kind: Kind,
        make_trigger: MakeTrigger,
        handler: Handler | None,
        options: dict[str, Any],
    ) -> Job | Callable[[H], H]:
        """The job (with ``handler``), or the decorator that registers the function it is
        given; everything is validated now, before the decorator form returns."""
        try:
            spec = self._registry.spec(name, kind, make_trigger, options)
        except ConfigurationError as exc:
            if handler is not None or not self._registry.refused(exc.all_errors):
                raise
            return _unchanged

        def add(function: Handler) -> Job:
            check_handler(spec.name, function)
            if spec.name in self._jobs:
                raise ConfigurationError(
                    f"job name '{spec.name}' is taken", option="name", job=spec.name
                )
            state = JobState(spec, function)
            job = self._jobs[spec.name] = self._make_job(state)
            if (warning := past_at(spec, self._host.clock.now_ms())) is not None:
                logger.warning("%s", warning)
            self._added(state)
            return job

        if handler is not None:
            return add(handler)

        def decorator(function: H) -> H:
            try:
                add(function)
            except ConfigurationError as exc:
                if not self._registry.refused([exc]):
                    raise
            return function

        return decorator

    def stored_trigger(self, name: str, spec: Spec) -> Trigger:
        """The trigger of one version of stored schedule ``name``, validated as registration
        validates a job (its name not taken by a job of the code). Raises
        ``ConfigurationError``."""
        held = self._jobs.get(name)
        replacing = state_of(held) if held is not None and state_of(held).stored else None
        maker = self._registry.maker(spec.kind, spec.schedule)
        return self._registry.stored(name, spec.kind, maker, spec.job_options(), replacing)[1]

    def put_stored(
        self, name: str, spec: Spec, handler: Handler, trigger: Trigger
    ) -> tuple[JobState, bool]:
        """Register the job of stored schedule ``name``, or change it: its slots ``trigger``'s,
        its task ``handler``, its options and data ``spec``'s; answers the job and whether it
        is new. Raises ``ConfigurationError``."""
        check_handler(name, handler)
        held = self._jobs.get(name)
        replacing = state_of(held) if held is not None else None
        if replacing is not None and not replacing.stored:
            raise ConfigurationError(
                f"job name '{name}' is taken by a job of the code", option="name", job=name
            )
        job_spec, _ = self._registry.stored(
            name, spec.kind, lambda _: trigger, spec.job_options(), replacing
        )
        if replacing is None:
            state = JobState(job_spec, handler, stored=True)
            self._jobs[name] = self._make_job(state)
            self._added(state)
            return state, True
        replacing.spec = job_spec
        replacing.handler = handler
        replacing.is_async = is_async_handler(handler)
        return replacing, False

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def state(self, name: str) -> JobState:
        """The state of job ``name``; a ``KeyError`` that lists the jobs if there is none."""
        job = self._jobs.get(name)
        if job is None:
            raise self._unknown(name)
        return state_of(job)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def count(self) -> int:
        return len(self._jobs)

    def states(self) -> list[JobState]:
        return [state_of(job) for job in self._jobs.values()]

    def states_by_name(self) -> dict[str, JobState]:
        return {name: state_of(job) for name, job in self._jobs.items()}

    def remove(self, name: str) -> Job:
        """Take job ``name`` out (what becomes of its timers and runs is the life cycle's)."""
        job = self._jobs.pop(name, None)
        if job is None:
            raise self._unknown(name)
        return job

    def _unknown(self, name: str) -> KeyError:
        return KeyError(f"no job named '{name}' (registered: {', '.join(self._jobs) or 'none'})")

    def maker(self, kind: Kind, schedule: Any) -> MakeTrigger:
        return self._registry.maker(kind, schedule)

    def update(self, job: JobState, options: dict[str, Any]) -> None:
        self._registry.update(job, options)

    def add_overrides(self, more: Mapping[str, Mapping[str, Any]]) -> None:
        self._registry.add_overrides(more)

    def override_errors(self) -> list[ConfigurationError]:
        return self._registry.override_errors()

    def check(self) -> list[ConfigurationError]:
        return self._registry.check()

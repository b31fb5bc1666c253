"""What every backend's options share: the model they are declared on, the types of the options
several backends take, and the one call that checks them all.

A backend declares its constructor's options as a ``BackendOptions`` model in its package and
calls ``parse`` once, on its ``locals()``, at the top of ``__init__``; every refusal is a
``ConfigurationError`` in one format (``_options.validation_error``). A check written as a
function of the value and the backend's name (a name built by ``name_check``, a URL) becomes a
field's validator through ``checked``; the backend's name reaches validators as the validation
context. Values a backend hands on unchecked (a path, a DSN, a store) stay out of the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Annotated, Any, Self, TypeVar, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo

from .. import _redact
from .._durations import parse_duration
from .._exceptions import ConfigurationError
from .._options import validation_error

__all__ = [
    "BackendOptions",
    "BudgetPeriod",
    "ClaimOptions",
    "ClockSkew",
    "Flag",
    "LeaseOptions",
    "PositiveDuration",
    "backend_of",
    "checked",
    "duration",
    "name_check",
    "positive_duration",
    "url_refusal",
]

T = TypeVar("T")


class BackendOptions(BaseModel):
    """A backend's constructor options, checked in one call."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @classmethod
    def parse(cls, backend: str, given: Mapping[str, Any]) -> Self:
        """The options among ``given`` (a constructor's ``locals()``: the model takes the names
        it declares), checked; the first refusal as ``ConfigurationError``."""
        names = [field.alias or name for name, field in cls.model_fields.items()]
        try:
            return cls.model_validate({name: given[name] for name in names}, context=backend)
        except ValidationError as exc:
            raise validation_error(exc, cls, backend=backend) from None


def backend_of(info: ValidationInfo) -> str:
    """The name of the backend whose options are being checked."""
    return cast(str, info.context)


def checked(check: Callable[[Any, str], T]) -> BeforeValidator:
    """A field validator of ``check(value, backend)``, which raises ``ConfigurationError``."""
    return BeforeValidator(lambda value, info: check(value, backend_of(info)))


def duration(value: Any, info: ValidationInfo) -> timedelta:
    """A duration option: 0 or more (``parse_duration`` refuses a negative one)."""
    option, backend = str(info.field_name), backend_of(info)
    try:
        return parse_duration(value, name=option)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{exc} ({backend})", option=option, backend=backend) from None


def positive_duration(value: Any, info: ValidationInfo) -> timedelta:
    """A duration option of at least 1 ms."""
    result = duration(value, info)
    if result < timedelta(milliseconds=1):
        raise ConfigurationError(
            f"{info.field_name} ({value!r}) of {backend_of(info)} must be at least 1ms",
            option=info.field_name,
            backend=backend_of(info),
        )
    return result


def name_check(option: str, pattern: str, rule: str) -> Callable[[object, str], str]:
    """The check of a name the backend makes others from (a prefix, a schema, a bucket): a
    string ``pattern`` matches whole, or a ``ConfigurationError`` saying ``rule``."""
    compiled = re.compile(pattern)

    def check(value: object, backend: str) -> str:
        if not isinstance(value, str) or not compiled.fullmatch(value):
            raise ConfigurationError(
                f"{option} {value!r} of {backend} must be {rule}", option=option, backend=backend
            )
        return value

    return check


def url_refusal(url: object, backend: str, why: str) -> ConfigurationError:
    """``url '<url>' of <backend> <why>``, the URL's password hidden."""
    shown = _redact.redact_url(url) if isinstance(url, str) else repr(url)
    return ConfigurationError(f"url {shown!r} of {backend} {why}", option="url", backend=backend)


def _period(value: Any, info: ValidationInfo) -> float | None:
    return None if value is None else positive_duration(value, info).total_seconds()


#: A duration of at least 1 ms (``slot_ttl``, ``lease_ttl``, ``claim_timeout``...).
PositiveDuration = Annotated[timedelta, BeforeValidator(positive_duration)]
#: How far the clocks of the fleet (and the store's) may disagree: 0 or more.
ClockSkew = Annotated[timedelta, BeforeValidator(duration)]
#: ``budget_interval`` in seconds; ``None``: the budget is not watched.
BudgetPeriod = Annotated[float | None, BeforeValidator(_period)]
#: A flag read as Python reads one (any value, by its truth).
Flag = Annotated[bool, BeforeValidator(bool)]


class LeaseOptions(BackendOptions):
    """What every lease backend takes: how long a lease lives unless renewed, and how far ahead
    of the store's clock a claimed slot may be."""

    lease_ttl: PositiveDuration
    max_clock_skew: ClockSkew


class ClaimOptions(BackendOptions):
    """What every claim backend takes: how long a claimed slot is remembered, and how far the
    fleet's clocks may disagree."""

    slot_ttl: PositiveDuration
    max_clock_skew: ClockSkew

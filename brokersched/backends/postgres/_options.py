"""``PostgresBackend``'s options, declared and checked in one call (``backends/_options``)."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import Field, ValidationInfo, model_validator

from ..._exceptions import ConfigurationError
from .._options import BudgetPeriod, LeaseOptions, backend_of, checked
from .._sql import check_identifier

__all__ = ["PostgresOptions", "check_schema"]


check_schema = check_identifier("schema", 63)


class PostgresOptions(LeaseOptions):
    budget_interval: BudgetPeriod
    # ``schema`` is a name of pydantic's BaseModel: the field takes it as its alias.
    schema_: Annotated[str, checked(check_schema)] = Field(alias="schema")
    min_size: int
    max_size: int

    @model_validator(mode="after")
    def _pool_sizes(self, info: ValidationInfo) -> Self:
        if not 0 <= self.min_size <= self.max_size or self.max_size < 1:
            raise ConfigurationError(
                f"{backend_of(info)} needs 0 <= min_size <= max_size and max_size >= 1 "
                f"(got min_size={self.min_size}, max_size={self.max_size})",
                option="max_size",
                backend=backend_of(info),
            )
        return self

"""The names ``NATSBackend`` gives its streams and subjects, derived from the prefix and the job
names (``subject_token``: reversible, one token per job)."""

from __future__ import annotations

import dataclasses
import functools
import re

from ..._exceptions import ConfigurationError
from ..._options import NAME_PATTERN
from ._errors import BACKEND

__all__ = ["Names", "subject_token"]

# Everything else is percent-encoded in subject tokens ('.' separates tokens; '%' is escaped so
# the encoding stays reversible and two job names never share a subject).
_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9_:$-]")


@functools.lru_cache(maxsize=4096)
def subject_token(job: str) -> str:
    """The NATS subject token for ``job``: reversible, no ``.``, ``*``, ``>`` or spaces."""
    # The scheduler checked it already; the backend's own guard, as the name becomes a subject
    # token and a header value.
    if not NAME_PATTERN.fullmatch(job):
        raise ConfigurationError(
            f"job name {job!r} cannot be used as a NATS subject token; "
            "use letters, digits and _ . : $ - (at most 128 characters)",
            backend=BACKEND,
            job=job,
        )
    return _TOKEN_UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m[0].encode()), job)


@dataclasses.dataclass(frozen=True, slots=True)
class Names:
    """Stream names and subjects derived from the prefix."""

    prefix: str

    @property
    def claims(self) -> str:
        return f"{self.prefix}-claims"

    @property
    def history(self) -> str:
        return f"{self.prefix}-history"

    @property
    def claim_subjects(self) -> str:
        return f"{self.prefix}.claim.>"

    @property
    def history_subjects(self) -> str:
        return f"{self.prefix}.history.>"

    def claim_subject(self, job: str) -> str:
        return f"{self.prefix}.claim.{subject_token(job)}"

    @property
    def fleet_subject(self) -> str:
        """The fleet's slot memory record, in the claims stream: two tokens after ``claim``,
        so never a job's subject (a job's token has no ``.``)."""
        return f"{self.prefix}.claim.fleet.memory"

    def history_subject(self, job: str) -> str:
        return f"{self.prefix}.history.{subject_token(job)}"

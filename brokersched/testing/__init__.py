"""Testing kit: a virtual clock, handler contexts, and (in ``brokersched.testing.conformance``)
the conformance suites every backend passes."""

from ._clock import TestClock
from ._context import abort, make_context

__all__ = ["TestClock", "abort", "make_context"]

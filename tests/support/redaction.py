"""Checks that a secret reached no error, no cause, no note and no log line."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from typing import Any

import pytest

from brokersched._exceptions import BrokerschedError
from brokersched.testing import TestClock

CLOCK = "2030-01-01T00:00:00Z"


def chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and everything chained to it, suppressed contexts included."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        link = todo.pop()
        if any(link is old for old in seen):
            continue
        seen.append(link)
        yield link
        todo += [e for e in (link.__cause__, link.__context__) if e is not None]


def assert_clean(error: BaseException, *secrets: str) -> None:
    """No secret in the message, the repr, the printed traceback, nor any chained exception."""
    texts = ["".join(traceback.format_exception(error))]
    texts += [text for link in chain(error) for text in (str(link), repr(link))]
    for secret in secrets:
        for text in texts:
            assert secret not in text, f"{secret!r} in {text!r}"


async def start_fails(backend: Any, caplog: pytest.LogCaptureFixture) -> BrokerschedError:
    """``backend.start()``'s error, with every logger recording at DEBUG meanwhile."""
    caplog.set_level(logging.DEBUG)
    with pytest.raises(BrokerschedError) as caught:
        await backend.start(TestClock(CLOCK))
    await backend.stop()
    return caught.value

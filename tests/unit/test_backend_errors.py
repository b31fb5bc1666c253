"""The one way a client library's exceptions become brokersched's (``backends/_errors.py``):
a row's error, ``from`` the client's exception scrubbed of secrets; brokersched's own errors
and bugs unchanged; a bound's expiry that says the bound."""

from __future__ import annotations

import asyncio

import pytest

from brokersched import BackendError, BackendUnavailableError, ConfigurationError
from brokersched.backends._errors import ErrorMap, Within

SECRET = "s3cret-password"


def errors() -> ErrorMap:
    def unreachable(action: str, exc: BaseException) -> BackendError:
        return BackendUnavailableError(f"could not {action}: {exc}")

    return ErrorMap(lambda: [((OSError, TimeoutError), unreachable)], secrets=[SECRET])


def raise_in(table: ErrorMap, action: str, exc: Exception) -> None:
    with table(action):
        raise exc


def test_a_client_error_becomes_the_row_s_from_the_scrubbed_cause() -> None:
    refused = ConnectionRefusedError(f"refused (password {SECRET})")
    with pytest.raises(BackendUnavailableError, match="could not claim: refused") as raised:
        raise_in(errors(), "claim", refused)
    cause = raised.value.__cause__
    assert isinstance(cause, ConnectionRefusedError)
    assert SECRET not in str(cause) and "refused" in str(cause)


@pytest.mark.parametrize("exc", [KeyError("bug"), ConfigurationError("said already")])
def test_a_bug_and_brokersched_s_own_errors_pass_unchanged(exc: Exception) -> None:
    with pytest.raises(type(exc)) as raised:
        raise_in(errors(), "claim", exc)
    assert raised.value is exc


async def test_an_expired_bound_says_it_and_a_timeout_from_inside_passes_unchanged() -> None:
    async def release() -> None:
        with errors()("release"):
            async with Within(0):  # expires at the first await: no real time waited
                await asyncio.Event().wait()

    with pytest.raises(BackendUnavailableError, match=r"could not release: timed out after 0s"):
        await release()
    inside = TimeoutError("the client's own")
    with pytest.raises(TimeoutError) as raised:
        async with Within(60):
            raise inside
    assert raised.value is inside


async def test_a_cancellation_from_outside_stays_one() -> None:
    async def call() -> None:
        async with Within(60):
            await asyncio.Event().wait()

    task = asyncio.create_task(call())
    await asyncio.sleep(0)  # inside the bound
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

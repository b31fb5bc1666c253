"""What can go wrong reaching RabbitMQ: the URLs checked at construction, the refusals of a
login or a virtual host explained, and aio-pika's and aiormq's errors translated."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Sequence
from urllib.parse import urlsplit

from ... import _redact
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from .._errors import ErrorRow
from .._options import url_refusal

__all__ = [
    "check_parsable",
    "check_urls",
    "describe",
    "error_rows",
    "login_refused",
    "refused_vhost",
    "url_vhost",
    "vhost_refused",
]


def error_rows(backend: str, secrets: Sequence[str]) -> list[ErrorRow]:
    """What aio-pika's and aiormq's exceptions mean (``backends/_errors.py``'s policy: anything
    else is raised unchanged)."""
    from aiormq.exceptions import AMQPError

    def shown(exc: BaseException) -> str:
        return describe(exc, secrets)

    return [
        (
            TimeoutError,
            lambda action, exc: BackendUnavailableError(
                f"{backend}: {action}: no answer from the broker in time"
            ),
        ),
        (
            # aio-pika's own CONNECTION_EXCEPTIONS: aiormq raises a bare RuntimeError ("...
            # closed") from channel() when the connection drops during a reconnect, and
            # ChannelInvalidStateError is a RuntimeError too.
            (ConnectionError, OSError, RuntimeError, StopAsyncIteration),
            lambda action, exc: BackendUnavailableError(
                f"{backend}: {action}: no connection to the broker ({shown(exc)})"
            ),
        ),
        (
            AMQPError,
            lambda action, exc: BackendError(f"{backend}: {action} failed ({shown(exc)})"),
        ),
        (
            # aiormq fails the waiters of a closing channel or connection with CancelledError
            # although nobody cancelled this task: that is a lost connection. A real
            # cancellation of this task is never swallowed.
            _cancelled_by_the_client,
            lambda action, exc: BackendUnavailableError(
                f"{backend}: {action}: the connection closed while waiting for the broker"
            ),
        ),
    ]


def _cancelled_by_the_client(exc: BaseException) -> bool:
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def describe(exc: BaseException, secrets: Sequence[str]) -> str:
    return f"{type(exc).__name__}: {_redact.scrub(str(exc), secrets)}"


def login_refused(backend: str, url: str) -> str:
    user = _url_user(url)
    return (
        f"{backend}: the broker at {_redact.redact_url(url)} refused the login of user"
        f" {user!r} (ACCESS_REFUSED): check the user name and password in the URL (with"
        " reserved characters percent-encoded), or create the user (rabbitmqctl add_user);"
        " RabbitMQ's 'guest' user may only log in from localhost"
    )


def vhost_refused(backend: str, url: str) -> str:
    vhost, user = url_vhost(url), _url_user(url)
    quoted = shlex.quote(vhost)
    return (
        f"{backend}: the broker at {_redact.redact_url(url)} refused virtual host"
        f" {vhost!r}:"
        f" it does not exist, or user {user!r} has no access to it; create it and grant"
        f" access (rabbitmqctl add_vhost {quoted}; rabbitmqctl set_permissions -p {quoted}"
        f" {shlex.quote(user)} '.*' '.*' '.*'), or name an existing vhost in the URL's path"
        " (amqp://host/ is the default vhost '/')"
    )


def check_parsable(url: str, backend: str) -> None:
    """Refuse a URL that aio-pika cannot parse, without the parser's message: it may quote
    a piece of a password that was cut at an unescaped ``#``, ``/`` or ``?``."""
    from yarl import URL

    try:
        URL(url).port  # noqa: B018 (older yarl checks the port when it is read)
    except ValueError:
        pass
    else:
        return
    # Raised here, outside the except block: no parser error chained to it.
    raise url_refusal(
        url,
        backend,
        "cannot be parsed: is the port a number, and are the reserved characters of the user"
        " name and password percent-encoded (@ : / ? # [ ] % as %40 %3A %2F %3F %23 %5B %5D %25)?",
    )


def refused_vhost(exc: BaseException) -> bool:
    """Whether aiormq's ``InvalidFrameError`` is the broker closing the connection in answer
    to ``Connection.Open``: RabbitMQ's ``530 NOT_ALLOWED``, for a vhost that does not exist or
    that the user may not use. aiormq keeps only the frame's type (not its reply text)."""
    text = str(exc)
    return "Connection.OpenOk" in text and "Connection.Close" in text


def url_vhost(url: str) -> str:
    """The vhost aiormq asks for: the URL's path without its first '/', or '/'."""
    from yarl import URL

    path = URL(url).path
    return path[1:].replace("%2F", "/") if path not in {"", "/"} else "/"


def _url_user(url: str) -> str:
    from yarl import URL

    return URL(url).user or "guest"  # aiormq's default login


def check_urls(urls: object, backend: str) -> list[str]:
    """One URL, or a non-empty list of them (the nodes of a cluster)."""
    if isinstance(urls, str):
        return [_check_url(urls, backend)]
    for n, url in enumerate(urls if isinstance(urls, Sequence) else ()):
        if not isinstance(url, str):
            raise ConfigurationError(
                f"url {url!r} (item {n + 1} of the list) of {backend} must be a string, an"
                " amqp:// or amqps:// URL",
                option="url",
                backend=backend,
            )
    if not isinstance(urls, Sequence) or not urls:
        shown = type(urls).__name__ if not isinstance(urls, Sequence) else "an empty list"
        raise ConfigurationError(
            f"url of {backend} must be an amqp:// or amqps:// URL or a non-empty list of them"
            f" (one per node of a cluster), not {shown}",
            option="url",
            backend=backend,
        )
    return [_check_url(url, backend) for url in urls]


def _check_url(url: str, backend: str) -> str:
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme not in {"amqp", "amqps"}:
        raise url_refusal(url, backend, "must start with amqp:// or amqps://")
    return url

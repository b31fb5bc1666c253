"""What can go wrong reaching NATS, and what every part of both NATS backends shares to say
it: the name and logger, the server URLs checked, the connection's defaults and its closing,
secrets and their redaction, the message id header, and the translation of nats-py
exceptions."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ... import _redact
from ..._exceptions import BackendError, BackendUnavailableError, ConfigurationError
from .._errors import ErrorMap, ErrorRow, Translating
from .._keywords import parameter_names

if TYPE_CHECKING:
    from nats.aio.client import Client as NATSClient

__all__ = [
    "BACKEND",
    "CALLBACKS",
    "CONNECT_DEFAULTS",
    "MSG_ID",
    "SECRET_OPTIONS",
    "Translated",
    "check_servers",
    "close_client",
    "connect_keywords",
    "describe",
    "import_nats",
    "logger",
    "redact",
]

logger = logging.getLogger("brokersched.backends.nats")

BACKEND = "NATSBackend"
_EXTRA_HINT = "pip install 'brokersched[nats]'"


# Defaults for nats.connect that suit a scheduler (the caller's connect_options win): reconnect
# for ever and quickly, so that claiming resumes by itself shortly after NATS returns, and notice
# a half-open connection within ~30 s instead of nats-py's 4 minutes.
CONNECT_DEFAULTS: dict[str, Any] = {
    "name": "brokersched",
    "max_reconnect_attempts": -1,
    "reconnect_time_wait": 0.5,
    "ping_interval": 10,
    "max_outstanding_pings": 3,
    "connect_timeout": 2,
}
CALLBACKS = ("error_cb", "disconnected_cb", "reconnected_cb", "closed_cb")
# connect_options that hold a secret (nats.connect's keywords)
SECRET_OPTIONS = ("password", "token", "nkeys_seed_str")
# The header JetStream deduplicates messages by.
MSG_ID = "Nats-Msg-Id"


async def close_client(nc: NATSClient) -> None:
    with contextlib.suppress(Exception):
        await nc.close()


def connect_keywords() -> set[str]:
    """The keywords ``nats.connect`` (``Client.connect``) really accepts."""
    from nats.aio.client import Client

    return parameter_names(Client.connect) - {"servers"}


def redact(text: str) -> str:
    """``text`` with the user-info part of every URL (``user:pass@``, ``token@``) replaced.

    The user name stays (it helps to debug permissions); passwords and tokens never appear.
    Only URLs with a scheme are found in free text: a backend also scrubs the secrets it knows.
    """
    return _redact.redact_text(text)


def describe(exc: BaseException, secrets: Sequence[str]) -> str:
    """The text of a client exception, fit for a message: no secret, never empty."""
    return _redact.scrub(redact(str(exc)), secrets) or type(exc).__name__


_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEMES = ("nats", "tls", "ws", "wss")  # what nats-py connects with
_ACCEPTED = "nats://host:4222, tls://host:4222, ws://host:8080, wss://host:443 or host:4222"


def check_servers(servers: object, backend: str = BACKEND) -> list[str]:
    """``servers`` as a list of URLs nats-py can connect to, or a ``ConfigurationError``.

    nats-py takes anything: it reads ``http://host:4222`` as the host ``http`` and fails with a
    DNS error seconds after ``start()``. Scheme-less ``host:port`` (and ``user:pw@host:port``)
    is nats-py's own shorthand for ``nats://``.
    """

    def refused(message: str) -> ConfigurationError:
        return ConfigurationError(message, option="servers", backend=backend)

    found = [servers] if isinstance(servers, str) else servers
    if not isinstance(found, list | tuple) or not found:
        raise refused(
            f"servers of {backend} must be a URL or a non-empty list of URLs ({_ACCEPTED})"
        )
    checked: list[str] = []
    for server in cast(Sequence[object], found):
        if not isinstance(server, str) or not server.strip():
            raise refused(f"server {server!r} of {backend} is not a URL; write {_ACCEPTED}")
        scheme = _scheme(server)
        if scheme is not None and scheme not in _SCHEMES:
            raise refused(
                f"server {_redact.redact_url(server)!r} of {backend} has the scheme {scheme!r};"
                " NATS URLs start with nats://, tls://, ws:// or wss://, in lower case (or have"
                " no scheme: host:4222)"
            )
        checked.append(server)
    websocket = [_scheme(server) in ("ws", "wss") for server in checked]
    if any(websocket) and not all(websocket):
        raise refused(
            f"servers of {backend} mix WebSocket (ws://, wss://) and plain (nats://, tls://)"
            " URLs, which nats-py refuses: list one kind only"
        )
    return checked


def _scheme(server: str) -> str | None:
    match = _SCHEME_RE.match(server)
    return match[1] if match else None


def import_nats(backend: str = BACKEND) -> Any:
    try:
        return importlib.import_module("nats")
    except ImportError as exc:  # the extra is not installed
        raise ConfigurationError(
            f"{backend} needs the nats-py client: {_EXTRA_HINT}", backend=backend
        ) from exc


def _error_rows(secrets: Sequence[str], backend: str) -> list[ErrorRow]:
    """What nats-py's exceptions mean (``backends/_errors.py``'s policy: anything else is
    raised unchanged)."""
    import nats.errors
    import nats.js.errors

    unavailable = (
        OSError,  # includes TimeoutError and nats.errors.TimeoutError
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.ConnectionDrainingError,
        nats.errors.NoServersError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.StaleConnectionError,
        nats.js.errors.NoStreamResponseError,
        nats.js.errors.ServiceUnavailableError,
    )
    return [
        (
            unavailable,
            lambda what, exc: BackendUnavailableError(
                f"{backend}: {what}: NATS unavailable ({describe(exc, secrets)})"
            ),
        ),
        (
            nats.errors.Error,
            lambda what, exc: BackendError(f"{backend}: {what}: {describe(exc, secrets)}"),
        ),
    ]


@functools.cache
def _errors(secrets: tuple[str, ...], backend: str) -> ErrorMap:
    return ErrorMap(functools.partial(_error_rows, secrets, backend), secrets)


class Translated(Translating):
    """Where nats-py exceptions become ``BackendError`` (chained, scrubbed of ``secrets``):
    ``with Translated("claim", msg_id, secrets=...):``."""

    __slots__ = ()

    def __init__(self, *what: str, secrets: Sequence[str] = (), backend: str = BACKEND) -> None:
        super().__init__(_errors(tuple(secrets), backend), " ".join(what))

"""The options of the Redis backends, declared and checked in one call (``backends/_options``):
the server's (``RedisServerOptions``, shared by both backends and their connection), each
backend's own, and the keywords handed on to redis-py."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import ValidationInfo, field_validator

from .._keywords import parameter_names, refuse_unknown
from .._options import (
    BackendOptions,
    BudgetPeriod,
    ClaimOptions,
    Flag,
    LeaseOptions,
    backend_of,
    checked,
    name_check,
    url_refusal,
)

__all__ = [
    "RedisLeaseOptions",
    "RedisOptions",
    "RedisServerOptions",
    "check_client_options",
    "check_prefix",
    "check_url",
]

_SCHEMES = ("redis", "rediss", "unix")
check_prefix = name_check(
    "prefix",
    r"[A-Za-z0-9_.:-]{1,100}",
    "1-100 characters of [A-Za-z0-9_.:-] (no '{', '}' or spaces: the job's hash tag follows it "
    "in every key)",
)


def _client_keywords(cluster: bool) -> Callable[[], set[str]]:
    def keywords() -> set[str]:
        """The keywords redis-py's ``from_url`` and the client's constructor accept; for a
        single server also its pools' and connections' (``from_url`` hands them on:
        ``connection_class``, ``path``, the ``ssl_*`` options...)."""
        import redis.asyncio
        import redis.asyncio.connection as connection
        from redis.asyncio.cluster import RedisCluster

        if cluster:
            return parameter_names(RedisCluster.__init__, RedisCluster.from_url) - {"url"}
        handed_on = (
            connection.ConnectionPool.__init__,
            connection.BlockingConnectionPool.__init__,
            connection.AbstractConnection.__init__,
            connection.Connection.__init__,
            connection.SSLConnection.__init__,
            connection.UnixDomainSocketConnection.__init__,
        )
        client = redis.asyncio.Redis
        return parameter_names(client.__init__, client.from_url, *handed_on) - {"url"}

    return keywords


def check_client_options(
    backend: str, own: Sequence[str], options: Mapping[str, Any], *, cluster: bool
) -> None:
    """Refuse, at construction, a keyword that is neither the backend's nor redis-py's."""
    refuse_unknown(
        backend,
        options,
        own=own,
        library="redis-py's RedisCluster" if cluster else "redis-py's Redis.from_url",
        accepted=_client_keywords(bool(cluster)),
    )


def check_url(url: object, backend: str, *, cluster: bool) -> str:
    """The scheme and the port are checked at construction; the rest by redis-py at start."""
    accepted = "redis://, rediss:// (TLS) or unix:// (a socket path)"
    try:
        if not isinstance(url, str):
            raise ValueError("not a string")
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        scheme = parts.scheme
    except ValueError as exc:
        raise url_refusal(url, backend, f"is not a valid URL ({exc}); use {accepted}") from None
    if scheme not in _SCHEMES:
        raise url_refusal(url, backend, f"must start with {accepted}")
    if cluster and scheme == "unix":
        raise url_refusal(
            url,
            backend,
            "is a unix socket: a Redis Cluster is reached over TCP (redis:// or rediss://)",
        )
    if scheme != "unix" and not parts.hostname:
        raise url_refusal(url, backend, "names no host; e.g. redis://127.0.0.1:6379/0")
    return url


class RedisServerOptions(BackendOptions):
    """Where the server is and how it is used, as both backends take them."""

    cluster: Flag
    url: str
    prefix: Annotated[str, checked(check_prefix)]
    require_persistence: Flag
    budget_interval: BudgetPeriod

    @field_validator("url", mode="before")
    @classmethod
    def _url(cls, value: object, info: ValidationInfo) -> str:
        return check_url(value, backend_of(info), cluster=info.data.get("cluster", False))


class RedisOptions(ClaimOptions, RedisServerOptions):
    """``RedisBackend``'s options."""


class RedisLeaseOptions(LeaseOptions, RedisServerOptions):
    """``RedisLeaseBackend``'s options."""

"""Who may change a scheduler through the admin app: the bearer token (or the host
application's own check), and only from a same-origin page or a client that is not a browser."""

from __future__ import annotations

import inspect
import ipaddress
import secrets
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .._exceptions import ConfigurationError
from ._reply import Reply, error

__all__ = [
    "HOSTS_ENV",
    "MIN_TOKEN_LENGTH",
    "PROXIES_ENV",
    "READ",
    "Authorize",
    "Guard",
    "LoopbackHostsOnly",
    "TrustedProxies",
]

# authorize(request), or authorize(request, action) to decide per action (reads included).
Authorize = Callable[..., bool | Awaitable[bool]]
MIN_TOKEN_LENGTH = 16
HOSTS_ENV = "BROKERSCHED_ADMIN_HOSTS"  # more Host names a loopback server answers to
PROXIES_ENV = "BROKERSCHED_TRUSTED_PROXIES"  # peers whose X-Forwarded-Host is believed

# A request from the dashboard itself, or from a client that is not a browser page (curl).
_SAME_SITE = {"same-origin", "none"}


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The reverse proxies whose ``X-Forwarded-Host`` (or ``Forwarded: host=``) names the host
    the browser asked for: addresses or networks (``127.0.0.1``, ``10.0.0.0/8``, ``::1``), or
    ``*`` for any peer (when nothing but the proxy can reach the app). As uvicorn's and
    gunicorn's ``forwarded_allow_ips``, judged on the peer address the server reports."""

    def __init__(self, spec: str | Iterable[str] | None) -> None:
        if spec is None:
            spec = ()
        items = spec.split(",") if isinstance(spec, str) else list(spec)
        self.any = False
        self.networks: list[Network] = []
        for raw in items:
            item = raw.strip()
            if not item:
                continue
            if item == "*":
                self.any = True
                continue
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ConfigurationError(
                    f"trusted proxy {item[:60]!r} is not an IP address or network; use e.g. "
                    "127.0.0.1, ::1, 10.0.0.0/8 or * (comma-separated in "
                    f"{PROXIES_ENV})",
                    option="trusted_proxies",
                ) from None

    def __bool__(self) -> bool:
        return self.any or bool(self.networks)

    def trusts(self, request: Request) -> bool:
        if self.any:
            return True
        if request.client is None or not self.networks:
            return False
        try:
            peer = ipaddress.ip_address(request.client.host)
        except ValueError:  # a Unix socket's path, a test client's name
            return False
        return any(peer in network for network in self.networks)

    def host(self, request: Request) -> str | None:
        """The host the browser asked for, as a trusted proxy passes it on."""
        if not self.trusts(request):
            return None
        if forwarded := request.headers.get("x-forwarded-host"):
            return forwarded.split(",")[0].strip()
        for part in request.headers.get("forwarded", "").split(",")[0].split(";"):
            key, _, value = part.strip().partition("=")
            if key.lower() == "host" and value:
                return value.strip('"')
        return None


#: What a request may do: read the scheduler, or one change (the routes' actions).
Action = str
READ: Action = "read"


def _takes_action(authorize: Authorize | None) -> bool:
    """Whether the host application's check decides per action: ``authorize(request,
    action)``, rather than ``authorize(request)`` for every change."""
    if authorize is None:
        return False
    try:
        parameters = inspect.signature(authorize).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: the documented one-argument form
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _token(value: str | None, what: str) -> bytes | None:
    if value is not None:
        # read from a file or a secret, it often ends with a newline no header can carry
        value = value.strip()
    if value is not None and len(value) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"the {what} is too short ({len(value)} characters); use at least "
            f"{MIN_TOKEN_LENGTH}, e.g. python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'",
            option="token" if what == "admin token" else "read_token",
        )
    return value.encode() if value else None


class Guard:
    """Who may do what through the app. Two roles: the admin (operator) token, or the host
    application's ``authorize``, may read and change; the read-only token may read. Reading
    is open to anyone unless a read token is configured or ``authorize`` decides per action
    (``authorize(request, action)``, ``action`` being ``"read"`` or a change's name:
    ``trigger``, ``pause``, ``resume``, ``disable``, ``enable``, ``skip``, ``abort``, or
    ``schedule`` for a write of a stored schedule).
    ``refuse()`` and ``refuse_read()`` return the error response, or ``None``."""

    def __init__(
        self,
        token: str | None,
        authorize: Authorize | None,
        proxies: TrustedProxies | None = None,
        read_token: str | None = None,
    ) -> None:
        self._token = _token(token, "admin token")
        self._read_token = _token(read_token, "read token")
        if self._token is not None and self._token == self._read_token:
            raise ConfigurationError(
                "the read token is the admin token: give the read-only role a token of its own",
                option="read_token",
            )
        self._authorize = authorize
        self._per_action = _takes_action(authorize)
        self._proxies = proxies or TrustedProxies(None)

    @property
    def configured(self) -> bool:
        return self._token is not None or self._authorize is not None

    @property
    def token_set(self) -> bool:
        return self._token is not None or self._read_token is not None

    @property
    def reads_protected(self) -> bool:
        """Reading needs credentials: a read token is configured, or the host application's
        check decides reads too."""
        return self._read_token is not None or self._per_action

    async def session(self, request: Request, actions: Iterable[Action]) -> dict[str, object]:
        """What the page may do with the credentials this request carries: read
        (``can_read``), and which of ``actions`` (the changes) it may make; ``authorized``:
        any of them."""
        allowed = [action for action in actions if await self._allows(request, action)]
        reads = await self._allows(request, READ)
        return {
            "changes_enabled": self.configured,
            "token_accepted": self.token_set,
            "authorized": bool(allowed),
            "via": self._via(request) if allowed or reads else None,
            "can_read": reads or not self.reads_protected,
            "reads_protected": self.reads_protected,
            "actions": allowed,
        }

    async def may_read(self, request: Request) -> bool:
        return not self.reads_protected or await self._allows(request, READ)

    async def refuse_read(self, request: Request) -> Reply | None:
        """A read without the credentials reading needs: 401."""
        if await self.may_read(request):
            return None
        return error(
            401,
            "reading needs a token: send Authorization: Bearer <token> (the read-only token or"
            " the admin token)",
            headers={"WWW-Authenticate": 'Bearer realm="brokersched"'},
        )

    async def refuse(self, request: Request, action: Action) -> Reply | None:
        """A change ``action``: refused from another site's page (403), when nothing can
        authorise it (403), without credentials that may make it (401; 403 for credentials
        of a role that may not)."""
        if why := _cross_site(request, self._proxies):
            return error(403, f"cross-site request refused: {why}")
        if not self.configured:
            return error(
                403,
                "changes are disabled: no admin token is configured (set "
                "BROKERSCHED_ADMIN_TOKEN, or pass token= or authorize= to create_app)",
            )
        if await self._allows(request, action):
            return None
        if self._matches(request, self._read_token):
            return error(403, f"the read-only token may not {action}: use the admin token")
        if self._per_action and await self._authorized(request, READ):
            return error(403, f"the host application does not let this session {action}")
        return error(
            401,
            "missing or wrong admin token (send Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": 'Bearer realm="brokersched"'},
        )

    def actor(self, request: Request) -> str:
        """Who made an authorised change, for the audit trail: the host application's user
        (``request.user``, Starlette's authentication) or ``token``, and where from."""
        who = "token" if self._matches(request, self._token) else "host"
        user = request.scope.get("user")
        if user is not None and getattr(user, "is_authenticated", False):
            who = str(getattr(user, "display_name", "") or who)
        client = request.client.host if request.client is not None else "?"
        return f"api:{who}@{client}"

    def _via(self, request: Request) -> str:
        if self._matches(request, self._token):
            return "token"
        return "read-token" if self._matches(request, self._read_token) else "host"

    async def _allows(self, request: Request, action: Action) -> bool:
        if self._matches(request, self._token):
            return True
        if action == READ and self._matches(request, self._read_token):
            return True
        return await self._authorized(request, action)

    @staticmethod
    def _matches(request: Request, token: bytes | None) -> bool:
        if token is None:
            return False
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(given.strip().encode(), token)

    async def _authorized(self, request: Request, action: Action) -> bool:
        """The host application's check: per action when it takes one, else for any."""
        if self._authorize is None:
            return False
        allowed = self._authorize(request, action) if self._per_action else self._authorize(request)
        if inspect.isawaitable(allowed):
            allowed = await allowed
        return allowed is True


def _cross_site(request: Request, proxies: TrustedProxies) -> str | None:
    """Why a browser sent this request from another site, or ``None``.

    Browsers send ``Sec-Fetch-Site`` (and ``Origin`` on a POST) themselves, and a page cannot
    forge them; clients that are not browsers send neither and are judged by the token alone.
    ``Sec-Fetch-Site`` decides when present (every current browser): ``same-origin`` holds
    behind a reverse proxy that passes another ``Host``, which an ``Origin`` never matches.
    Without it (older browsers), ``Origin`` must match ``Host``, or the ``X-Forwarded-Host`` of
    a trusted proxy. (Go's ``net/http.CrossOriginProtection`` decides the same way.)
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return None if site in _SAME_SITE else f"Sec-Fetch-Site is {site!r}"
    origin = request.headers.get("origin")
    if origin is None:
        return None
    host = request.headers.get("host", "")
    forwarded = proxies.host(request)
    asked = {name.lower() for name in (host, forwarded) if name}
    if origin != "null" and urlsplit(origin).netloc.lower() in asked:
        return None
    hint = f" nor X-Forwarded-Host {forwarded!r}" if forwarded else ""
    if not forwarded and not proxies:
        hint = f" (behind a reverse proxy: list it in {PROXIES_ENV})"
    return f"Origin {origin!r} does not match Host {host!r}{hint}"


def _loopback_name(host: str) -> bool:
    """Whether ``host`` (from a ``Host`` header, without port or brackets) names this machine
    only: a loopback address, ``localhost`` or a name under ``.localhost``, which browsers
    never look up in the DNS (RFC 6761)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LoopbackHostsOnly:
    """Refuses a request whose ``Host`` is not a loopback name (nor one of ``extra``), for an
    app served on a loopback address: a page of ``evil.example`` whose name an attacker's DNS
    now resolves to 127.0.0.1 is same-origin with itself, and would read every route (DNS
    rebinding). ``extra``: the names a reverse proxy on this machine passes on."""

    def __init__(self, app: ASGIApp, extra: Iterable[str] = ()) -> None:
        self.app = app
        self.extra = {name.strip().lower().rstrip(".") for name in extra if name.strip()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            name = _host_name(host)
            if name is None or not (_loopback_name(name) or name in self.extra):
                response = JSONResponse(
                    {
                        "error": f"Host {host[:100]!r} refused: this admin server listens on a "
                        "loopback address and answers to loopback names only (127.0.0.1, "
                        "[::1], localhost); a proxy in front of it must pass one of those as "
                        f"Host, or its name must be listed in {HOSTS_ENV}"
                    },
                    status_code=421,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str | None:
    """The name in a ``Host`` header (``name``, ``name:port``, ``[::1]:port``), lowercase."""
    if not host.isascii():
        return None
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:  # "[::1" and the like
        return None
    return name.rstrip(".") if name else None

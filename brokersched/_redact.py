"""Keeping credentials out of ``repr``, error messages and logs: the one implementation.

Three tools, for three situations:

* ``redact_url(url)``: one URL or DSN that we hold (a backend's ``repr``, its error messages),
  with the password shown as ``***``. The scheme is optional (nats-py accepts
  ``alice:pw@host:4222``). The userinfo ends at the LAST ``@``, so a password with an
  unescaped ``@``, ``#``, ``/`` or ``?`` in it is still hidden whole (a query value holding an
  ``@`` then hides a bit more than the password: safe, if less readable). ``password=`` and
  ``sslpassword=``-style parameters are hidden too, in a URL's query string and in a libpq
  ``key=value`` DSN.
* ``url_secrets(url)`` and ``scrub(text, secrets)``: a client's message about a URL we gave it
  may quote the password in any form (percent-decoded, or a piece of it when the client's
  parser cut an unescaped password at a delimiter). A backend lists those forms once and
  scrubs every client text with them (``connection_secrets`` adds the secrets passed as
  keywords); ``scrub_exception`` does the same to a whole chain of exceptions, in place, since
  ``raise ... from exc`` carries the client's text along (``chainable`` says what to chain).
* ``redact_text(text)``: free text whose secrets we do not know (log lines): every
  ``scheme://user:password@`` URL and every ``password=...`` pair in it.

A userinfo without ``:`` is a user name, except for NATS (``nats://``, ``tls://``, ``ws://``,
``wss://`` and scheme-less URLs), where ``token@host`` is a token, a secret.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, unquote_plus

__all__ = [
    "MASK",
    "MIN_DATA_SECRET",
    "chainable",
    "connection_secrets",
    "data_secrets",
    "leaks",
    "redact_json",
    "redact_text",
    "redact_url",
    "scrub",
    "scrub_exception",
    "url_secrets",
]

#: What a secret is replaced with.
MASK = "***"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# A scheme-less string starting with ``key=`` is a libpq keyword/value DSN.
_KEYWORD_DSN = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
# Schemes whose userinfo without ':' is a token (nats-py), not a user name.
_TOKEN_SCHEMES = frozenset({"", "nats", "tls", "ws", "wss"})
# ``password``, ``sslpassword``, ``passwd``...: a parameter that holds a secret.
_KEY = r"(?<![A-Za-z0-9_])(?P<key>[A-Za-z0-9_]*pass(?:word|wd)\s*=\s*)"
# In a URL the value ends at '&' (a '#' may be an unescaped part of it); in a keyword DSN (and
# in free text) at white space, unless it is quoted.
_URL_PARAM = re.compile(_KEY + r"(?P<value>[^&\s]*)", re.IGNORECASE)
_KEYWORD_PARAM = re.compile(_KEY + r"(?P<value>'(?:[^'\\]|\\.)*'|\S*)", re.IGNORECASE)
# A URL inside free text: from its scheme to white space or to a comma before another URL (a
# list of servers is often written with commas and no spaces). Anything else, quotes included,
# may be part of a password: a URL that runs into the next word hides too much, never too little.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?:(?!,[A-Za-z][A-Za-z0-9+.-]*://)\S)*")
# Where a URL parser may cut a password that was not percent-encoded.
_DELIMITERS = re.compile(r"[@/?#&]")
# Shorter pieces of a cut password would blank out common words and tell little of it.
_MIN_PIECE = 3


def redact_url(url: str) -> str:
    """``url`` (a URL, a scheme-less ``user:pw@host``, or a ``key=value`` DSN) with every
    secret replaced by ``***``; the rest (user name, hosts, options) stays readable."""
    if _is_keyword_dsn(url):
        return _KEYWORD_PARAM.sub(_mask_value, url)
    head, userinfo, rest = _split(url)
    if userinfo is not None:
        user, colon, _password = userinfo.partition(":")
        if colon:
            userinfo = f"{user}:{MASK}"
        elif _is_token_scheme(head):
            userinfo = MASK
        head = f"{head}{userinfo}@"
    return head + _URL_PARAM.sub(_mask_value, rest)


def url_secrets(url: str) -> list[str]:
    """Every form in which the secrets of ``url`` could show up in a client's message:
    raw, percent-decoded, unquoted, and the pieces of a password cut at an unescaped
    delimiter. Longest first, so that ``scrub`` replaces a secret whole before its pieces."""
    raw: list[str] = []
    pieces: list[str] = []
    if _is_keyword_dsn(url):
        raw += [_unquote_keyword(m["value"]) for m in _KEYWORD_PARAM.finditer(url)]
    else:
        head, userinfo, rest = _split(url)
        if userinfo is not None:
            user, colon, password = userinfo.partition(":")
            secret = password if colon else (user if _is_token_scheme(head) else "")
            raw.append(secret)
            pieces += _DELIMITERS.split(secret)
        raw += [m["value"] for m in _URL_PARAM.finditer(rest)]
    forms = {form for secret in raw for form in (secret, unquote(secret), unquote_plus(secret))}
    forms.update(piece for piece in pieces if len(piece) >= _MIN_PIECE)
    return sorted((form for form in forms if form), key=lambda form: (-len(form), form))


def connection_secrets(
    urls: Iterable[str], options: Mapping[str, object], keywords: Iterable[str]
) -> list[str]:
    """The secrets of a client's connection, longest first: every form of those in ``urls``
    (``url_secrets``) and the string values of ``options`` (its connect keywords) named in
    ``keywords`` (``password``, ``token``, ...)."""
    found = {secret for url in urls for secret in url_secrets(url)}
    found.update(value for key in keywords if isinstance(value := options.get(key), str) and value)
    return sorted(found, key=lambda form: (-len(form), form))


# Shorter strings of a job's data are not masked in errors: they would blank out common words
# ("eu", "yes") and are no secret worth the name.
MIN_DATA_SECRET = 4


def data_secrets(data: Any) -> list[str]:
    """Every string in a job's ``data`` (in dicts' values, lists and tuples, nested) of at least
    ``MIN_DATA_SECRET`` characters, longest first: what ``scrub`` masks in a handler's error or
    traceback, which may quote it (``KeyError: 'no account for sk-live-...'``)."""
    found = {text for text in _strings(data) if len(text) >= MIN_DATA_SECRET}
    # As a repr shows it too (a KeyError, a dict in a message): backslashes and quotes escaped.
    found |= {repr(text)[1:-1] for text in found}
    return sorted(found, key=lambda text: (-len(text), text))


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [text for item in value for text in _strings(item)]
    return []


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each of ``secrets`` replaced by ``***``.

    ``secrets`` should come longest first (as ``url_secrets`` gives them), so that a secret
    holding another is replaced whole.
    """
    for secret in secrets:
        if secret and secret in text:
            text = text.replace(secret, MASK)
    return text


def redact_json(value: Any) -> Any:
    """A JSON value (a schedule's ``data``) with ``redact_text`` applied to each string in it,
    keys and values, nested: a URL's password is masked and nothing around it (redacting the
    JSON text whole would take a URL to run on to the next ``@`` of the text)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact_text(str(k)): redact_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(item) for item in value]
    return value


def redact_text(text: str) -> str:
    """Free text (a log line, a traceback) with the secrets of every URL and every
    ``password=`` pair in it replaced by ``***``."""
    out: list[str] = []
    start = 0
    for match in _URL_IN_TEXT.finditer(text):
        out.append(_KEYWORD_PARAM.sub(_mask_value, text[start : match.start()]))
        out.append(redact_url(match.group()))
        start = match.end()
    out.append(_KEYWORD_PARAM.sub(_mask_value, text[start:]))
    return "".join(out)


def leaks(exc: BaseException, secrets: Iterable[str]) -> bool:
    """Whether ``exc`` or an exception chained to it shows one of ``secrets``."""
    secrets = [secret for secret in secrets if secret]
    return any(
        secret in text for error in _chain(exc) for text in _texts(error) for secret in secrets
    )


def scrub_exception(exc: BaseException, secrets: Iterable[str]) -> bool:
    """Scrub ``exc`` and every exception chained to it (``__cause__``, ``__context__``) in
    place: their ``args`` and string attributes. Whether none of ``secrets`` shows any more.

    In place because a translated error keeps the client's exception as its cause, and even
    ``raise ... from None`` inside an ``except`` block keeps it as ``__context__``.
    """
    secrets = [secret for secret in secrets if secret]
    if not secrets:
        return True
    for error in _chain(exc):
        _scrub_one(error, secrets)
    return not leaks(exc, secrets)


def chainable(exc: BaseException, secrets: Iterable[str]) -> BaseException | None:
    """``exc`` scrubbed of ``secrets`` in place (with what is chained to it), or ``None`` when
    some text of it still shows one: what a translated error may be raised ``from``."""
    return exc if scrub_exception(exc, secrets) else None


def _split(url: str) -> tuple[str, str | None, str]:
    """``(scheme://, userinfo or None, the rest)``; the userinfo ends at the last ``@``."""
    match = _SCHEME.match(url)
    head = match.group() if match else ""
    rest = url[len(head) :]
    at = rest.rfind("@")
    if at < 0:
        return head, None, rest
    return head, rest[:at], rest[at + 1 :]


def _is_keyword_dsn(url: str) -> bool:
    return _SCHEME.match(url) is None and _KEYWORD_DSN.match(url) is not None


def _is_token_scheme(head: str) -> bool:
    return head.removesuffix("://").lower() in _TOKEN_SCHEMES


def _mask_value(match: re.Match[str]) -> str:
    return match["key"] + MASK if match["value"] else match.group()


def _unquote_keyword(value: str) -> str:
    """The value a libpq keyword DSN means: ``'it\\'s'`` is ``it's``."""
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception reachable through causes and contexts, once each."""
    found: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        error = todo.pop()
        if any(error is seen for seen in found):
            continue
        found.append(error)
        todo += [linked for linked in (error.__cause__, error.__context__) if linked is not None]
        if isinstance(error, BaseExceptionGroup):
            todo += list(error.exceptions)
    return found


def _texts(error: BaseException) -> list[str]:
    try:
        return [str(error), repr(error)]
    except Exception:  # a broken __str__: nothing of it can be shown either
        return []


# Attributes some exceptions print from rather than from ``args``.
_TEXT_ATTRIBUTES = ("strerror", "filename", "filename2", "msg", "message", "detail", "hint")


def _scrub_one(error: BaseException, secrets: list[str]) -> None:
    error.args = tuple(_scrub_arg(arg, secrets) for arg in error.args)
    names = set(_TEXT_ATTRIBUTES) | set(getattr(error, "__dict__", {}))
    for name in names:
        try:
            value = getattr(error, name, None)
            if isinstance(value, str) and scrub(value, secrets) != value:
                setattr(error, name, scrub(value, secrets))
        except Exception:  # a read-only or computed attribute: leaks() tells
            continue


def _scrub_arg(arg: object, secrets: list[str]) -> object:
    """A string scrubbed; another object that shows a secret becomes its scrubbed ``repr``."""
    if isinstance(arg, str):
        return scrub(arg, secrets)
    try:
        text = repr(arg)
    except Exception:
        return "<unprintable>"
    return arg if scrub(text, secrets) == text else scrub(text, secrets)

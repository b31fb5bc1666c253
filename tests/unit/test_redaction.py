"""Secrets never reach a ``repr``, an error (nor anything chained to it) or a log line.

The helpers of ``brokersched._redact`` on their own, then each backend with the URLs that used
to leak: a scheme-less NATS URL, ``@`` ``#`` ``/`` ``?`` in passwords, ``sslpassword=``. Start
failures run against a closed port or the real servers on 127.0.0.1, with every logger at DEBUG.
"""

from __future__ import annotations

import io
import logging
from typing import Any
from urllib.parse import quote, unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brokersched import NATSBackend, NATSLeaseBackend, PostgresBackend
from brokersched._exceptions import BackendUnavailableError
from brokersched._logging import configure_logging
from brokersched._redact import (
    chainable,
    connection_secrets,
    leaks,
    redact_text,
    redact_url,
    scrub,
    scrub_exception,
    url_secrets,
)
from tests.support.redaction import assert_clean, start_fails
from tests.support.wait import free_port

# -- redact_url ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # scheme-less, as nats-py accepts it
        ("alice:S3cretZ@127.0.0.1:4222", "alice:***@127.0.0.1:4222"),
        ("tok3n@127.0.0.1:4222", "***@127.0.0.1:4222"),
        ("127.0.0.1:4222", "127.0.0.1:4222"),
        # the userinfo ends at the last '@'
        ("nats://alice:Pw@Tail9@host:4222", "nats://alice:***@host:4222"),
        ("postgresql://bob:Se?cretQ@host/db", "postgresql://bob:***@host/db"),
        ("amqp://carol:ab#TailX@host/", "amqp://carol:***@host/"),
        ("amqp://carol:ab/TailY@host/", "amqp://carol:***@host/"),
        ("amqp://carol:ab?TailZ@host/vh?heartbeat=5", "amqp://carol:***@host/vh?heartbeat=5"),
        ("amqps://u:p%40ss@host:5671/vh?x=1", "amqps://u:***@host:5671/vh?x=1"),
        # a token, or a user name, by scheme
        ("tls://tok3n@host:4222", "tls://***@host:4222"),
        ("amqp://user@host/", "amqp://user@host/"),
        ("postgresql://bob@host/db", "postgresql://bob@host/db"),
        ("nats://:token@host", "nats://:***@host"),
        # parameters
        (
            "postgresql://bob@127.0.0.1/test?sslmode=require&sslpassword=KeyPassX",
            "postgresql://bob@127.0.0.1/test?sslmode=require&sslpassword=***",
        ),
        (
            "postgresql://db/x?user=app&password=pw&sslmode=verify-full",
            "postgresql://db/x?user=app&password=***&sslmode=verify-full",
        ),
        ("postgresql://h1:5432,h2:5433/x", "postgresql://h1:5432,h2:5433/x"),
        ("host=db password='a b\\' c' user=app", "host=db password=*** user=app"),
        ("host=db sslpassword=KeyPassX user=app", "host=db sslpassword=*** user=app"),
        ("host=db user=app", "host=db user=app"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize(
    ("url", "secrets"),
    [
        ("alice:S3cretZ@127.0.0.1:4222", {"S3cretZ"}),
        ("nats://alice:Pw@Tail9@host", {"Pw@Tail9", "Tail9"}),
        ("amqp://carol:ab#TailX@host/", {"ab#TailX", "TailX"}),
        ("postgresql://bob:Se?cretQ@host/db", {"Se?cretQ", "cretQ"}),
        ("amqps://u:p%40ss@host/", {"p%40ss", "p@ss"}),
        ("amqp://u:a+b@host/", {"a+b", "a b"}),
        ("postgresql://bob@host/db?sslpassword=Key%26X", {"Key%26X", "Key&X"}),
        ("host=db password='it\\'s' user=app", {"it's"}),
        ("tls://tok3n@host", {"tok3n"}),
        ("amqp://user@host/", set()),
    ],
)
def test_url_secrets_lists_every_form(url: str, secrets: set[str]) -> None:
    found = url_secrets(url)
    assert set(found) == secrets
    assert found == sorted(found, key=len, reverse=True)


# '*' would survive as part of the mask
PASSWORDS = st.text(min_size=1, max_size=30).filter(lambda pw: "*" not in pw + unquote(pw))


@given(PASSWORDS, st.sampled_from(["amqp", "amqps", "postgresql", "nats", ""]))
def test_any_password_is_redacted_whole(password: str, scheme: str) -> None:
    head = f"{scheme}://" if scheme else ""
    url = f"{head}user:{password}@127.0.0.1:1/db"
    assert redact_url(url) == f"{head}user:***@127.0.0.1:1/db"
    message = f"cannot log in with {password!r} ({unquote(password)}, {quote(password)!r})"
    scrubbed = scrub(message, url_secrets(url))
    assert password not in scrubbed
    assert unquote(password) not in scrubbed


# A password in free text can only be found up to white space.
PRINTABLE = st.text(
    st.characters(blacklist_categories=("Z", "C"), blacklist_characters="*"), min_size=1
)


@given(PRINTABLE, st.sampled_from(["amqp", "postgresql", "nats"]))
def test_any_password_in_a_log_line_is_redacted_whole(password: str, scheme: str) -> None:
    line = f"connect to {scheme}://user:{password}@127.0.0.1:1/db failed"
    assert redact_text(line) == f"connect to {scheme}://user:***@127.0.0.1:1/db failed"


def test_scrub_replaces_the_longest_secret_first() -> None:
    assert scrub("pw and pw2", ["pw2", "pw"]) == "*** and ***"
    assert scrub("nothing", ["", "absent"]) == "nothing"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
        ("nats://:token@n1:4222,nats://u:p@n2", "nats://:***@n1:4222,nats://u:***@n2"),
        ("lost nats://alice:Pw@Tail9@h:4222 now", "lost nats://alice:***@h:4222 now"),
        ("to amqp://u:x://Tail7@h/ failed", "to amqp://u:***@h/ failed"),
        ("'postgresql://bob:Se?cretQ@h/db'", "'postgresql://bob:***@h/db'"),
        ("url='amqp://carol:ab#TailX@h/' failed", "url='amqp://carol:***@h/' failed"),
        ("dsn postgresql://b@h/t?sslpassword=KeyPassX", "dsn postgresql://b@h/t?sslpassword=***"),
        ("host=db user=app password=hunter2 dbname=x", "host=db user=app password=*** dbname=x"),
        ("sslpassword='a b' sslmode=require", "sslpassword=*** sslmode=require"),
        ("http://host:8080/path and amqp://host/", "http://host:8080/path and amqp://host/"),
    ],
)
def test_redact_text_and_the_log_formatters(text: str, expected: str) -> None:
    assert redact_text(text) == expected
    assert redact_text(text) == expected


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_log_lines_at_debug_carry_no_password(log_format: Any, root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging(log_format, "DEBUG", stream)
    log = logging.getLogger("brokersched.test")
    urls = [
        "nats://alice:Pw@Tail9@127.0.0.1:4222",
        "postgresql://bob:Se?cretQ@127.0.0.1/test",
        "postgresql://bob@127.0.0.1/test?sslpassword=KeyPassX",
        "amqp://carol:ab#TailX@127.0.0.1/",
    ]
    for url in urls:
        log.debug("connecting to %s", url, extra={"url": url})
        try:
            raise RuntimeError(f"refused: {url}")
        except RuntimeError:
            log.debug("failed", exc_info=True)
    output = stream.getvalue()
    for secret in ("Tail9", "cretQ", "KeyPassX", "TailX"):
        assert secret not in output
    assert output.count("***") >= 2 * len(urls)  # the message and the traceback


# -- exceptions ------------------------------------------------------------------------------


def test_scrub_exception_cleans_the_whole_chain_in_place() -> None:
    tail = "TailX"  # in a variable: the traceback prints the lines that raise
    secrets = url_secrets(f"amqp://carol:ab#{tail}@host/")
    try:
        try:
            try:
                raise OSError(13, f"denied for ab#{tail}", f"/tmp/{tail}")
            except OSError as inner:
                raise ValueError(f"port '{tail}@host' is not a number") from inner
        except ValueError:
            raise RuntimeError("client failed", {tail: 1}) from None  # the context stays
    except RuntimeError as exc:
        error = exc
    assert leaks(error, secrets)
    assert scrub_exception(error, secrets)
    assert not leaks(error, secrets)
    assert_clean(error, tail)
    assert error.__context__ is not None
    assert "port '***@host' is not a number" in str(error.__context__)


def test_scrub_exception_reports_what_it_cannot_clean() -> None:
    class Stubborn(Exception):
        def __str__(self) -> str:
            return "always S3cretZ"

    assert not scrub_exception(Stubborn(), ["S3cretZ"])
    assert scrub_exception(Stubborn(), [])
    assert chainable(Stubborn(), ["S3cretZ"]) is None  # raise ... from None: nothing leaks
    cleaned = OSError("refused for S3cretZ")
    assert chainable(cleaned, ["S3cretZ"]) is cleaned
    assert str(cleaned) == "refused for ***"


def test_connection_secrets_are_the_urls_and_the_named_keywords_longest_first() -> None:
    found = connection_secrets(
        ["nats://tok3nQ@h:4222", "nats://alice:p%40ssW@h:4222"],
        {"password": "Opt10nPw", "token": 42, "user": "bob", "nkeys_seed_str": ""},
        ("password", "token", "nkeys_seed_str"),
    )
    assert set(found) == {"tok3nQ", "p%40ssW", "p@ssW", "Opt10nPw"}
    assert [len(secret) for secret in found] == sorted(map(len, found), reverse=True)


# -- NATS ------------------------------------------------------------------------------------


NATS_BACKENDS = pytest.mark.parametrize("cls", [NATSBackend, NATSLeaseBackend])


@NATS_BACKENDS
def test_nats_repr_hides_every_form(cls: type[NATSBackend | NATSLeaseBackend]) -> None:
    backend = cls(
        [
            "alice:S3cretZ@127.0.0.1:4222",
            "nats://alice:Pw@Tail9@127.0.0.1:4222",
            "tls://tok3nQ@127.0.0.1:4222",
        ]
    )
    text = repr(backend)
    for secret in ("S3cretZ", "Tail9", "tok3nQ"):
        assert secret not in text
    assert "alice:***@127.0.0.1:4222" in text


@NATS_BACKENDS
@pytest.mark.parametrize(
    "server", ["alice:S3cretZ@127.0.0.1:{port}", "nats://alice:Pw@Tail9@127.0.0.1:{port}"]
)
async def test_nats_start_error_carries_no_password(
    cls: type[NATSBackend | NATSLeaseBackend], server: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = cls(server.format(port=free_port()), connect_timeout=0.2)
    error = await start_fails(backend, caplog)
    assert isinstance(error, BackendUnavailableError)
    assert "alice:***@127.0.0.1" in str(error)
    assert_clean(error, "S3cretZ", "Tail9")
    assert "S3cretZ" not in caplog.text
    assert "Tail9" not in caplog.text


@NATS_BACKENDS
async def test_nats_connect_options_secrets_stay_out_too(
    cls: type[NATSBackend | NATSLeaseBackend], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    backend = cls(f"nats://127.0.0.1:{port}", connect_timeout=0.2, password="Opt10nPw")
    error = await start_fails(backend, caplog)
    assert_clean(error, "Opt10nPw")
    assert "Opt10nPw" not in repr(backend) + caplog.text


# -- PostgreSQL ------------------------------------------------------------------------------


def test_postgres_repr_hides_every_form() -> None:
    for dsn, secret in [
        ("postgresql://bob:Se?cretQ@127.0.0.1:5432/test", "cretQ"),
        ("postgresql://bob@127.0.0.1/test?sslmode=require&sslpassword=KeyPassX", "KeyPassX"),
        ("host=127.0.0.1 password='Kv Pass' user=bob", "Kv Pass"),
    ]:
        assert secret not in repr(PostgresBackend(dsn))


# -- RabbitMQ --------------------------------------------------------------------------------

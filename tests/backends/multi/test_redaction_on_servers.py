"""Secrets stay out of errors and logs when a real server refuses (tests/unit/test_redaction.py
has the rest): PostgreSQL's and RabbitMQ's own parsers and refusals."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from brokersched import PostgresBackend, RabbitMQBackend
from brokersched._exceptions import BackendUnavailableError, ConfigurationError
from tests.support.redaction import assert_clean, start_fails
from tests.support.wait import free_port


def with_userinfo(dsn: str, userinfo: str, port: int | None = None) -> str:
    parts = urlsplit(dsn)
    return f"{parts.scheme}://{userinfo}@127.0.0.1:{port or parts.port or 5432}{parts.path}"


async def test_postgres_a_password_with_a_question_mark(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncpg reads ``Se?cretQ`` as the start of the query string: a configuration error that
    used to quote ``cretQ``."""
    backend = PostgresBackend(with_userinfo(postgres_dsn, "bob:Se?cretQ"))
    error = await start_fails(backend, caplog)
    assert isinstance(error, ConfigurationError)
    assert error.option == "dsn"
    assert_clean(error, "cretQ")
    assert "cretQ" not in caplog.text


async def test_postgres_sslpassword_and_percent_encoded_passwords(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    closed = free_port()
    dsns = [
        with_userinfo(postgres_dsn, "bob", closed) + "?sslmode=disable&sslpassword=KeyPassX",
        with_userinfo(postgres_dsn, "bob:Se%3FcretQ%40", closed),
        with_userinfo(postgres_dsn, "bob:Pw@Tail9", closed),
    ]
    for dsn in dsns:
        error = await start_fails(PostgresBackend(dsn, schema="unused"), caplog)
        assert isinstance(error, BackendUnavailableError)
        assert_clean(error, "KeyPassX", "Se%3FcretQ%40", "Se?cretQ@", "Tail9")
    for secret in ("KeyPassX", "cretQ", "Tail9"):
        assert secret not in caplog.text


@pytest.mark.parametrize(
    ("password", "secret"),
    [("ab#TailX", "TailX"), ("ab/TailY", "TailY"), ("ab?TailZ", "TailZ")],
)
async def test_rabbitmq_an_unparsable_password_is_a_configuration_error(
    amqp_url: str, password: str, secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aio-pika's URL parser cuts such a password and used to raise a bare ``ValueError``
    quoting a piece of it."""
    port = urlsplit(amqp_url).port or 5672
    backend = RabbitMQBackend(f"amqp://carol:{password}@127.0.0.1:{port}/")
    assert secret not in repr(backend)
    error = await start_fails(backend, caplog)
    assert isinstance(error, ConfigurationError)
    assert (error.option, error.backend) == ("url", "RabbitMQBackend")
    assert "carol:***@127.0.0.1" in str(error)
    assert "percent-encode" in str(error)
    assert_clean(error, secret)
    assert error.__cause__ is None  # nothing of the parser's message (it quoted "ab")
    assert error.__context__ is None
    assert secret not in caplog.text


async def test_rabbitmq_a_refused_login_carries_no_password(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = urlsplit(amqp_url).port or 5672
    for password in ("ab@TailW", "ab%23TailV"):
        backend = RabbitMQBackend(f"amqp://carol:{password}@127.0.0.1:{port}/")
        error = await start_fails(backend, caplog)
        assert isinstance(error, BackendUnavailableError)
        assert_clean(error, "TailW", "TailV", "ab#TailV")
    for secret in ("TailW", "TailV"):
        assert secret not in caplog.text

"""The CLI on Redis: a manual run and its history, and an unreachable server in one line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from tests.support.cli_apps.process import brokersched
from tests.support.names import unique
from tests.support.redis_helpers import delete_keys

APP = "tests.support.cli_apps.redis_app:scheduler"


@pytest.fixture(params=["lease", "claim"])
def redis_env(request: pytest.FixtureRequest, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = unique("cli")
    yield {
        "BROKERSCHED_REDIS_URL": redis_url,
        "BROKERSCHED_TEST_PREFIX": prefix,
        "BROKERSCHED_TEST_REDIS_KIND": request.param,
    }
    asyncio.run(delete_keys(redis_url, prefix))


def test_trigger_and_history_on_redis(redis_env: dict[str, str]) -> None:
    result = brokersched("trigger", APP, "sweep", env=redis_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("job 'sweep' completed in")
    listed = brokersched("history", APP, "sweep", "--json", env=redis_env)
    assert listed.returncode == 0, listed.stderr
    (record,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (record["outcome"], record["reason"], record["attempt"]) == ("completed", "manual", 1)


def test_an_unreachable_redis_exits_3_in_one_line_without_secrets() -> None:
    env = {"BROKERSCHED_REDIS_URL": "redis://app:s3cret@127.0.0.1:1/0"}
    result = brokersched("history", APP, "sweep", env=env)
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("Error: backend unavailable: RedisLeaseBackend could not connect")
    assert "redis://app:***@127.0.0.1:1/0" in lines[0] and "s3cret" not in result.stderr

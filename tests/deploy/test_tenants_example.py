"""examples/tenants under a real ``uvicorn --workers 3`` on PostgreSQL: a tenant created
through the API gets its schedule, whose every slot runs once across the workers; its plan
changed, the slots follow the new one from its effective time; the tenant removed, its reports
stop. Bad input is a 400 naming it, a stale version a 409."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.deploy import Server, get
from tests.support.names import unique
from tests.support.wait import free_port


@pytest.fixture
def schema(postgres_dsn: str) -> Iterator[str]:
    name = unique("deploy_tenants")
    yield name
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def call(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode())


def reports(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_tenant_created_through_the_api_runs_its_schedule_once_per_slot(
    tmp_path: Path, postgres_dsn: str, schema: str
) -> None:
    """About 20 s of real time."""
    port, sent = free_port(), tmp_path / "reports.jsonl"
    env = {
        **os.environ,
        "BROKERSCHED_URL": postgres_dsn,
        "BROKERSCHED_SCHEMA": schema,
        "REPORTS_FILE": str(sent),
    }
    command = [sys.executable, "-m", "uvicorn", "examples.tenants.app:app", "--workers", "3"]
    server = Server([*command, "--port", str(port)], env, tmp_path / "uvicorn.log")
    base = f"http://127.0.0.1:{port}"
    try:
        server.wait_until(lambda: _answers(f"{base}/tenants"), "the app answers")
        status, acme = call("PUT", f"{base}/tenants/acme", {"every": "1s"})
        assert status == 200 and acme["version"] == 1, acme
        status, refused = call("PUT", f"{base}/tenants/acme", {"cron": "0 25 * * *"})
        assert status == 400 and "hour '25' is out of range" in refused["detail"], refused
        status, stale = call("PUT", f"{base}/tenants/acme", {"every": "2s", "version": 7})
        assert status == 409 and stale["detail"]["version"] == 1, stale
        server.wait_until(lambda: len(reports(sent)) >= 5, "5 reports of acme")
        status, changed = call("PUT", f"{base}/tenants/acme", {"every": "2s", "version": 1})
        assert status == 200 and changed["version"] == 2, changed
        change_ms = _ms(changed["effective_at"])
        server.wait_until(
            lambda: sum(r["slot_ms"] >= change_ms for r in reports(sent)) >= 3,
            "3 reports of the second plan",
        )
        status, listed = call("GET", f"{base}/tenants")
        assert [t["id"] for t in listed] == ["tenant-acme"]
        assert call("DELETE", f"{base}/tenants/acme")[0] == 204
        stopped_ms = round(time.time() * 1000) + 3000  # the delete's effective time, about
        time.sleep(5)
        assert call("DELETE", f"{base}/tenants/acme")[0] == 404
        assert server.terminate() < 15, server.text()[-4000:]
    finally:
        server.kill()
    sent_reports = reports(sent)
    slots = Counter(r["slot_ms"] for r in sent_reports)
    assert max(slots.values()) == 1, [s for s, n in slots.items() if n > 1]
    ones = sorted(s for s in slots if s < change_ms)
    twos = sorted(s for s in slots if s >= change_ms)
    assert ones == list(range(ones[0], ones[-1] + 1, 1000)), ones  # none missed
    assert twos == list(range(twos[0], twos[-1] + 1, 2000)) and twos[0] - change_ms < 2000
    assert twos[-1] < stopped_ms + 1000, "a report after the tenant was removed"
    assert len({r["pid"] for r in sent_reports}) >= 2  # the workers share them
    assert {r["tenant"] for r in sent_reports} == {"acme"}


def _answers(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:  # not listening yet
        return False


def _ms(iso: str) -> int:
    from datetime import datetime

    return round(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)

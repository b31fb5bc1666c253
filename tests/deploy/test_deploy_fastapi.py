"""examples/fastapi under a real ``uvicorn --workers 3`` on PostgreSQL: every slot runs once
across the workers, ``/health`` answers, and with ``PROMETHEUS_MULTIPROC_DIR`` one scrape of
``/metrics`` (answered by one worker) counts the runs of all of them."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from tests.support.deploy import Server, get
from tests.support.names import unique
from tests.support.paths import REPO_ROOT
from tests.support.wait import free_port

ROOT = REPO_ROOT


@pytest.fixture
def schema(postgres_dsn: str) -> Iterator[str]:
    name = unique("deploy_fastapi")
    yield name
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def test_uvicorn_three_workers_on_postgres(tmp_path: Path, postgres_dsn: str, schema: str) -> None:
    """About 10 s of real time."""
    port = free_port()
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    env = {
        **os.environ,
        "BROKERSCHED_URL": postgres_dsn,
        "BROKERSCHED_SCHEMA": schema,
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "REPORT_EVERY": "1s",
    }
    command = [sys.executable, "-m", "uvicorn", "examples.fastapi.app:app", "--workers", "3"]
    server = Server([*command, "--port", str(port)], env, tmp_path / "uvicorn.log")
    try:

        def enough() -> bool:
            runs = server.runs()
            refreshing = {pid for pid, job, _ in runs if job == "cache.refresh"}
            reports = [slot for _, job, slot in runs if job == "report.build"]
            return len(refreshing) == 3 and len(reports) >= 6

        server.wait_until(enough, "3 workers refreshing and 6 reports built")
        status, body = get(f"http://127.0.0.1:{port}/health")
        assert status == 200, body
        health = json.loads(body)
        assert health["ready"] is True and health["overdue"] == []

        status, text = get(f"http://127.0.0.1:{port}/metrics")  # answered by one worker
        after = Counter(pid for pid, job, _ in server.runs() if job == "cache.refresh")
        assert status == 200
        scraped = {
            labels["job"]: value
            for labels, value in samples(text, "brokersched_runs_total")
            if labels["outcome"] == "completed"
        }
        # more than any one worker has run, even counted after the scrape: all are summed
        assert scraped["cache.refresh"] > max(after.values()), (scraped, after)
        # gauges add up into one series per job, without a pid label per worker
        active = samples(text, "brokersched_active_runs")
        last = samples(text, "brokersched_last_success_timestamp_seconds")
        assert {labels["job"] for labels, _ in active} == {"report.build", "cache.refresh"}
        assert all("pid" not in labels for labels, _ in active + last), active + last
        assert all(value > 1.7e9 for _, value in last)
        claims = samples(text, "brokersched_claim_duration_seconds_count")
        assert [labels["backend"] for labels, _ in claims] == ["postgres"]

        assert server.terminate() < 15, server.text()[-4000:]
    finally:
        server.kill()

    runs = server.runs()
    reports = Counter(slot for _, job, slot in runs if job == "report.build")
    assert max(reports.values()) == 1, [slot for slot, n in reports.items() if n > 1]
    slots = sorted(reports)
    assert slots == list(range(slots[0], slots[-1] + 1000, 1000)), slots  # none missed
    assert len({pid for pid, job, _ in runs if job == "report.build"}) >= 2  # spread by jitter
    # after the workers exited, their files still hold every run they logged
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, str(multiproc))
    for job, count in Counter(job for _, job, _ in runs).items():
        labels = {"job": job, "outcome": "completed"}
        assert registry.get_sample_value("brokersched_runs_total", labels) == count, job

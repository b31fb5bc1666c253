"""examples/kubernetes/deployment.yaml, as Kubernetes would run it: the container's command as
a real process with the manifest's environment; its probe route answers as the probes expect,
and SIGTERM drains a running job within ``terminationGracePeriodSeconds``."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from brokersched import parse_duration
from tests.support.deploy import Server, get
from tests.support.paths import REPO_ROOT
from tests.support.wait import free_port

MANIFEST = REPO_ROOT / "examples" / "kubernetes" / "deployment.yaml"


def pod() -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and its one container."""
    deployment = yaml.safe_load(MANIFEST.read_text())
    assert deployment["kind"] == "Deployment"
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def container_process(container: dict[str, Any], log: Path, **env: str) -> tuple[Server, int]:
    """The container's command on a free local port, with the manifest's plain env values."""
    port = free_port()
    (declared,) = [each["containerPort"] for each in container["ports"]]
    command = [
        {"python": sys.executable, "0.0.0.0": "127.0.0.1", str(declared): str(port)}.get(arg, arg)
        for arg in container["command"]
    ]
    values = {each["name"]: each["value"] for each in container["env"] if "value" in each}
    return Server(command, {**_base_env(), **values, **env}, log), port


def _base_env() -> dict[str, str]:
    environment = dict(os.environ)
    environment.pop("BROKERSCHED_URL", None)  # the manifest's secret: each test says its own
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return environment


def probe_url(container: dict[str, Any], probe: str, port: int) -> str:
    http = container[probe]["httpGet"]
    (named,) = [each for each in container["ports"] if each["name"] == http["port"]]
    assert named["containerPort"]  # the probe's port is the one the command serves
    return f"http://127.0.0.1:{port}{http['path']}"


def reports(server: Server) -> int:
    return [job for _, job, _ in server.runs()].count("report.build")


def active_runs(port: int, job: str) -> float:
    _, text = get(f"http://127.0.0.1:{port}/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "brokersched_active_runs" and sample.labels["job"] == job:
                return sample.value
    return 0.0


def test_the_manifest_leaves_time_to_drain() -> None:
    spec, container = pod()
    env = {each["name"]: each.get("value") for each in container["env"]}
    drain = parse_duration(env["DRAIN_TIMEOUT"]).total_seconds()
    assert drain + 5 <= spec["terminationGracePeriodSeconds"]  # 5 s to stop serving and exit
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"]["path"] == liveness["httpGet"]["path"] == "/health"
    # liveness restarts only after the default max_late (60 s) has flagged a job, twice over
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 2 * 60


def test_sigterm_drains_a_running_job_within_the_grace_period(tmp_path: Path) -> None:
    """About 6 s: a report takes 3 s; SIGTERM arrives while one is being built."""
    spec, container = pod()
    grace = spec["terminationGracePeriodSeconds"]
    server, port = container_process(
        container, tmp_path / "pod.log", REPORT_EVERY="1s", REPORT_WORK="3s"
    )
    try:
        health = probe_url(container, "readinessProbe", port)
        server.wait_until(lambda: _answers(health) == 200, "ready")
        assert probe_url(container, "livenessProbe", port) == health
        server.wait_until(lambda: active_runs(port, "report.build") == 1, "a report being built")
        built = reports(server)  # the one being built is not among them: it takes 3 s
        took = server.terminate(timeout=grace)
    finally:
        server.kill()
    assert took < grace
    # uvicorn re-raises the signal once it has shut down cleanly
    assert server.process.returncode in (0, -signal.SIGTERM), server.text()[-4000:]
    assert "Application shutdown complete" in server.text()
    # the report SIGTERM found running was finished, not cut: the drain waited for it
    assert reports(server) == built + 1, server.text()[-4000:]
    assert "outcome=interrupted" not in server.text()


def test_the_probe_fails_while_the_backend_is_unreachable(tmp_path: Path) -> None:
    """The pod starts (start(wait=False)) and stays out of the Service: /health answers 503."""
    _, container = pod()
    server, port = container_process(
        container,
        tmp_path / "pod.log",
        BROKERSCHED_URL=f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere",
    )
    try:
        health = probe_url(container, "readinessProbe", port)
        server.wait_until(lambda: _answers(health) is not None, "an answer")
        status, body = get(health)
        assert status == 503
        assert json.loads(body)["ready"] is False
        server.terminate(timeout=pod()[0]["terminationGracePeriodSeconds"])
    finally:
        server.kill()


def _answers(url: str) -> int | None:
    try:
        return get(url)[0]
    except OSError:  # not listening yet
        return None


def test_the_deployment_docs_quote_the_manifest() -> None:
    readme = (MANIFEST.parents[2] / "docs" / "operations.md").read_text()
    spec, container = pod()
    env = {each["name"]: each.get("value") for each in container["env"]}
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    for quoted in (
        f"`DRAIN_TIMEOUT={env['DRAIN_TIMEOUT']}`",
        f"`terminationGracePeriodSeconds` ({spec['terminationGracePeriodSeconds']})",
        f"({readiness['failureThreshold']} failures, {readiness['periodSeconds']} s apart)",
        f"({liveness['failureThreshold']} failures, {liveness['periodSeconds']} s apart)",
    ):
        assert quoted in readme

"""The README runs as written: every Python block type-checks, and the programs among them run
(against the local RabbitMQ, and on the embedded backend as the README says) and stop cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mypy import api as mypy_api

from brokersched.backends.rabbitmq import history_queue_name
from tests.support.helpers import read_until
from tests.support.paths import REPO_ROOT
from tests.support.rabbitmq_helpers import delete_queues, fleet_queues

ROOT = REPO_ROOT
READMES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),  # the reference pages the README links to
    *sorted((ROOT / "examples").glob("**/README.md")),
]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_README_AMQP = "amqp://guest:guest@127.0.0.1/"


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) for every ```python block of the READMEs."""
    blocks = []
    for readme in READMES:
        text = readme.read_text()
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((f"{readme.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


def programs() -> list[tuple[str, str]]:
    return [(where, code) for where, code in python_blocks() if "__main__" in code]


def test_the_readmes_have_python_blocks_a_program_and_a_test() -> None:
    assert len(python_blocks()) >= 1
    assert len(programs()) >= 1
    assert len(readme_tests()) >= 1


def test_every_python_block_type_checks(tmp_path: Path) -> None:
    files = []
    for number, (where, code) in enumerate(python_blocks()):
        path = tmp_path / f"block_{number}.py"
        path.write_text(f"# {where}\n{code}")
        files.append(str(path))
    out, err, status = mypy_api.run(
        ["--strict", "--no-incremental", "--python-version", "3.11", *files]
    )
    assert status == 0, out + err


def readme_tests() -> list[tuple[str, str, str]]:
    """(where, code, name) for every ``async def test_...`` the READMEs show."""
    return [
        (where, code, name)
        for where, code in python_blocks()
        for name in re.findall(r"^async def (test_\w+)", code, re.MULTILINE)
    ]


@pytest.mark.parametrize(
    ("where", "code", "name"), readme_tests(), ids=[name for _, _, name in readme_tests()]
)
async def test_the_tests_the_readme_shows_pass(where: str, code: str, name: str) -> None:
    namespace: dict[str, Any] = {"__name__": f"readme_{name}"}
    exec(compile(code, where, "exec"), namespace)
    await namespace[name]()


def quick_start(tmp_path: Path, code: str) -> Path:
    app = tmp_path / "app.py"
    app.write_text(code)
    return app


def run_until_a_run_completes(app: Path, job: str) -> str:
    """``python app.py`` until it logs a completed run of ``job``, then Ctrl-C: it must stop
    cleanly (exit 0, no traceback)."""
    process = subprocess.Popen(
        [sys.executable, str(app)],
        cwd=app.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        seen = read_until(process.stdout, f"run job={job} ", timeout=60)
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    output = seen + rest
    assert "outcome=completed" in seen, output
    assert process.returncode == 0, output
    assert "SIGINT: stopping" in output, output
    assert "Traceback" not in output, output
    return output


def cli(app: Path, *args: str) -> subprocess.CompletedProcess[str]:
    brokersched = Path(sys.executable).with_name("brokersched")
    return subprocess.run(
        [str(brokersched), *args],
        cwd=app.parent,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},  # a wide table: job names are not cut
    )


@pytest.mark.parametrize(("where", "code"), programs(), ids=[where for where, _ in programs()])
async def test_readme_programs_run_on_rabbitmq_and_stop_cleanly(
    tmp_path: Path, where: str, code: str, amqp_url: str
) -> None:
    app = quick_start(tmp_path, code.replace(_README_AMQP, amqp_url))
    job = re.search(r'\.every\("([^"]+)"', code)
    assert job is not None, f"{where}: the program registers no every() job to watch"
    try:
        run_until_a_run_completes(app, job.group(1))
    finally:  # the history queues it left (claim queues expire by themselves)
        jobs = re.findall(r'\.(?:every|cron|at)\("([^"]+)"', code)
        histories = [history_queue_name("brokersched", name) for name in jobs]
        await delete_queues(amqp_url, [*fleet_queues("brokersched"), *histories])
    # the guarded module is what the CLI imports: it lists the jobs instead of running them
    listed = cli(app, "jobs", "app:scheduler")
    assert listed.returncode == 0, listed.stderr
    assert job.group(1) in listed.stdout
    checked = cli(app, "check", "app:scheduler")
    assert checked.returncode == 0, checked.stderr


def test_the_quick_start_runs_on_the_embedded_backend(tmp_path: Path) -> None:
    """As the README says: ``Scheduler()`` alone, no server."""
    [(_, code), *_] = programs()
    embedded, count = re.subn(r"Scheduler\(backend=RabbitMQBackend\([^)]*\)\)", "Scheduler()", code)
    assert count == 1
    app = quick_start(tmp_path, embedded.replace("RabbitMQBackend, ", ""))
    run_until_a_run_completes(app, "outbox.flush")

"""gunicorn serving examples/fastapi with pre-forked uvicorn workers.

    gunicorn -c examples/gunicorn/gunicorn.conf.py examples.fastapi.app:app

``preload_app``: the application (and its ``Scheduler``) is imported once, in the master, and
the workers are forked from it; each worker starts its scheduler in the app's lifespan, with an
``instance_id`` and a jitter of its own. ``graceful_timeout`` must exceed the scheduler's
``drain_timeout`` (10 s by default), or gunicorn kills workers that are still draining.
"""

import os
from typing import Any

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WORKERS", "3"))
worker_class = "uvicorn_worker.UvicornWorker"
preload_app = True
graceful_timeout = 15
timeout = 30


def child_exit(server: Any, worker: Any) -> None:
    """With PROMETHEUS_MULTIPROC_DIR, forget a dead worker's live gauges (active runs)."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)

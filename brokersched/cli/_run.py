"""``brokersched run``: serve the scheduler (and its metrics and admin API) until a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .._durations import format_duration
from .._exceptions import ConfigurationError
from .._logging import LogFormat, configure_logging
from .._scheduler import Scheduler
from ._app import EXIT_FAILED, EXIT_OK, CLIError, load_app, log_options, override_option, run_async
from ._group import EPILOG, cli
from ._output import shown_backend

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from ..web._serve import HTTPServer

__all__ = ["run"]

logger = logging.getLogger("brokersched.cli")


@cli.command(epilog=EPILOG)
@click.argument("app", metavar="APP")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (0: any free port, logged at start).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option(
    "--http",
    "http",
    metavar="HOST:PORT",
    help="Serve the admin API and dashboard (brokersched[web]), e.g. 127.0.0.1:8080; "
    "another address than loopback needs BROKERSCHED_ADMIN_TOKEN.",
)
@click.option(
    "--no-schedule",
    is_flag=True,
    help="Arm no job here (as BROKERSCHED_ENABLED=false): jobs stay listed and run on "
    "trigger (--http), e.g. on web replicas.",
)
@override_option
@log_options
def run(
    app: str,
    metrics_port: int | None,
    metrics_host: str,
    http: str | None,
    no_schedule: bool,
    overrides: tuple[str, ...],
    log_format: LogFormat,
    log_level: str,
) -> None:
    """Run the scheduler until SIGINT or SIGTERM, then drain running jobs."""
    configure_logging(log_format, log_level)
    scheduler = load_app(app, overrides)
    if no_schedule:
        scheduler.enabled = False
    metrics = (metrics_host, metrics_port) if metrics_port is not None else None
    web = _admin_server(scheduler, http) if http is not None else None
    run_async(_serve(scheduler, metrics, web, app))


def _admin_server(scheduler: Scheduler[Any], address: str) -> HTTPServer:
    try:
        from ..web._serve import HTTPServer, parse_address
    except ImportError as exc:
        raise CLIError(f"--http needs {exc.name}: pip install 'brokersched[web]'") from None
    try:
        return HTTPServer(scheduler, *parse_address(address))
    except ConfigurationError as exc:
        raise CLIError(str(exc)) from None


async def _start_admin(web: HTTPServer) -> None:
    try:
        url = await web.start()
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise CLIError(f"cannot serve --http {web.address}: {why}") from None
    logger.info("serving the admin API and dashboard on %s", url, extra={"http_url": url})
    # How the buttons are used; never the token itself (this line goes to the logs).
    if web.token_set:
        logger.info(
            "dashboard buttons: sign in on the page with the admin token (the value of "
            "BROKERSCHED_ADMIN_TOKEN)"
        )
    else:
        logger.info(
            "dashboard read-only: set BROKERSCHED_ADMIN_TOKEN (16+ characters) for its "
            "trigger, pause and resume buttons"
        )


async def _serve(
    scheduler: Scheduler[Any],
    metrics: tuple[str, int] | None,
    web: HTTPServer | None = None,
    app: str = "the application",
) -> None:
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():  # a second signal: the user does not want to wait for the drain
            logger.warning("second %s: exiting now, without waiting for running jobs", name)
            _exit_now(EXIT_FAILED)
        logger.info("%s: stopping", name)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    server = _serve_metrics(scheduler, *metrics) if metrics is not None else None
    try:
        if web is not None:
            await _start_admin(web)
        await scheduler.start()
        _log_started(scheduler, app)
        stopped = asyncio.ensure_future(scheduler.wait_stopped())
        requested = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, requested}, return_when=asyncio.FIRST_COMPLETED)
        requested.cancel()
        stopped.cancel()
        drain = format_duration(scheduler.options.drain_timeout)
        logger.info(
            "draining running jobs (up to %s)", drain, extra={"running": _running(scheduler)}
        )
        await scheduler.stop()
        logger.info("stopped")
    finally:
        if web is not None:
            await web.stop()
        if server is not None:
            server.shutdown()
            server.server_close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if left := _running(scheduler):
        # stop() recorded them as abandoned; a sync handler's thread cannot be cancelled, and
        # the interpreter would wait for it at exit.
        logger.warning(
            "runs of %d job(s) outlived drain_timeout: exiting without waiting for them", left
        )
        _exit_now(EXIT_OK)


def _exit_now(code: int) -> NoReturn:
    logging.shutdown()  # flush the log lines written so far
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _running(scheduler: Scheduler[Any]) -> int:
    """How many jobs have a run going here."""
    return sum(job.is_running for job in scheduler.jobs())


def _log_started(scheduler: Scheduler[Any], app: str) -> None:
    backend = shown_backend(scheduler)
    jobs = scheduler.jobs()
    if not jobs:
        logger.warning(
            "%s registers no jobs: nothing will run (are the jobs registered on another "
            "Scheduler, or in a module %s does not import?)",
            app,
            app.rpartition(":")[0],
        )
    logger.info(
        "started %d job(s) on %s as instance %s%s",
        len(jobs),
        backend,
        scheduler.instance_id,
        "" if scheduler.enabled else " with scheduling disabled (jobs run on trigger only)",
        extra={
            "backend": backend,
            "jobs": [job.name for job in jobs],
            "instance_id": scheduler.instance_id,
            "enabled": scheduler.enabled,
        },
    )


def _serve_metrics(scheduler: Scheduler[Any], host: str, port: int) -> WSGIServer:
    from .._metrics import PrometheusMetrics

    try:
        import prometheus_client
    except ImportError:
        raise CLIError(
            "--metrics-port needs prometheus-client: pip install 'brokersched[prometheus]'"
        ) from None
    # The process-wide registry: the application's own metrics are served too.
    PrometheusMetrics(registry=prometheus_client.REGISTRY).attach(scheduler)
    try:
        server, _ = prometheus_client.start_http_server(
            port, addr=host, registry=prometheus_client.REGISTRY
        )
    except OSError as exc:
        raise CLIError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    bound = server.server_port
    logger.info(
        "serving metrics on http://%s:%d/metrics", host, bound, extra={"metrics_port": bound}
    )
    return server

"""The admin dashboard on the embedded backend: two instances of one application in this
process (no server), a few jobs, one of which sometimes fails, one slower than its interval.

    python examples/dashboard/app.py                  # then open http://127.0.0.1:8080/

Each instance claims slots from the same store, so the timelines show two lanes. The buttons
need the admin token: set ``BROKERSCHED_ADMIN_TOKEN``, or use the one printed at start. One
instance alone, through the CLI: ``brokersched run examples/dashboard/app.py:scheduler --http
127.0.0.1:8080``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import signal
import socket
from collections.abc import Iterator

import uvicorn

from brokersched import JobContext, MemoryBackend, Scheduler
from brokersched.backends.memory import MemoryStore
from brokersched.web import TOKEN_ENV, create_app


async def flush_outbox(ctx: JobContext) -> None:
    await asyncio.sleep(0.05)


async def sync_payments(ctx: JobContext) -> None:
    await asyncio.sleep(0.1)
    if random.random() < 0.3:  # a red dot now and then
        raise RuntimeError("the payment provider timed out")


async def export(ctx: JobContext) -> None:
    # longer than its 5 s: the next slot is skipped (overlap); a stop ends it at once
    await ctx.wait_aborted(timeout=7)


def build(instance_id: str, store: MemoryStore) -> Scheduler[MemoryBackend]:
    scheduler = Scheduler(MemoryBackend(store=store), instance_id=instance_id)
    scheduler.every("outbox.flush", "2s", flush_outbox, timeout="1s")
    scheduler.every("payments.sync", "3s", sync_payments, max_attempts=1)
    scheduler.every("export.slow", "5s", export, timeout="30s")
    # data is never shown by the API or the page: only "***"
    scheduler.cron("report.daily", "0 8 * * *", flush_outbox, data={"smtp_password": "s3cret"})
    return scheduler


store = MemoryStore()  # what a shared database would be to several processes
scheduler = build("instance-1", store)  # the one `brokersched run ...:scheduler` serves


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # main() handles Ctrl-C and SIGTERM: the server stops, then the schedulers drain


async def main(host: str, port: int, seconds: float | None) -> None:
    if not os.environ.get(TOKEN_ENV):  # a token for this run, so that the buttons work
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(24)
        print(f"admin token for the buttons: {os.environ[TOKEN_ENV]}")
    second = build("instance-2", store)  # another instance: its runs get a lane of their own
    config = uvicorn.Config(create_app(scheduler), lifespan="off", timeout_graceful_shutdown=1)
    server = Server(config)
    sock = socket.create_server((host, port))  # port 0: any free port
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, setattr, server, "should_exit", True)
    if seconds is not None:  # a short run
        loop.call_later(seconds, setattr, server, "should_exit", True)
    async with scheduler, second:
        print(f"dashboard: http://{host}:{sock.getsockname()[1]}/", flush=True)
        await server.serve([sock])  # until Ctrl-C


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="loopback: reading is open to all")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--seconds", type=float, help="stop after this long (default: Ctrl-C)")
    args = parser.parse_args()
    asyncio.run(main(args.host, args.port, args.seconds))

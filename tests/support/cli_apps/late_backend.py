"""Jobs registered first, the backend chosen afterwards (from settings, say).

Registration validated the jobs against the default MemoryBackend; ``Scheduler.check()`` finds
what the real backend refuses.
"""

from __future__ import annotations

from typing import Any

from brokersched import JobContext, RabbitMQBackend, Scheduler


async def noop(ctx: JobContext) -> None:
    pass


def create() -> Scheduler[Any]:
    scheduler: Scheduler[Any] = Scheduler(jitter=0)
    scheduler.every("exclusive", "1m", noop, overlap="skip")
    scheduler.every("persistent", "1m", noop, max_attempts=5, catch_up="10m")
    scheduler.every("fine", "1m", noop)
    scheduler.backend = RabbitMQBackend("amqp://app:s3cret@127.0.0.1:1/")
    return scheduler

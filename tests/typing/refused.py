"""Must NOT type-check: every line marked ``# E`` is an error for mypy and pyright."""

from datetime import UTC, datetime

from brokersched import JobContext, MemoryBackend, NATSBackend, RabbitMQBackend, Scheduler


async def flush(ctx: JobContext) -> None: ...


when = datetime(2027, 1, 1, tzinfo=UTC)
rabbit = Scheduler(RabbitMQBackend("amqp://guest:guest@127.0.0.1/"))
nats = Scheduler(NATSBackend("nats://127.0.0.1:4222"))
memory = Scheduler(MemoryBackend())

rabbit.every("a", "5s", flush, overlap="allow")  # E
rabbit.every("b", "5s", flush, max_attempts=1)  # E
rabbit.every("c", "5s", flush, catch_up="1m")  # E
rabbit.cron("d", "* * * * *", flush, overlap="skip")  # E
nats.every("e", "5s", flush, overlap="allow")  # E
nats.at("f", when, flush, catch_up="1m")  # E
nats.every("g", "5s", overlap="allow")  # E
memory.at("h", when, flush, overlap="skip")  # E
memory.every("i", "5s", flush, max_late_ms=5000)  # E
memory.every("j", "5s", flush, timezone="UTC")  # E
memory.cron("k", "* * * * *", flush, offset="1s")  # E

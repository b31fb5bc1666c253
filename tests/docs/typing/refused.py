"""Must NOT type-check: every line marked ``# E`` is an error for mypy and pyright."""

from datetime import UTC, datetime

from brokersched import (
    JobContext,
    MemoryBackend,
    NATSBackend,
    RabbitMQBackend,
    RedisBackend,
    Retry,
    RunEvent,
    Scheduler,
    SkipEvent,
)


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


def on_skip(event: SkipEvent) -> None: ...


def on_run(event: RunEvent) -> None: ...


memory.on("complete", on_skip)  # E
memory.on("skip", on_run)  # E
memory.on("finish", on_run)  # E

redis_claims = Scheduler(RedisBackend("redis://127.0.0.1:6379/0"))
redis_claims.every("r1", "5s", flush, overlap="allow")  # E
redis_claims.every("r2", "5s", flush, max_attempts=2)  # E
redis_claims.cron("r3", "* * * * *", flush, catch_up="1m")  # E

memory.at("s1", when, flush, run_on_start=True)  # E
memory.after("s2", "2s", flush, jitter="1s")  # E
rabbit.after("s3", "2s", flush, catch_up="1m")  # E
memory.every("s4", "5s", flush, key=3)  # E
memory.after("s5", "2s", flush, run_on_start=True)  # E
Scheduler(enabled="no")  # E
Scheduler(overrides={"digest.daily": "0 * * * *"})  # E
memory.every("s6", "5s", flush, retry=3)  # E
Retry(3)  # E
Retry(attempts="3")  # E
memory.every("s7", "5s", flush, dst="skip")  # E
memory.cron("s8", "30 2 * * *", flush, dst="twice")  # E

rabbit.every("p1", "5s", flush, overlap="replace")  # E
redis_claims.cron("p2", "* * * * *", flush, overlap="replace")  # E
memory.at("p3", when, flush, overlap="replace")  # E
memory.every("p4", "5s", flush, overlap="cancel")  # E

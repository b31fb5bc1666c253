"""Must type-check: lease options on lease backends, common options everywhere."""

from datetime import UTC, datetime

from brokersched import (
    JobContext,
    MemoryBackend,
    NATSBackend,
    NATSLeaseBackend,
    PostgresBackend,
    RabbitMQBackend,
    RecordDroppedEvent,
    RedisBackend,
    RedisLeaseBackend,
    Retry,
    RunEvent,
    Scheduler,
    SkipEvent,
    SQLiteBackend,
    StartEvent,
)


async def flush(ctx: JobContext) -> None: ...


def sync_flush(ctx: JobContext) -> None: ...


when = datetime(2027, 1, 1, tzinfo=UTC)

lease = Scheduler(PostgresBackend("postgresql://127.0.0.1/test"))
lease.every("a", "5s", flush, overlap="allow", max_attempts=1, catch_up="1m", timeout="4s")
lease.cron("b", "0 8 * * MON-FRI", flush, timezone="Europe/Paris", overlap="skip", catch_up=0)
lease.at("c", when, flush, max_attempts=1, catch_up="1h", max_late="1h")
Scheduler(SQLiteBackend("/tmp/x.db")).every("d", "1m", sync_flush, max_attempts=2)
Scheduler().every("e", "1m", flush, overlap="allow")  # the embedded MemoryBackend
Scheduler(MemoryBackend(lease_ttl="10s")).every("e2", "1m", flush, catch_up=0)


@lease.every("f", "1m", overlap="allow")
async def decorated(ctx: JobContext) -> None: ...


rabbit = Scheduler(RabbitMQBackend("amqp://guest:guest@127.0.0.1/", slot_ttl="5m"))
rabbit.every("outbox.flush", "5s", flush, timeout="4s", jitter="1s", max_late="30s")
rabbit.cron("digest", "0 8 * * MON-FRI", flush, timezone="Europe/Paris", jitter="30s")
rabbit.cron("nightly", "30 2 * * *", flush, timezone="Europe/Paris", dst="run-twice")
lease.cron("nightly", "30 2 * * *", flush, dst="skip", overlap="skip")
rabbit.at("migrate", when, flush, max_late="1h", data={"batch": 10}, claim=True)
Scheduler(NATSBackend("nats://127.0.0.1:4222")).every("g", "1m", flush, history_size=10)


@rabbit.every("h", "1m", timeout="10s")
def decorated_sync(ctx: JobContext) -> None: ...


# a handler may return a value (kept as RunRecord.result) and read the previous run's
@rabbit.every("totals", "1m")
async def totals(ctx: JobContext) -> dict[str, int]:
    previous = await ctx.previous
    sent: int = previous.result["sent"] if previous and previous.result else 0
    return {"sent": sent + 1}


@rabbit.every("sync-totals", "1m")
def sync_totals(ctx: JobContext) -> int:
    previous = ctx.previous.get(timeout=5)
    return 1 if previous is None else previous.attempt


Scheduler(record_results=False).every("quiet", "1m", sync_totals)


# typed listeners: each event name takes a listener of its own event type (or of any Event)
def on_skip(event: SkipEvent) -> None: ...


async def on_start(event: StartEvent) -> None: ...


def on_run(event: RunEvent) -> None: ...


def on_any(event: SkipEvent | StartEvent | RunEvent) -> None: ...


rabbit.on("skip", on_skip)
rabbit.on("start", on_start)
rabbit.on("complete", on_run)
rabbit.on("fail", on_run)
rabbit.on("skip", on_any)
rabbit.on("fail", lambda event: print(event.outcome, event.exception))
rabbit.on("claim", lambda event: print(event.backend, event.seconds))


def on_dropped(event: RecordDroppedEvent) -> None: ...


rabbit.on("record-dropped", on_dropped)
rabbit.on("record-dropped", lambda event: print(event.run_id, event.dropped))

redis_claims = Scheduler(RedisBackend("redis://127.0.0.1:6379/0", slot_ttl="5m", cluster=False))
redis_claims.every("r1", "5s", flush, timeout="4s", jitter="1s", history_ttl="1d")
redis_leases = Scheduler(RedisLeaseBackend("redis://127.0.0.1:6379/0", lease_ttl="30s"))
redis_leases.every("r2", "5s", flush, overlap="allow", max_attempts=2, catch_up="1m")
nats_leases = Scheduler(NATSLeaseBackend("nats://127.0.0.1:4222", bucket="jobs", lease_ttl="30s"))
nats_leases.every("n1", "5s", flush, overlap="skip", max_attempts=2, catch_up="1m")
nats_leases.cron("n2", "* * * * *", flush, history_ttl="1d", history_size=50)


# wave 2: key, run_on_start, after(), enabled, overrides
rabbit.every("sync", "5m", flush, key="sync-v2", run_on_start=True)
rabbit.cron("digest.daily", "0 8 * * *", flush, run_on_start=False, key="digest")
lease.every("recover", "1h", flush, run_on_start=True, overlap="skip", key="recover-v1")
lease.cron("recover2", "0 * * * *", flush, run_on_start=True, catch_up=0)
rabbit.after("cache.warm", "2s", flush, claim=False)
lease.after("sweep", 0, sync_flush, timeout="1m", key="sweep-v2", data={"a": 1})
off = Scheduler(enabled=False)


@rabbit.after("warm2", "2s", claim=False)
async def warm(ctx: JobContext) -> None: ...


Scheduler(overrides={"digest.daily": {"cron": "0 * * * *"}, "purge": {"enabled": False}})
Scheduler(RabbitMQBackend("amqp://127.0.0.1/"), enabled=False, overrides={"a": {"every": 5}})


# wave 3: retry= on every backend, backfill
rabbit.every("billing", "1h", flush, retry=Retry(attempts=5, backoff="30s", on=ConnectionError))
lease.cron("report", "0 6 * * *", flush, retry=Retry(max_backoff="5m", deadline="2h"))
lease.after("boot.retry", "1s", flush, retry=Retry(attempts=2, on=(OSError, TimeoutError)))


async def backfill() -> None:
    steps = await lease.backfill("report", when, when, rate=2.0, dry_run=True)
    print([(step.at, step.status, step.record) for step in steps])


# overlap="replace" on every lease backend
lease.every("feed", "10s", flush, overlap="replace")
nats_leases.cron("feed.cron", "* * * * *", flush, overlap="replace", max_late="30s")
Scheduler().every("feed.memory", "1m", flush, overlap="replace")

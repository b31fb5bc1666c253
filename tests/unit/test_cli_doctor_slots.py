"""``brokersched doctor`` gives the backend the slots of the application's claimed jobs within
one slot memory from now (RabbitMQ names the open-files limit their claim queues need from
them): every slot of each claimed job in that window, none of an unclaimed job's, none of a
lease backend's."""

from __future__ import annotations

from collections import Counter

from brokersched import JobContext, MemoryBackend, RabbitMQBackend, Scheduler
from brokersched.cli._ops import _slots_ahead


def noop(ctx: JobContext) -> None:
    pass


def test_the_slots_of_one_slot_memory_of_each_claimed_job() -> None:
    scheduler = Scheduler(RabbitMQBackend(slot_ttl="5m"), max_late="10s")
    scheduler.every("often", "1s", noop)
    scheduler.every("tens", "10s", noop)
    scheduler.every("local", "1s", noop, claim=False)
    scheduler.cron("daily", "0 8 * * *", noop)
    counts = Counter(slot.job for slot in _slots_ahead(scheduler))
    assert counts["often"] in (300, 301)
    assert counts["tens"] in (30, 31)
    assert "local" not in counts
    assert counts["daily"] <= 1


def test_a_lease_backend_gets_none() -> None:
    scheduler = Scheduler(MemoryBackend())
    scheduler.every("often", "1s", noop)
    assert _slots_ahead(scheduler) == []

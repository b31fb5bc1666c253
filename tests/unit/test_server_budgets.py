"""The servers' budgets without a server: each backend's pure ``read_budget``
from its server's real reply shapes (Redis 7.0 ``INFO`` as redis-py parses it, NATS
``$JS.API.INFO`` answers of nats-server 2.9 and 2.15, PostgreSQL's row), and the shared
``BudgetWatch``'s states on the virtual clock (warn, shed, hysteresis, failing reads)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from nats.js.api import AccountInfo
from redis._parsers.helpers import parse_info

from brokersched._exceptions import BackendError
from brokersched.abc import BrokerBudget
from brokersched.backends._budget import BudgetWatch, Effects, Part, judge
from brokersched.backends.nats._budget import read_budget as nats_budget
from brokersched.backends.postgres._budget import read_budget as postgres_budget
from brokersched.backends.redis._budget import read_budget as redis_budget
from brokersched.testing import TestClock

# -- Redis ---------------------------------------------------------------------------------

# Lines of a Redis 7.0.15 server's INFO memory and INFO clients (trimmed).
INFO = """# Memory\r
used_memory:{used}\r
used_memory_human:1.57M\r
used_memory_startup:876424\r
maxmemory:{maxmemory}\r
maxmemory_human:2.00M\r
maxmemory_policy:{policy}\r
mem_not_counted_for_evict:0\r
# Clients\r
connected_clients:{clients}\r
cluster_connections:0\r
{maxclients}blocked_clients:0\r
"""


def redis_info(
    used: int, maxmemory: int, policy: str, clients: int = 3, maxclients: int | None = 10000
) -> dict[str, object]:
    text = INFO.format(
        used=used,
        maxmemory=maxmemory,
        policy=policy,
        clients=clients,
        maxclients="" if maxclients is None else f"maxclients:{maxclients}\r\n",
    )
    return dict(parse_info(text.encode()))


@pytest.mark.parametrize(
    ("used", "policy", "state"),
    [
        (1_200_000, "allkeys-lru", "ok"),
        (1_300_000, "allkeys-lru", "warn"),
        (1_700_000, "volatile-lru", "shed"),
        (1_700_000, "noeviction", "warn"),  # a full Redis refuses writes: claims fail closed
        (2_100_000, "noeviction", "warn"),
    ],
)
def test_redis_memory_sheds_only_under_an_evicting_policy(
    used: int, policy: str, state: str
) -> None:
    budget = redis_budget([("", redis_info(used, 2_097_152, policy))])
    assert (budget.state, budget.used) == (state, pytest.approx(used / 2_097_152))
    assert budget.detail.startswith("used_memory ")
    assert budget.detail.endswith("; 3 of maxclients 10000 clients")


def test_redis_clients_warn_and_the_fullest_primary_decides() -> None:
    nodes = [
        ("127.0.0.1:7000", redis_info(100, 0, "noeviction", clients=9_000)),
        ("127.0.0.1:7001", redis_info(1_000_000, 4_000_000, "noeviction")),
    ]
    budget = redis_budget(nodes)
    assert (budget.state, budget.used) == ("warn", 0.9)  # clients never shed
    assert budget.detail.startswith("127.0.0.1:7000: 9000 of maxclients 10000 clients")
    assert "127.0.0.1:7000: used_memory 100 B, no maxmemory" in budget.detail


def test_redis_without_limits_or_maxclients() -> None:
    """No maxmemory, maxclients unknown (Redis before 7 with CONFIG refused)."""
    budget = redis_budget([("", redis_info(1_000_000, 0, "noeviction", maxclients=None))])
    assert (budget.state, budget.used, budget.detail) == (
        "ok",
        0.0,
        "used_memory 976.6 KB, no maxmemory",
    )
    assert redis_budget([]).detail == "INFO tells neither memory nor clients"


# -- NATS ----------------------------------------------------------------------------------

# $JS.API.INFO answers: nats-server 2.9.10 (no limits), 2.15.1 with an account's limits.
UNLIMITED = """{"type":"io.nats.jetstream.api.v1.account_info_response","memory":0,
"storage":328,"streams":2,"consumers":0,"limits":{"max_memory":-1,"max_storage":-1,
"max_streams":-1,"max_consumers":-1,"max_ack_pending":-1,"memory_max_stream_bytes":-1,
"storage_max_stream_bytes":-1,"max_bytes_required":false},"api":{"total":2067,"errors":621}}"""
LIMITED = """{"type":"io.nats.jetstream.api.v1.account_info_response","memory":0,
"storage":%d,"reserved_memory":0,"reserved_storage":0,"streams":3,"consumers":0,
"limits":{"max_memory":524288,"max_storage":1048576,"max_streams":8,"max_consumers":-1,
"max_ack_pending":-1,"memory_max_stream_bytes":-1,"storage_max_stream_bytes":-1,
"max_bytes_required":false},"api":{"level":5,"total":0,"errors":0}}"""
# Tiered limits (an operator's account JWT): the top level's limits are zero, each tier's
# are its own (the shape of the JetStream API's account_info_response schema).
TIERED = """{"type":"io.nats.jetstream.api.v1.account_info_response","memory":0,
"storage":900000,"streams":1,"consumers":0,"limits":{"max_memory":0,"max_storage":0,
"max_streams":0,"max_consumers":0,"max_ack_pending":0,"memory_max_stream_bytes":0,
"storage_max_stream_bytes":0,"max_bytes_required":false},"api":{"total":1,"errors":0},
"tiers":{"R1":{"memory":0,"storage":900000,"streams":1,"consumers":0,"limits":{
"max_memory":-1,"max_storage":1000000,"max_streams":-1,"max_consumers":-1,
"max_ack_pending":-1,"memory_max_stream_bytes":-1,"storage_max_stream_bytes":-1,
"max_bytes_required":false}}}}"""


def account(text: str) -> AccountInfo:
    return AccountInfo.from_response(json.loads(text))


def test_an_account_without_limits_reads_as_unlimited() -> None:
    budget = nats_budget(account(UNLIMITED), max_payload=1048576, version="2.9.10")
    assert (budget.state, budget.used) == ("ok", 0.0)
    assert budget.detail == (
        "the account has no JetStream limits; server 2.9.10, max_payload 1.0 MB"
    )


@pytest.mark.parametrize(
    ("storage", "state"), [(600_000, "ok"), (700_000, "warn"), (840_000, "shed")]
)
def test_storage_near_the_account_limit_sheds(storage: int, state: str) -> None:
    budget = nats_budget(account(LIMITED % storage))
    assert (budget.state, budget.used) == (state, pytest.approx(storage / 1048576))
    assert budget.detail.startswith("storage ")
    assert "of 1.0 MB; streams 3 of 8; memory 0 B of 512.0 KB" in budget.detail


def test_streams_near_max_streams_only_warn_and_tiers_count() -> None:
    full = json.loads(LIMITED % 0)
    full["streams"] = 8
    budget = nats_budget(AccountInfo.from_response(full))
    assert (budget.state, budget.used) == ("warn", 1.0)
    tiered = nats_budget(account(TIERED))
    assert (tiered.state, tiered.used) == ("shed", 0.9)
    assert tiered.detail == "tier R1: storage 878.9 KB of 976.6 KB"


# -- PostgreSQL ----------------------------------------------------------------------------


@pytest.mark.parametrize(("used", "state"), [(57, "ok"), (59, "warn"), (78, "shed"), (97, "shed")])
def test_postgres_connections_against_what_ordinary_roles_may_open(used: int, state: str) -> None:
    """max_connections 100, 3 reserved for superusers: ordinary roles may open 97."""
    budget = postgres_budget(
        used=used, max_connections=100, superuser_reserved=3, reserved=0, version="15.20"
    )
    assert (budget.state, budget.used) == (state, pytest.approx(used / 97))
    assert budget.detail == (
        f"{used} client connections of the 97 ordinary roles may open (max_connections 100 - "
        "3 reserved); PostgreSQL 15.20"
    )


def test_postgres_16_reserved_connections_count_and_all_reserved_is_full() -> None:
    assert postgres_budget(used=10, max_connections=20, superuser_reserved=3, reserved=2).used == (
        pytest.approx(10 / 15)
    )
    assert postgres_budget(used=3, max_connections=3, superuser_reserved=3).state == "shed"


# -- the shared watch ----------------------------------------------------------------------

EFFECTS = Effects("server", "nothing refused yet", "no new claim", "claims again", "Fix it")
LOGGER = logging.getLogger("tests.budget")


class Script:
    """The readings a watch gets, in order (an exception: that read fails)."""

    def __init__(self, *answers: float | Exception) -> None:
        self.answers: Iterator[float | Exception] = iter(answers)

    async def __call__(self) -> BrokerBudget:
        answer = next(self.answers)
        if isinstance(answer, Exception):
            raise answer
        state = "shed" if answer >= 0.8 else "warn" if answer >= 0.6 else "ok"
        return BrokerBudget(answer, state, f"{answer:.0%}")


async def test_the_watch_warns_sheds_and_sheds_until_back_under_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = TestClock("2027-01-01T00:00:00+00:00")
    watch = BudgetWatch("B", Script(0.1, 0.65, 0.85, 0.7, 0.5), EFFECTS, logger=LOGGER, period=30)
    states: list[str | None] = []
    with caplog.at_level(logging.INFO, logger="tests.budget"):
        await watch.start(clock)
        try:
            for n in range(5):
                if n:
                    await clock.advance("30s")
                states.append(watch.reading and watch.reading.state)
                if watch.shedding:
                    with pytest.raises(BackendError, match=r"^B: shedding: x, the server being at"):
                        watch.refuse_if_shedding("x")
        finally:
            await watch.close()
    assert states == ["ok", "warn", "shed", "shed", "ok"]  # 70 % after shedding: still shed
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "B: the server is at 65% of its budget (65%); nothing refused yet"),
        (
            "ERROR",
            "B: shedding: the server is at 85% of its budget (85%): no new claim, until it is "
            "back under 60%. Fix it",
        ),
        ("WARNING", "B: the server is back at 50% of its budget: claims again"),
    ]


async def test_a_failing_read_keeps_the_state_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = TestClock("2027-01-01T00:00:00+00:00")
    down = BackendError("no answer")
    script = Script(0.9, down, down, ValueError("odd shape"), 0.2)
    watch = BudgetWatch("B", script, EFFECTS, logger=LOGGER, period=30)
    await watch.start(clock)
    try:
        with caplog.at_level(logging.WARNING, logger="tests.budget"):
            for _ in range(3):
                await clock.advance("30s")
                assert watch.shedding  # the last reading holds
        await clock.advance("30s")
        assert watch.reading is not None and watch.reading.state == "ok"
    finally:
        await watch.close()
    messages = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert messages == [
        "B: the server's budget could not be read: no answer",  # once for two failures
        "B: the server's budget could not be read",  # an unforeseen shape: with its traceback
    ]


async def test_shedding_ends_with_the_part_that_sheds_whatever_the_parts_that_only_warn() -> None:
    """Redis under an evicting policy at 85 % sheds; its memory back at 30 % ends it even
    with clients (a part that only warns) at 70 %; a part that only warns never sheds."""
    memory, clients = Part("memory", 0.85), Part("clients", 0.7, sheds=False)
    readings = iter(
        [
            judge([memory, clients], unknown=""),
            judge([Part("memory", 0.7), clients], unknown=""),  # still over WARN: shedding
            judge([Part("memory", 0.3), clients], unknown=""),
            judge([Part("memory", 0.3), Part("clients", 0.95, sheds=False)], unknown=""),
        ]
    )

    async def read() -> BrokerBudget:
        return next(readings)

    clock = TestClock("2027-01-01T00:00:00+00:00")
    watch = BudgetWatch("B", read, EFFECTS, logger=LOGGER, period=30)
    await watch.start(clock)
    states = [watch.reading.state if watch.reading else None]
    try:
        for _ in range(3):
            await clock.advance("30s")
            states.append(watch.reading.state if watch.reading else None)
    finally:
        await watch.close()
    assert states == ["shed", "shed", "warn", "warn"]

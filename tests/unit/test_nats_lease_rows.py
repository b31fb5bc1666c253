"""NATSLeaseBackend without a server: its options are checked at construction, a job's row
key is injective, and a decision's compare-and-set reads again after a lost race and resolves
a write whose answer was lost by the row's write id."""

from __future__ import annotations

import pytest

from brokersched import ConfigurationError
from brokersched._exceptions import BackendError, BackendUnavailableError
from brokersched.abc import JobPolicy, Lease
from brokersched.backends._lease import Acquire, JobRow, LeaseRow, Renew, TakenOver, TakeOver
from brokersched.backends.nats import NATSLeaseBackend
from brokersched.backends.nats._rows import Conflict, Rows, Table, decode_row, encode_row, row_key

NOW = 1_800_000_000_000


class FakeTable(Table):
    """A KV bucket in memory; ``race`` writes land first from "another instance", ``lose``
    writes are stored but their answer is lost."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.race: list[bytes] = []
        self.lose = 0
        self.writes = 0

    async def read(self, key: str, timeout: float) -> tuple[bytes | None, int]:
        value, revision = self.entries.get(key, (None, 0))
        return value, revision

    def _store(self, key: str, value: bytes) -> None:
        self.revision += 1
        self.entries[key] = (value, self.revision)

    async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
        self.writes += 1
        if self.race:
            self._store(key, self.race.pop())
        if self.entries.get(key, (None, 0))[1] != last:
            raise Conflict(key)
        self._store(key, value)
        if self.lose:
            self.lose -= 1
            raise BackendError("the link was cut before the answer")

    async def read_at(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
        value, revision = await self.read(key, timeout)
        return value, revision, NOW


def _acquire(slot_ms: int, instance: str = "i1") -> Acquire:
    return Acquire(slot_ms, "schedule", "skip", f"tok-{instance}", "run", instance, NOW)


async def _decide(rows: Rows, request: object) -> object:
    answer, _ = await rows.decide("job", request, ttl_ms=1000, skew_ms=500, timeout=5.0)  # type: ignore[arg-type]
    return answer


@pytest.mark.parametrize(
    ("value", "option"),
    [
        ({"bucket": "a.b"}, "bucket"),
        ({"bucket": ""}, "bucket"),
        ({"replicas": 0}, "replicas"),
        ({"lease_ttl": "0s"}, "lease_ttl"),
        ({"max_clock_skew": -1}, "max_clock_skew"),
    ],
)
def test_options_are_checked_at_construction(value: dict[str, object], option: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        NATSLeaseBackend("nats://127.0.0.1:9", **value)  # type: ignore[arg-type]
    assert caught.value.option == option
    assert "NATSLeaseBackend" in str(caught.value)


@pytest.mark.parametrize(("keyword", "instead"), [("prefix", "bucket="), ("slot_ttl", "lease_ttl")])
def test_natsbackends_options_say_what_to_pass_instead(keyword: str, instead: str) -> None:
    with pytest.raises(ConfigurationError, match=f"keyword '{keyword}' cannot be given") as caught:
        NATSLeaseBackend("nats://127.0.0.1:9", **{keyword: "x"})  # type: ignore[arg-type]
    assert instead in str(caught.value)


def test_servers_are_checked_and_named_by_this_backend() -> None:
    with pytest.raises(ConfigurationError, match="of NATSLeaseBackend has the scheme 'http'"):
        NATSLeaseBackend("http://127.0.0.1:4222")


def test_row_keys_are_valid_kv_keys_and_injective() -> None:
    jobs = ["a", "a.b", "a:b", "a$b", "a=3Ab", "a-b_c", "..", "é"]
    keys = [row_key(job) for job in jobs]
    assert len(set(keys)) == len(jobs)
    for key in keys:
        assert all(token for token in key.split(".")), key
        assert set(key) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-=.")


@pytest.mark.asyncio
async def test_a_row_round_trips() -> None:
    table = FakeTable()
    lease = await _decide(Rows(table, "B"), _acquire(NOW))
    assert isinstance(lease, Lease)
    row, write_id = decode_row(table.entries[row_key("job")][0])
    assert row.fence == NOW and row.leases[NOW].token == "tok-i1" and write_id
    assert decode_row(encode_row(row, "w"))[0] == row


@pytest.mark.asyncio
async def test_a_lost_race_reads_again_and_decides_on_the_winners_row() -> None:
    table = FakeTable()
    rows = Rows(table, "B")
    winner = encode_row(JobRow(NOW, None, {}), "theirs")  # another instance claimed the slot
    table.race.append(winner)
    assert await _decide(rows, _acquire(NOW)) == "not-acquired"
    assert table.writes == 1


@pytest.mark.asyncio
async def test_a_write_without_an_answer_stands_when_the_row_is_still_its_own() -> None:
    table = FakeTable()
    rows = Rows(table, "B")
    table.lose = 1
    lease = await _decide(rows, _acquire(NOW))
    assert isinstance(lease, Lease)
    assert await _decide(rows, Renew(NOW, lease.token)) is True


@pytest.mark.asyncio
async def test_a_write_without_an_answer_that_another_followed_is_decided_again() -> None:
    """The claim's write landed (or not) and another instance's fenced the slot after it: the
    claim is decided again on that row, and refused; no lease is handed out unstored."""

    class Overwritten(FakeTable):
        async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
            self.writes += 1
            self._store(key, encode_row(JobRow(NOW, None, {}), "later"))  # the other's
            raise BackendError("the link was cut before the answer")

    table = Overwritten()
    assert await _decide(Rows(table, "B"), _acquire(NOW)) == "not-acquired"
    assert table.writes == 1


@pytest.mark.asyncio
async def test_a_grant_that_landed_before_another_write_is_found_by_its_token() -> None:
    class Followed(FakeTable):
        async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
            await FakeTable.write(self, key, value, last, timeout)  # ours lands...
            row, _ = decode_row(value)
            self._store(key, encode_row(row, "a renewal of another slot"))  # ...then another
            raise BackendError("the link was cut before the answer")

    lease = await _decide(Rows(Followed(), "B"), _acquire(NOW))
    assert isinstance(lease, Lease) and lease.token == "tok-i1"


@pytest.mark.asyncio
async def test_a_take_over_that_landed_before_another_write_is_found_by_its_tokens() -> None:
    """The restart of a dead runner's slot landed, its answer was lost, another write came
    after: the take-over is not made again (its lease would be nobody's), it answers the
    restart it made, with the dead attempt to record."""

    class Followed(FakeTable):
        async def write(self, key: str, value: bytes, last: int, timeout: float) -> None:
            await FakeTable.write(self, key, value, last, timeout)
            row, _ = decode_row(value)
            self._store(key, encode_row(row, "another instance's"))
            raise BackendError("the link was cut before the answer")

    table = Followed()
    dead = LeaseRow("old", "run-1", "i1", "schedule", 1, "running", NOW - 5000, NOW - 100)
    table._store(row_key("job"), encode_row(JobRow(NOW - 3000, None, {NOW - 3000: dead}), "w"))
    taken = await _decide(Rows(table, "B"), TakeOver(JobPolicy("job"), "i2", NOW))
    assert isinstance(taken, TakenOver)
    assert [(lease.slot_ms, lease.attempt) for lease in taken.leases] == [(NOW - 3000, 2)]
    assert [record.run_id for record in taken.records] == ["run-1"]
    row, _ = decode_row(table.entries[row_key("job")][0])
    assert row.leases[NOW - 3000].token == taken.leases[0].token


@pytest.mark.asyncio
async def test_failed_calls_are_made_again_until_the_deadline() -> None:
    class Electing(FakeTable):
        failures = 3

        async def read_at(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
            if self.failures:
                self.failures -= 1
                raise BackendUnavailableError("no responders: the stream elects a leader")
            return await FakeTable.read_at(self, key, timeout)

    assert isinstance(await _decide(Rows(Electing(), "B"), _acquire(NOW)), Lease)

    class Down(FakeTable):
        async def read_at(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
            raise BackendUnavailableError("connection refused")

    rows = Rows(Down(), "B")
    with pytest.raises(BackendUnavailableError, match="connection refused"):
        await rows.decide("job", _acquire(NOW), ttl_ms=1000, skew_ms=500, timeout=0.2)


@pytest.mark.asyncio
async def test_a_refusal_writes_nothing() -> None:
    table = FakeTable()
    rows = Rows(table, "B")
    assert isinstance(await _decide(rows, _acquire(NOW)), Lease)
    writes = table.writes
    assert await _decide(rows, _acquire(NOW - 1, "i2")) == "not-acquired"
    assert await _decide(rows, Renew(NOW, "not-the-token")) is False
    assert table.writes == writes

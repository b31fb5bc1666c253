"""Adversarial seams of exactly-once (real servers, one process per fleet member).

Each test is a way the README's promise "a slot runs at most once on a claim-only backend"
(or the lease backends' equivalent) broke, reproduced the way an operator would meet it, and
kept as a regression test (each fails on code without its fix). The harness is
``tests/cluster/test_seams_real.py``'s (``Fleet``, ``tests/support/seam_worker.py``).
"""

from __future__ import annotations

import asyncio

import nats
import nats.js.errors

from tests.support.seams import (
    LEAD_MS,
    Fleet,
    at,
    nats_store,
    now_ms,
    postgres_store,
    starts_by_slot,
    until_ms,
    with_ttl,
)
from tests.support.stall_proxy import StallProxy
from tests.support.tcp_proxy import TcpProxy

# The reply nats-server sends to a stream update ($JS.API.STREAM.UPDATE.<stream>): the update
# has been applied when it leaves the server.
_STREAM_UPDATED = b"io.nats.jetstream.api.v1.stream_update_response"


async def claims_window(nats_url: str, prefix: str) -> tuple[float, bytes | None]:
    """The claims stream's duplicate window (s), and the fleet's record of its raises (the
    last message on ``<prefix>.claim.fleet.memory``; ``None``: no raise noted)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(f"{prefix}-claims")
        try:
            note = (await js.get_last_msg(f"{prefix}-claims", f"{prefix}.claim.fleet.memory")).data
        except nats.js.errors.NotFoundError:
            note = None
        return float(info.config.duplicate_window or 0), note
    finally:
        await nc.close()


async def test_nats_a_window_raise_cut_before_it_is_noted_runs_an_at_slot_twice(
    fleet: Fleet, nats_url: str
) -> None:
    """An at() slot across a rolling deploy that raises the claims window, with one fault. OLD
    (slot_ttl 3 s) runs an at() slot. After the 3 s window has forgotten the slot's id, NEW
    (slot_ttl 60 s, max_late 30 s) starts and raises the claims stream's window to 60 s, but its
    link to NATS is cut as the update's answer comes back (kill -9 at that moment, an OOM, a
    network blip do the same). NEW starts again (its supervisor restarts it) and finds a 60 s
    window. Were the raise noted on ``<prefix>.claim.fleet.memory`` only after the update, that
    note would never be written: NEW would believe the slot remembered 60 s, claim it 7 s late
    and win (NATS forgot OLD's id at 3 s): the slot would run twice. The note comes before the
    update."""
    store = nats_store(fleet, nats_url)
    prefix = store["options"]["prefix"]
    old = fleet.spec("OLD", with_ttl(store, "3s"), [at("report", LEAD_MS, max_late="1s")])
    await fleet.start({**old, "relative": True})
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait("OLD runs the slot", lambda: fleet.has("start", instance="OLD"), 15)

    new_jobs = [at("report", slot, max_late="30s")]
    port = int(nats_url.rsplit(":", 1)[1])
    async with TcpProxy("127.0.0.1", port) as proxy:
        proxy.cut_when_downstream(lambda data: _STREAM_UPDATED in data)
        cut_store = {**with_ttl(store, "60s"), "url": f"nats://127.0.0.1:{proxy.port}"}
        first = fleet.spec("NEW", cut_store, new_jobs, start_at_ms=slot + 4500)
        await fleet.start(first)
        await fleet.wait("NEW's raise is cut", lambda: proxy.links == 0 and proxy.accepted > 0, 20)
        await fleet.kill("NEW")
    assert (await claims_window(nats_url, prefix))[0] == 60.0  # raised, answer cut
    again = fleet.spec("NEW-again", with_ttl(store, "60s"), new_jobs)
    await fleet.start(again)
    await fleet.wait("NEW decides the slot", lambda: fleet.decided("NEW-again", "report"), 15)
    await fleet.stop("OLD")
    twice = {key: n for key, n in starts_by_slot(fleet.runs()).items() if n > 1}
    assert not twice, f"the slot ran twice: {fleet.runs()}\n{fleet.diagnostics()}"


async def test_nats_a_raise_noted_but_never_made_does_not_let_a_later_raiser_claim_late(
    fleet: Fleet, nats_url: str
) -> None:
    """The seam the note-before-update order opens. NEW (slot_ttl 60 s) notes its raise of the
    claims window on ``<prefix>.claim.fleet.memory`` and dies before the update reaches NATS
    (here: its link cut as it sends the update): the note says 60 s, the window stays 3 s.
    OLD (slot_ttl 3 s) then runs an at() slot, which NATS forgets 3 s later. NEW-again starts
    4.5 s after the slot and raises the window itself. Had it found the dead raiser's note, it
    would have taken it for the raise and claimed the slot (due after the note) up to 60 s
    late, and won. It cannot: the note is a message of the claims stream, whose ``max_age`` is
    still the old window, so NATS drops it with the claims it might mislead about; a raiser
    that still finds it comes within the old window of it, while the claims of the slots due
    since are still remembered, and its update extends them."""
    store = nats_store(fleet, nats_url)
    prefix = store["options"]["prefix"]
    old = fleet.spec("OLD", with_ttl(store, "3s"), [at("report", 8000, max_late="1s")])
    await fleet.start({**old, "relative": True})
    slot = await fleet.go(now_ms()) + 8000
    await fleet.wait("OLD up", lambda: fleet.has("ready", instance="OLD"), 15)

    new_jobs = [at("report", slot, max_late="30s")]
    port = int(nats_url.rsplit(":", 1)[1])
    async with TcpProxy("127.0.0.1", port) as proxy:
        proxy.cut_when_upstream(lambda data: b"$JS.API.STREAM.UPDATE." in data)
        cut_store = {**with_ttl(store, "60s"), "url": f"nats://127.0.0.1:{proxy.port}"}
        await fleet.start(fleet.spec("NEW", cut_store, new_jobs))
        await fleet.wait("NEW's update is cut", lambda: proxy.links == 0 and proxy.accepted > 0, 20)
        await fleet.kill("NEW")
    window, noted = await claims_window(nats_url, prefix)
    assert (window, noted is not None) == (3.0, True)  # noted, never made
    assert now_ms() < slot - 1000, "the raise came too late to judge: the slot fell due"
    await fleet.wait("OLD runs the slot", lambda: fleet.has("start", instance="OLD"), 15)
    again = fleet.spec("NEW-again", with_ttl(store, "60s"), new_jobs, start_at_ms=slot + 4500)
    await fleet.start(again)
    await fleet.wait("NEW decides the slot", lambda: fleet.decided("NEW-again", "report"), 20)
    await fleet.stop("OLD")
    assert (await claims_window(nats_url, prefix))[0] == 60.0
    twice = {key: n for key, n in starts_by_slot(fleet.runs()).items() if n > 1}
    assert not twice, f"the slot ran twice: {fleet.runs()}\n{fleet.diagnostics()}"


async def test_nats_two_new_members_starting_together_run_an_at_slot_twice(
    fleet: Fleet, nats_url: str
) -> None:
    """No fault at all: a rolling deploy starts two new members (slot_ttl 60 s, max_late
    30 s) a moment apart, after OLD (slot_ttl 3 s) ran an at() slot and the 3 s window forgot
    it. A raises the window to 60 s; its link is slow for a second right after the update's
    answer (here: held by a proxy; a paused VM, a GC pause, a busy event loop do the same). B
    starts in that second and finds a 60 s window with nothing to raise. When A noted its raise
    only after the update, B read no note, claimed the slot 6 s late under a memory it believed
    was 60 s, and won (NATS forgot OLD's id at 3 s): the slot ran twice. The note now comes
    before the update, so B reads it with the raised window."""
    store = nats_store(fleet, nats_url)
    prefix = store["options"]["prefix"]
    old = fleet.spec("OLD", with_ttl(store, "3s"), [at("report", LEAD_MS, max_late="1s")])
    await fleet.start({**old, "relative": True})
    slot = await fleet.go(now_ms()) + LEAD_MS
    await fleet.wait("OLD runs the slot", lambda: fleet.has("start", instance="OLD"), 15)

    new_store, new_jobs = with_ttl(store, "60s"), [at("report", slot, max_late="30s")]
    port = int(nats_url.rsplit(":", 1)[1])
    proxy = StallProxy(port)
    proxy.stall_after_downstream(lambda data: _STREAM_UPDATED in data)
    async with proxy:
        slow = {**new_store, "url": f"nats://127.0.0.1:{proxy.port}"}
        await fleet.start(fleet.spec("A", slow, new_jobs, start_at_ms=slot + 4500))
        async with asyncio.timeout(20):
            await proxy.stalled.wait()
        assert (await claims_window(nats_url, prefix))[0] == 60.0  # raised, A held up
        await fleet.start(fleet.spec("B", new_store, new_jobs))
        await fleet.wait("B up", lambda: fleet.has("ready", instance="B"), 15)
        proxy.resume()  # A's link is fast again: A notes its raise
        await fleet.wait("A up", lambda: fleet.has("ready", instance="A"), 15)
        await fleet.stop("OLD")
        await fleet.wait("A decides", lambda: fleet.decided("A", "report"), 15)
        await fleet.wait("B decides", lambda: fleet.decided("B", "report"), 15)
    twice = {key: n for key, n in starts_by_slot(fleet.runs()).items() if n > 1}
    assert not twice, f"the slot ran twice: {fleet.runs()}\n{fleet.diagnostics()}"


async def test_postgres_a_link_stalled_as_a_run_completes_and_back_before_its_lease_expires(
    fleet: Fleet, postgres_dsn: str
) -> None:
    """README, Backends: a store away as a run completes never makes the slot run again when it
    is back before the lease expires. A (lease_ttl 3 s) runs a slot for 1.9 s; its link to
    PostgreSQL stalls (bytes held, the connection kept: a slow link, a paused VM) 0.9 s into the
    run, just before the first renewal, for 1.5 s: the run completes inside the stall and its
    release waits with the renewal. B starts (a rolling deploy) 3.3 s after the claim, once the
    lease would have expired, and sweeps for dead runners: the slot ran once.

    Held 2.9 s instead (back after the expiry, although for less than lease_ttl), B's first
    sweep restarts the completed slot before A's release lands: the Limits section's "a runner
    out of its store's reach for longer than its lease has left"."""
    store = postgres_store(fleet, postgres_dsn, lease_ttl="3s")
    port = int(postgres_dsn.rsplit("@", 1)[1].split("/")[0].rsplit(":", 1)[1])
    slot = now_ms() // 1000 * 1000 + 3000
    proxy = StallProxy(port)
    async with proxy:
        via = {**store, "url": postgres_dsn.replace(f":{port}/", f":{proxy.port}/", 1)}
        await fleet.start(fleet.spec("A", via, [at("report", slot)], hold={"schedule": 1.9}))
        await fleet.wait("A runs the slot", lambda: fleet.has("start", instance="A"), 15)
        started = fleet.events("start", instance="A")[0]["host_ms"]
        # B has the job too (another day's instant): it sweeps the job's dead slots.
        later = [at("report", slot + 86_400_000, max_late="30s")]
        await fleet.start(fleet.spec("B", store, later, start_at_ms=started + 3300))
        await until_ms(started + 900)
        proxy.stall()
        await until_ms(started + 900 + 1500)
        proxy.resume()
        await fleet.wait("A's run ends", lambda: fleet.has("end", instance="A"), 10)
        await fleet.wait("B up", lambda: fleet.has("ready", instance="B"), 10)
        await fleet.wait("B swept", lambda: now_ms() > started + 3300 + 2000, 10)
    runs = [(run["instance"], run["reason"], run["attempt"]) for run in fleet.runs()]
    assert runs == [("A", "schedule", 1)], f"the completed slot ran again: {runs}"

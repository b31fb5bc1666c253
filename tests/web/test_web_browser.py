"""The dashboard in a real browser: Debian's headless Chromium, driven by Selenium through
Debian's chromedriver (``apt-get install chromium chromium-driver``).

The servers run in the test's event loop (a fleet of two schedulers sharing the embedded
store, served by the admin server with uvicorn; a host application mounting the dashboard
behind its own cookie session; a Redis backend behind a proxy the test stalls) and the browser
is driven from a worker thread. One test goes through ``brokersched run --http`` as the README
says. Screenshots at 1400 and 390 px are saved to ``$BROKERSCHED_TEST_ARTIFACTS`` (default:
``tmp/artifacts`` in the repository) and asserted on: at 390 px nothing is wider than the
screen, and what matters is on it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from brokersched import (
    Instance,
    JobContext,
    MemoryBackend,
    RedisLeaseBackend,
    RunInProgress,
    Scheduler,
)
from brokersched._clock import ms_to_datetime
from brokersched.abc import RunRecord, new_run_id
from brokersched.backends.memory import MemoryStore
from brokersched.web import READ_TOKEN_ENV, TOKEN_ENV, create_app
from brokersched.web._serve import HTTPServer
from tests.support.cli_apps.process import ROOT, RunningCLI
from tests.support.helpers import missing
from tests.support.redis_helpers import delete_keys
from tests.support.stall_proxy import StallProxy

T = TypeVar("T")
TOKEN = "test-admin-token-0123456789"
READER = "test-read-token-0123456789"
ODD = "report:daily$eu"
WAIT_S = 20
ARTIFACTS = Path(os.environ.get("BROKERSCHED_TEST_ARTIFACTS", ROOT / "tmp" / "artifacts"))


# -- the applications ------------------------------------------------------------------------------


def connect() -> None:
    raise ConnectionError("payment provider reset the connection")


LIVE_ERROR = "RuntimeError: payments batch 4 failed after 3 retries"  # the seeded past says 3


async def sync_payments(ctx: JobContext) -> None:
    try:
        connect()
    except ConnectionError as exc:
        raise RuntimeError("payments batch 4 failed after 3 retries") from exc


async def quick(ctx: JobContext) -> None:
    await asyncio.sleep(0.02)


async def slow(ctx: JobContext) -> None:
    await ctx.wait_aborted(timeout=2.5)  # longer than its 1 s interval: overlap skips


def fleet_member(name: str, store: MemoryStore) -> Scheduler[MemoryBackend]:
    scheduler = Scheduler(MemoryBackend(store=store), instance_id=name, jitter="100ms")
    scheduler.every("outbox.flush", "2s", quick, data={"api_key": "sk-live-do-not-show"})
    scheduler.every("payments.sync", "2s", sync_payments, max_attempts=1)
    scheduler.every("invoices.render", "5s", quick, timeout="1s")
    scheduler.every("export.slow", "1s", slow)
    scheduler.every("cache.warm", "2s", quick)
    scheduler.cron(ODD, "0 8 * * *", quick, timezone="Europe/Paris")
    return scheduler


SEEDED_UNTIL: dict[str, int] = {}  # by dashboard URL
SEEDED_TRACEBACK = """Traceback (most recent call last):
  File "/srv/app/payments.py", line 41, in sync_payments
    await provider.push(batch)
ConnectionError: payment provider reset the connection

The above exception was the direct cause of the following exception:

RuntimeError: payments batch 3 failed after 3 retries
"""


async def seed_history(scheduler: Scheduler[Any], minutes: int = 15) -> int:
    """The last ``minutes`` of the fleet's history, as the backend would hold it after a while:
    runs on both instances, some failed or cut by their timeout, a slow job whose next slots
    are skipped (overlap), one slot nobody ran, and one skipped slow slot an operator
    backfilled. Written before the schedulers start."""
    chance = random.Random(7)
    now = int(time.time() * 1000)
    for job in scheduler.jobs():
        slot = job.schedule.next_ms(now - minutes * 60_000)
        busy_until = 0
        backfilled = job.name != "export.slow"  # one of its skipped slots, 5 minutes ago
        while slot is not None and slot < now - 1000:
            lost = (
                job.name == "outbox.flush" and (now - slot) // 60_000 == 8 and slot % 10_000 < 2000
            )
            backfill = not backfilled and slot < busy_until and now - slot < 300_000
            if backfill:
                backfilled = True
                started = now - 60_000 + chance.randrange(5, 120)
                await scheduler.backend.record(
                    job.settings.policy,
                    RunRecord(
                        job=job.name, slot_ms=slot, run_id=new_run_id(), instance_id="ops",
                        reason="backfill", attempt=1, started_at=ms_to_datetime(started),
                        finished_at=ms_to_datetime(started + 100), outcome="completed",
                    ),
                )  # fmt: skip
            elif slot >= busy_until and not lost:
                took = {"export.slow": 2500, "invoices.render": 300}.get(job.name, 40)
                outcome, error, traceback = "completed", None, None
                if job.name == "payments.sync" and chance.random() < 0.2:
                    outcome, error = (
                        "failed",
                        "RuntimeError: payments batch 3 failed after 3 retries",
                    )
                    traceback = SEEDED_TRACEBACK
                elif job.name == "invoices.render" and chance.random() < 0.15:
                    outcome, error, took = "timed-out", "Timed out after 1s", 1000
                started = slot + chance.randrange(5, 120)
                record = RunRecord(
                    job=job.name,
                    slot_ms=slot,
                    run_id=new_run_id(),
                    instance_id=chance.choice(("web-1", "web-2")),
                    reason="schedule",
                    attempt=1,
                    started_at=ms_to_datetime(started),
                    finished_at=ms_to_datetime(started + took),
                    outcome=outcome,  # type: ignore[arg-type]
                    error=error,
                    traceback=traceback,
                    result={"paid": took} if outcome == "completed" else None,
                )
                await scheduler.backend.record(job.settings.policy, record)
                busy_until = started + took
            slot = job.schedule.next_ms(slot)
    return now - 1000  # what is seeded ends here


async def wait_for(check: Callable[[], Any], what: str, within_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + within_s
    while not (result := await check()):
        assert time.monotonic() < deadline, f"{what}: not within {within_s}s"
        await asyncio.sleep(0.1)
    return result


@asynccontextmanager
async def admin_server(scheduler: Scheduler[Any]) -> AsyncIterator[str]:
    server = HTTPServer(scheduler, "127.0.0.1", 0)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


@pytest.fixture
async def fleet(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """Two instances; the dashboard of the first, once some runs have failed."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    store = MemoryStore()
    one, two = fleet_member("web-1", store), fleet_member("web-2", store)
    await one.backend.start(one.clock)  # the embedded store, to write the past into
    # The slots between the end of the seeded past and the start are caught up, or skipped
    # as the first run of a slow job holds them (a loaded machine may leave one more).
    seeded_until = await seed_history(one)
    await one.backend.stop()
    async with one, two, admin_server(one) as url, httpx.AsyncClient(base_url=url) as http:

        async def failed_live() -> bool:  # a failure of this run, not of the seeded past
            failed = await http.get("jobs/payments.sync/history?outcome=failed&limit=1")
            (latest,) = failed.json()["records"]
            return bool(latest["error"] == LIVE_ERROR)

        await wait_for(failed_live, "a failed run")
        await one.backend.publish_instance(killed_instance())
        SEEDED_UNTIL[url] = seeded_until
        yield url


def killed_instance() -> Instance:
    """A third instance's last presence: killed (-9) a minute ago during a run of a job of its
    own release (ledger.close, which the other two do not run: they cannot tell that its run
    is over, and show it as its instance left it, its lease holding the slot)."""
    killed = datetime.now(UTC) - timedelta(minutes=1)
    slot_ms = int(killed.timestamp()) * 1000
    run = RunInProgress("ledger.close", DEAD_RUN, slot_ms, killed, "schedule", leased=True)
    return Instance(
        id="web-3",
        host="pod-7",
        pid=4242,
        version="0.1.0",
        started_at=killed - timedelta(minutes=30),
        last_seen=killed,
        heartbeat=timedelta(seconds=5),
        running=(run,),
    )


DEAD_RUN = "dead0000beef0001"


# -- the browser -----------------------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing("chromium and chromedriver are needed: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1400,1000",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


# The page's width, what sticks out of the screen (but inside a box that scrolls on its own: a
# traceback), and where each element asked for is.
_LAYOUT = """
const inner = window.innerWidth;
const scrolls = (e) => e.closest("pre, dialog");
const wider = [...document.querySelectorAll("body *")]
  .filter((e) => e.getBoundingClientRect().right > inner + 1 && !scrolls(e))
  .map((e) => `${e.tagName}.${e.getAttribute("class") || ""}`).slice(0, 5);
const boxes = arguments[0].map((selector) => {
  const element = document.querySelector(selector);
  if (!element) return null;
  const r = element.getBoundingClientRect();
  return [r.left, r.right, r.height];
});
return { scrollWidth: document.documentElement.scrollWidth, innerWidth: inner, wider, boxes };
"""


# The words of the instances panel that wrap inside themselves: a name or a time on two lines,
# a button two lines high.
_BROKEN_WORDS = """
const words = '#instances td a.mono, #instances td .relative, #instances td button';
return [...document.querySelectorAll(words)]
  .filter((e) => e.tagName === 'BUTTON'
    ? e.getBoundingClientRect().height > 40 : e.getClientRects().length > 1)
  .map((e) => e.textContent);
"""


class Page:
    """The browser, driven from a worker thread; each look is retried until it holds (the
    page redraws on every event: an element found a moment ago may be gone)."""

    def __init__(self, driver: Any) -> None:
        from selenium.common.exceptions import (
            NoSuchElementException,
            StaleElementReferenceException,
        )
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        self.wait = WebDriverWait(
            driver,
            WAIT_S,
            ignored_exceptions=[StaleElementReferenceException, NoSuchElementException],
        )

    def find(self, selector: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def until(self, check: Callable[[Any], T], what: str = "") -> T:
        result: T = self.wait.until(check, message=what)
        return result

    def visible(self, selector: str) -> Any:
        return self.until(lambda d: (e := self.find(selector)).is_displayed() and e, selector)

    def click(self, selector: str) -> None:
        self.until(lambda d: self.find(selector).click() or True, f"click {selector}")

    def text(self, selector: str) -> str:
        def read(driver: Any) -> list[str] | None:
            element = self.find(selector)
            return [element.text] if element.is_displayed() else None

        return self.until(read, f"the text of {selector}")[0]

    def has_text(self, selector: str, text: str) -> None:
        self.until(lambda d: text in self.find(selector).text, f"{text!r} in {selector}")

    def js(self, script: str) -> Any:
        return self.driver.execute_script(script)

    def open(self, url: str, ready: str) -> None:
        self.driver.get(url)
        self.visible(ready)

    def shot(self, name: str, width: int) -> Path:
        """The whole page at ``width`` px, saved to the artifacts."""
        self.driver.set_window_size(width, 1000)
        height = self.js("return document.documentElement.scrollHeight")
        self.driver.set_window_size(width, min(height + 160, 6000))
        self.until(lambda d: self.js("return window.innerWidth") == width, "resized")
        path = ARTIFACTS / f"{name}-{width}.png"
        assert self.driver.save_screenshot(str(path)), path
        self.driver.set_window_size(width, 1000)
        return path

    def fits_a_phone(self, *selectors: str) -> None:
        """No horizontal scroll, and each of ``selectors`` shown within the screen's width."""
        layout = self.until(
            lambda d: self.driver.execute_script(_LAYOUT, list(selectors)), "the layout"
        )
        assert layout["scrollWidth"] <= layout["innerWidth"], layout
        assert layout["wider"] == [], layout  # elements that stick out
        for selector, box in zip(selectors, layout["boxes"], strict=True):
            assert box is not None, f"{selector}: not on the page"
            left, right, height = box
            assert height > 0 and left >= 0 and right <= layout["innerWidth"], (selector, box)

    def errors(self) -> list[str]:
        return [
            entry["message"]
            for entry in self.driver.get_log("browser")
            if entry["level"] == "SEVERE"
        ]


async def in_browser(browser: Any, steps: Callable[[Page], T]) -> T:
    """Run ``steps`` in a worker thread: the servers go on in this event loop meanwhile."""
    await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
    return await asyncio.to_thread(steps, Page(browser))


# -- the pages -------------------------------------------------------------------------------------


async def test_a_failure_is_two_clicks_from_the_overview_on_a_desktop_and_a_phone(
    fleet: str, browser: Any
) -> None:
    def steps(page: Page) -> dict[str, Any]:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        found: dict[str, Any] = {}
        page.open(f"{fleet}#/?window=15m", "#failures tbody tr")
        page.visible('#jobs tr[data-job="payments.sync"]')
        page.visible("#fleet-timeline svg.timeline .mark-failed")
        found["failures"] = page.text("#failures")
        found["cards"] = page.text("#summary")
        page.visible(f'#instances tr[data-run-id="{DEAD_RUN}"]')
        found["broken"] = page.js(_BROKEN_WORDS)  # at 1400 px no word is cut in two
        # a dead instance, and its run whose lease still holds the slot
        found["dead"] = page.text('#instances tr[data-instance="web-3"]')
        found["held"] = page.text(f'#instances tr[data-run-id="{DEAD_RUN}"]')
        page.visible("#fleet-timeline svg.timeline .mark-missed")  # outbox.flush's gap
        found["shots"] = [page.shot("overview", 1400)]
        # click 1: the job; click 2: its latest failed run
        page.click('#jobs tr[data-job="payments.sync"] a.job-link')
        page.visible('#history tr[data-outcome="failed"]')
        page.visible("#job-timeline svg.timeline .lane-label")
        found["lanes"] = page.js(
            "return [...document.querySelectorAll('#job-timeline .lane-label')]"
            ".map(e => e.textContent)"
        )
        found["schedule"] = page.text("#schedule")
        found["shots"].append(page.shot("job", 1400))
        page.click('#history tr[data-outcome="failed"] a')
        found["traceback"] = page.text("pre.traceback")
        found["run_url"] = page.driver.current_url
        found["run"] = page.text("#run")
        found["result"] = page.text("#result")
        found["shots"].append(page.shot("run", 1400))
        page.driver.refresh()  # a deep link survives a reload
        found["reloaded"] = page.text("pre.traceback")
        page.open(f"{fleet}#/jobs/payments.sync", '#history tr[data-outcome="completed"] a')
        page.click('#history tr[data-outcome="completed"] a')
        found["returned"] = page.text("pre.result")
        # a slow job's skipped slots: on its "not run" lane, as skipped, not missed
        page.open(f"{fleet}#/jobs/export.slow", "#job-timeline svg.timeline .mark-overlap")
        found["slow_missed"] = page.js(
            "return document.querySelectorAll('#job-timeline svg.timeline .mark-missed').length"
        )
        found["backfilled"] = page.js(  # an operator's run of a past slot is ringed
            "return [...document.querySelectorAll('#job-timeline svg.timeline .backfilled')]"
            ".map(e => e.querySelector('title').textContent)"
        )
        # the history's filters are in the URL too
        page.open(f"{fleet}#/jobs/payments.sync?outcome=failed", "#history tr[data-outcome]")
        found["filtered"] = page.js(
            "return [...document.querySelectorAll('#history tr[data-outcome]')]"
            ".map(e => e.dataset.outcome)"
        )
        found["filter_shown"] = page.find("#filter-outcome").get_attribute("value")
        found["reasons"] = page.js(
            "return [...document.querySelectorAll('#filter-reason option')].map(e => e.value)"
        )
        # a word the API may send that the page has no shape for: a shape and its own name
        found["unknown"] = page.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "import('./static/shapes.js').then((m) => { const b = m.badge('postponed');"
            " done([b.textContent, m.look('postponed').shape, b.querySelector('svg g') !== null]);"
            "}).catch((error) => done(String(error)));"
        )
        # by keyboard: a page takes the focus when it opens; Tab, Enter open the latest failure
        page.open(f"{fleet}#/", "#failures tbody tr")
        page.until(lambda d: page.js("return document.activeElement.id") == "view", "focus")
        ActionChains(page.driver).send_keys(Keys.TAB).perform()
        found["first_focus"] = page.js("return document.activeElement.className")
        ActionChains(page.driver).send_keys(Keys.ENTER).perform()
        found["by_keyboard"] = page.text("pre.traceback")
        # a phone
        page.driver.set_window_size(390, 900)
        for name, url, parts in (
            (
                "overview",
                f"{fleet}#/?window=15m",
                [
                    "#failures tbody tr",
                    "#summary",
                    "#fleet-timeline svg",
                    '#jobs tr[data-job="payments.sync"] button[data-action="pause"]',
                    '#instances tr[data-instance="web-3"][data-liveness="dead"]',
                    f'#instances tr[data-run-id="{DEAD_RUN}"]',
                ],
            ),
            (
                "job",
                f"{fleet}#/jobs/payments.sync",
                [
                    "#job-timeline svg",
                    '#history tr[data-outcome="failed"]',
                    "#filter-outcome",
                    ".page-head button.primary",
                ],
            ),
            ("run", found["run_url"], ["pre.traceback", "#run-error", "#attempts"]),
        ):
            page.open(url, parts[0])
            for part in parts[1:]:  # each part loads on its own (the history after the timeline)
                page.visible(part)
            page.fits_a_phone(*parts)
            found["shots"].append(page.shot(name, 390))
            page.driver.set_window_size(390, 900)
            page.fits_a_phone(*parts)
        found["errors"] = page.errors()
        return found

    found = await in_browser(browser, steps)
    assert "failed" in found["failures"]
    assert LIVE_ERROR in found["failures"]
    assert "FAILURES, LAST HOUR" in found["cards"].upper()
    async with httpx.AsyncClient(base_url=fleet) as http:
        slow = (await http.get("jobs/export.slow/timeline?window=15m")).json()["slots"]
        flush = (await http.get("jobs/outbox.flush/timeline?window=15m")).json()["slots"]
    assert {mark["state"] for mark in slow} == {"overlap"}  # skipped by design, not missed
    assert found["slow_missed"] == 0
    assert len(found["backfilled"]) == 1 and "on ops · backfill" in found["backfilled"][0]
    seeded = [mark["state"] for mark in flush if mark["slot_ms"] < SEEDED_UNTIL[fleet]]
    assert seeded == ["missed"] * 6  # the seeded gap, nothing else
    assert found["lanes"][:2] == ["not run", "web-1 (here)"]  # web-2 too once it ran one
    assert set(found["lanes"]) <= {"not run", "web-1 (here)", "web-2"}
    assert "every 2s" in found["schedule"]
    assert "dead" in found["dead"] and "pod-7" in found["dead"]
    assert "its instance is dead: the lease holds the slot" in found["held"]
    traceback = found["traceback"]
    assert "ConnectionError: payment provider reset the connection" in traceback
    assert "The above exception was the direct cause of the following exception" in traceback
    assert traceback.rstrip().endswith(LIVE_ERROR)
    assert re.search(r"#/jobs/payments\.sync/runs/[0-9a-f]{16}$", found["run_url"])
    assert found["reloaded"] == traceback
    assert "ran on" in found["run"] and "lateness" in found["run"]
    assert "The run did not return: there is no result." in found["result"]
    assert json.loads(found["returned"]) == {"paid": 40}  # as the handler returned it
    # max_attempts=1 and no retry=: a failed run is not run again, and the page says so
    assert "1; not retried" in found["run"] and "of at most" not in found["run"]
    assert "no retry= option" in found["run"]
    assert found["broken"] == []
    assert found["filtered"] and set(found["filtered"]) == {"failed"}
    assert found["filter_shown"] == "failed"
    async with httpx.AsyncClient(base_url=fleet) as http:
        vocabulary = (await http.get("vocabulary")).json()
    assert found["reasons"] == ["", *vocabulary["run_reasons"]]  # "": any
    assert "backfill" in found["reasons"]
    assert found["unknown"] == ["postponed", "diamond", True]
    assert found["first_focus"] == "run-link"
    assert LIVE_ERROR in found["by_keyboard"]
    assert all(path.stat().st_size > 10_000 for path in found["shots"])
    assert found["errors"] == []


async def test_signing_in_with_the_token_and_pausing_a_job(fleet: str, browser: Any) -> None:
    def steps(page: Page) -> dict[str, Any]:
        found: dict[str, Any] = {}
        page.open(f"{fleet}#/jobs/cache.warm", ".page-head button[data-action='pause-dialog']")
        found["before"] = page.text("#signin-button")
        page.click(".page-head button[data-action='pause-dialog']")  # until when, and why
        page.js("document.querySelector('#change-until').value = '4h'")
        page.visible("#change-note").send_keys("db failover")
        page.driver.set_window_size(390, 900)  # the pause dialog on a phone
        page.fits_a_phone("#change-form", "#change-submit")
        found["dialog_shot"] = page.shot("pause-dialog", 390)
        page.driver.set_window_size(1400, 1000)
        page.click("#change-submit")  # not signed in: the sign-in dialog
        page.visible("#signin #token").send_keys("not-the-token-0123456789")
        page.click("#signin button[type='submit']")
        page.has_text("#signin-error", "This is not one of the server's tokens.")
        token = page.find("#signin #token")
        token.clear()
        token.send_keys(TOKEN)
        page.click("#signin button[type='submit']")  # signed in, and the pause goes on
        page.has_text(".page-head .badge", "paused")
        found["status"] = page.text("#status")
        page.click(".page-head button[data-action='skip-dialog']")
        count = page.visible("#change-count")
        count.clear()
        count.send_keys("2")
        page.click("#change-submit")
        page.has_text("#status", "skips its next 2 slots")
        page.has_text("#schedule", "Skips its next")  # 2 slots, or 1 once the first passed
        found["job_shot"] = page.shot("paused-job", 1400)
        found["signed_in"] = page.text("#signin-button")
        found["stored"] = page.js("return sessionStorage.getItem('brokersched-token')")
        found["schedule"] = page.text("#schedule")
        page.driver.set_window_size(390, 900)  # the paused job on a phone
        page.fits_a_phone("#schedule .note", ".page-head button[data-action='resume']")
        page.driver.set_window_size(1400, 1000)
        page.open(f"{fleet}#/", '#jobs tr[data-job="cache.warm"]')
        page.has_text('#jobs tr[data-job="cache.warm"]', "paused")
        found["row"] = page.text('#jobs tr[data-job="cache.warm"]')
        found["shot"] = page.shot("paused", 1400)
        return found

    found = await in_browser(browser, steps)
    assert found["before"] == "Sign in"
    assert found["signed_in"] == "signed in · sign out"
    assert found["stored"] == TOKEN  # this tab only
    assert "cache.warm: paused until " in found["status"]
    assert "Paused for the whole fleet until " in found["schedule"]
    assert "by api:token@127.0.0.1 at " in found["schedule"]
    assert '("db failover"): no instance runs its slots before then' in found["schedule"]
    assert "paused" in found["row"] and "Resume" in found["row"]
    async with httpx.AsyncClient(base_url=fleet) as http:
        job = (await http.get("jobs/cache.warm")).json()
        assert job["state"] == "paused" and job["control"]["skip"]["count"] == 2
        until = datetime.fromisoformat(job["control"]["until"])
        assert timedelta(hours=3, minutes=58) < until - datetime.now(UTC) <= timedelta(hours=4)


async def test_a_fleet_with_every_job_paused_stands_out_and_resumes_at_once(
    fleet: str, browser: Any
) -> None:
    async with httpx.AsyncClient(
        base_url=fleet, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as http:
        jobs = [job["name"] for job in (await http.get("jobs")).json()["jobs"]]
        for name in jobs:
            path = f"jobs/{name.replace(':', '%3A').replace('$', '%24')}"
            answer = await http.post(f"{path}/{'disable' if name == ODD else 'pause'}")
            assert answer.status_code == 200, answer.text

    def steps(page: Page) -> dict[str, Any]:
        found: dict[str, Any] = {}
        page.open(f"{fleet}#/", "#jobs-card button.resume-all")
        page.has_text("#jobs-card", "every job is paused or disabled")
        found["card"] = page.text("#jobs-card")
        found["class"] = page.find("#jobs-card").get_attribute("class")
        found["shots"] = [page.shot("paused-fleet", 1400)]
        page.driver.set_window_size(390, 900)
        page.fits_a_phone("#jobs-card", "#jobs-card button.resume-all")
        found["shots"].append(page.shot("paused-fleet", 390))
        page.driver.set_window_size(1400, 1000)
        page.click("#jobs-card button.resume-all")  # not signed in: the dialog, then on
        page.visible("#signin #token").send_keys(TOKEN)
        page.click("#signin button[type='submit']")
        page.has_text("#status", "resume: done for 5 jobs, for the whole fleet")
        page.until(
            lambda d: not page.js("return document.querySelector('#jobs-card.warn')"), "calm"
        )
        found["after"] = page.text("#jobs-card")
        return found

    found = await in_browser(browser, steps)
    assert "6" in found["card"] and "Resume all 5 paused jobs" in found["card"]
    assert "warn" in found["class"].split()
    assert "every job is paused or disabled" not in found["after"]
    assert all(path.stat().st_size > 10_000 for path in found["shots"])
    async with httpx.AsyncClient(base_url=fleet) as http:
        states = {job["name"]: job["state"] for job in (await http.get("jobs")).json()["jobs"]}
    assert states.pop(ODD) == "disabled"  # disabled stays disabled: resume is for the paused
    assert set(states.values()) <= {"armed", "running"}, states


# -- mounted in a host application behind its own session ------------------------------------------


@asynccontextmanager
async def uvicorn_serving(app: Any, dashboard: Any) -> AsyncIterator[str]:
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, log_config=None, log_level="warning", lifespan="off", timeout_graceful_shutdown=3
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve([sock]))
    await wait_for(lambda: asyncio.sleep(0, server.started), "uvicorn started")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        dashboard.state.events.close()  # event streams never end by themselves
        server.should_exit = True
        await task


async def test_mounted_behind_a_cookie_session_the_page_asks_for_no_token(
    browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    session = secrets.token_hex(8)

    def is_admin(request: Request) -> bool:  # the host application's own session check
        return request.cookies.get("session") == session

    async def home(request: Request) -> PlainTextResponse:
        return PlainTextResponse("the host application")

    scheduler = fleet_member("web-1", MemoryStore())
    dashboard = create_app(scheduler, authorize=is_admin)
    host = Starlette(routes=[Route("/", home), Mount("/ops/scheduler", dashboard)])

    def steps(page: Page) -> dict[str, Any]:
        found: dict[str, Any] = {}
        page.open(f"{base}/", "body")
        page.driver.add_cookie({"name": "session", "value": session, "path": "/"})
        page.open(
            f"{base}/ops/scheduler#/jobs/cache.warm",
            ".page-head button[data-action='pause-dialog']",
        )
        page.has_text("#signin-button", "signed in (session)")
        page.click(".page-head button[data-action='pause-dialog']")
        page.click("#change-submit")  # until resumed, no note
        page.has_text(".page-head .badge", "paused")
        found["dialog_open"] = page.js("return document.querySelector('#signin').open")
        found["status"] = page.text("#status")
        page.driver.delete_all_cookies()
        page.driver.refresh()
        page.has_text("#signin-button", "read-only")

        def why_read_only(driver: Any) -> str | None:  # once the session's answer is in
            title: str = page.find("#signin-button").get_attribute("title") or ""
            return title if title.startswith("changes need a session") else None

        found["anonymous"] = page.until(why_read_only, "the read-only button's reason")
        return found

    async with scheduler, uvicorn_serving(host, dashboard) as base:
        found = await in_browser(browser, steps)
        job = scheduler.get("cache.warm")
        assert job is not None and job.paused
    assert found["dialog_open"] is False  # no token was asked for
    assert "cache.warm: paused" in found["status"]
    assert found["anonymous"].startswith("changes need a session of the application")


async def test_with_a_read_token_the_page_asks_for_one_and_a_reader_sees_no_change_button(
    browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(READ_TOKEN_ENV, READER)
    scheduler = fleet_member("web-1", MemoryStore())

    def steps(page: Page) -> dict[str, Any]:
        found: dict[str, Any] = {}
        page.driver.get(f"{url}#/")
        page.visible("#signin #token").send_keys(READER)  # asked at once: nothing to read yet
        found["asked"] = page.text("#status")
        page.click("#signin button[type='submit']")
        page.visible('#jobs tr[data-job="cache.warm"]')
        found["row"] = page.text('#jobs tr[data-job="cache.warm"]')
        found["buttons"] = page.js("return document.querySelectorAll('#jobs button').length")
        found["signed_in"] = page.text("#signin-button")
        page.open(f"{url}#/jobs/cache.warm", "#schedule .facts")
        found["head"] = page.js(
            "return [...document.querySelectorAll('.page-head button')].map(b => b.textContent)"
        )
        found["shot"] = page.shot("read-only", 1400)
        return found

    async with scheduler, admin_server(scheduler) as url, httpx.AsyncClient() as http:
        anonymous = await http.get(f"{url}jobs")
        found = await in_browser(browser, steps)
    assert anonymous.status_code == 401
    assert "needs a token" in found["asked"]
    assert "cache.warm" in found["row"] and found["buttons"] == 0
    assert found["signed_in"] == "signed in (read-only) · sign out"
    assert found["head"] == []


# -- a backend outage ------------------------------------------------------------------------------


async def test_the_page_says_when_the_backend_is_unreachable(browser: Any, redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    prefix = "t" + secrets.token_hex(5)
    loop = asyncio.get_running_loop()
    async with StallProxy(port) as proxy:
        backend = RedisLeaseBackend(f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix)
        scheduler = Scheduler(backend, instance_id="web-1")
        scheduler.every("outbox.flush", "1s", quick)

        def steps(page: Page) -> dict[str, Any]:
            found: dict[str, Any] = {}
            page.open(f"{url}#/", "#jobs tr")
            page.has_text("#backend", "ok")
            found["banner_before"] = page.find("#banner").is_displayed()
            loop.call_soon_threadsafe(proxy.stall)  # the proxy lives in the servers' loop
            page.until(lambda d: page.find("#banner").is_displayed(), "the outage banner")
            found["banner"] = page.text("#banner")
            found["pill"] = page.text("#backend")
            page.has_text('#jobs tr[data-job="outbox.flush"]', "backend down")
            found["shot"] = page.shot("outage", 1400)
            page.driver.refresh()  # a page opened during the outage: nothing was read yet
            page.has_text("#summary", "could not be read")
            found["fresh_cards"] = page.text("#summary")
            found["fresh_failures"] = page.text("#failures")
            found["fresh_classes"] = page.js(
                "return [...document.querySelectorAll('#summary .card')].map(e => e.className)"
            )
            found["fresh_shot"] = page.shot("outage-fresh", 1400)
            page.driver.set_window_size(390, 900)
            page.fits_a_phone("#summary", "#failures")
            page.shot("outage-fresh", 390)
            page.driver.set_window_size(1400, 1000)
            loop.call_soon_threadsafe(proxy.resume)
            page.until(lambda d: not page.find("#banner").is_displayed(), "the banner gone")
            found["pill_after"] = page.text("#backend")
            return found

        try:
            async with scheduler, admin_server(scheduler) as url:
                found = await in_browser(browser, steps)
        finally:
            proxy.resume()
            await delete_keys(redis_url, prefix)
    assert found["banner_before"] is False
    assert found["banner"].startswith("The backend is unreachable since ")
    assert "No slot runs while it is" in found["banner"]
    assert found["pill"] == "RedisLeaseBackend unreachable"
    assert found["pill_after"] == "RedisLeaseBackend ok"
    cards = found["fresh_cards"]
    assert "all alive" not in cards and "?" in cards, cards
    assert "the backend could not be read" in cards
    assert not any("good" in classes.split() for classes in found["fresh_classes"])
    assert "unknown" in found["fresh_failures"] and "No failed" not in found["fresh_failures"]


# -- brokersched run --http, as the README says ----------------------------------------------------


@pytest.fixture
def cli_dashboard() -> Iterator[str]:
    cli = RunningCLI(
        "run",
        "tests.support.cli_apps.web_app:scheduler",
        "--http",
        "127.0.0.1:0",
        env={TOKEN_ENV: TOKEN},
    )
    try:
        line = cli.wait_for_line(lambda line: "serving the admin API and dashboard" in line)
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match is not None, line
        yield match.group(0)
    finally:
        cli.kill()


def test_the_token_of_brokersched_run_makes_the_buttons_usable(
    cli_dashboard: str, browser: Any
) -> None:
    page = Page(browser)
    odd = ODD.replace(":", "%3A").replace("$", "%24")
    page.open(f"{cli_dashboard}#/jobs/{odd}", ".page-head button[data-action='trigger']")
    assert "sk-live-do-not-show" not in browser.page_source
    page.has_text("#live", "live")  # the event stream
    page.click(".page-head button[data-action='trigger']")
    page.visible("#signin #token").send_keys(TOKEN)
    page.click("#signin button[type='submit']")
    page.has_text("#status", f"{ODD}: triggered.")
    page.visible('#history tr[data-outcome="completed"]')
    row = page.text('#history tr[data-outcome="completed"]')
    assert "manual" in row and "web-1" in row
    assert page.errors() == []

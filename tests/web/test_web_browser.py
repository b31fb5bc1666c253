"""The dashboard in a real browser: Debian's headless Chromium, driven by Selenium through
Debian's chromedriver, against ``brokersched run --http`` on a free port.

The screenshot is saved to ``$BROKERSCHED_TEST_ARTIFACTS`` (default: the test's tmp_path)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli_apps.process import RunningCLI
from tests.support.helpers import IN_CI

TOKEN = "test-admin-token-0123456789"
APP = "tests.support.cli_apps.web_app:scheduler"
ODD = "report:daily$eu"
WAIT_S = 15


@pytest.fixture
def dashboard_url() -> Iterator[str]:
    cli = RunningCLI("run", APP, "--http", "127.0.0.1:0", env={"BROKERSCHED_ADMIN_TOKEN": TOKEN})
    try:
        line = cli.wait_for_line(lambda line: "serving the admin API and dashboard" in line)
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match is not None, line
        yield match.group(0)
    finally:
        cli.kill()


@pytest.fixture
def browser() -> Iterator[object]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        message = "chromium and chromedriver are needed: apt-get install chromium chromium-driver"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1300,1000",
    ):
        options.add_argument(argument)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def test_the_dashboard_shows_jobs_and_a_triggered_run_live_and_pauses(
    dashboard_url: str, browser: object, tmp_path: Path
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    # The page redraws its table and timelines on every event: an element found a moment ago
    # may be gone, so each look is one step that is retried.
    wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=[StaleElementReferenceException])
    browser.get(dashboard_url)

    def row(job: str) -> str:
        return f'#jobs tbody tr[data-job="{job}"]'

    def click(selector: str) -> None:
        wait.until(lambda driver: driver.find_element(By.CSS_SELECTOR, selector).click() or True)

    def title_of(selector: str) -> str:
        def read(driver: WebDriver) -> str | None:
            marks = driver.find_elements(By.CSS_SELECTOR, selector)
            if not marks:
                return None
            return marks[0].find_element(By.TAG_NAME, "title").get_attribute("textContent")

        text: str = wait.until(read)
        return text

    def texts(selector: str) -> list[str]:
        found: list[str] = wait.until(
            lambda driver: [e.text for e in driver.find_elements(By.CSS_SELECTOR, selector)]
        )
        return found

    # the jobs table, from GET /jobs
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, row(ODD))))
    assert texts("#jobs td.name") == ["outbox.flush", ODD]
    assert "sk-live-do-not-show" not in browser.page_source
    wait.until(ec.text_to_be_present_in_element((By.ID, "live"), "live"))  # the event stream

    # the cron job never ran: its timeline is empty until the trigger
    odd_runs = f'.timeline[data-job="{ODD}"] circle.run'
    assert browser.find_elements(By.CSS_SELECTOR, odd_runs) == []
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    click("#token-form button")
    click(f'{row(ODD)} button[data-action="trigger"]')
    tip = title_of(f'{odd_runs}[data-outcome="completed"]')
    assert re.fullmatch(r"slot .+ on web-1: completed \(manual, \d+ ms late\)", tip), tip
    assert texts(f'.timeline[data-job="{ODD}"] text') == ["schedule", "web-1 (here)"]

    # the every-2s job's runs are on this instance's lane; pause it here
    flush_runs = '.timeline[data-job="outbox.flush"] circle.run[data-outcome="completed"]'
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, flush_runs)))
    click(f'{row("outbox.flush")} button[data-action="pause"]')
    wait.until(
        ec.text_to_be_present_in_element(
            (By.CSS_SELECTOR, f"{row('outbox.flush')} td.state"), "paused"
        )
    )
    assert "this instance only (web-1)" in browser.find_element(By.ID, "status").text
    wait.until(
        ec.presence_of_element_located(
            (By.CSS_SELECTOR, f'{row("outbox.flush")} button[data-action="resume"]')
        )
    )
    state = httpx.get(f"{dashboard_url}jobs/outbox.flush", timeout=10).json()["state"]
    assert state == "paused"

    artifacts = Path(os.environ.get("BROKERSCHED_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(artifacts / "dashboard.png"))

"""The dashboard in real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium) against a real server process; training jobs are simulated over real HTTP.

One server and one browser serve the whole suite (starting Chromium costs seconds); each test
uses its own hosts and process ids. A failed test leaves a screenshot and the page's HTML in
test-artifacts/browser/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.dashboard import Api, FakeHost, Jobs, LiveServer, SimJob
from support.dashboard_page import Dashboard

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

# Short timings so that staleness shows within seconds. Stale must stay above the server's
# 5 s interval between writes of one host's GPU reports, or fresh GPUs would look silent.
SERVER_ARGS = (
    "--stale-after",
    "8",
    "--sweep-interval",
    "0.5",
    "--heartbeat-interval",
    "1",
    "--poll-timeout",
    "5",
    "--command-ttl",
    "120",
)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        skip = pytest.mark.skip(
            reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)"
        )
        for item in items:
            if Path(str(item.fspath)).parent == Path(__file__).parent:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    driver = item.funcargs.get("browser")
    if driver is None:
        return
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = ARTIFACTS / f"FAILED-{item.name}"
    try:
        driver.save_screenshot(str(stem.with_suffix(".png")))
        stem.with_suffix(".html").write_text(driver.page_source)
        logs = "\n".join(str(e) for e in driver.get_log("browser"))
        stem.with_suffix(".console.txt").write_text(logs)
        report.sections.append(("dashboard", f"screenshot and page kept: {stem}.png / .html"))
    except Exception as exc:  # the browser itself may be what broke
        report.sections.append(("dashboard", f"no screenshot: {exc}"))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer(tmp_path_factory.mktemp("server"), *SERVER_ARGS).start()
    yield srv
    try:
        srv.check_alive()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def api(server: LiveServer) -> Api:
    return Api(server)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The last run's screenshots go before this run's tests start, by the one process that runs
    them or (pytest-xdist) by the controller, never by a worker: it would delete those of the
    others' failures."""
    if ARTIFACTS.exists() and not hasattr(session.config, "workerinput"):
        for old in ARTIFACTS.iterdir():
            if old.is_file():
                old.unlink()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def browser(server: LiveServer, artifacts: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--disable-extensions",
        "--no-first-run",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


@pytest.fixture
def dash(browser: Any, server: LiveServer) -> Iterator[Dashboard]:
    page = Dashboard(browser, server)
    yield page
    page.assert_console_clean()


@pytest.fixture
def jobs(api: Api, server: LiveServer) -> Iterator[Jobs]:
    """``jobs(host, process_id, **options)`` starts a simulated job; all stop at the end, and
    each must have had every answer (with the server's stalls, if any, where one had not)."""
    started: list[SimJob] = []

    def start(host: FakeHost, process_id: str, **options: Any) -> SimJob:
        job = SimJob(api, host, process_id, **options).start()
        started.append(job)
        return job

    yield start
    for job in started:  # they exit: stop talking, unregister
        job.die()
        api.delete(f"/processes/{job.process_id}")
    for job in started:
        assert not job.errors, (job.process_id, job.errors, server.stalls)

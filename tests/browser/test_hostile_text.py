"""Hostile text (tests/support/hostile_text.py) as the job keys, hosts, users, command lines, GPU names
and errors of jobs of two ranks, on the dashboard in headless Chromium: every job row is there
with its text as sent, its migrate form opens (the form's URL carries the key), a pause goes
through and its notice quotes the key, and nothing runs: no alert, no injected image, no script
error or refused inline script (the fixture checks the console)."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By

from support.dashboard import FakeHost, Jobs, SimJob
from support.dashboard_page import Dashboard
from support.hostile_text import ACCEPTED

pytestmark = pytest.mark.timeout(180)


def job_row(dash: Dashboard, key: str) -> Any:
    """The row of job `key`, found by its id (Selenium's By.ID builds a CSS selector the key breaks)."""
    return dash.js("return document.getElementById(arguments[0])", f"job-{key}")


def click_job(dash: Dashboard, key: str, action: str) -> None:
    job_row(dash, key).find_element(By.CSS_SELECTOR, f'button[data-action="job-{action}"]').click()


def test_hostile_text_in_job_keys_hosts_and_errors(dash: Dashboard, jobs: Jobs) -> None:
    ranks: dict[str, list[SimJob]] = {}
    for i, value in enumerate(ACCEPTED.values()):
        host = FakeHost(f"{value}-{i}")
        host.gpus[2].name = value
        host.gpus[3].health = value
        ranks[value] = [
            jobs(
                host,
                f"hostile-{i}-r{rank}",
                gpu=rank,
                user=value,
                cmdline=value,
                op_seconds=0.2,
                job={"key": value, "rank": rank, "world_size": 2},
            )
            for rank in (0, 1)
        ]
    dash.open()
    for key in ranks:
        dash.wait(lambda k=key: job_row(dash, k), f"the job row of {key!r}")
        assert dash.job_text(key, "Process") and "2 ranks" in dash.job_text(key, "Process"), key
    for key in (ACCEPTED["newlines"], ACCEPTED["html"], ACCEPTED["attribute"]):
        dash.wait(lambda k=key: job_row(dash, k).find_elements(By.CSS_SELECTOR, '[data-action="job-migrate"]'), key)
        click_job(dash, key, "migrate")
        dash.wait(dash.dialog_open, f"the migrate form of job {key!r}")
        assert dash.d.find_elements(By.CSS_SELECTOR, '#job-form select[data-rank="1"]'), key
        dash.d.find_element(By.CSS_SELECTOR, "#target-dialog [data-close]").click()
        dash.wait(lambda: not dash.dialog_open(), "the form closes")
    key = ACCEPTED["html"]
    click_job(dash, key, "pause")
    dash.wait(lambda: all(job.state == "PAUSED" for job in ranks[key]), "both ranks pause")
    dash.wait(lambda: any(key in text and "succeeded" in text for _r, text in dash.notices()), "the notice")
    assert dash.js("return document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert dash.js("return document.querySelectorAll('[onerror], [onmouseover]').length") == 0
    with pytest.raises(NoAlertPresentException):
        _ = dash.d.switch_to.alert.text

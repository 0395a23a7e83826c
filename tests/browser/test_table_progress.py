"""The main table's training progress in headless Chromium: each job's steps and steps/s under its
runtime, as `flexium ps` has them in STEPS and SPEED, kept current by the progress events
without a reload; a paused job's last rate is no speed."""

from __future__ import annotations

import re

import pytest

from support.dashboard import FakeHost, Jobs
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


def _steps(runtime: str) -> int:
    found = re.search(r"([\d,]+) steps", runtime)
    return int(found.group(1).replace(",", "")) if found else -1


def test_the_table_shows_each_job_s_steps_and_speed_live(dash: Dashboard, jobs: Jobs) -> None:
    host = FakeHost("progress-node")
    jobs(host, "gpu-st3ps001", steps=1000)
    jobs(host, "gpu-n0steps1", gpu=1)  # a client that reports no progress
    dash.open()
    dash.js("window.samePage = true")
    first = _steps(dash.wait_cell("gpu-st3ps001", "Runtime", " steps", "steps/s", timeout=20))
    assert first >= 1000
    dash.wait(
        lambda: _steps(dash.cell("gpu-st3ps001", "Runtime")) > first, "the steps grow as beats arrive", timeout=30
    )
    assert dash.js("return window.samePage === true")  # set in place, no reload
    assert "steps" not in dash.cell("gpu-n0steps1", "Runtime")

    dash.click("gpu-st3ps001", "pause")
    dash.wait_cell("gpu-st3ps001", "Status", "PAUSED")
    dash.wait(lambda: "steps/s" not in dash.cell("gpu-st3ps001", "Runtime"), "a paused job shows no speed")
    assert " steps" in dash.cell("gpu-st3ps001", "Runtime")

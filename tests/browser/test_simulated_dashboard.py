"""A job on flexium's simulated host (flexium demo without a GPU) in headless Chromium: its memory,
the time of its last command (in the table and the recent commands), the notice of a command's
outcome and its page's timeline say simulated, where a job on a real driver's host says none of it."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By

from flexium.simulated import SIMULATED_DRIVER
from support.dashboard import GIB, Api, FakeHost, SimJob
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


class SimulatedHostJob(SimJob):
    """A job whose driver is the simulated one, as it reports its version (its GPUs keep the fake
    host's model, that the resume dialog offers)."""

    def registration(self) -> dict[str, Any]:
        return super().registration() | {"driver_version": SIMULATED_DRIVER}


def _recent_commands(dash: Dashboard) -> list[str]:
    """The recent commands' texts, read in one call (a live update may replace the list)."""
    return list(
        dash.js(
            "return Array.from(document.querySelectorAll('#commands li'))"
            ".map(function (li) { return li.textContent.replace(/\\s+/g, ' ').trim(); })"
        )
    )


def _text(dash: Dashboard, by: str, value: str) -> str:
    """An element's text, read again where a live redraw replaced the element in between."""
    return str(dash.wait(lambda: dash.d.find_element(by, value).text, f"the text of {value}"))


def test_simulated_figures_say_so_and_real_ones_do_not(dash: Dashboard, api: Api) -> None:
    demo = SimulatedHostJob(api, FakeHost("demo-host"), "gpu-s1mu1ate", memory=6 * GIB, op_seconds=0.42).start()
    real = SimJob(api, FakeHost("real-host"), "gpu-rea1h0st", memory=6 * GIB, op_seconds=0.42).start()
    try:
        dash.open()
        for job in (demo, real):
            dash.wait_buttons(job.process_id, {"Migrate": True, "Pause": True})
            dash.click(job.process_id, "pause")
            dash.wait_cell(job.process_id, "Status", "PAUSED")
        dash.wait_cell(demo.process_id, "Last command", "pause", "0.42 s", "simulated", "succeeded")
        assert "simulated" not in dash.wait_cell(real.process_id, "Last command", "pause", "0.42 s", "succeeded")
        dash.wait(
            lambda: any(
                f"pause {demo.process_id}" in text and "succeeded in 0.42 s on simulated GPUs (driver path)" in text
                for _role, text in dash.notices()
            ),
            "the notice says the outcome was on simulated GPUs",
        )
        notices = dash.wait(  # the two notices come in their own time
            lambda: [text for _role, text in dash.notices() if f"pause {real.process_id}" in text],
            "the notice of the real host's pause",
        )
        assert not any("simulated" in text for text in notices), notices
        dash.wait(
            lambda: any(demo.process_id in item and "0.42 s simulated" in item for item in _recent_commands(dash)),
            "recent commands say the simulated pause's time is simulated",
        )
        items = dash.wait(  # a live redraw of the list may not have the second pause yet
            lambda: [item for item in _recent_commands(dash) if real.process_id in item and "succeeded" in item],
            "recent commands show the real host's pause",
        )
        assert not any("simulated" in item for item in items), items

        for job in (demo, real):
            dash.click(job.process_id, "resume")
            dash.wait(dash.dialog_open, "the Resume dialog opens")
            dash.submit_dialog()  # where flexium chooses
            dash.wait_cell(job.process_id, "Status", "RUNNING")
        assert "6.0 GiB simulated" in dash.wait_cell(demo.process_id, "Memory", "simulated")
        assert "simulated" not in dash.cell(real.process_id, "Memory")

        dash.d.get(f"{dash.server.url}/jobs/{demo.process_id}")
        events = dash.wait(
            lambda: (
                [
                    e.text
                    for e in dash.d.find_elements(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]')
                ]
                if len(dash.d.find_elements(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]')) == 2
                else None
            ),
            "the job page's timeline lists its pause and resume",
        )
        for event in events:
            assert "training stopped 0.42 s simulated" in event and "6.0 GiB of simulated memory moved" in event, event
        phases = _text(dash, By.CSS_SELECTOR, "#job-timeline details.event-steps summary")
        assert phases == "2 phases simulated timings", phases
        assert "simulated" in _text(dash, By.ID, "job-memory")
        assert "GB/s" not in _text(dash, By.TAG_NAME, "main")

        dash.d.get(f"{dash.server.url}/jobs/{real.process_id}")
        dash.wait(
            lambda: len(dash.d.find_elements(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]')) == 2,
            "the real job's timeline lists its pause and resume",
        )
        timeline = _text(dash, By.ID, "job-timeline")
        assert "training stopped 0.42 s" in timeline and "6.0 GiB moved" in timeline
        assert "simulated" not in timeline and "simulated" not in _text(dash, By.ID, "job-memory")
    finally:
        for job in (demo, real):
            job.die()
            api.delete(f"/processes/{job.process_id}")

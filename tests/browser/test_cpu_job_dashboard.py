"""A job on the CPU in headless Chromium: its device is one word, cpu, in the table and on its
page, as `flexium ps` says it (not none, nor none (cpu))."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import Api, FakeHost, SimJob
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


class CpuJob(SimJob):
    """A job whose torch has no CUDA: no GPU, and nothing to move."""

    def __init__(self, api: Api, host: FakeHost, process_id: str) -> None:
        super().__init__(api, host, process_id, memory=0, migration=False, pause_resume=False)
        self.gpu_uuid = None
        self.gpu_index = None
        self.capabilities["problems"] = ["CPU-only torch: no GPU memory to move"]

    def registration(self) -> dict[str, Any]:
        return super().registration() | {"logical_device": "cpu", "gpu_model": ""}


def test_a_cpu_job_s_device_is_cpu(dash: Dashboard, api: Api) -> None:
    job = CpuJob(api, FakeHost("laptop"), "gpu-cpu0only").start()
    try:
        dash.open()
        assert dash.wait_cell(job.process_id, "Device", "cpu") == "cpu"
        dash.d.get(f"{dash.server.url}/jobs/{job.process_id}")
        gpu = dash.wait(lambda: dash.d.find_element(By.ID, "job-gpu").text.strip(), "the job page's GPU fact")
        assert gpu == "cpu", gpu
    finally:
        job.die()
        api.delete(f"/processes/{job.process_id}")

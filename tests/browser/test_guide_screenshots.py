"""The user guide's dashboard screenshots, taken by the browser so that they stay true: a server
of its own (so that no other test's rows show), a few simulated jobs, the main page and the
Migrate dialog at desktop (1280x800) and phone (390x844) widths.

With FLEXIUM_DOC_SCREENSHOTS=1 the images are written to docs/images/ (commit them: the guide in
docs/guide/ embeds them); otherwise to the test's own temporary folder."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import GIB, Api, FakeHost, Gpu, LiveServer, SimJob
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(180)

DOC_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 15_000  # a blank or broken page compresses far below this
VIEWPORTS = (("desktop", 1280, 800, False), ("phone", 390, 844, True))
MOVED_JOB = "gpu-7f3a9c21"
MOVED_SCRIPT = "train_llama.py"


@pytest.fixture(scope="module")
def guide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer(tmp_path_factory.mktemp("guide-server"), "--poll-timeout", "5").start()
    yield srv
    srv.stop()


@pytest.fixture
def guide_jobs(guide_server: LiveServer) -> Iterator[list[SimJob]]:
    api = Api(guide_server)
    host = FakeHost(
        "gpu-node-01",
        gpus=[Gpu(i, other=o * GIB, utilization=u) for i, (o, u) in enumerate([(0, 96), (0, 91), (0, 0), (100, 58)])],
    )
    started = [  # each registered before the next is made: its pid counts the host's jobs so far
        SimJob(
            api,
            host,
            MOVED_JOB,
            gpu=0,
            memory=48 * GIB,
            user="alice",
            cmdline=f"python {MOVED_SCRIPT} --config configs/llama-8b.yaml",
        ).start(),
        SimJob(api, host, "gpu-0b91e4d7", gpu=1, memory=17 * GIB, user="bob", cmdline="python resnet50.py").start(),
        SimJob(
            api, host, "gpu-c4d2aa90", gpu=2, state="PAUSED", memory=33 * GIB, user="carol", cmdline="python whisper.py"
        ).start(),
    ]
    yield started
    for job in started:
        job.die()
        api.delete(f"/processes/{job.process_id}")
    for job in started:
        assert not job.errors, (job.process_id, job.errors)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    if os.environ.get("FLEXIUM_DOC_SCREENSHOTS") == "1":
        DOC_IMAGES.mkdir(parents=True, exist_ok=True)
        return DOC_IMAGES
    return tmp_path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) >= MIN_PNG_BYTES, f"{path} is only {len(data)} bytes: a blank page?"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


def _shoot(dash: Dashboard, path: Path, width: int, height: int) -> None:
    dash.d.save_screenshot(str(path))
    assert _png_size(path) == (width, height), path


def test_guide_screenshots_of_the_dashboard_and_the_migrate_dialog(
    browser: Any, server: LiveServer, guide_server: LiveServer, guide_jobs: list[SimJob], out_dir: Path
) -> None:
    dash = Dashboard(browser, guide_server)
    browser.delete_all_cookies()  # the suite's server and this one share 127.0.0.1's cookies
    try:
        dash.open()
        for job in guide_jobs:
            dash.wait(lambda: dash.has_row(job.process_id), f"{job.process_id}'s row")  # noqa: B023 (waited on here)
        dash.wait_cell(MOVED_JOB, "Status", "RUNNING")
        # One job already moved, so that the table shows a last command and the list a recent one.
        moved = Api(guide_server).post(
            "/commands", {"process_id": "gpu-0b91e4d7", "kind": "migrate", "target": "cuda:3"}
        )
        assert moved.status_code in (200, 201), moved.text
        dash.wait_cell("gpu-0b91e4d7", "Device", "GPU 3")
        dash.wait_cell("gpu-0b91e4d7", "Last command", "succeeded")
        source = guide_jobs[1].host.uuid(1)  # a host's GPU report is stored at most every 5 s
        dash.wait(lambda: dash.bar(source) == {"flexium": 0, "other": 0}, "GPU 1 shows empty again", timeout=20)
        dash.wait_cell("gpu-c4d2aa90", "Status", "PAUSED")
        dash.wait(
            lambda: len(dash.host_section("gpu-node-01").find_elements(By.CSS_SELECTOR, "article.gpu")) == 4,
            "the host's four GPU cards",
        )
        for name, width, height, mobile in VIEWPORTS:
            dash.viewport(width, height, mobile)
            dash.js("window.scrollTo(0, 0)")
            page = out_dir / f"dashboard-{name}.png"
            _shoot(dash, page, width, height)
            assert MOVED_SCRIPT in dash.cell(MOVED_JOB, "Process")
            assert "48.0 GiB" in dash.cell(MOVED_JOB, "Memory")

            button = dash.row(MOVED_JOB).find_element(By.CSS_SELECTOR, "button[data-action=migrate]")
            dash.js("arguments[0].scrollIntoView({block: 'center'})", button)
            button.click()
            dash.wait(dash.dialog_open, "the Migrate dialog opens")
            dash.wait(lambda: len(dash.target_values()) >= 2, "the dialog lists the GPUs the job may move to")
            dialog = dash.d.find_element(By.ID, "target-dialog").text
            assert MOVED_JOB in dialog or MOVED_SCRIPT in dialog, dialog
            dash.d.find_element(By.CSS_SELECTOR, "#target-dialog details.refused summary").click()
            refused = dash.d.find_element(By.CSS_SELECTOR, "#target-dialog details.refused").text
            assert "the job is already on it" in refused, refused  # GPU 0: the server's reasons
            assert "23.0 GiB free, the job needs 48.0 GiB" in refused, refused  # GPU 3
            box = dash.js("return document.getElementById('target-dialog').getBoundingClientRect().toJSON()")
            assert box["left"] >= 0 and box["right"] <= width, box
            _shoot(dash, out_dir / f"migrate-dialog-{name}.png", width, height)
            dash.d.find_element(By.CSS_SELECTOR, "#target-dialog [data-close]").click()
            dash.wait(lambda: not dash.dialog_open(), "the dialog closes")
        dash.assert_console_clean()
    finally:
        dash.reset_viewport()
        browser.delete_all_cookies()
        if server.login_link:  # hand the browser back logged in to the suite's server
            browser.get(server.login_link)

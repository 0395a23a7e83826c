"""One process on several GPUs (DataParallel, a model split over devices) on the dashboard in
headless Chromium: its migrate dialog asks where each GPU's memory goes; a swap and a move to two
other GPUs go out as one command with gpus and reach the process; the server's refusals show in
the dialog; the notice and the row name every move."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import GIB, Api, FakeHost, Jobs
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


def _choices(dash: Dashboard) -> dict[str, tuple[str, str]]:
    """GPU it holds memory on -> (where the form sends it, where it is)."""
    return {
        select.get_attribute("data-gpu"): (select.get_attribute("value"), select.get_attribute("data-current"))
        for select in dash.d.find_elements(By.CSS_SELECTOR, "#gpus-form select[data-gpu]")
    }


def _text(dash: Dashboard, element_id: str) -> str:
    return str(dash.js("return document.getElementById(arguments[0]).textContent.replace(/\\s+/g, ' ')", element_id))


def _choose(dash: Dashboard, gpu: str, target: str) -> None:
    dash.js(
        "document.querySelector('#gpus-form select[data-gpu=\"' + arguments[0] + '\"]').value = arguments[1]",
        gpu,
        target,
    )


def _open_migrate(dash: Dashboard, process_id: str) -> None:
    dash.wait_buttons(process_id, {"Migrate": True, "Pause": True})
    dash.click(process_id, "migrate")
    dash.wait(lambda: dash.dialog_open() and _choices(dash), "the per-GPU migrate dialog")


def test_a_process_on_two_gpus_is_swapped_and_moved_gpu_by_gpu(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    proc = "dp-job-0001"
    host = FakeHost("dp-node")
    u = [host.uuid(i) for i in range(4)]
    job = jobs(host, proc, gpu=0, shares={0: 30 * GIB, 1: 20 * GIB}, cmdline="python train_dp.py")
    dash.open()
    dash.wait_cell(proc, "Device", "GPU 0", "+ GPU 1")

    _open_migrate(dash, proc)
    assert _choices(dash) == {u[0]: (u[0], u[0]), u[1]: (u[1], u[1])}
    assert "On 2 GPUs of dp-node" in dash.d.find_element(By.ID, "gpus-form").text
    dash.submit_dialog()  # every GPU where it is
    dash.wait(lambda: "gpus names no GPU" in dash.dialog_error(), "nothing to move, refused")
    _choose(dash, u[0], u[2])
    _choose(dash, u[1], u[2])
    dash.submit_dialog()
    dash.wait(lambda: f"cannot both go to GPU {u[2]}" in dash.dialog_error(), "two GPUs onto one, refused")
    assert dash.dialog_open() and not job.received and not api.commands(proc)

    dash.d.find_element(By.CSS_SELECTOR, "#gpus-form [data-swap]").click()
    assert _choices(dash) == {u[0]: (u[1], u[0]), u[1]: (u[0], u[1])}
    dash.submit_dialog()
    dash.wait(lambda: job.shares == {u[1]: 30 * GIB, u[0]: 20 * GIB}, "the process's GPUs swap")
    [swap] = job.received
    assert swap["gpu_moves"] == {u[0]: u[1], u[1]: u[0]} and swap["target_uuid"] == u[1]
    assert not dash.dialog_open()
    dash.wait(
        lambda: any("GPU 0 → GPU 1, GPU 1 → GPU 0" in text and "succeeded" in text for _r, text in dash.notices()),
        "the notice names both moves",
    )
    dash.wait_cell(proc, "Device", "GPU 1", "+ GPU 0")
    dash.wait_cell(proc, "Last command", "migrate GPU 0 → GPU 1, GPU 1 → GPU 0", "succeeded")

    _open_migrate(dash, proc)
    assert _choices(dash) == {u[1]: (u[1], u[1]), u[0]: (u[0], u[0])}
    _choose(dash, u[1], u[2])
    _choose(dash, u[0], u[3])
    dash.submit_dialog()
    dash.wait(lambda: job.shares == {u[2]: 30 * GIB, u[3]: 20 * GIB}, "the process moves to GPUs 2 and 3")
    assert job.received[-1]["gpu_moves"] == {u[1]: u[2], u[0]: u[3]}
    dash.wait_cell(proc, "Device", "GPU 2", "+ GPU 3")
    dash.wait(
        lambda: dash.bar(u[2])["flexium"] > 0 and dash.bar(u[3])["flexium"] > 0 and dash.bar(u[0])["flexium"] == 0,
        "the GPU cards show its memory where it went",
    )
    assert not job.errors


def test_a_gpu_without_room_for_its_share_is_the_jobs_to_refuse(dash: Dashboard, jobs: Jobs) -> None:
    """The last report shows too little room there, but it is older than the command: the job's own
    room check refuses it (here its stand-in says so), nothing moves, and a notice tells why."""
    proc = "dp-job-0002"
    host = FakeHost("dp-node2")
    host.gpus[3].other = 125 * GIB
    u = [host.uuid(i) for i in range(4)]
    job = jobs(host, proc, gpu=0, shares={0: 30 * GIB, 1: 20 * GIB})
    dash.open()
    _open_migrate(dash, proc)
    _choose(dash, u[1], u[3])  # 15 GiB free there, 20 GiB to take
    job.fail_with = "cuda:3 has 15.00 GiB free; the job needs 20.00 GiB there: it stays where it is"
    dash.submit_dialog()
    dash.wait(
        lambda: any(role == "alert" and "15.00 GiB free" in text for role, text in dash.notices()),
        "the job's refusal is told",
    )
    assert job.shares == {u[0]: 30 * GIB, u[1]: 20 * GIB}
    job.fail_with = None
    _open_migrate(dash, proc)
    _choose(dash, u[1], u[2])  # only its second GPU's share moves; its own device stays
    dash.submit_dialog()
    dash.wait(lambda: job.shares == {u[0]: 30 * GIB, u[2]: 20 * GIB}, "its second GPU's share moves alone")
    move = job.received[-1]
    assert move["gpu_moves"] == {u[1]: u[2]} and move["target_uuid"] is None
    dash.wait_cell(proc, "Device", "GPU 0", "+ GPU 2")

    dash.open(f"jobs/{proc}")  # its page: both GPUs, and a card for each
    dash.wait(lambda: "GPU 0 + GPU 2" in _text(dash, "job-gpu"), "the job page names both GPUs")
    # Read in one script call: the page refreshes itself, and a card found before a refresh is stale after it.
    cards = dash.js('return [...document.querySelectorAll("#job-gpus article.gpu")].map(c => c.dataset.uuid)')
    assert sorted(cards) == [u[0], u[2]]

"""A job of several ranks on the dashboard in headless Chromium: one job row with its ranks
under it, a pause and a resume of the whole job, a swap sent as one command with ranks and
reaching both ranks, and the server's refusal shown in the dialog."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import Api, FakeHost, Jobs, SimJob, two_rank_job
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)

KEY = "ddp-run-42"


def _ranks(jobs: Jobs, host: FakeHost, key: str = KEY) -> list[SimJob]:
    return two_rank_job(jobs, host, key)


def _operation_of(api: Api, process_id: str, kind: str) -> Any:
    return next(c["job"]["operation_id"] for c in api.commands(process_id) if c["kind"] == kind)


def test_job_row_with_its_ranks_pause_resume_and_swap(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    host = FakeHost("ddp-node")
    r0, r1 = _ranks(jobs, host)
    dash.open()
    dash.wait(lambda: dash.has_row(r1.process_id), "the ranks' rows")
    order = dash.table_order()
    start = order.index(f"job-{KEY}")
    assert order[start : start + 3] == [f"job-{KEY}", f"proc-{r0.process_id}", f"proc-{r1.process_id}"]
    assert "train_ddp.py" in dash.job_text(KEY, "Process") and "2 ranks" in dash.job_text(KEY, "Process")
    assert dash.job_text(KEY, "Status") == "RUNNING"
    assert dash.job_text(KEY, "Device") == "rank 0: GPU 0 rank 1: GPU 1"
    assert "rank 1 of 2" in dash.cell(r1.process_id, "Process")
    assert "GPU 1" in dash.cell(r1.process_id, "Device") and "20.0 GiB" in dash.cell(r1.process_id, "Memory")
    assert dash.buttons(r0.process_id) == {} and "moves with its job" in dash.cell(r0.process_id, "Actions")

    dash.click_job(KEY, "pause")
    dash.wait(lambda: r0.state == r1.state == "PAUSED", "both ranks pause")
    assert _operation_of(api, r0.process_id, "pause") == _operation_of(api, r1.process_id, "pause")
    dash.wait(lambda: dash.job_text(KEY, "Status") == "PAUSED", "the job row shows PAUSED")
    dash.wait_cell(r0.process_id, "Status", "PAUSED")
    dash.wait(
        lambda: any("pause job ddp-run-42" in text and "succeeded on every rank" in text for _, text in dash.notices()),
        "the operation's notice",
    )

    dash.click_job(KEY, "resume")
    dash.wait(lambda: r0.state == r1.state == "RUNNING", "both ranks resume")
    dash.wait(lambda: dash.job_text(KEY, "Status") == "RUNNING", "the job row shows RUNNING")

    dash.wait(lambda: dash.job_row(KEY).find_elements(By.CSS_SELECTOR, '[data-action="job-migrate"]'), "Migrate")
    dash.click_job(KEY, "migrate")
    dash.wait(dash.dialog_open, "the job's migrate dialog")
    dash.d.find_element(By.CSS_SELECTOR, "#job-form [data-swap]").click()
    assert dash.js("return document.querySelector('#job-form select[data-rank=\"0\"]').value") == host.uuid(1)
    dash.submit_dialog()
    dash.wait(lambda: (r0.gpu_uuid, r1.gpu_uuid) == (host.uuid(1), host.uuid(0)), "the ranks swap GPUs")
    swap = [next(c for c in reversed(job.received) if c["kind"] == "migrate") for job in (r0, r1)]
    assert swap[0]["job"]["operation_id"] == swap[1]["job"]["operation_id"]
    assert swap[0]["job"]["moves"] == {"0": host.uuid(1), "1": host.uuid(0)}
    assert not dash.dialog_open()
    dash.wait(lambda: dash.job_text(KEY, "Device") == "rank 0: GPU 1 rank 1: GPU 0", "the job row shows the swap")


def test_job_refusals_show_in_the_dialog_and_disabled_buttons_say_why(dash: Dashboard, jobs: Jobs) -> None:
    host = FakeHost("ddp-node2")
    r0, r1 = _ranks(jobs, host, key="ddp-run-43")
    dash.open()
    dash.wait(lambda: dash.has_row(r1.process_id), "the ranks' rows")
    dash.click_job("ddp-run-43", "migrate")
    dash.wait(dash.dialog_open, "the job's migrate dialog")
    dash.submit_dialog()  # every rank where it is
    dash.wait(lambda: "nothing to move in job 'ddp-run-43'" in dash.dialog_error(), "the refusal in the dialog")
    assert dash.dialog_open() and not [c for job in (r0, r1) for c in job.received]
    dash.js("document.querySelector('#job-form select[data-rank=\"0\"]').value = arguments[0]", host.uuid(1))
    dash.submit_dialog()
    dash.wait(lambda: "rank 0 would share GPU" in dash.dialog_error(), "the placement refusal")
    dash.d.find_element(By.CSS_SELECTOR, "#job-form [data-close]").click()

    host3 = FakeHost("ddp-node3")
    why = "NCCL 2.27.3 has no ncclCommSuspend: install NCCL 2.28 or newer"
    _ranks(jobs, host3, key="ddp-run-44")
    jobs(
        host3,
        "ddp-run-45-r1",
        gpu=2,
        migration=False,
        pause_resume=False,
        problems=[why],
        job={"key": "ddp-run-45", "rank": 1, "world_size": 2},
    )
    jobs(host3, "ddp-run-45-r0", gpu=3, job={"key": "ddp-run-45", "rank": 0, "world_size": 2})
    dash.wait(lambda: dash.has_row("ddp-run-45-r0") and dash.has_row("ddp-run-44-r1"), "the other jobs' rows")

    def pause_of(key: str) -> Any:
        return dash.job_row(key).find_element(By.CSS_SELECTOR, '[data-action="job-pause"]')

    dash.wait(  # read again if a rank's registration re-renders the rows meanwhile
        lambda: not pause_of("ddp-run-45").is_enabled() and pause_of("ddp-run-45").get_attribute("title") == why,
        "the job with a rank that cannot pause has its Pause greyed, saying why",
    )
    dash.wait(lambda: pause_of("ddp-run-44").is_enabled(), "the other job's Pause is not")

    # an NCCL job whose ranks share a GPU: its pause would break it (fact `nccl-ranks-sharing-gpu-fail`); a move apart
    # would not
    host4 = FakeHost("ddp-node4")
    for rank in (0, 1):
        member = {"key": "ddp-run-46", "rank": rank, "world_size": 2}
        jobs(host4, f"ddp-run-46-r{rank}", gpu=0, job=member, nccl=True)
    dash.wait(lambda: dash.has_row("ddp-run-46-r1"), "the NCCL job sharing a GPU")

    def greyed_pause_only() -> bool:  # read again if a rank's registration re-renders the rows meanwhile
        row = dash.job_row("ddp-run-46")
        pause = row.find_element(By.CSS_SELECTOR, '[data-action="job-pause"]')
        return (
            not pause.is_enabled()
            and pause.get_attribute("title").startswith("ranks 0 and 1 of this NCCL job would be on one GPU")
            and row.find_element(By.CSS_SELECTOR, '[data-action="job-migrate"]').is_enabled()
        )

    dash.wait(greyed_pause_only, "its Pause greyed with why, its Migrate not")

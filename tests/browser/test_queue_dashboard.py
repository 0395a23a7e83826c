"""The resume-when-free queue, priorities and making room in headless Chromium: each control
clicked as a person does, and the server's state read back through the API (the waits, a job's
priority, the commands its policies sent), the refusals as the server words them; a viewer sees
the queue and the priorities but none of these controls."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select

from support.dashboard import GIB, Api, FakeHost, Jobs, LiveServer, SimJob, two_rank_job
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)

# The server stores a host's GPU reports at most every 5 s: the queue sees room that long after.
ROOM_SHOWS_S = 20


def _full(host: FakeHost) -> FakeHost:
    """Every GPU of ``host`` held by other processes but 5 GiB: no paused job of ours fits."""
    for gpu in host.gpus:
        gpu.other = gpu.total - 5 * GIB
    return host


def _waits(api: Api, process_id: str, *, all: bool = False) -> list[dict[str, Any]]:
    r = api.get("/waits", params={"process_id": process_id, "all": str(all).lower()})
    r.raise_for_status()
    return list(r.json())


def _process(api: Api, process_id: str) -> dict[str, Any]:
    r = api.get(f"/processes/{process_id}")
    r.raise_for_status()
    return dict(r.json())


def _click(dash: Dashboard, css: str) -> None:
    """Click what ``css`` finds; live updates re-render rows, so a stale element is found again."""
    dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, css).click() or True, f"clicked {css}")


def _type(dash: Dashboard, css: str, text: str) -> None:
    """Type ``text`` into what ``css`` finds, typed again into a fresh field when a live update
    re-rendered it halfway (what was typed stays over a render: the page keeps a priority being
    chosen)."""

    def typed() -> bool:
        field = dash.d.find_element(By.CSS_SELECTOR, css)
        field.clear()
        field.send_keys(text)
        return bool(dash.d.find_element(By.CSS_SELECTOR, css).get_attribute("value") == text)

    dash.wait(typed, f"{text!r} typed into {css}")


def _queue_items(dash: Dashboard, host: str) -> list[str]:
    """The process ids the queue panel lists for ``host``, in its order."""
    return list(
        dash.js(
            "var host = arguments[0];"
            "var s = Array.from(document.querySelectorAll('#queue .queue-host'))"
            ".find(function (q) { return q.dataset.host === host; });"
            "return s ? Array.from(s.querySelectorAll('li.wait')).map(function (li) { return li.dataset.processId; })"
            " : [];",
            host,
        )
    )


def _wait_text(dash: Dashboard, process_id: str) -> str:
    return str(
        dash.js(
            "var li = document.querySelector('#queue li.wait[data-process-id=\"' + arguments[0] + '\"]');"
            "return li ? li.textContent.replace(/\\s+/g, ' ').trim() : '';",
            process_id,
        )
    )


def _notice(dash: Dashboard, *texts: str) -> Any:
    def shown() -> Any:
        notices = dash.d.find_elements(By.CSS_SELECTOR, "#notices .notice")
        return next((n for n in notices if all(t in n.text for t in texts)), None)

    return dash.wait(shown, f"a notice saying {texts}")


def test_resume_when_free_queues_the_job_in_order_and_cancel_takes_it_out(
    dash: Dashboard, api: Api, jobs: Jobs
) -> None:
    host = _full(FakeHost("queue-node"))
    first = jobs(host, "gpu-queue-a1", state="PAUSED", memory=20 * GIB)
    second = jobs(host, "gpu-queue-b2", state="PAUSED", memory=30 * GIB)
    dash.open()
    dash.wait_buttons(first.process_id, {"Resume": True, "Resume when free": True})

    dash.click(first.process_id, "queue")
    dash.wait(lambda: _waits(api, first.process_id), "the server queued it")
    [wait] = _waits(api, first.process_id)
    assert wait["state"] == "waiting" and wait["position"] == 1 and wait["gpu_uuid"] is None
    _notice(dash, "gpu-queue-a1 waits to resume when free: #1 in the queue of queue-node")
    dash.wait_cell(first.process_id, "Status", "PAUSED", "queued #1 on queue-node")
    dash.wait_buttons(first.process_id, {"Resume": True, "Leave queue": True})
    dash.wait(lambda: _queue_items(dash, "queue-node") == [first.process_id], "the queue panel lists it")
    text = _wait_text(dash, first.process_id)
    assert "#1" in text and "priority normal" in text and "any GPU it may use" in text and "needs 20.0 GiB" in text
    assert "queued by" in text and "when free" in text

    dash.click(second.process_id, "queue")
    dash.wait(lambda: _queue_items(dash, "queue-node") == [first.process_id, second.process_id], "first come first")
    # a higher priority goes first: set through the API, the panel follows the wait event
    assert api.session.put(f"{api.base}/processes/{second.process_id}/priority", json={"priority": "high"}).ok
    dash.wait(lambda: _queue_items(dash, "queue-node") == [second.process_id, first.process_id], "high goes first")
    assert "priority high" in _wait_text(dash, second.process_id)
    dash.wait_cell(second.process_id, "Status", "priority high", "queued #1")
    dash.wait_cell(first.process_id, "Status", "queued #2")

    _click(dash, f'#queue li.wait[data-process-id="{first.process_id}"] button[data-action="cancel-wait"]')
    dash.wait(lambda: not _waits(api, first.process_id), "its wait is cancelled on the server")
    [cancelled] = _waits(api, first.process_id, all=True)
    assert cancelled["state"] == "cancelled" and "cancelled by" in cancelled["note"]
    dash.wait(lambda: _queue_items(dash, "queue-node") == [second.process_id], "the panel drops it")
    dash.wait_buttons(first.process_id, {"Resume": True, "Resume when free": True})

    # "Leave queue" in the row does the same
    dash.click(second.process_id, "cancel-wait")
    dash.wait(lambda: not _waits(api, second.process_id), "the second wait is cancelled")
    dash.wait(lambda: not _queue_items(dash, "queue-node"), "the queue is empty")
    assert dash.d.find_element(By.ID, "no-waits").is_displayed()
    assert first.state == second.state == "PAUSED" and not first.received and not second.received


def test_a_queued_job_resumes_by_itself_and_its_timeline_says_which_policy_and_why(
    dash: Dashboard, api: Api, jobs: Jobs
) -> None:
    host = _full(FakeHost("free-node"))
    job = jobs(host, "gpu-freed-01", state="PAUSED", memory=20 * GIB)
    dash.open()
    dash.wait_buttons(job.process_id, {"Resume": True, "Resume when free": True})
    dash.click(job.process_id, "queue")
    dash.wait_cell(job.process_id, "Status", "queued #1")
    host.gpus[2].other = 0  # the neighbour on GPU 2 exits
    dash.wait(lambda: job.state == "RUNNING", "the queue resumes it", timeout=ROOM_SHOWS_S)
    assert job.gpu_uuid == host.uuid(2)
    dash.wait_cell(job.process_id, "Status", "RUNNING")
    dash.wait(lambda: not _queue_items(dash, "free-node"), "it left the queue")
    [done] = _waits(api, job.process_id, all=True)
    assert done["state"] == "done"

    _click(dash, f"#proc-{job.process_id} a.job-link")
    dash.wait(lambda: dash.d.current_url.endswith(f"/jobs/{job.process_id}"), "its page opens")
    event = dash.wait(
        lambda: dash.d.find_element(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]').text,
        "the resume on its timeline",
    )
    assert "resume → GPU 2" in event
    assert "by the server on its own: resume when free" in event
    assert "why:" in event and done["reason"] not in ("", None)


def test_a_job_of_several_ranks_waits_as_one_and_resumes_whole(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    host = _full(FakeHost("queue-ddp-node"))  # from the start: the queue judges on the reports stored
    r0, r1 = two_rank_job(jobs, host, "queued-ddp")
    dash.open()
    dash.wait(lambda: dash.job_row("queued-ddp").find_elements(By.CSS_SELECTOR, '[data-action="job-pause"]'), "Pause")
    dash.click_job("queued-ddp", "pause")
    dash.wait(lambda: r0.state == r1.state == "PAUSED", "both ranks pause")
    dash.wait(lambda: dash.job_row("queued-ddp").find_elements(By.CSS_SELECTOR, '[data-action="queue"]'), "the button")
    _click(dash, '#job-queued-ddp button[data-action="queue"]')
    dash.wait(lambda: _waits(api, r1.process_id), "the job is queued, through either rank")
    [wait] = _waits(api, r0.process_id)
    assert wait["job_key"] == "queued-ddp" and wait["state"] == "waiting"
    dash.wait(lambda: "queued #1 on queue-ddp-node" in dash.job_text("queued-ddp", "Status"), "the job row's mark")
    dash.wait(lambda: "job queued-ddp" in _wait_text(dash, wait["process_id"]), "the panel names the job")
    for gpu in host.gpus[:2]:
        gpu.other = 0
    dash.wait(lambda: r0.state == r1.state == "RUNNING", "the queue resumes both ranks", timeout=ROOM_SHOWS_S)
    assert (r0.gpu_uuid, r1.gpu_uuid) == (host.uuid(0), host.uuid(1))
    dash.wait(lambda: dash.job_text("queued-ddp", "Status") == "RUNNING", "the job row shows it running")


def test_a_refused_resume_offers_to_queue_it(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    host = _full(FakeHost("refuse-node"))
    job = jobs(host, "gpu-refused-1", state="PAUSED", memory=18 * GIB)
    job.fail_with = "cuda:0 has 5.00 GiB free; the paused job needs 18.00 GiB: it stays paused"
    dash.open()
    dash.wait_buttons(job.process_id, {"Resume": True, "Resume when free": True})
    dash.click(job.process_id, "resume")
    dash.wait(dash.dialog_open, "the Resume dialog")
    dash.submit_dialog()
    notice = _notice(dash, "resume gpu-refused-1", "failed", "it stays paused")
    assert notice.get_attribute("role") == "alert"
    notice.find_element(By.CSS_SELECTOR, "button.notice-action").click()
    dash.wait(lambda: _waits(api, job.process_id), "queued by the notice's button")
    [wait] = _waits(api, job.process_id)
    assert wait["state"] == "waiting"
    _notice(dash, "gpu-refused-1 waits to resume when free")
    dash.wait_cell(job.process_id, "Status", "queued #1")


def test_make_room_pauses_a_lower_priority_job_or_says_why_gpu_by_gpu(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    host = FakeHost("room-node")
    for gpu in host.gpus[1:]:
        gpu.other = gpu.total - 5 * GIB
    host.gpus[0].other = 30 * GIB  # 140 GiB: 30 other, 100 the low job's, 10 free
    low = jobs(host, "gpu-room-low", gpu=0, memory=100 * GIB)
    wanted = jobs(host, "gpu-room-want", gpu=0, state="PAUSED", memory=60 * GIB)
    dash.open(f"jobs/{wanted.process_id}")
    _click(dash, '#job-actions button[data-action="make-room"]')
    notice = _notice(dash, "make room for gpu-room-want refused")
    lines = notice.find_element(By.CSS_SELECTOR, ".notice-text").text.splitlines()
    assert any(line.startswith("GPU 0: ") and "no job of lower priority" in line for line in lines), lines
    assert any(line.startswith("GPU 1: ") for line in lines), lines
    assert "jobs of its priority or higher hold 100.0 GiB" in notice.text
    assert low.state == "RUNNING" and not _waits(api, wanted.process_id)

    # an admin lowers the running job's priority on its page; then room can be made
    dash.d.get(f"{dash.server.url}/jobs/{low.process_id}")
    dash.wait(
        lambda: (
            Select(dash.d.find_element(By.CSS_SELECTOR, "form.priority-form select")).select_by_value("low") or True
        ),
        "low chosen",
    )
    _click(dash, "form.priority-form button[type=submit]")
    dash.wait(lambda: _process(api, low.process_id)["priority"] == 10, "the server took it")
    dash.wait(lambda: dash.d.find_element(By.ID, "job-priority").text.startswith("low"), "the page shows it")

    dash.d.get(f"{dash.server.url}/jobs/{wanted.process_id}")
    _click(dash, '#job-actions button[data-action="make-room"]')
    _notice(dash, "making room for gpu-room-want on GPU 0: pausing gpu-room-low")
    dash.wait(lambda: low.state == "PAUSED", "the low job is paused for it")
    dash.wait(lambda: wanted.state == "RUNNING", "and the job resumes in the room", timeout=ROOM_SHOWS_S)
    assert wanted.gpu_uuid == host.uuid(0)
    [queued] = _waits(api, low.process_id)
    assert queued["requested_by"] == "policy: make room" and "gpu-room-want" in queued["reason"]
    pause = next(c for c in api.commands(low.process_id) if c["kind"] == "pause")
    assert pause["reason"] and "make room" in pause["reason"]
    dash.d.get(f"{dash.server.url}/jobs/{low.process_id}")
    dash.wait(lambda: "Waiting to resume when free" in dash.d.find_element(By.ID, "job-wait").text, "its wait shown")
    event = dash.wait(
        lambda: dash.d.find_element(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]').text,
        "the pause on its timeline",
    )
    assert "pause" in event and "by the server on its own: make room" in event and "why: make room" in event


def test_priority_by_number_and_a_viewer_sees_it_without_controls(
    server: LiveServer, browser: Any, dash: Dashboard, api: Api, jobs: Jobs
) -> None:
    host = _full(FakeHost("prio-node"))
    job = jobs(host, "gpu-prio-0001", state="PAUSED", memory=20 * GIB)
    dash.open(f"jobs/{job.process_id}")
    _type(dash, "form.priority-form input[name=number]", "70")
    _click(dash, "form.priority-form button[type=submit]")
    dash.wait(lambda: _process(api, job.process_id)["priority"] == 70, "the server took 70")
    dash.wait(lambda: dash.d.find_element(By.ID, "job-priority").text.startswith("70"), "the page shows 70")
    _type(dash, "form.priority-form input[name=number]", "101")
    _click(dash, "form.priority-form button[type=submit]")
    _notice(dash, "priority of gpu-prio-0001 refused", "priority '101' is not low, normal, high or a number 0-100")
    assert _process(api, job.process_id)["priority"] == 70
    assert api.post("/waits", {"process_id": job.process_id}).status_code == 201

    minted = api.post("/tokens", {"name": "queue screen", "role": "viewer"})
    assert minted.status_code == 201
    browser.delete_all_cookies()
    viewer = Dashboard(browser, server)
    viewer.open(token=minted.json()["token"])
    viewer.wait(lambda: viewer.has_row(job.process_id), "the row")
    viewer.wait_cell(job.process_id, "Status", "priority 70", "queued #1")
    viewer.wait_buttons(job.process_id, {"Resume": False})
    viewer.wait(lambda: _queue_items(viewer, "prio-node") == [job.process_id], "the viewer sees the queue")
    assert not browser.find_elements(By.CSS_SELECTOR, "#queue button")
    viewer.wait(lambda: viewer.host_section("prio-node"), "the host's GPU cards")
    assert not browser.find_elements(By.CSS_SELECTOR, '#hosts [data-action="drain"]')
    viewer.d.get(f"{server.url}/jobs/{job.process_id}")
    viewer.wait(lambda: viewer.d.find_element(By.ID, "job-priority").text.startswith("70"), "priority, read-only")
    assert not browser.find_elements(By.CSS_SELECTOR, "form.priority-form")
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-action="make-room"], [data-action="queue"]')
    viewer.wait(lambda: "Waiting to resume when free: #1" in browser.find_element(By.ID, "job-wait").text, "its wait")
    viewer.assert_console_clean()
    browser.delete_all_cookies()


def test_the_table_is_grouped_by_host_when_it_lists_several(dash: Dashboard, jobs: Jobs) -> None:
    a, b = FakeHost("group-node-a"), FakeHost("group-node-b")
    jobs(b, "gpu-group-b1", gpu=1)
    jobs(a, "gpu-group-a1", gpu=0)
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-group-b1") and dash.has_row("gpu-group-a1"), "both rows")

    def layout() -> list[str]:
        return list(
            dash.js(
                "return Array.from(document.querySelectorAll('#process-rows tr')).filter(function (r) {"
                " return !r.hidden; }).map(function (r) {"
                " return r.classList.contains('host-heading') ? 'host ' + r.dataset.host : r.dataset.processId; });"
            )
        )

    dash.wait(
        lambda: layout() == ["host group-node-a", "gpu-group-a1", "host group-node-b", "gpu-group-b1"],
        "a heading per host, its rows under it",
    )
    late: SimJob = jobs(a, "gpu-group-a2", gpu=2)
    dash.wait(
        lambda: layout() == ["host group-node-a", "gpu-group-a1", late.process_id, "host group-node-b", "gpu-group-b1"],
        "a new job goes under its host's heading",
    )
    dash.search("group-node-b")
    dash.wait(lambda: layout() == ["host group-node-b", "gpu-group-b1"], "a host with no row shown hides its heading")
    dash.search("")


def test_a_wait_queued_on_the_job_page_keeps_the_reason_typed_there(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    host = _full(FakeHost("why-node"))
    job = jobs(host, "gpu-why-0001", state="PAUSED", memory=20 * GIB)
    dash.open(f"jobs/{job.process_id}")
    _type(dash, "#job-reason", "back after the demo")
    _click(dash, '#job-actions button[data-action="queue"]')
    dash.wait(lambda: _waits(api, job.process_id), "the server queued it")
    [wait] = _waits(api, job.process_id)
    assert wait["why"] == "back after the demo"
    dash.wait(lambda: "why: back after the demo" in dash.d.find_element(By.ID, "job-wait").text, "its page says why")
    assert dash.d.find_element(By.ID, "job-reason").get_attribute("value") == ""  # said once, with this wait

    dash.open()
    dash.wait(lambda: "why: back after the demo" in _wait_text(dash, job.process_id), "the queue panel says why")
    host.gpus[1].other = 0
    dash.wait(lambda: job.state == "RUNNING", "the queue resumes it", timeout=ROOM_SHOWS_S)
    resume = next(c for c in api.commands(job.process_id) if c["kind"] == "resume")
    assert "back after the demo" in resume["reason"]
    dash.d.get(f"{dash.server.url}/jobs/{job.process_id}")
    event = dash.wait(
        lambda: dash.d.find_element(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]').text,
        "the resume on its timeline",
    )
    assert "by the server on its own: resume when free" in event and "back after the demo" in event
    # the timeline redraws as events arrive: its entries are read again until one says why
    dash.wait(
        lambda: any(
            "back after the demo" in e.text
            for e in dash.d.find_elements(By.CSS_SELECTOR, "#job-timeline li.event-queue")
        ),
        "the queueing on its timeline, and why",
    )

"""The job page, short refusal reasons, cluster totals and GPU history charts in headless
Chromium, at desktop and phone widths."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import GIB, Api, FakeHost, Jobs, LiveServer
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)

DESKTOP, PHONE = (1280, 800), (390, 844)


def _no_horizontal_overflow(dash: Dashboard, width: int) -> None:
    sizes = dash.js(
        "var e = document.documentElement;"
        "var widest = Array.from(document.querySelectorAll('main *')).reduce("
        " function (m, el) { return Math.max(m, el.getBoundingClientRect().right); }, 0);"
        "return {scroll: e.scrollWidth, client: e.clientWidth, widest: widest};"
    )
    assert sizes["scroll"] <= sizes["client"] <= width, sizes
    assert sizes["widest"] <= sizes["client"] + 0.5, sizes


def _text(dash: Dashboard, element_id: str) -> str:
    return str(
        dash.js("var e = document.getElementById(arguments[0]); return e ? e.textContent.trim() : null", element_id)
    )


def _click(dash: Dashboard, css: str) -> None:
    """Click what `css` finds; the job page re-renders every few seconds, so a stale element is
    found again."""
    dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, css).click() or True, f"clicked {css}")


def _refusal(dash: Dashboard, process_id: str) -> dict[str, Any]:
    """The short reason beside a row's greyed buttons, scrolled into view, read in one call (a
    live update may re-render the row between two Selenium calls)."""
    return dict(
        dash.js(
            "var el = document.querySelector('#proc-' + CSS.escape(arguments[0]) + ' .refusal-short');"
            "if (!el) { return {text: null, title: null, visible: false}; }"
            "el.scrollIntoView(); var r = el.getBoundingClientRect();"
            "return {text: el.textContent.trim(), title: el.title,"
            " visible: r.width > 0 && r.height > 0 && r.left >= 0 && r.right <= window.innerWidth"
            " && getComputedStyle(el).visibility !== 'hidden'};",
            process_id,
        )
    )


def test_clicking_a_job_opens_its_page_with_progress_and_a_timeline(
    dash: Dashboard, jobs: Jobs, api: Api, artifacts: Path
) -> None:
    host = FakeHost("jobpage-node")
    jobs(host, "gpu-j0b0page", gpu=0, memory=12 * GIB, cmdline="python train_gpt.py --lr 3e-4", steps=100, loss=2.5)
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-j0b0page"), "the job's row appears")
    _click(dash, "#proc-gpu-j0b0page a.job-link")
    dash.wait(lambda: dash.d.current_url.endswith("/jobs/gpu-j0b0page"), "the job page opens")
    dash.wait(lambda: "live-on" in dash.d.find_element(By.ID, "live").get_attribute("class"), "live")
    assert _text(dash, "job-title") == "train_gpt.py"
    assert "python train_gpt.py --lr 3e-4" in _text(dash, "job-cmdline")
    assert "GPU 0" in _text(dash, "job-gpu") and "12.0 GiB" in _text(dash, "job-memory")
    # progress comes with the heartbeats, and the page follows it by progress events
    first = dash.wait(lambda: _text(dash, "job-steps") not in ("None", "—") and _text(dash, "job-steps"), "steps shown")
    dash.wait(lambda: _text(dash, "job-steps") != first, "the step count moves", timeout=15)
    dash.wait(lambda: "steps/s" in _text(dash, "job-rate"), "steps/s shown", timeout=15)
    assert _text(dash, "job-loss") == "2.5"
    assert dash.js("var e = document.getElementById('no-timeline'); return !!e && e.offsetParent !== null")

    _click(dash, '#job-actions button[data-action="migrate"]')
    dash.wait(dash.dialog_open, "the Migrate dialog opens")
    dash.pick_target(host.uuid(2))
    dash.submit_dialog()
    dash.wait(
        lambda: dash.d.find_elements(By.CSS_SELECTOR, '#job-timeline li.event[data-state="succeeded"]'),
        "the migrate shows on the timeline, succeeded",
        timeout=15,
    )
    event = dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, "#job-timeline li.event").text, "event text")
    assert "migrate → GPU 2" in event and "driver path" in event and "training stopped 1.23 s" in event
    assert "20.0 GiB moved" not in event and "12.0 GiB moved" in event
    dash.wait(lambda: "GPU 2" in _text(dash, "job-gpu"), "the page shows the job on GPU 2")
    # an operation's parts are its phases, never "steps" beside the training's steps
    summary = dash.wait(
        lambda: dash.d.find_element(By.CSS_SELECTOR, "#job-timeline details.event-steps summary").text, "phases"
    )
    assert re.fullmatch(r"\d+ phases", summary), summary
    _click(dash, "#job-timeline details.event-steps summary")
    dash.wait(
        lambda: "checkpoint" in dash.d.find_element(By.CSS_SELECTOR, "#job-timeline details.event-steps").text,
        "the operation's phases unfold (and stay open across re-renders)",
    )

    try:
        for (width, height), name in ((DESKTOP, "job-page-1280"), (PHONE, "job-page-390")):
            dash.viewport(width, height)
            _no_horizontal_overflow(dash, width)
            dash.d.save_screenshot(str(artifacts / f"{name}.png"))
            box = dash.js(
                "var b = document.querySelector('#job-actions button[data-action=pause]'); b.scrollIntoView();"
                "return b.getBoundingClientRect().toJSON();"
            )
            assert box["height"] >= 30 and 0 <= box["left"] and box["right"] <= width, box
    finally:
        dash.reset_viewport()
    # Pause from the job page: the state follows
    _click(dash, '#job-actions button[data-action="pause"]')
    dash.wait(lambda: _text(dash, "job-state") == "PAUSED", "paused, on the job page", timeout=15)
    assert dash.js("return document.querySelectorAll('#job-timeline li.event').length") == 2


def test_progress_reaches_the_job_page_by_events_not_a_poll(dash: Dashboard, jobs: Jobs) -> None:
    """The job's beats (every 0.5 s here) are stored in batches and announced: the page shows
    each new count within a second or two, three in a row, where a 5 s poll could show one."""
    host = FakeHost("jobpage-progress")
    jobs(host, "gpu-progr3ss", gpu=0, steps=0, loss=1.5)
    dash.open("jobs/gpu-progr3ss")
    dash.wait(lambda: "live-on" in dash.d.find_element(By.ID, "live").get_attribute("class"), "live")
    shown = [dash.wait(lambda: _text(dash, "job-steps") not in ("None", "—") and _text(dash, "job-steps"), "steps")]
    for _ in range(3):
        moved = dash.wait(
            lambda: _text(dash, "job-steps") not in shown and _text(dash, "job-steps"), "the steps move", timeout=2.5
        )
        shown.append(moved)
    assert len(set(shown)) == 4 and _text(dash, "job-loss") == "1.5"
    assert dash.js("return document.querySelectorAll('#job-progress').length") == 1  # swapped, not added
    fetched = dash.js("return performance.getEntriesByType('resource').map(function (e) { return e.name; })")
    assert any(url.endswith("/ui/jobs/gpu-progr3ss/progress") for url in fetched)  # its training sections alone


def _curve_texts(dash: Dashboard, figure_id: str) -> dict[str, str]:
    """The labels an SVG curve of the job page draws, by their class (curve-last, ...)."""
    return dict(
        dash.js(
            "var f = document.getElementById(arguments[0]); if (!f) { return {}; }"
            "var texts = {}; f.querySelectorAll('svg text').forEach(function (t) {"
            " texts[t.getAttribute('class')] = t.textContent.trim(); });"
            "texts.points = String(f.querySelector('svg polyline').getAttribute('points').split(' ').length);"
            "return texts;",
            figure_id,
        )
    )


def test_the_job_page_draws_loss_and_speed_curves_with_their_values(dash: Dashboard, jobs: Jobs) -> None:
    """The sweep samples the progress the beats store; the curves end at the last report, say
    their lowest, highest and last values in the SVG, and follow the progress events."""
    host = FakeHost("jobpage-curves")
    job = jobs(host, "gpu-curv3s", gpu=0, steps=0, loss=2.0)
    dash.open("jobs/gpu-curv3s")
    dash.wait(lambda: "live-on" in dash.d.find_element(By.ID, "live").get_attribute("class"), "live")
    dash.wait(lambda: _curve_texts(dash, "job-loss-curve").get("curve-last") == "last 2", "the loss curve", timeout=15)
    with job._lock:
        job.loss = 0.5
    dash.wait(
        lambda: _curve_texts(dash, "job-loss-curve").get("curve-last") == "last 0.5", "the curve follows", timeout=15
    )
    loss = _curve_texts(dash, "job-loss-curve")
    assert loss["curve-name"] == "loss" and loss["curve-highest"] == "2" and loss["curve-lowest"] == "0.5", loss
    assert loss["curve-now"] == "now" and loss["curve-since"].endswith(" s ago") and int(loss["points"]) >= 2, loss
    speed = dash.wait(lambda: _curve_texts(dash, "job-speed-curve") or None, "the steps/s curve", timeout=15)
    assert speed["curve-name"] == "steps/s", speed
    # 5 steps a beat, a beat every 0.5 s: about 10 steps/s, whatever the machine's load
    assert 1 < float(speed["curve-last"].removeprefix("last ")) < 20, speed
    assert float(speed["curve-lowest"]) <= float(speed["curve-highest"]), speed
    assert dash.js("return document.querySelectorAll('#job-progress').length") == 1


def _event(dash: Dashboard, kind: str) -> str:
    """The text of the newest timeline entry of this kind."""
    return str(
        dash.js(
            "var kind = arguments[0];"
            "var e = Array.from(document.querySelectorAll('#job-timeline li.event')).find(function (li) {"
            " return li.querySelector('.event-what').textContent.trim().startsWith(kind); });"
            "return e ? e.textContent.replace(/\\s+/g, ' ').trim() : '';",
            kind,
        )
    )


def test_a_reason_typed_on_the_job_page_shows_on_its_timeline_with_who_and_the_door(
    dash: Dashboard, jobs: Jobs, api: Api
) -> None:
    """Pause with the page's reason field, resume with the dialog's: each timeline entry says why,
    who sent it and that it came through the dashboard; a reason is text, never markup."""
    host = FakeHost("jobpage-reasons")
    jobs(host, "gpu-r3asons", gpu=0, steps=0, loss=1.0)
    dash.open("jobs/gpu-r3asons")
    dash.wait(lambda: "live-on" in dash.d.find_element(By.ID, "live").get_attribute("class"), "live")
    # the panel re-renders on every report of the job's GPUs; what is typed there stays
    assert dash.js("return document.getElementById('job-reason').maxLength") == 200
    dash.js("document.getElementById('job-reason').value = arguments[0]", "<b>free</b> GPU 0 for the eval run")
    _click(dash, '#job-actions button[data-action="pause"]')
    dash.wait(lambda: "succeeded" in _event(dash, "pause"), "the pause on the timeline", timeout=15)
    paused = _event(dash, "pause")
    assert "why: <b>free</b> GPU 0 for the eval run" in paused and "via the dashboard" in paused, paused
    assert not dash.d.find_elements(By.CSS_SELECTOR, "#job-timeline .event-reason b")
    [admin] = [t for t in api.get("/tokens").json() if t["role"] == "admin" and not t["revoked"]]
    assert f"by {admin['name'] or 'token ' + str(admin['id'])} via the dashboard" in paused, paused
    assert dash.js("return document.getElementById('job-reason').value") == ""  # said once, with its command

    _click(dash, '#job-actions button[data-action="resume"]')
    dash.wait(dash.dialog_open, "the Resume dialog opens")
    dash.d.find_element(By.CSS_SELECTOR, "#target-dialog input[name=reason]").send_keys("eval done")
    dash.submit_dialog()
    dash.wait(lambda: "succeeded" in _event(dash, "resume"), "the resume on the timeline", timeout=15)
    resumed = _event(dash, "resume")
    assert "why: eval done" in resumed and "via the dashboard" in resumed, resumed
    [stored] = [c for c in api.get("/commands", params={"process_id": "gpu-r3asons"}).json() if c["kind"] == "resume"]
    assert (stored["reason"], stored["door"]) == ("eval done", "dashboard")


def test_a_job_of_several_ranks_shows_its_ranks(dash: Dashboard, jobs: Jobs) -> None:
    host = FakeHost("jobpage-ddp")
    for rank in (0, 1):
        membership = {"key": "run-jp-01", "rank": rank, "world_size": 2, "local_rank": rank, "local_world_size": 2}
        jobs(host, f"gpu-jpr{rank}000", gpu=rank, cmdline="torchrun --nproc-per-node 2 ddp.py", job=membership, steps=0)
    dash.open("jobs/gpu-jpr1000")
    ranks = dash.wait(
        lambda: (
            dash.js("return Array.from(document.querySelectorAll('#job-ranks tr.rank-row'), r => r.dataset.rank)")
            == ["0", "1"]
        ),
        "both ranks listed, by rank",
    )
    assert ranks
    head = dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, ".job-head").text, "the head")
    assert "job run-jp-01 · 2 ranks" in head
    assert dash.js("return !document.querySelector('#job-actions button[data-action=job-migrate]').disabled")
    dash.viewport(*PHONE)
    try:
        _no_horizontal_overflow(dash, PHONE[0])
    finally:
        dash.reset_viewport()


def test_a_viewer_gets_the_job_page_without_buttons(server: LiveServer, browser: Any, api: Api, jobs: Jobs) -> None:
    minted = api.post("/tokens", {"name": "wall screen 2", "role": "viewer"})
    assert minted.status_code == 201
    jobs(FakeHost("jobpage-viewer"), "gpu-jpv00001", memory=8 * GIB)
    page = Dashboard(browser, server)
    browser.delete_all_cookies()
    page.open(token=minted.json()["token"])
    try:
        page.wait(lambda: page.has_row("gpu-jpv00001"), "the job's row appears")
        # greyed, and why in a few words beside them
        short = page.wait(
            lambda: _refusal(page, "gpu-jpv00001")["visible"] and _refusal(page, "gpu-jpv00001"), "reason"
        )
        assert short["text"] == "read-only login: an admin token can"
        _click(page, "#proc-gpu-jpv00001 a.job-link")
        page.wait(lambda: browser.current_url.endswith("/jobs/gpu-jpv00001"), "the job page opens")
        note = page.wait(lambda: browser.find_element(By.ID, "read-only").text, "the read-only note")
        assert "needs a token with role admin" in note
        assert not browser.find_elements(By.CSS_SELECTOR, "button[data-action]")
        page.assert_console_clean()
    finally:
        browser.delete_all_cookies()  # the next test logs in as admin again


def test_greyed_buttons_say_why_beside_them_on_a_phone_too(dash: Dashboard, jobs: Jobs) -> None:
    problems = [
        "torch 2.13.0+cpu is a CPU-only build: training runs, migration and pause are off",
        "flexium's engine is not running in this process (training on cpu): migrate, pause and resume are off",
    ]
    jobs(FakeHost("refusal-node"), "gpu-refu0001", migration=False, pause_resume=False, problems=problems)
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-refu0001"), "the job's row appears")
    assert dash.buttons("gpu-refu0001") == {"Migrate": False, "Pause": False}
    try:
        for width, height in (DESKTOP, PHONE):
            dash.viewport(width, height)
            short = dash.wait(
                lambda: _refusal(dash, "gpu-refu0001")["visible"] and _refusal(dash, "gpu-refu0001"), "reason shown"
            )
            assert short["text"] == "CPU-only torch: no GPU memory to move"
            assert len(short["text"]) <= 60 and "engine is not running" in short["title"]
    finally:
        dash.reset_viewport()
    dash.open("jobs/gpu-refu0001")
    # read in one go: the page's live refresh may replace the list between two WebDriver calls
    reasons = dash.js("return [...document.querySelectorAll('#why-not li')].map(li => li.innerText.trim())")
    assert reasons == problems  # all of it here


def _add_history(server: LiveServer, host: FakeHost, now: float) -> None:
    """Two hours of samples a minute apart, written as the server's device reports would have."""
    db = sqlite3.connect(str(Path(server.home) / "server.db"), timeout=10)
    try:
        workspace = db.execute("SELECT id FROM workspaces WHERE name = 'default'").fetchone()[0]
        rows = [
            (workspace, host.name, host.uuid(0), now - 7200 + 60 * i, (i % 40) * GIB, 140 * GIB, (i * 7) % 100)
            for i in range(120)
        ]
        db.executemany(
            "INSERT INTO gpu_samples (workspace_id, host, uuid, at, memory_used, memory_total, utilization)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        db.commit()
    finally:
        db.close()


def test_totals_and_gpu_history_on_the_main_page(
    dash: Dashboard, jobs: Jobs, server: LiveServer, artifacts: Path
) -> None:
    host = FakeHost("history-node")
    jobs(host, "gpu-hist0001", gpu=1, memory=10 * GIB)
    jobs(host, "gpu-hist0002", gpu=2, memory=10 * GIB, state="PAUSED")
    _add_history(server, host, time.time())
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-hist0002"), "rows rendered")
    read = (
        "var f = document.querySelector('article.gpu[data-uuid=\"' + arguments[0] + '\"] figure.gpu-history');"
        "if (!f) { return null; } f.scrollIntoView(); var r = f.getBoundingClientRect();"
        "return {samples: f.dataset.samples, text: f.textContent.replace(/\\s+/g, ' '),"
        " visible: r.width > 0 && r.height > 0 && r.right <= window.innerWidth,"
        " charts: Array.from(f.querySelectorAll('svg polyline'), l => ({"
        "  cls: l.parentNode.getAttribute('class'), points: l.getAttribute('points').split(' ').length,"
        "  width: l.getBoundingClientRect().width}))};"
    )
    chart = dash.wait(lambda: dash.js(read, host.uuid(0)), "the GPU's history chart")
    assert chart["samples"] == "121"  # the two hours written, and one from the jobs' reports
    assert [c["cls"] for c in chart["charts"]] == ["spark spark-memory", "spark spark-util"]
    for line in chart["charts"]:
        assert line["points"] == 121 and line["width"] > 200  # drawn across the chart, not squeezed
    assert "last 2 h" in chart["text"] and "peak 39.0 GiB" in chart["text"]
    totals = {t: int(_text(dash, f"total-{t}")) for t in ("gpus", "running", "paused", "moves")}
    assert totals["gpus"] >= 4 and totals["running"] >= 1 and totals["paused"] >= 1
    try:
        for width, height in (DESKTOP, PHONE):
            dash.viewport(width, height)
            assert dash.js("return document.getElementById('totals').getBoundingClientRect().height") > 0
            assert dash.overflow()["scroll"] <= width
            assert dash.wait(lambda: dash.js(read, host.uuid(0)), "chart")["visible"]
            dash.d.save_screenshot(str(artifacts / f"totals-history-{width}.png"))
    finally:
        dash.reset_viewport()


def test_the_job_page_tells_each_commands_outcome_as_the_dashboard_does(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    """The job page's notices are the dashboard's (common.js): the target GPU, the time and the
    path; and a command sent from elsewhere (here the API, as the CLI does) gets one too."""
    host = FakeHost("jobpage-notices")
    jobs(host, "gpu-n0tices1", gpu=0, memory=6 * GIB, cmdline="python notices.py")
    dash.open("jobs/gpu-n0tices1")
    _click(dash, '#job-actions button[data-action="migrate"]')
    dash.wait(dash.dialog_open, "the Migrate dialog opens")
    dash.pick_target(host.uuid(1))
    dash.submit_dialog()
    outcome = dash.wait(
        lambda: next((text for _r, text in dash.notices() if "succeeded" in text), None), "the outcome", timeout=15
    )
    # named by the index the target dialog showed, whichever GPU cards the page shows by the end
    expected = r"migrate gpu-n0tices1 → GPU 1 \(command \d+\): succeeded in 1\.23 s \(driver path\)"
    assert re.fullmatch(expected, outcome), outcome
    assert api.post("/commands", {"kind": "pause", "process_id": "gpu-n0tices1"}).status_code == 201
    dash.wait(
        lambda: any(t.startswith("pause gpu-n0tices1 (command ") and "succeeded in" in t for _r, t in dash.notices()),
        "a notice for the pause sent from elsewhere",
        timeout=15,
    )

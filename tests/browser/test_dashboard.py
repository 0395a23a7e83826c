"""The dashboard in headless Chromium: login link, live updates, GPU cards, filters, commands
with their progress and errors, staleness, escaping, and layout at desktop and phone widths."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from support.dashboard import GIB, Api, FakeHost, Gpu, Jobs, LiveServer, SimJob
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


def test_login_link_opens_the_dashboard_once(server: LiveServer, browser: Any) -> None:
    out = "\n".join(server.lines)
    assert server.token and server.token.startswith("flx_")
    assert server.login_link and f"Log in to the dashboard: {server.url}/login#code=" in out
    assert server.token not in server.login_link  # a one-time code, never the token
    page = Dashboard(browser, server)
    browser.delete_all_cookies()
    browser.get(server.url + "/")
    assert browser.current_url == server.url + "/login"
    browser.find_element(By.ID, "token").send_keys("flx_not-a-token")
    browser.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()
    page.wait(lambda: "invalid" in browser.find_element(By.ID, "login-error").text, "the login error shows")

    browser.get(server.login_link)
    page.wait(lambda: browser.current_url == server.url + "/", "redirected to the dashboard")
    page.wait(lambda: browser.find_element(By.ID, "live").text == "live", "event stream connected")
    assert browser.find_element(By.ID, "proc-title").text == "Processes"
    assert "code" not in browser.current_url  # not left in the address bar
    assert browser.find_element(By.ID, "role").text == "admin"
    page.assert_console_clean()

    page.log_out()
    browser.get(server.login_link)  # used: it opens nothing now
    page.wait(lambda: "used already" in browser.find_element(By.ID, "login-error").text, "the link is refused")
    assert browser.current_url == server.url + "/login"
    page.log_in(server.token)  # the token itself still does
    assert browser.find_element(By.ID, "proc-title").text == "Processes"


def test_a_viewer_sees_the_buttons_disabled_and_the_audit_log(
    server: LiveServer, browser: Any, api: Api, jobs: Jobs
) -> None:
    minted = api.post("/tokens", {"name": "wall screen", "role": "viewer"})
    assert minted.status_code == 201
    jobs(FakeHost("viewer-node"), "gpu-view0001", memory=8 * GIB)
    page = Dashboard(browser, server)
    browser.delete_all_cookies()
    page.open(token=minted.json()["token"])
    page.wait(lambda: page.has_row("gpu-view0001"), "the job's row appears")
    page.wait_cell("gpu-view0001", "Status", "RUNNING")
    assert page.buttons("gpu-view0001") == {"Migrate": False, "Pause": False}
    title = page.row("gpu-view0001").find_element(By.CSS_SELECTOR, 'button[data-action="pause"]').get_attribute("title")
    assert "needs a token with role admin" in title and "viewer token" in title
    assert browser.find_element(By.ID, "role").text == "viewer"

    browser.find_element(By.ID, "audit-link").click()
    page.wait(lambda: browser.current_url == server.url + "/audit", "the audit log opens")
    rows = browser.find_elements(By.CSS_SELECTOR, "#audit tbody tr")
    actions = [(r.get_attribute("data-action"), r.text) for r in rows]
    assert actions[0][0] == "login" and "wall screen" in actions[0][1]  # newest first: this login
    assert any(a == "token.issued" and "wall screen" in text for a, text in actions)
    page.assert_console_clean()
    page.log_out()


def test_job_appears_live_with_gpu_cards(dash: Dashboard, jobs: Jobs) -> None:
    dash.open()
    dash.js("window.samePage = true")
    host = FakeHost("live-node")
    host.gpus[1].other = 35 * GIB
    host.gpus[2].utilization = 87
    jobs(host, "gpu-live0001", memory=28 * GIB, cmdline="python train_resnet.py --epochs 90")

    dash.wait(lambda: dash.has_row("gpu-live0001"), "the new job's row appears")
    assert dash.js("return window.samePage") is True  # no reload
    dash.wait_cell("gpu-live0001", "Status", "RUNNING")
    assert "train_resnet.py" in dash.cell("gpu-live0001", "Process")
    assert "live-node" in dash.cell("gpu-live0001", "Host")
    assert "GPU 0" in dash.cell("gpu-live0001", "Device")
    assert "28.0 GiB" in dash.cell("gpu-live0001", "Memory")
    assert "1 h 2 min" in dash.cell("gpu-live0001", "Runtime")
    assert dash.buttons("gpu-live0001") == {"Migrate": True, "Pause": True}

    dash.wait(
        lambda: len(dash.host_section("live-node").find_elements(By.CSS_SELECTOR, "article.gpu")) == 4,
        "four GPU cards for the new host",
    )
    dash.wait(lambda: dash.bar(host.uuid(0))["flexium"] == 200, "GPU 0 bar: the job's 28 of 140 GiB")
    assert dash.bar(host.uuid(0))["other"] == 0
    assert dash.bar(host.uuid(1)) == {"flexium": 0, "other": 250}
    card = dash.gpu_card(host.uuid(2)).text
    assert "utilization 87 %" in card and "ok" in card and "140 GiB free" in card
    assert "gpu-live0001" in dash.gpu_card(host.uuid(0)).text
    assert dash.js("return window.samePage") is True


def test_filters_and_search_narrow_the_table(dash: Dashboard, jobs: Jobs) -> None:
    host = FakeHost("filter-node")
    jobs(host, "gpu-filt-a", gpu=0, cmdline="python llama_finetune.py")
    jobs(host, "gpu-filt-b", gpu=1, user="bob", cmdline="python resnet.py")
    jobs(host, "gpu-filt-c", gpu=2, state="PAUSED", cmdline="python llama_pretrain.py")
    other = FakeHost("filter-other")
    jobs(other, "gpu-elsewhere", gpu=1, cmdline="python llama_eval.py")
    dash.open()
    everyone = {"gpu-filt-a", "gpu-filt-b", "gpu-filt-c", "gpu-elsewhere"}
    assert everyone <= dash.visible_rows()

    dash.search("gpu-filt-")
    assert dash.visible_rows() == {"gpu-filt-a", "gpu-filt-b", "gpu-filt-c"}
    dash.choose("filter-status", "PAUSED")
    assert dash.visible_rows() == {"gpu-filt-c"}
    dash.choose("filter-status", "RUNNING")
    assert dash.visible_rows() == {"gpu-filt-a", "gpu-filt-b"}
    dash.choose("filter-status", "")
    dash.choose("filter-device", host.uuid(1))
    assert dash.visible_rows() == {"gpu-filt-b"}
    dash.search("")
    assert dash.visible_rows() == {"gpu-filt-b"}  # GPU 1 of filter-other is another GPU
    dash.choose("filter-device", "none")
    assert "gpu-filt-c" in dash.visible_rows() and not {"gpu-filt-a", "gpu-filt-b"} & dash.visible_rows()
    dash.choose("filter-device", "")
    dash.search("llama filter-node")  # every word must match
    assert dash.visible_rows() == {"gpu-filt-a", "gpu-filt-c"}
    assert "2 of" in dash.d.find_element(By.ID, "shown-count").text
    dash.search("bob")
    assert dash.visible_rows() == {"gpu-filt-b"}
    dash.search("no-such-job")
    assert dash.visible_rows() == set()
    assert dash.d.find_element(By.ID, "no-match").is_displayed()

    # the filters live in the address: a reload keeps them
    dash.search("llama")
    dash.choose("filter-status", "RUNNING")
    assert "q=llama" in dash.d.current_url and "status=RUNNING" in dash.d.current_url
    dash.d.refresh()
    dash.wait(lambda: dash.visible_rows() == {"gpu-filt-a", "gpu-elsewhere"}, "filters restored after reload")
    dash.d.find_element(By.ID, "filter-reset").click()
    dash.wait(lambda: everyone <= dash.visible_rows(), "cleared filters show every row")
    assert "q=" not in dash.d.current_url

    # a job arriving while a filter is set is filtered too
    dash.choose("filter-status", "PAUSED")
    jobs(host, "gpu-filt-d", gpu=3, cmdline="python late.py")
    dash.wait(lambda: dash.has_row("gpu-filt-d"), "the late job's row arrives")
    assert "gpu-filt-d" not in dash.visible_rows()
    dash.choose("filter-status", "")


def test_migrate_offers_only_gpus_that_fit_and_shows_the_outcome(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    host = FakeHost(
        "mig-node",
        gpus=[
            Gpu(0),
            Gpu(1),
            Gpu(2, other=125 * GIB),
            Gpu(3, name="NVIDIA A100-SXM4-80GB", total=80 * GIB),
            Gpu(4, health="xid 79"),
            Gpu(5, other=40 * GIB),
        ],
    )
    job = jobs(host, "gpu-mig-0001", memory=20 * GIB, op_seconds=1.87)
    jobs(FakeHost("mig-other"), "gpu-mig-other", gpu=0)  # same model, other host: never offered
    job.hold.clear()
    dash.open()
    dash.wait_buttons("gpu-mig-0001", {"Migrate": True, "Pause": True})
    moves_before = _total(dash, "moves")
    dash.click("gpu-mig-0001", "migrate")
    dash.wait(dash.dialog_open, "the Migrate dialog opens")
    assert sorted(dash.target_values()) == [host.uuid(1), host.uuid(5)]
    refused = dash.d.find_element(By.CSS_SELECTOR, "#target-dialog details.refused")
    refused.find_element(By.TAG_NAME, "summary").click()
    reasons = refused.text
    assert "GPU 0: the job is already on it" in reasons
    assert "GPU 2: 15.0 GiB free, the job needs 20.0 GiB" in reasons
    assert "GPU 3: NVIDIA A100-SXM4-80GB" in reasons
    assert "GPU 4: health: xid 79" in reasons

    dash.pick_target(host.uuid(5))
    dash.submit_dialog()
    dash.wait(lambda: not dash.dialog_open(), "the dialog closes once the command is stored")
    [command] = api.commands("gpu-mig-0001")
    assert command["kind"] == "migrate" and command["target_uuid"] == host.uuid(5)
    assert command["state"] in ("queued", "delivered", "running")

    dash.wait_cell("gpu-mig-0001", "Status", "MIGRATING", "migrate → GPU 5: running")
    assert dash.buttons("gpu-mig-0001") == {}  # one command at a time
    assert any("running" in text for _role, text in dash.notices())
    job.hold.set()
    dash.wait_cell("gpu-mig-0001", "Status", "RUNNING")
    dash.wait_cell("gpu-mig-0001", "Device", "GPU 5")
    last = dash.wait_cell("gpu-mig-0001", "Last command", "migrate → GPU 5", "1.87 s", "driver path", "succeeded")
    assert "succeeded · " in last and ("just now" in last or "ago" in last)
    assert api.get(f"/commands/{command['id']}").json()["state"] == "succeeded"
    dash.wait(
        lambda: any("succeeded in 1.87 s (driver path)" in text for _r, text in dash.notices()),
        "a notice tells the outcome and the path that ran",
    )
    dash.wait(
        lambda: any(
            f"#{command['id']}" in item and "succeeded" in item and "1.87 s" in item for item in dash.command_items()
        ),
        "recent commands list it",
    )
    dash.wait_buttons("gpu-mig-0001", {"Migrate": True, "Pause": True})
    dash.wait(
        lambda: dash.bar(host.uuid(5))["flexium"] > 0 and dash.bar(host.uuid(0))["flexium"] == 0,
        "the job's memory moved on the GPU cards",
    )
    dash.wait(lambda: _total(dash, "moves") == moves_before + 1, "the totals count the move without a reload")


def test_pause_and_resume_follow_the_state(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    host = FakeHost("pause-node")
    jobs(host, "gpu-pause-01", memory=16 * GIB, op_seconds=0.42)
    jobs(host, "gpu-oldriver", gpu=3, migration=False, pause_resume=False)
    dash.open()
    dash.wait_buttons("gpu-pause-01", {"Migrate": True, "Pause": True})
    assert dash.buttons("gpu-oldriver") == {"Migrate": False, "Pause": False}
    assert "580+" in dash.row("gpu-oldriver").find_element(By.CSS_SELECTOR, "[data-action=migrate]").get_attribute(
        "title"
    )

    paused_before = _total(dash, "paused")
    dash.click("gpu-pause-01", "pause")
    dash.wait_cell("gpu-pause-01", "Status", "PAUSED")
    dash.wait(lambda: _total(dash, "paused") == paused_before + 1, "the totals count the paused job live")
    [pause] = api.commands("gpu-pause-01")
    assert pause["kind"] == "pause" and pause["target_uuid"] is None
    dash.wait_buttons("gpu-pause-01", {"Resume": True, "Resume when free": True})
    assert "paused from GPU 0" in dash.cell("gpu-pause-01", "Device")
    assert "0 B" in dash.cell("gpu-pause-01", "Memory") and "needs 16.0 GiB" in dash.cell("gpu-pause-01", "Memory")
    dash.wait_cell("gpu-pause-01", "Last command", "pause", "0.42 s")

    dash.click("gpu-pause-01", "resume")
    dash.wait(dash.dialog_open, "the Resume dialog opens")
    assert dash.target_values()[0] == ""  # "let flexium choose" comes first
    assert dash.d.find_element(By.CSS_SELECTOR, '#target-dialog input[value=""]').is_selected()
    assert set(dash.target_values()[1:]) == {host.uuid(i) for i in range(4)}  # sharing a GPU is fine when it has room
    dash.pick_target(host.uuid(2))
    dash.submit_dialog()
    dash.wait_cell("gpu-pause-01", "Status", "RUNNING")
    dash.wait_cell("gpu-pause-01", "Device", "GPU 2")
    dash.wait_buttons("gpu-pause-01", {"Migrate": True, "Pause": True})
    resume = api.commands("gpu-pause-01")[0]
    assert resume["kind"] == "resume" and resume["target_uuid"] == host.uuid(2) and resume["state"] == "succeeded"
    dash.wait_cell("gpu-pause-01", "Last command", "resume → GPU 2", "succeeded")
    dash.wait(lambda: _total(dash, "paused") == paused_before, "the totals follow the resume")


def _total(dash: Dashboard, name: str) -> int:
    """One of the cluster totals over the page (total-gpus, -running, -paused, -moves)."""
    return int(dash.js(f"return document.getElementById('total-{name}').textContent.trim()"))


def test_keyboard_alone_can_migrate(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    host = FakeHost("keys-node")
    jobs(host, "gpu-keys-001", op_seconds=0.5)
    dash.open()
    dash.wait_buttons("gpu-keys-001", {"Migrate": True, "Pause": True})
    button = dash.row("gpu-keys-001").find_element(By.CSS_SELECTOR, "[data-action=migrate]")
    dash.js("arguments[0].focus()", button)
    active = dash.d.switch_to.active_element
    assert active.get_attribute("aria-label") == "Migrate gpu-keys-001"
    active.send_keys(Keys.ENTER)
    dash.wait(dash.dialog_open, "Enter opens the dialog")
    focused = dash.d.switch_to.active_element  # the first target, already chosen
    assert focused.get_attribute("name") == "target" and focused.get_attribute("value") == host.uuid(1)
    focused.send_keys(Keys.ESCAPE)
    dash.wait(lambda: not dash.dialog_open(), "Escape closes it")
    assert dash.d.switch_to.active_element.get_attribute("aria-label") == "Migrate gpu-keys-001"
    dash.d.switch_to.active_element.send_keys(Keys.ENTER)
    dash.wait(dash.dialog_open, "the dialog opens again")
    dash.d.switch_to.active_element.send_keys(Keys.ARROW_DOWN)  # radio group: next GPU
    assert dash.d.switch_to.active_element.get_attribute("value") == host.uuid(2)
    dash.d.switch_to.active_element.send_keys(Keys.ENTER)  # submits the form
    dash.wait_cell("gpu-keys-001", "Last command", "migrate → GPU 2", "succeeded")
    assert api.commands("gpu-keys-001")[0]["target_uuid"] == host.uuid(2)
    labels = dash.js(
        "return Array.from(document.querySelectorAll('#filters input, #filters select'))"
        ".map(function (e) { return e.labels.length; })"
    )
    assert labels and all(n == 1 for n in labels)


def test_a_live_redraw_keeps_the_focus_and_leaves_the_page_where_it_was(dash: Dashboard, jobs: Jobs) -> None:
    """A row redrawn under a focused button gets the focus back on its new button without scrolling
    to it: the page must not jump while a person reads or clicks elsewhere (a click on a notice at
    the top was once lost so)."""
    job = jobs(FakeHost("focus-node"), "gpu-f0cus001", memory=20 * GIB)
    size = dash.d.get_window_size()
    dash.d.set_window_size(1280, 420)  # the table's rows below the fold
    try:
        dash.open()
        dash.wait_buttons(job.process_id, {"Migrate": True, "Pause": True})
        button = dash.row(job.process_id).find_element(By.CSS_SELECTOR, "[data-action=pause]")
        dash.js("arguments[0].focus(); window.scrollTo(0, 0)", button)
        assert dash.js("return window.scrollY") == 0
        assert dash.d.switch_to.active_element.get_attribute("aria-label") == f"Pause {job.process_id}"
        job.memory = 21 * GIB  # its next heartbeat redraws its row
        dash.wait_cell(job.process_id, "Memory", "21.0 GiB")
        assert dash.d.switch_to.active_element.get_attribute("aria-label") == f"Pause {job.process_id}"
        assert dash.js("return window.scrollY") == 0
    finally:
        dash.d.set_window_size(size["width"], size["height"])


def test_refused_and_failed_commands_are_visible(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    host = FakeHost("err-node")
    job = jobs(host, "gpu-err-0001", op_seconds=0.3)
    job.hold.clear()
    dash.open()
    dash.click("gpu-err-0001", "migrate")
    dash.wait(dash.dialog_open, "the Migrate dialog opens")
    # meanwhile someone pauses the job from the command line
    assert api.post("/commands", {"kind": "pause", "process_id": "gpu-err-0001"}).status_code == 201
    dash.wait_cell("gpu-err-0001", "Status", "PAUSING")
    dash.submit_dialog()
    dash.wait(lambda: "already has command" in dash.dialog_error(), "the refusal shows in the dialog")
    assert dash.dialog_open()
    assert any(
        role == "alert" and "migrate gpu-err-0001 refused" in text and "one at a time" in text
        for role, text in dash.notices()
    )
    assert len(api.commands("gpu-err-0001")) == 1  # nothing stored
    dash.d.find_element(By.CSS_SELECTOR, "#target-dialog [data-close]").click()
    dash.wait(lambda: not dash.dialog_open(), "the dialog closes")

    job.hold.set()
    dash.wait_buttons("gpu-err-0001", {"Resume": True, "Resume when free": True})
    job.fail_with = "cuCheckpointProcessRestore failed: CUDA_ERROR_INVALID_VALUE"
    dash.click("gpu-err-0001", "resume")
    dash.wait(dash.dialog_open, "the Resume dialog opens")
    dash.submit_dialog()
    last = dash.wait_cell("gpu-err-0001", "Last command", "failed", "CUDA_ERROR_INVALID_VALUE")
    assert "resume" in last
    dash.wait_cell("gpu-err-0001", "Status", "PAUSED")
    dash.wait_buttons("gpu-err-0001", {"Resume": True, "Resume when free": True})
    dash.wait(
        lambda: any(role == "alert" and "failed: cuCheckpointProcessRestore" in text for role, text in dash.notices()),
        "a notice tells the failure",
    )
    dash.wait(
        lambda: any("failed" in item and "CUDA_ERROR_INVALID_VALUE" in item for item in dash.command_items()),
        "recent commands show the error",
    )


def test_a_silent_job_is_shown_stale(dash: Dashboard, jobs: Jobs, api: Api) -> None:
    host = FakeHost("stale-node")
    job = jobs(host, "gpu-stale-01")
    dash.open()
    dash.wait_cell("gpu-stale-01", "Status", "RUNNING")
    job.die()
    dash.wait_cell("gpu-stale-01", "Status", "STALE", "silent since", timeout=20)
    dash.wait_buttons("gpu-stale-01", {"Forget": True})
    # Its runtime ends where it went silent: the cell counts on no more.
    runtime = dash.cell("gpu-stale-01", "Runtime")
    time.sleep(2.5)
    assert dash.cell("gpu-stale-01", "Runtime") == runtime, runtime

    def folded() -> bool:  # read again when a live update re-renders the section meanwhile
        section = dash.host_section("stale-node")
        return bool(
            section.get_attribute("data-stale") == "1"
            and section.get_attribute("open") is None
            and "silent" in section.text
        )

    dash.wait(folded, "its host went silent too: folded")
    dash.choose("filter-status", "STALE")
    assert "gpu-stale-01" in dash.visible_rows()
    dash.click("gpu-stale-01", "forget")
    dash.wait(lambda: not dash.has_row("gpu-stale-01"), "the forgotten row goes")
    assert api.get("/processes/gpu-stale-01").status_code == 404
    dash.choose("filter-status", "")


XSS = "<img src=x onerror=alert(1)>"


def test_client_text_is_escaped(dash: Dashboard, jobs: Jobs) -> None:
    host = FakeHost(f"{XSS}-node")
    host.gpus[1].health = f"<b>{XSS}</b>"
    host.gpus[2].name = XSS
    job = jobs(host, "gpu-xss-0001", user=XSS, cmdline=f"python train.py --tag '{XSS}'", op_seconds=0.2)
    jobs(host, "gpu-xss-0002", gpu=3, cmdline=XSS)
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-xss-0002"), "the rows are there")
    job.fail_with = XSS
    dash.click("gpu-xss-0001", "pause")
    dash.wait_cell("gpu-xss-0001", "Last command", "failed", XSS)
    assert XSS in dash.cell("gpu-xss-0001", "User") and XSS in dash.cell("gpu-xss-0001", "Host")
    assert XSS in dash.cell("gpu-xss-0002", "Process")
    dash.wait(lambda: XSS in dash.host_section(f"{XSS}-node").text, "the host's name, as text")  # re-rendered live
    dash.click("gpu-xss-0001", "migrate")
    dash.wait(dash.dialog_open, "the Migrate dialog opens")
    dash.d.find_element(By.CSS_SELECTOR, "#target-dialog details.refused summary").click()
    assert XSS in dash.d.find_element(By.ID, "target-dialog").text
    dash.d.find_element(By.CSS_SELECTOR, "#target-dialog [data-close]").click()
    dash.wait(lambda: any(XSS in text for _r, text in dash.notices()), "the failure notice quotes the error")
    assert dash.js("return document.querySelectorAll('img').length") == 0
    assert f"<b>{XSS}</b>" in dash.gpu_card(host.uuid(1)).text
    with pytest.raises(NoAlertPresentException):
        _ = dash.d.switch_to.alert.text


def test_reconnects_after_a_server_restart(dash: Dashboard, server: LiveServer, jobs: Jobs) -> None:
    dash.open()
    dash.js("window.samePage = true")
    server.stop()
    dash.wait(lambda: dash.d.find_element(By.ID, "live").text == "reconnecting…", "the page says it lost the stream")
    server.start()
    dash.wait(lambda: dash.d.find_element(By.ID, "live").text == "live", "the stream is back", timeout=15)
    jobs(FakeHost("restart-node"), "gpu-restart-01")
    dash.wait(lambda: dash.has_row("gpu-restart-01"), "a job registered after the restart appears")
    dash.wait(lambda: dash.host_section("restart-node"), "and its GPUs")
    assert dash.js("return window.samePage") is True


def _populate_for_screenshots(jobs: Jobs) -> SimJob:
    host = FakeHost(
        "dgx-h200-01",
        gpus=[
            Gpu(i, other=o * GIB, utilization=u)
            for i, (o, u) in enumerate([(0, 92), (3, 97), (60, 40), (0, 0), (110, 71), (0, 12), (139, 100), (8, 55)])
        ],
    )
    host.gpus[5].health = "xid 79"
    jobs(
        host,
        "gpu-7f3a9c21",
        gpu=0,
        memory=48 * GIB,
        user="alice",
        cmdline="python -m torch.distributed.run --nproc-per-node 1 train_llama.py "
        "--config configs/llama-8b-long-context.yaml",
    )
    jobs(host, "gpu-0b91e4d7", gpu=1, memory=17 * GIB, user="bob", cmdline="python resnet50_imagenet.py")
    jobs(
        host, "gpu-c4d2aa90", gpu=7, state="PAUSED", memory=33 * GIB, user="carol", cmdline="python -m finetune.whisper"
    )
    long_id = "gpu-" + "averyveryverylongprocessidentifier" * 3
    jobs(
        host,
        long_id[:120],
        gpu=3,
        memory=9 * GIB,
        user="dmitri.sokolovsky-longname",
        cmdline="accelerate launch sft.py",
    )
    busy = jobs(host, "gpu-5e6f7a8b", gpu=2, memory=22 * GIB, user="erin", cmdline="python ppo_agent.py")
    busy.hold.clear()
    jobs(
        FakeHost("node-a100", gpus=[Gpu(i, name="NVIDIA A100-SXM4-80GB", total=80 * GIB) for i in range(2)]),
        "gpu-aa00bb11",
        gpu=1,
        memory=30 * GIB,
        user="frank",
        cmdline="python bert.py",
    )
    return busy


def _full_page_screenshot(dash: Dashboard, path: Path, width: int, mobile: bool) -> None:
    height = int(dash.js("return document.documentElement.scrollHeight"))
    dash.d.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
    )
    dash.d.save_screenshot(str(path))


def test_layout_at_1280_and_on_a_phone(dash: Dashboard, jobs: Jobs, api: Api, artifacts: Path) -> None:
    busy = _populate_for_screenshots(jobs)
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-aa00bb11"), "rows rendered")
    dash.click("gpu-5e6f7a8b", "migrate")
    dash.wait(dash.dialog_open, "the Migrate dialog opens")
    dash.submit_dialog()
    dash.wait_cell("gpu-5e6f7a8b", "Status", "MIGRATING", "running")
    try:
        for width, height, mobile, name in (
            (1280, 900, False, "dashboard-1280"),
            (1024, 768, False, "dashboard-1024"),
            (390, 844, True, "dashboard-390"),
        ):
            dash.viewport(width, height, mobile)
            sizes = dash.overflow()
            assert sizes["scroll"] <= sizes["client"] <= width, sizes  # a scroll bar may take a few px
            assert sizes["table"] <= sizes["box"] + 0.5, sizes
            dash.d.save_screenshot(str(artifacts / f"{name}-top.png"))
            _full_page_screenshot(dash, artifacts / f"{name}.png", width, mobile)
            if mobile:
                display = dash.js(
                    "return getComputedStyle(document.getElementById(arguments[0])).display", "proc-gpu-7f3a9c21"
                )
                assert display == "grid"  # one card per process
                button = dash.row("gpu-7f3a9c21").find_element(By.CSS_SELECTOR, "[data-action=migrate]")
                assert button.is_displayed() and button.size["height"] >= 36
                dash.viewport(width, height, mobile)
                dash.js("arguments[0].scrollIntoView()", button)
                button.click()
                dash.wait(dash.dialog_open, "the Migrate dialog opens on the phone")
                box = dash.js("return document.getElementById('target-dialog').getBoundingClientRect().toJSON()")
                assert box["left"] >= 0 and box["right"] <= width, box
                dash.d.save_screenshot(str(artifacts / "dialog-390.png"))
                dash.d.find_element(By.CSS_SELECTOR, "#target-dialog [data-close]").click()
            assert dash.overflow()["scroll"] <= width
    finally:
        dash.reset_viewport()
        busy.hold.set()

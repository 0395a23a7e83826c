"""Draining a GPU from its card in headless Chromium: the drain the server starts (read back
through the API), its jobs moved off live, the card marked with the drain's progress job by job,
and Undrain ending it; a viewer sees no Drain control (tests/browser/test_queue_dashboard.py)."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import GIB, Api, FakeHost, Jobs, LiveServer
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


def _drains(api: Api, host: str, *, all: bool = False) -> list[dict[str, Any]]:
    r = api.get("/drains", params={"host": host, "all": str(all).lower()})
    r.raise_for_status()
    return list(r.json())


def _card(dash: Dashboard, uuid: str) -> dict[str, Any]:
    """A GPU card's drain as the page shows it, read in one call (live updates re-render cards)."""
    return dict(
        dash.js(
            "var c = document.querySelector('#hosts article.gpu[data-uuid=\"' + arguments[0] + '\"]');"
            "if (!c) { return {}; }"
            "var d = c.querySelector('.gpu-drain');"
            "return {drained: c.classList.contains('gpu-drained'), state: d ? d.dataset.state : null,"
            " text: d ? d.textContent.replace(/\\s+/g, ' ').trim() : '',"
            " buttons: Array.from(c.querySelectorAll('button[data-action]'))"
            ".map(function (b) { return b.textContent; })};",
            uuid,
        )
    )


def _click_in_card(dash: Dashboard, uuid: str, action: str) -> None:
    css = f'#hosts article.gpu[data-uuid="{uuid}"] button[data-action="{action}"]'
    dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, css).click() or True, f"clicked {action} on {uuid}")


def test_drain_moves_the_jobs_off_and_undrain_gives_the_gpu_back(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    host = FakeHost("drain-node")
    gpu0 = host.uuid(0)
    first = jobs(host, "gpu-drain-a1", gpu=0, memory=20 * GIB, op_seconds=0.3)
    second = jobs(host, "gpu-drain-b2", gpu=0, memory=30 * GIB, op_seconds=0.3)
    dash.open()
    dash.wait(lambda: _card(dash, gpu0).get("buttons") == ["Drain"], "GPU 0's card offers Drain")

    _click_in_card(dash, gpu0, "drain")
    dash.wait(lambda: _drains(api, "drain-node"), "the server drains GPU 0")
    [drain] = _drains(api, "drain-node")
    assert drain["gpu_uuid"] == gpu0 and drain["state"] in ("draining", "drained")
    dash.wait(lambda: first.gpu_uuid != gpu0 and second.gpu_uuid != gpu0, "both jobs move off GPU 0", timeout=20)
    assert first.state == second.state == "RUNNING"
    dash.wait(lambda: _card(dash, gpu0).get("state") == "drained", "the card says drained", timeout=20)
    card = _card(dash, gpu0)
    assert card["drained"] and card["buttons"] == ["Undrain"]
    assert "gpu-drain-a1 migrate → GPU" in card["text"] and "gpu-drain-b2 migrate → GPU" in card["text"]
    assert "succeeded" in card["text"] and "nothing is placed, resumed or moved here" in card["text"]
    moved = [c for c in api.commands(first.process_id) if c["kind"] == "migrate"]
    assert moved and moved[-1]["target_uuid"] != gpu0

    _click_in_card(dash, gpu0, "undrain")
    dash.wait(lambda: not _drains(api, "drain-node"), "the drain ends on the server")
    [ended] = _drains(api, "drain-node", all=True)
    assert ended["state"] == "ended" and ended["id"] == drain["id"]
    dash.wait(lambda: _card(dash, gpu0).get("buttons") == ["Drain"], "the card offers Drain again")
    assert not _card(dash, gpu0)["drained"]


def _heading(dash: Dashboard, host: str) -> dict[str, Any]:
    """A host's section as the page shows it: its heading's buttons, the drain under the heading
    and each card's drain mark, read in one call."""
    return dict(
        dash.js(
            "var host = arguments[0];"
            "var s = Array.from(document.querySelectorAll('#hosts .host'))"
            ".find(function (h) { return h.dataset.host === host; });"
            "if (!s) { return {}; }"
            "var d = s.querySelector(':scope > .host-drain .gpu-drain');"
            "return {open: s.open, drained: s.classList.contains('host-drained'),"
            " buttons: Array.from(s.querySelectorAll(':scope > summary button, :scope > .host-drain button'))"
            ".map(function (b) { return b.textContent; }),"
            " state: d ? d.dataset.state : null, text: d ? d.textContent.replace(/\\s+/g, ' ').trim() : '',"
            " cards: Array.from(s.querySelectorAll('article.gpu')).map(function (c) {"
            "   var m = c.querySelector('.gpu-drain');"
            "   return m ? m.textContent.replace(/\\s+/g, ' ').trim() : ''; })};",
            host,
        )
        or {}
    )


def _click_in_heading(dash: Dashboard, host: str, action: str) -> None:
    css = f'#hosts .host[data-host="{host}"] button[data-action="{action}"]'
    dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, css).click() or True, f"clicked {action} of {host}")


def _drain_dialog(dash: Dashboard) -> str:
    return str(
        dash.js(
            "var d = document.getElementById('drain-dialog');"
            "return d.open ? d.textContent.replace(/\\s+/g, ' ').trim() : '';"
        )
    )


def test_drain_host_pauses_every_job_once_confirmed_and_undrain_host_resumes_them(
    server: LiveServer, browser: Any, dash: Dashboard, api: Api, jobs: Jobs
) -> None:
    host = FakeHost("drain-whole-node")
    first = jobs(host, "host-drain-a1", gpu=0, memory=20 * GIB, op_seconds=0.3)
    second = jobs(host, "host-drain-b2", gpu=1, memory=30 * GIB, op_seconds=0.3)
    dash.open()
    dash.wait(lambda: _heading(dash, host.name).get("buttons") == ["Drain host"], "the heading offers Drain host")

    # the dialog says what it does to each job; Cancel drains nothing
    _click_in_heading(dash, host.name, "drain-host")
    text = dash.wait(lambda: _drain_dialog(dash), "the Drain host dialog")
    assert "Drain every GPU of drain-whole-node?" in text
    assert "host-drain-a1" in text and "host-drain-b2" in text and "paused" in text
    dash.d.find_element(By.CSS_SELECTOR, "#drain-dialog button[data-close]").click()
    dash.wait(lambda: not _drain_dialog(dash), "the dialog closes")
    assert not _drains(api, host.name) and _heading(dash, host.name)["open"]

    _click_in_heading(dash, host.name, "drain-host")
    dash.wait(lambda: _drain_dialog(dash), "the Drain host dialog again")
    dash.d.find_element(By.ID, "reason-drain-host").send_keys("driver update")
    dash.d.find_element(By.CSS_SELECTOR, "#drain-dialog button[type=submit]").click()
    dash.wait(lambda: _drains(api, host.name), "the server drains the host")
    [drain] = _drains(api, host.name)
    assert drain["gpu_uuid"] is None and drain["reason"] == "driver update"
    dash.wait(lambda: first.state == second.state == "PAUSED", "both jobs are paused", timeout=20)
    dash.wait(lambda: _heading(dash, host.name).get("state") == "drained", "the heading says drained", timeout=20)
    shown = _heading(dash, host.name)
    assert shown["drained"] and shown["buttons"] == ["Undrain host"]
    assert "host-drain-a1 pause: succeeded" in shown["text"] and "host-drain-b2 pause: succeeded" in shown["text"]
    assert "every GPU of drain-whole-node, by" in shown["text"] and "driver update" in shown["text"]
    assert all("with every GPU of drain-whole-node" in card for card in shown["cards"]), shown["cards"]
    for job in (first, second):
        [wait] = api.get("/waits", params={"process_id": job.process_id}).json()
        assert wait["state"] == "waiting" and wait["requested_by"] == "policy: drain", wait

    # a viewer sees the drain, without Undrain host
    minted = api.post("/tokens", {"name": "drain screen", "role": "viewer"})
    assert minted.status_code == 201
    browser.delete_all_cookies()
    viewer = Dashboard(browser, server)
    viewer.open(token=minted.json()["token"])
    viewer.wait(lambda: _heading(viewer, host.name).get("state") == "drained", "the viewer sees the drain")
    assert _heading(viewer, host.name)["buttons"] == []
    assert not browser.find_elements(By.CSS_SELECTOR, '#hosts [data-action="drain-host"], #hosts [data-action="drain"]')
    viewer.assert_console_clean()
    browser.delete_all_cookies()

    dash.open()
    _click_in_heading(dash, host.name, "undrain")
    dash.wait(lambda: not _drains(api, host.name), "the drain ends on the server")
    dash.wait(lambda: first.state == second.state == "RUNNING", "the queue resumes both jobs", timeout=30)
    dash.wait(lambda: _heading(dash, host.name).get("buttons") == ["Drain host"], "the heading offers Drain host again")
    assert not _heading(dash, host.name)["drained"]


def _table_heading(dash: Dashboard, host: str) -> dict[str, Any]:
    """A host's heading in the process table (one per host once it lists several), read in one call."""
    return dict(
        dash.js(
            "var h = document.querySelector('#process-rows tr.host-heading[data-host=\"' + arguments[0] + '\"]');"
            "if (!h) { return {}; }"
            "var d = h.querySelector('.gpu-drain');"
            "return {drained: h.classList.contains('host-drained'), state: d ? d.dataset.state : null,"
            " text: d ? d.textContent.replace(/\\s+/g, ' ').trim() : '',"
            " buttons: Array.from(h.querySelectorAll('button[data-action]'))"
            ".map(function (b) { return b.textContent; })};",
            host,
        )
        or {}
    )


def _click_in_table_heading(dash: Dashboard, host: str, action: str) -> None:
    css = f'#process-rows tr.host-heading[data-host="{host}"] button[data-action="{action}"]'
    dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, css).click() or True, f"clicked {action} of {host}")


def test_drain_host_and_undrain_from_the_process_tables_host_heading(dash: Dashboard, api: Api, jobs: Jobs) -> None:
    drained, other = FakeHost("table-drain-node"), FakeHost("table-other-node")
    job = jobs(drained, "table-drain-a1", gpu=0, memory=20 * GIB, op_seconds=0.3)
    jobs(other, "table-other-b1", gpu=0, memory=20 * GIB)
    dash.open()
    dash.wait(lambda: _table_heading(dash, drained.name).get("buttons") == ["Drain host"], "the table's heading")

    _click_in_table_heading(dash, drained.name, "drain-host")
    text = dash.wait(lambda: _drain_dialog(dash), "the Drain host dialog")
    assert "Drain every GPU of table-drain-node?" in text and "table-drain-a1" in text
    dash.d.find_element(By.ID, "reason-drain-host").send_keys("new cooling")
    dash.d.find_element(By.CSS_SELECTOR, "#drain-dialog button[type=submit]").click()
    dash.wait(lambda: _drains(api, drained.name), "the server drains the host")
    [drain] = _drains(api, drained.name)
    assert drain["gpu_uuid"] is None and drain["reason"] == "new cooling"
    dash.wait(lambda: job.state == "PAUSED", "its job is paused", timeout=20)
    dash.wait(
        lambda: _table_heading(dash, drained.name).get("state") == "drained", "the heading says drained", timeout=20
    )
    shown = _table_heading(dash, drained.name)
    assert shown["drained"] and shown["buttons"] == ["Undrain host"]
    assert "table-drain-a1 pause: succeeded" in shown["text"] and "new cooling" in shown["text"]
    assert _table_heading(dash, other.name)["buttons"] == ["Drain host"]

    _click_in_table_heading(dash, drained.name, "undrain")
    dash.wait(lambda: not _drains(api, drained.name), "the drain ends on the server")
    dash.wait(lambda: job.state == "RUNNING", "the queue resumes its job", timeout=30)
    dash.wait(lambda: _table_heading(dash, drained.name).get("buttons") == ["Drain host"], "Drain host again")

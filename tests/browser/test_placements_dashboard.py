"""flexium run's jobs waiting to start (placements) in the dashboard's Queue panel, in headless
Chromium: listed live among the paused jobs' waits in the queue's one order, with what each waits
for, an admin's Cancel (read back through the API), a placement shown placed with its room held,
and gone once its flexium run ends it; a viewer sees them without Cancel."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import GIB, Api, FakeHost, Jobs, LiveServer
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)


def _full(host: FakeHost) -> FakeHost:
    """Every GPU of ``host`` held by other processes but 5 GiB."""
    for gpu in host.gpus:
        gpu.other = gpu.total - 5 * GIB
    return host


def _place(api: Api, host: FakeHost, *, memory: int, priority: str, command: str, reason: str = "") -> dict[str, Any]:
    """What flexium run asks for (POST /placements) with the host's GPUs as it reads them."""
    asked = {"host": host.name, "memory_bytes": memory, "priority": priority, "command": command, "reason": reason}
    r = api.post("/placements", {**asked, "devices": host.report()})
    assert r.status_code == 201, r.text
    return dict(r.json()["placement"])


@contextmanager
def _asking(api: Api, host: FakeHost, *placements: dict[str, Any]) -> Iterator[None]:
    """Each placement's flexium run asking again every 0.5 s with the host's GPUs, as it does while
    it waits (one that stops asking for longer than the server's stale_after is cancelled)."""
    stop = threading.Event()

    def ask() -> None:
        while not stop.wait(0.5):
            for placement in placements:
                api.post(f"/placements/{placement['id']}/report", {"devices": host.report()})

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _placement(api: Api, placement_id: int) -> dict[str, Any]:
    r = api.get(f"/placements/{placement_id}")
    r.raise_for_status()
    return dict(r.json())


def _entries(dash: Dashboard, host: str) -> list[str]:
    """The host's queue as the panel lists it, the next first: 'wait PROCESS' or 'placement ID'."""
    return list(
        dash.js(
            "var host = arguments[0];"
            "var s = Array.from(document.querySelectorAll('#queue .queue-host'))"
            ".find(function (q) { return q.dataset.host === host; });"
            "return s ? Array.from(s.querySelectorAll('li')).map(function (li) {"
            " return li.dataset.placementId ? 'placement ' + li.dataset.placementId : 'wait ' + li.dataset.processId;"
            " }) : [];",
            host,
        )
    )


def _placement_text(dash: Dashboard, placement_id: int) -> str:
    return str(
        dash.js(
            "var li = document.querySelector('#queue li.placement[data-placement-id=\"' + arguments[0] + '\"]');"
            "return li ? li.dataset.state + ': ' + li.textContent.replace(/\\s+/g, ' ').trim() : '';",
            str(placement_id),
        )
    )


def test_placements_wait_in_the_queue_order_and_cancel_and_placing_show_live(
    server: LiveServer, browser: Any, dash: Dashboard, api: Api, jobs: Jobs
) -> None:
    host = _full(FakeHost("place-node"))
    paused = jobs(host, "gpu-place-wait", state="PAUSED", memory=20 * GIB)
    assert api.post("/waits", {"process_id": paused.process_id}).status_code == 201
    dash.open()
    dash.wait(lambda: _entries(dash, host.name) == [f"wait {paused.process_id}"], "the paused job's wait")

    big = _place(
        api, host, memory=40 * GIB, priority="high", command="python train_big.py --epochs 3", reason="paper deadline"
    )
    small = _place(api, host, memory=30 * GIB, priority="normal", command="python eval.py")
    assert big["state"] == small["state"] == "waiting"
    with _asking(api, host, big, small):
        dash.wait(
            lambda: (
                _entries(dash, host.name)
                == [f"placement {big['id']}", f"wait {paused.process_id}", f"placement {small['id']}"]
            ),
            "both placements listed live, a higher priority first, first come first served within one",
        )
        text = _placement_text(dash, big["id"])
        assert text.startswith("waiting: start #1") and "python train_big.py --epochs 3" in text
        assert "priority high" in text and "the GPU with the most room" in text and "needs 40.0 GiB" in text
        assert f"flexium run by {big['requested_by']}" in text and "waiting" in text and big["note"] in text
        assert "why: paper deadline" in text and "why:" not in _placement_text(dash, small["id"])
        assert "start #3" in _placement_text(dash, small["id"])  # after the paused job, #2 of the one queue

        css = f'#queue li.placement[data-placement-id="{small["id"]}"] button[data-action="cancel-placement"]'
        dash.wait(lambda: dash.d.find_element(By.CSS_SELECTOR, css).click() or True, "clicked Cancel")
        dash.wait(lambda: _placement(api, small["id"])["state"] == "cancelled", "the server cancelled it")
        dash.wait(lambda: f"placement {small['id']}" not in _entries(dash, host.name), "the panel drops it")

        # room appears; flexium run asks again with the GPUs it reads now, and its placement is placed
        host.gpus[3].other = 0
        r = api.post(f"/placements/{big['id']}/report", {"devices": host.report()})
        assert r.status_code == 200 and r.json()["state"] == "placed", r.text
        dash.wait(lambda: _placement_text(dash, big["id"]).startswith("placed: starting"), "shown placed")
        text = _placement_text(dash, big["id"])
        assert "placed on GPU 3, starting" in text and "GiB held on GPU 3 until" in text
        assert not dash.d.find_elements(By.CSS_SELECTOR, f'li[data-placement-id="{big["id"]}"] button')

        # a viewer sees the queue's placements without Cancel
        waiting = _place(api, host, memory=135 * GIB, priority="low", command="python huge.py")
        with _asking(api, host, waiting):
            minted = api.post("/tokens", {"name": "placement screen", "role": "viewer"})
            assert minted.status_code == 201
            browser.delete_all_cookies()
            viewer = Dashboard(browser, server)
            viewer.open(token=minted.json()["token"])
            viewer.wait(lambda: f"placement {waiting['id']}" in _entries(viewer, host.name), "the viewer sees it")
            assert not browser.find_elements(By.CSS_SELECTOR, '#queue [data-action="cancel-placement"]')
            viewer.assert_console_clean()
            browser.delete_all_cookies()

            dash.open()
            dash.wait(lambda: f"placement {waiting['id']}" in _entries(dash, host.name), "listed")

    # their flexium runs end them (the job ended, or Ctrl-C) and stop asking
    for placement in (big, waiting):
        assert api.delete(f"/placements/{placement['id']}").status_code == 200
    dash.wait(
        lambda: not any(e.startswith("placement") for e in _entries(dash, host.name)),
        "the panel drops both",
        timeout=15,
    )


# The panel reads itself again on a placement event; before there were any, it polled every 5 s
# while it listed a placement.
SHOWN_WITHIN_S = 3.0


def test_the_panel_follows_placement_events_without_polling(dash: Dashboard, api: Api) -> None:
    """A placement asked for, placed by a GPU report, and given up by its flexium run: each shown
    within a few seconds, though nothing else on the page changes (no devices event after the ask)."""
    host = _full(FakeHost("place-events-node"))
    dash.open()
    waiting = _place(api, host, memory=40 * GIB, priority="normal", command="python waits.py")
    dash.wait(lambda: _entries(dash, host.name) == [f"placement {waiting['id']}"], "listed", timeout=SHOWN_WITHIN_S)
    dash.wait(lambda: _placement_text(dash, waiting["id"]).startswith("waiting"), "shown waiting")
    assert api.delete(f"/placements/{waiting['id']}").status_code == 200
    dash.wait(lambda: _entries(dash, host.name) == [], "dropped once given up", timeout=SHOWN_WITHIN_S)

"""Draining a GPU from its card in headless Chromium: the drain the server starts (read back
through the API), its jobs moved off live, the card marked with the drain's progress job by job,
and Undrain ending it; a viewer sees no Drain control (tests/browser/test_queue_dashboard.py)."""

from __future__ import annotations

from typing import Any

import pytest
from selenium.webdriver.common.by import By

from support.dashboard import GIB, Api, FakeHost, Jobs
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

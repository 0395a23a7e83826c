"""The dashboard's allocator panels as the server renders them, on SQLite and PostgreSQL: the
queue fragment lists flexium run's placements among the waits in the queue's one order (Cancel
for an admin only, a command line's markup escaped), and the Drain host dialog's form and a
drained host's heading (tests/browser clicks them)."""

from __future__ import annotations

import re
from typing import Any

from support.server import GIB, Api, gpu

FULL = [gpu(0, used=139 * GIB), gpu(1, used=139 * GIB)]


def _pages_as(api: Api, token: str, *paths: str) -> list[str]:
    assert api.log_in(token).status_code == 303
    try:
        return [api.client.get(path).text for path in paths]
    finally:
        api.client.cookies.clear()


def _place(api: Api, *, priority: str, command: str) -> dict[str, Any]:
    asked = {"host": "node1", "memory_bytes": 40 * GIB, "priority": priority, "command": command, "devices": FULL}
    r = api.post("/placements", asked)
    assert r.status_code == 201, r.text
    return dict(r.json()["placement"])


def _queue(page: str) -> list[str]:
    """The queue's items in the order shown: 'wait ID' or 'placement ID'."""
    return [
        f"{kind} {number}"
        for kind, number in re.findall(r'<li class="(wait|placement) [^"]*" data-\1-id="(\d+)"', page)
    ]


def test_the_queue_lists_placements_among_the_waits_in_the_queue_order(api: Api) -> None:
    api.register("p", state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=FULL)
    wait = api.post("/waits", {"process_id": "p"}).json()["wait"]
    high = _place(api, priority="high", command="python big.py <script>alert(1)</script>")
    normal = _place(api, priority="normal", command="python eval.py")
    main, fragment = api.pages("/", "/ui/queue")
    expected = [f"placement {high['id']}", f"wait {wait['id']}", f"placement {normal['id']}"]
    for page in (main, fragment):
        assert _queue(page) == expected, page
    assert "python big.py &lt;script&gt;alert(1)&lt;/script&gt;" in fragment and "<script>alert" not in fragment
    # One numbering of the host's queue: the placements are its first and third, the paused job its second.
    assert "start #1" in fragment and "start #3" in fragment and ">#2<" in fragment
    assert "1 waiting to resume · 2 to start" in fragment
    assert fragment.count('data-action="cancel-placement"') == 2 and 'data-action="cancel-wait"' in fragment

    viewer = api.post("/tokens", {"name": "screen", "role": "viewer"}).json()["token"]
    [seen] = _pages_as(api, viewer, "/ui/queue")
    assert _queue(seen) == expected and "data-action" not in seen


def test_the_drain_host_form_names_the_jobs_and_a_drained_host_is_told_under_its_heading(api: Api) -> None:
    api.register("a", gpu_index=0, memory=10 * GIB)
    api.register("b", gpu_index=1, memory=20 * GIB)
    assert api.post("/drains", {"host": "node1", "gpu": 3}).status_code == 201
    [form, missing] = api.pages("/ui/drain-host?host=node1", "/ui/drain-host?host=nowhere")
    assert 'data-process-id="a"' in form and 'data-process-id="b"' in form and "Drain every GPU of" in form
    assert "Drained on their own already, until their own Undrain: GPU 3" in form
    assert missing == ""

    [before] = api.pages("/ui/devices")
    assert 'data-action="drain-host"' in before
    drain = api.post("/drains", {"host": "node1", "reason": "driver update"}).json()
    [after] = api.pages("/ui/devices")
    assert 'data-action="drain-host"' not in after and "host-drained" in after
    heading = re.search(r'<div class="host-drain">.*?</div>\s*</div>', after, re.S)
    assert heading and f'data-drain-id="{drain["id"]}"' in heading.group(0) and "Undrain host" in heading.group(0)
    assert after.count("with every GPU of node1") == 3  # GPU 3 has its own drain, shown on its card
    assert after.count(">Undrain<") == 1

"""What a GPU card lists: the jobs on that GPU now. A paused job holds no memory on any GPU, so
no card lists it (the API's /devices neither); the process table still shows it, PAUSED."""

from __future__ import annotations

import re
from typing import Any

from support.server import GIB, Api, gpu


def _card(page: str, uuid: str) -> str:
    found = re.search(rf'<article class="gpu[^"]*" data-uuid="{uuid}".*?</article>', page, re.S)
    assert found, f"no card for {uuid}"
    return found.group(0)


def _jobs_on(api: Api) -> dict[str, list[str]]:
    hosts = api.get("/devices").json()["hosts"]
    return {d["uuid"]: d["processes"] for h in hosts for d in h["devices"]}


def _pause(api: Api, process_id: str) -> None:
    created = api.command("pause", process_id)
    assert created.status_code == 201, created.text
    api.client.get(f"{api.base}/processes/{process_id}/commands/next", params={"timeout": 0}, headers=api.headers())
    for state in ("running", "succeeded"):
        body: dict[str, Any] = {"state": state}
        if state == "succeeded":
            body["result"] = {"kind": "pause", "path": "driver", "ok": True, "seconds": 0.5}
            body["process"] = {"state": "PAUSED"}
        r = api.post(f"/commands/{created.json()['id']}/report", body)
        assert r.status_code == 200, r.text


def test_a_paused_job_is_on_no_gpu_card_but_still_in_the_table(api: Api) -> None:
    api.register("gpu-run", gpu_index=0, memory=10 * GIB)
    api.register("gpu-held", gpu_index=1, memory=20 * GIB)
    assert _jobs_on(api)["GPU-0001"] == ["gpu-held"]
    [before] = api.pages("/ui/devices")
    assert "gpu-held" in _card(before, "GPU-0001")

    _pause(api, "gpu-held")
    assert api.get("/processes/gpu-held").json()["state"] == "PAUSED"
    jobs_on = _jobs_on(api)
    assert jobs_on["GPU-0000"] == ["gpu-run"]
    assert not any("gpu-held" in names for names in jobs_on.values())
    main, cards = api.pages("/", "/ui/devices")
    for page in (main, cards):
        assert "gpu-run" in _card(page, "GPU-0000")
        for index in range(4):
            assert "gpu-held" not in _card(page, f"GPU-{index:04d}")
        assert 'class="gpu-jobs"' not in _card(page, "GPU-0001")  # no empty "jobs:" line either
    row = re.search(r'<tr id="proc-gpu-held" class="proc".*?</tr>', main, re.S)
    assert row and 'data-state="PAUSED"' in row.group(0) and "PAUSED" in row.group(0)


def test_a_job_on_two_gpus_is_on_both_cards_with_what_it_holds_on_each(api: Api) -> None:
    """One process on GPUs 0 and 1 (DataParallel, a model split over devices): its client says
    what it holds on each (process_bytes); an older client's memory all counts on its own GPU."""
    devices = [gpu(0, used=30 * GIB), gpu(1, used=20 * GIB), gpu(2), gpu(3)]
    devices[0]["process_bytes"], devices[1]["process_bytes"] = 30 * GIB, 20 * GIB
    api.register("two-gpus", gpu_index=0, memory=50 * GIB, devices=devices)
    api.register("older", host="node2", gpu_index=1, memory=8 * GIB)  # no process_bytes
    hosts = {h["host"]: {d["uuid"]: d for d in h["devices"]} for h in api.get("/devices").json()["hosts"]}
    on = hosts["node1"]
    assert on["GPU-0000"]["processes"] == ["two-gpus"] and on["GPU-0000"]["memory_flexium"] == 30 * GIB
    assert on["GPU-0001"]["processes"] == ["two-gpus"] and on["GPU-0001"]["memory_flexium"] == 20 * GIB
    assert on["GPU-0001"]["memory_other"] == 0  # its memory there is not "other processes"
    assert hosts["node2"]["GPU-0001"]["processes"] == ["older"]
    assert hosts["node2"]["GPU-0001"]["memory_flexium"] == 8 * GIB
    [cards] = api.pages("/ui/devices")
    assert "two-gpus" in _card(cards, "GPU-0001")
    assert api.get("/processes/two-gpus").json()["other_gpus"] == ["GPU-0001"]
    assert api.get("/processes/older").json()["other_gpus"] == []
    [main] = api.pages("/")
    row = re.search(r'<tr id="proc-two-gpus" class="proc".*?</tr>', main, re.S)
    assert row and re.search(r'class="gpu-ref also-gpu">\+ GPU 1<', row.group(0)), row.group(0) if row else main


def test_the_migrate_form_of_a_job_on_two_gpus_has_a_gpu_for_each_where_it_is(api: Api) -> None:
    """One line per GPU it holds memory on, its GPU selected; one its host's report or its visible
    GPUs lack is still offered, selected, so the form never sends a move nobody chose."""
    devices = [gpu(0, used=30 * GIB), gpu(1, used=20 * GIB), gpu(2), gpu(3)]
    devices[0]["process_bytes"], devices[1]["process_bytes"] = 30 * GIB, 20 * GIB
    visible = ["GPU-0000", "GPU-0002", "GPU-0003"]  # GPU-0001 left out
    api.register("two-gpus", gpu_index=0, memory=50 * GIB, devices=devices, visible_gpus=visible)
    [form] = api.pages("/ui/processes/two-gpus/targets?kind=migrate")
    assert 'id="gpus-form"' in form and 'data-gpus="2"' in form
    selects = {m.group(1): m.group(0) for m in re.finditer(r'<select name="gpu-(GPU-\d+)".*?</select>', form, re.S)}
    assert sorted(selects) == ["GPU-0000", "GPU-0001"]
    for uuid, select in selects.items():
        chosen = re.findall(r'<option value="(GPU-\d+)"[^>]*selected', select)
        assert chosen == [uuid], select
    assert 'value="GPU-0002"' in selects["GPU-0001"]  # where it may go


def test_a_gpu_card_shows_the_room_held_for_a_job_not_on_it_yet(api: Api) -> None:
    """flexium run's placement holds room on a GPU before its job's memory shows there: the card says how
    much (as `flexium devices` says RESERVED), and a card with nothing held says nothing of it."""
    api.register("gpu-run", gpu_index=0, memory=10 * GIB)
    [before] = api.pages("/ui/devices")
    assert "mem-reserved" not in before
    body = {
        "host": "node1",
        "devices": [gpu(0, used=10 * GIB), gpu(1)],
        "memory_bytes": 30 * GIB,
        "gpu_uuid": "GPU-0001",
    }
    placed = api.post("/placements", body)
    assert placed.status_code == 201 and placed.json()["placement"]["state"] == "placed", placed.text
    reserved = {d["uuid"]: d["memory_reserved"] for h in api.get("/devices").json()["hosts"] for d in h["devices"]}
    assert reserved["GPU-0001"] > 30 * GIB and reserved["GPU-0000"] == 0
    main, cards = api.pages("/", "/ui/devices")
    for page in (main, cards):
        held = re.search(r'<li class="mem-reserved"[^>]*><b>([^<]+)</b> reserved</li>', _card(page, "GPU-0001"))
        assert held is not None and held.group(1).startswith("3"), _card(page, "GPU-0001")
        assert "mem-reserved" not in _card(page, "GPU-0000")

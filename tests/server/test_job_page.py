"""The dashboard's job page, refusal reasons beside greyed buttons and the cluster totals, as
the server renders them (the browser tests click through them)."""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import quote

import pytest
from markupsafe import escape

from flexium import protocol
from flexium.reasons import SHORT_REASON_MAX, short_reason
from flexium.server import storage
from support.server import GIB, Api, gpu, rank_body


def _finish(api: Api, command: dict[str, Any], result: dict[str, Any]) -> None:
    for state in ("running", "succeeded"):
        body: dict[str, Any] = {"state": state}
        if state == "succeeded":
            body["result"] = result
            body["process"] = {"state": "RUNNING", "gpu_uuid": "GPU-0002"}
        r = api.post(f"/commands/{command['id']}/report", body)
        assert r.status_code == 200, r.text


def test_a_job_page_shows_its_command_progress_and_every_command(api: Api) -> None:
    api.register("gpu-1", cmdline="python train.py --lr 3e-4 --batch <64>", steps=10)
    created = api.command("migrate", "gpu-1", target=2)
    assert created.status_code == 201, created.text
    result = {
        "kind": "migrate",
        "path": "fast",
        "ok": True,
        "seconds": 1.25,
        "bytes_moved": 10 * GIB,
        "steps": [{"step": "checkpoint", "seconds": 0.5}, {"step": "restore", "seconds": 0.75}],
    }
    r = api.client.get(f"{api.base}/processes/gpu-1/commands/next", params={"timeout": 0}, headers=api.headers())
    assert r.status_code == 200, r.text
    _finish(api, created.json(), result)
    assert (
        api.post("/processes/gpu-1/heartbeat", {"gpu_uuid": "GPU-0002", "steps": 10, "loss": 0.125}).status_code == 200
    )
    refused = api.command("resume", "gpu-1")  # not paused: refused, and on its timeline as refused
    assert refused.status_code == 409
    deadline = time.monotonic() + 5
    while api.get("/processes/gpu-1").json()["loss"] != 0.125 and time.monotonic() < deadline:
        time.sleep(0.05)

    page, panel, main = api.pages("/jobs/gpu-1", "/ui/jobs/gpu-1/panel", "/")
    assert "python train.py --lr 3e-4 --batch &lt;64&gt;" in page  # escaped once
    assert '<h1 id="job-title" class="job-title">train.py</h1>' in page
    assert 'id="job-steps">10<' in page and 'id="job-loss">0.125<' in page
    timeline = page.split('id="job-timeline"')[1]
    assert timeline.count('class="event ') == 2
    newest = timeline.split('class="event ')[1]
    assert newest.startswith('event-refused"') and "resume" in newest
    assert str(escape(refused.json()["message"])) in newest  # the reason, in full
    assert "migrate → GPU 2" in timeline and "fast path" in timeline
    assert "training stopped 1.25 s" in timeline and "10.0 GiB moved" in timeline
    sender = api.get("/tokens").json()[0]
    who = sender["name"] or f"token {sender['id']}"
    assert re.search(r'sent <span data-ago="[\d.]+">[^<]+</span> by ' + re.escape(str(escape(who))), timeline)
    assert "checkpoint" in timeline and "restore" in timeline  # the operation's steps
    gpus = page.split('id="job-gpus"')[1].split("</section>")[0]
    assert gpus.count('<article class="gpu') == 1 and 'data-uuid="GPU-0002"' in gpus  # the GPU it is on now
    assert 'id="job-title"' in panel and "<html" not in panel  # the fragment the page's script swaps in
    assert 'href="/jobs/gpu-1"' in main  # the job's name in the table opens it
    [missing] = api.pages("/jobs/gpu-none")
    assert "No job gpu-none" in missing


def test_a_job_page_asks_for_its_own_audit_entries(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Who sent each command and what was refused come from the entries naming the job's
    processes, never from a scan of the workspace's log."""
    for process_id in ("gpu-1", "gpu-2"):
        api.register(process_id)
    assert api.command("pause", "gpu-1").status_code == 201
    assert api.command("resume", "gpu-1").status_code == 409  # refused: on gpu-1's timeline
    assert api.command("resume", "gpu-2").status_code == 409  # another process's
    assert api.command("pause", "gpu-2").status_code == 201

    def no_scan(**_kw: Any) -> None:
        raise AssertionError("the job page read the whole audit log")

    monkeypatch.setattr(storage, "list_audit", no_scan)
    page, panel = api.pages("/jobs/gpu-1", "/ui/jobs/gpu-1/panel")
    for html in (page, panel):
        timeline = html.split('id="job-timeline"')[1]
        assert timeline.count('class="event ') == 2
        assert timeline.count("event-refused") == 1 and "pause" in timeline
        sender = api.get("/tokens").json()[0]
        assert f"by {escape(sender['name'] or 'token ' + str(sender['id']))}</span>" in timeline


def test_a_viewer_sees_the_job_page_without_buttons(api: Api) -> None:
    api.register("gpu-1")
    viewer = api.post("/tokens", {"name": "wall", "role": protocol.ROLE_VIEWER}).json()["token"]
    assert api.log_in(viewer).status_code == 303
    try:
        page = api.client.get("/jobs/gpu-1")
    finally:
        api.client.cookies.clear()
    assert page.status_code == 200
    assert 'id="read-only"' in page.text and "data-action=" not in page.text
    assert "needs a token with role admin" in page.text  # the whole reason, here
    [admin] = api.pages("/jobs/gpu-1")
    assert 'data-action="migrate"' in admin and 'data-action="pause"' in admin


def test_a_job_of_several_ranks_has_one_page_with_its_ranks(api: Api) -> None:
    key = "run-<b>"
    for rank in (0, 1):
        api.register(f"rank-{rank}", **{k: v for k, v in rank_body(rank, key=key).items() if k != "process_id"})
    page, rank_page = api.pages("/jobs/rank-0", "/jobs/rank-1")
    assert "job run-&lt;b&gt; · 2 ranks" in page
    assert page.count('class="rank-row"') == 2
    assert 'data-action="job-migrate"' in page and 'data-action="job-pause"' in page
    assert rank_page.count('class="rank-row"') == 2  # any rank's page is the job's
    [main] = api.pages("/")
    assert 'href="/jobs/rank-0"' in main and quote(key, safe="") not in page


def test_greyed_buttons_say_why_in_a_few_words(api: Api) -> None:
    cpu = [
        "torch 2.13.0+cpu is a CPU-only build: training runs, migration and pause are off",
        "flexium's engine is not running in this process (training on cpu): migrate, pause and resume are off",
    ]
    api.register("gpu-1", capabilities={"pause_resume": False, "migration": False, "problems": cpu})
    api.register("gpu-2", capabilities={"pause_resume": True, "migration": False})
    cpu_row, old_driver = api.pages("/ui/processes?id=gpu-1", "/ui/processes?id=gpu-2")
    shown = re.findall(r'<small class="refusal-short" title="([^"]*)">([^<]*)</small>', cpu_row)
    assert shown == [(str(escape("; ".join(cpu))), "CPU-only torch: no GPU memory to move")]
    [(_full, short)] = re.findall(r'<small class="refusal-short" title="([^"]*)">([^<]*)</small>', old_driver)
    assert short == "migrate: This job&#39;s driver cannot migrate (needs driver 580+)"


def test_short_reasons_fit_beside_a_button() -> None:
    refusal = (
        "moving, pausing, resuming or forgetting a job needs a token with role admin; this one (wall) is a "
        "viewer token. An admin issues one: flexium token issue default --role admin"
    )
    assert short_reason(refusal) == "read-only login: an admin token can"
    assert short_reason(
        "NVIDIA driver 535.1 is too old: it needs 570+ to pause and resume, 580+ to move between GPUs"
    ) == ("NVIDIA driver too old (570+ / 580+)")
    unknown = "something nobody foresaw, said at great length by a process of a newer flexium release: x"
    assert len(short_reason(unknown)) <= SHORT_REASON_MAX and short_reason(unknown).endswith("…")


def test_the_main_page_sums_up_the_cluster(api: Api) -> None:
    api.register("gpu-1", memory=10 * GIB)
    api.register("gpu-2", gpu_index=1, memory=20 * GIB, state="PAUSED")
    for rank in (0, 1):
        api.register(f"rank-{rank}", **{k: v for k, v in rank_body(rank).items() if k != "process_id"})
    created = api.command("migrate", "gpu-1", target=3).json()
    api.client.get(f"{api.base}/processes/gpu-1/commands/next", params={"timeout": 0}, headers=api.headers())
    _finish(api, created, {"kind": "migrate", "path": "driver", "ok": True, "seconds": 2.0})
    [main] = api.pages("/")
    totals = dict(re.findall(r'id="total-(\w+)">([^<]*)<', main))
    assert totals["gpus"] == "4"  # one host's 4 GPUs, reported by every job on it
    assert totals["running"] == "2"  # gpu-1 and the job of two ranks, once
    assert totals["paused"] == "1"
    assert totals["moves"] == "1"
    labels = re.findall(r'<span class="total-label">([^<]*)', main)
    assert labels == ["GPUs", "GPU memory used", "jobs running", "job paused", "move today "]  # 1 job, not 1 jobs
    assert re.search(r'id="total-memory">[\d.]+ \w?i?B <small class="muted">of 560 GiB</small>', main)


def test_a_cpu_job_reads_cpu_in_the_table(api: Api) -> None:
    """One word for a job without a GPU wherever it shows: `cpu`, as `flexium ps` says it."""
    api.register("cpu-job", gpu_uuid=None, logical_device="cpu", visible_gpus=[], devices=[])
    [main] = api.pages("/")
    row = main.split('id="proc-cpu-job"')[1].split("</tr>")[0]
    device = row.split('class="col-device">')[1].split("</td>")[0]
    assert re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", device)).strip() == "cpu"


def test_a_job_timeline_says_what_the_queue_did_to_it(api: Api) -> None:
    """Queued (by whom, on which GPU, why), taken out of the queue, and its priority set from one to
    another, each by whom, beside its commands."""
    full = [gpu(0, used=139 * GIB), gpu(1, used=139 * GIB)]
    api.register("gpu-1", state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=full)
    created = api.post("/waits", {"process_id": "gpu-1", "gpu": "1", "reason": "back after the demo"})
    assert created.status_code == 201, created.text
    assert api.delete(f"/waits/{created.json()['wait']['id']}").status_code == 200
    r = api.client.put(f"{api.base}/processes/gpu-1/priority", json={"priority": "high"}, headers=api.headers())
    assert r.status_code == 200, r.text
    sender = api.get("/tokens").json()[0]
    who = str(escape(sender["name"] or f"token {sender['id']}"))
    for html in api.pages("/jobs/gpu-1", "/ui/jobs/gpu-1/panel"):
        timeline = html.split('id="job-timeline"')[1]
        events = timeline.split('class="event ')[1:]
        assert [e.split('"')[0] for e in events] == ["event-queue"] * 3
        priority, cancelled, queued = events
        assert "priority normal → high" in priority and f"by {who}" in priority
        assert "taken out of the queue" in cancelled and f"cancelled by {who}" in cancelled
        assert "queued to resume when free" in queued and f"by {who}" in queued
        assert f"queued by {who} to resume on GPU 1 when free; why: back after the demo" in queued

"""The queue over HTTP: POST, GET and DELETE /waits and PUT .../priority with the roles of the other
routes; a waiting job told what to watch in its heartbeat's answer; a heartbeat saying it saw room
resumes it and its long-poll hands the command over at once. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio.from_thread
import pytest

from flexium import wire
from flexium.server import queue, storage
from flexium.server.settings import BACKFILL_PATIENCE_S, Settings
from support.server import GIB, Api, gpu, make_settings

FULL = [gpu(0, used=139 * GIB), gpu(1, used=139 * GIB)]
POLL_WAIT_S = 20.0


@pytest.fixture
def app_settings(database_url_at_head: str, request: pytest.FixtureRequest) -> Settings:
    """The server's settings; a test parametrized over ``app_settings`` gives its backfill patience."""
    return make_settings(database_url_at_head, backfill_patience_s=getattr(request, "param", BACKFILL_PATIENCE_S))


def register_paused(api: Api, process_id: str = "p", **fields: Any) -> None:
    api.register(process_id, state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=FULL, **fields)


def issue(api: Api, role: str) -> str:
    r = api.post("/tokens", {"name": role, "role": role})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def test_a_wait_is_queued_listed_and_cancelled(api: Api) -> None:
    register_paused(api)
    created = api.post("/waits", {"process_id": "p"})
    assert created.status_code == 201, created.text
    wait = created.json()["wait"]
    assert wait["state"] == "waiting" and wait["position"] == 1 and wait["need_bytes"] == 30 * GIB
    assert created.json()["commands"] == []
    listed = api.get("/waits").json()
    assert [w["id"] for w in listed] == [wait["id"]]
    assert api.get("/processes/p").json()["wait_id"] == wait["id"]
    cancelled = api.delete(f"/waits/{wait['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert api.get("/waits").json() == []
    assert [w["state"] for w in api.get("/waits", params={"all": "true"}).json()] == ["cancelled"]
    again = api.delete(f"/waits/{wait['id']}")
    assert again.status_code == 409 and again.json()["error"] == "invalid_state"


def test_queueing_and_priorities_are_an_admins_reading_anyones(api: Api) -> None:
    register_paused(api)
    job, viewer = issue(api, "job"), issue(api, "viewer")
    for token in (job, viewer):
        assert api.post("/waits", {"process_id": "p"}, headers=api.headers(token)).status_code == 403
        assert (
            api.client.put(
                f"{api.base}/processes/p/priority", json={"priority": "high"}, headers=api.headers(token)
            ).status_code
            == 403
        )
    assert api.get("/waits", headers=api.headers(viewer)).status_code == 200
    r = api.client.put(f"{api.base}/processes/p/priority", json={"priority": "high"}, headers=api.headers())
    assert r.status_code == 200 and r.json()["priority"] == 90
    bad = api.client.put(f"{api.base}/processes/p/priority", json={"priority": "urgent"}, headers=api.headers())
    assert bad.status_code == 422 and "low, normal, high or a number 0-100" in bad.text
    assert api.post("/waits", {"process_id": "p", "gpu": "cuda:x"}).status_code == 422


def test_a_waiting_job_watches_its_gpus_and_is_resumed_when_it_sees_room(api: Api) -> None:
    register_paused(api)
    created = api.post("/waits", {"process_id": "p"}).json()
    wait = created["wait"]
    watch = {"wait_id": wait["id"], "gpus": ["GPU-0000", "GPU-0001"], "need_bytes": 30 * GIB}
    assert created["watch"] == watch  # what to watch at once, not at its next heartbeat
    beat = api.post("/processes/p/heartbeat", {"state": "PAUSED"})
    assert beat.json()["watch"] == watch
    assert api.get("/processes/p/commands/next", params={"wait": 0}).status_code == 204

    seen = api.post(
        "/processes/p/heartbeat",
        {"state": "PAUSED", "room_seen": True, "devices": [gpu(0, used=139 * GIB), gpu(1, used=10 * GIB)]},
    )
    assert seen.status_code == 200 and seen.json()["watch"] is None
    command = api.get("/processes/p/commands/next", params={"wait": 1})
    assert command.status_code == 200, command.text
    body = command.json()
    assert body["kind"] == "resume" and body["target_uuid"] == "GPU-0001"
    assert body["reason"].startswith("resume when free: GPU 1 had 130.0 GiB free for 30.0 GiB")
    assert seen.json()["pending_command"] == body["id"]
    assert api.get(f"/waits/{wait['id']}").json()["state"] == "dispatched"
    [panel] = api.pages("/ui/jobs/p/panel")  # the job's timeline says who sent it, and why
    assert 'by the server on its own: <b class="event-policy">resume when free</b>' in panel
    assert "resume when free: GPU 1 had 130.0 GiB free" in panel


def test_a_read_of_the_queues_view_keeps_what_changed_here_while_it_read(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the queue's view may see the database from before a wait made or ended here while it
    read (CI saw a job told to watch again after the queue had sent its resume, from a read begun just
    before): what changed here meanwhile is made again over what it found."""
    register_paused(api)
    ended = api.post("/waits", {"process_id": "p"}).json()["wait"]
    [(workspace_id, _)] = api.ctx.watches
    made = wire.RoomWatch(wait_id=ended["id"] + 1, gpus=["GPU-0001"], need_bytes=GIB)
    real_read = storage.queue_view
    reads: list[storage.QueueView] = []

    def changes_while_reading() -> None:
        api.ctx.waits_ended_here({ended["id"]})
        api.ctx.jobs_wait_here({(workspace_id, "q"): made}, (workspace_id, "host-q"))

    def read_then_changed_here(**kwargs: Any) -> storage.QueueView:
        view = real_read(**kwargs)
        if not reads and api.db.inline:  # the first read found the database before what happens here now
            changes_while_reading()
        elif not reads:  # on a worker thread: the change is made on the server's loop, as a request's is
            anyio.from_thread.run_sync(changes_while_reading)
        reads.append(view)
        return view

    monkeypatch.setattr(storage, "queue_view", read_then_changed_here)
    api.client.portal.call(queue.refresh, api.ctx)
    assert reads and (workspace_id, "p") in reads[0].watches  # it read the wait as waiting
    assert (workspace_id, "p") not in api.ctx.watches
    assert api.ctx.watches[(workspace_id, "q")] == made and (workspace_id, "host-q") in api.ctx.queue_hosts


def test_a_wait_created_ends_its_jobs_long_poll_so_it_asks_what_to_watch_at_once(api: Api) -> None:
    """A job is queued by someone else (the CLI, the dashboard): its long-poll, the one way the
    server reaches it, ends empty at once, and the job's heartbeat right after (the client's rule
    for an empty poll answered early) gets what to watch, not a heartbeat interval later."""
    register_paused(api)
    answered: list[tuple[int, float]] = []

    def poll() -> None:
        asked = time.monotonic()
        r = api.get("/processes/p/commands/next", params={"wait": POLL_WAIT_S})
        answered.append((r.status_code, time.monotonic() - asked))

    polling = threading.Thread(target=poll)
    polling.start()
    time.sleep(0.5)
    assert answered == []  # it waits: nothing to hand out
    created = api.post("/waits", {"process_id": "p"}).json()
    polling.join(POLL_WAIT_S)
    [(status, seconds)] = answered
    assert status == 204 and seconds < POLL_WAIT_S / 2, answered
    beat = api.post("/processes/p/heartbeat", {"state": "PAUSED"})
    assert beat.json()["watch"] == created["watch"] and created["watch"]["wait_id"] == created["wait"]["id"]


def test_a_refused_resume_is_queued_and_a_plain_one_is_sent_however_full_the_report(api: Api) -> None:
    """A person's resume is not refused on the last report's room (the job judges it); making room
    where nothing of lower priority runs is refused with why."""
    register_paused(api)
    refused = api.post("/waits", {"process_id": "p", "make_room": True})
    assert refused.status_code == 422 and "cannot make room for process 'p'" in refused.json()["message"]
    sent = api.command("resume", "p")
    assert sent.status_code == 201 and sent.json()["target_uuid"] == "GPU-0000"


def test_the_jobs_of_a_host_that_see_the_same_room_store_it_once(api: Api) -> None:
    for process_id in ("p", "q"):
        register_paused(api, process_id)
        assert api.post("/waits", {"process_id": process_id, "gpu": "0"}).status_code == 201
    seen = {"state": "PAUSED", "room_seen": True, "devices": [gpu(0, used=139 * GIB), gpu(1, used=100 * GIB)]}
    stored = api.post("/processes/p/heartbeat", seen).json()
    assert stored["watch"] is not None  # room on GPU 1; it waits for GPU 0
    written = api.get("/devices").json()["hosts"][0]["updated_at"]
    time.sleep(0.05)
    same = api.post("/processes/q/heartbeat", seen).json()
    assert same["watch"] is not None and api.get("/devices").json()["hosts"][0]["updated_at"] == written
    more = {**seen, "devices": [gpu(0, used=139 * GIB), gpu(1, used=90 * GIB)]}
    api.post("/processes/q/heartbeat", more)
    assert api.get("/devices").json()["hosts"][0]["updated_at"] > written


def _room_seen(api: Api, process_id: str, *, used: int) -> None:
    """The paused job's heartbeat says it saw room: GPU 0 of its host with ``used`` in use."""
    beat = api.post(
        f"/processes/{process_id}/heartbeat", {"state": "PAUSED", "room_seen": True, "devices": [gpu(0, used=used)]}
    )
    assert beat.status_code == 200, beat.text


def _wait_states(api: Api) -> dict[str, str]:
    return {w["process_id"]: w["state"] for w in api.get("/waits", params={"all": "true"}).json()}


@pytest.mark.parametrize(
    "app_settings,after_a_second",
    [
        (1.0, {"big": "waiting", "small": "waiting"}),  # the room freed collects for the big job
        (BACKFILL_PATIENCE_S, {"big": "waiting", "small": "dispatched"}),  # the small job still goes first
    ],
    indirect=["app_settings"],
)
def test_a_short_backfill_patience_collects_room_for_an_earlier_job_sooner(
    api: Api, after_a_second: dict[str, str]
) -> None:
    """--backfill-patience: a small job that fits goes ahead of an earlier big one of its priority
    that fits nowhere, until the big one has waited that long. Set to 1 s, the room freed a second
    after both were queued is kept for the big one; at the default (60 s) the small one takes it."""
    for process_id, footprint in (("big", 60 * GIB), ("small", 10 * GIB)):
        api.register(process_id, state="PAUSED", memory=0, footprint_bytes=footprint, devices=[gpu(0, used=139 * GIB)])
        assert api.post("/waits", {"process_id": process_id}).status_code == 201
    time.sleep(1.2)  # past the short patience, well within the default
    _room_seen(api, "small", used=100 * GIB)  # 40 GiB free: room for the small job, not for the big
    assert _wait_states(api) == after_a_second
    _room_seen(api, "big", used=40 * GIB)  # 100 GiB free: room for the big job
    assert _wait_states(api)["big"] == "dispatched"

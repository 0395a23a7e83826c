"""flexium run's placements through the real HTTP API and the server's passes: each change is a
``placement`` event (asked, placed, taken, given up, ended); a GPU report that frees room places a
waiting one at once, not at the next sweep; and flexium run's silence is counted only while the
server answered (after a restart or a database outage it is not taken for gone). On SQLite and
PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import update

from flexium import protocol
from flexium.server import queue
from flexium.server.db import DatabaseUnavailable
from flexium.server.models import Placement, Reservation
from flexium.server.policy_pass import answering_since, run_policy_pass
from support.server import GIB, Api, gpu

HOST = "node1"


def _ask(api: Api, used: int, **request: Any) -> dict[str, Any]:
    body = {"host": HOST, "devices": [gpu(0, used=used)], "memory_bytes": 30 * GIB, **request}
    r = api.post("/placements", body)
    assert r.status_code == 201, r.text
    placement: dict[str, Any] = r.json()["placement"]
    return placement


def _placement_events(api: Api, after: int) -> list[tuple[str, int, str]]:
    return [
        (data["action"], data["placement"]["id"], data["placement"]["state"])
        for kind, data in api.events(after)
        if kind == protocol.EVENT_PLACEMENT
    ]


def _sweep_pass(api: Api) -> None:
    async def place() -> None:
        await queue.place(api.ctx)

    api.client.portal.call(place)


def _unheard_since(api: Api, placement_id: int, seconds: float) -> None:
    """Its flexium run last heard ``seconds`` before this server started."""
    with api.db.session(write=True) as session:
        session.execute(
            update(Placement).where(Placement.id == placement_id).values(asked_at=api.ctx.started_at - seconds)
        )


def test_every_change_of_a_placement_is_an_event(api: Api) -> None:
    before = api.ctx.bus.last_id
    waiting = _ask(api, used=130 * GIB)
    placed = _ask(api, used=130 * GIB, memory_bytes=1 * GIB)  # fits now: ahead of the big one
    api.register("gpu-run", host=HOST, memory=1 * GIB, devices=[gpu(0, used=131 * GIB)], placement_id=placed["id"])
    assert api.delete(f"/placements/{waiting['id']}").status_code == 200
    assert _placement_events(api, before) == [
        ("created", waiting["id"], "waiting"),
        ("created", placed["id"], "placed"),
        ("updated", placed["id"], "started"),
        ("updated", waiting["id"], "cancelled"),
    ]
    # one whose flexium run stopped asking ends at the sweep's pass, and says so
    silent = _ask(api, used=130 * GIB)
    after = api.ctx.bus.last_id
    with api.db.session(write=True) as session:
        gone = time.time() - 2 * api.ctx.settings.stale_after_s
        session.execute(update(Placement).where(Placement.id == silent["id"]).values(asked_at=gone))
    api.ctx.answering_since = gone  # the server answered all along
    _sweep_pass(api)
    assert _placement_events(api, after) == [("updated", silent["id"], "cancelled")]


def test_a_gpu_report_that_frees_room_places_a_waiting_job_at_once(api: Api) -> None:
    """The sweep is an hour apart here: only the report can place it."""
    api.register("neighbour", host=HOST, memory=130 * GIB, devices=[gpu(0, used=130 * GIB)])
    waiting = _ask(api, used=130 * GIB)
    assert waiting["state"] == "waiting"
    assert api.delete("/processes/neighbour").status_code in (200, 204)
    api.register("other-job", host=HOST, memory=5 * GIB, devices=[gpu(0, used=5 * GIB)])  # its report: room now
    placement = api.get(f"/placements/{waiting['id']}").json()
    assert placement["state"] == "placed" and placement["placed_uuid"] == "GPU-0000", placement


def test_a_placement_asked_for_before_the_server_started_is_not_taken_for_gone(api: Api) -> None:
    """The server was down longer than flexium run's silence may last: its asks could not be heard."""
    waiting = _ask(api, used=130 * GIB)
    _unheard_since(api, waiting["id"], 2 * api.ctx.settings.stale_after_s)
    _sweep_pass(api)
    assert api.get(f"/placements/{waiting['id']}").json()["state"] == "waiting"


def test_a_database_outage_is_not_counted_as_flexium_runs_silence(api: Api) -> None:
    waiting = _ask(api, used=130 * GIB)

    def unreachable(**_kwargs: Any) -> None:
        raise DatabaseUnavailable("the database is down")

    async def failing_pass() -> None:
        await run_policy_pass(api.ctx, unreachable, what="a test's", workspace_id=None, host=None)

    api.client.portal.call(failing_pass)
    assert answering_since(api.ctx) >= time.time() - 1  # while it lasts: nobody is heard
    back = time.time()
    _sweep_pass(api)  # the database is back
    assert back <= api.ctx.answering_since <= time.time()
    with api.db.session(write=True) as session:  # last heard long before the outage ended
        asked = back - 2 * api.ctx.settings.stale_after_s
        session.execute(update(Placement).where(Placement.id == waiting["id"]).values(asked_at=asked))
    _sweep_pass(api)
    assert api.get(f"/placements/{waiting['id']}").json()["state"] == "waiting"


def test_room_held_for_a_placed_job_is_held_again_when_its_flexium_run_is_heard_after_an_outage(api: Api) -> None:
    placed = _ask(api, used=10 * GIB)
    assert placed["state"] == "placed" and placed["reservation"] is not None
    with api.db.session(write=True) as session:  # the hold ran out while nobody could take it
        session.execute(update(Reservation).values(expires_at=time.time() - 1))
    _unheard_since(api, placed["id"], 2 * api.ctx.settings.stale_after_s)
    r = api.post(f"/placements/{placed['id']}/report", {"devices": [gpu(0, used=10 * GIB)]})
    assert r.status_code == 200, r.text
    held = r.json()["reservation"]
    assert r.json()["state"] == "placed" and held is not None
    assert held["expires_at"] >= time.time() + api.ctx.settings.reservation_ttl_s - 60


def test_a_job_larger_than_any_gpu_of_its_host_is_refused_not_queued(api: Api) -> None:
    """It would wait for ever, holding up every job of lower priority on the host: refused at once, saying
    how much the largest GPU holds, and nothing is stored (no placement, no audit entry of one)."""
    two = [gpu(0, total=140 * GIB), gpu(1, total=80 * GIB)]
    r = api.post("/placements", {"host": HOST, "devices": two, "memory_bytes": 500 * GIB})
    assert r.status_code == 422 and r.json()["error"] == "target_refused", r.text
    message = r.json()["message"]
    assert "no GPU of host 'node1' can ever hold 500.5 GiB" in message, message
    assert "the largest GPU of the host holds 140.0 GiB in all; ask for less with --memory" in message, message
    named = api.post("/placements", {"host": HOST, "devices": two, "memory_bytes": 100 * GIB, "gpu_uuid": "GPU-0001"})
    assert named.status_code == 422 and "GPU GPU-0001 holds 80.0 GiB in all" in named.json()["message"], named.text
    assert api.get("/placements", params={"all": "true"}).json() == []
    fits = api.post("/placements", {"host": HOST, "devices": two, "memory_bytes": 100 * GIB})
    assert fits.status_code == 201 and fits.json()["placement"]["placed_index"] == 0, fits.text

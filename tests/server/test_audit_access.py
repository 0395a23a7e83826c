"""The audit log against a reader who floods it (issue 41 item 4), over HTTP on SQLite and
PostgreSQL: logins repeated count in one entry and keep a bounded number of sessions, refused
writes and logins are recorded once per sender and hour, the server's own actor names cannot be
taken by a token, and forgetting a process is recorded with the outcome of the command it ran."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import text

from flexium.server import refusals, storage
from support.server import Api

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _mint(api: Api, role: str, name: str = "") -> dict[str, Any]:
    r = api.post("/tokens", {"name": name, "role": role})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _login(api: Api, token: str) -> Any:
    return api.client.post("/login", content=f"token={token}", headers=FORM, follow_redirects=False)


def _entries(api: Api, action: str) -> list[dict[str, Any]]:
    return [e for e in api.get("/audit?limit=1000").json() if e["action"] == action]


def _refusals_written(api: Api) -> None:
    """The refusals counted in memory, written now (as the server does every FLUSH_S)."""
    api.client.portal.call(api.ctx.refusals.write, api.ctx)


def test_a_viewer_logging_in_again_and_again_fills_neither_the_log_nor_the_sessions(api: Api) -> None:
    issued = _entries(api, "token.issued")
    viewer = _mint(api, "viewer", "alice")
    logins = storage.Retention().sessions_per_token + 30
    for _ in range(logins):
        assert _login(api, viewer["token"]).status_code == 303
        api.client.cookies.clear()
    mine = [e for e in _entries(api, "login") if e["token_id"] == viewer["id"]]
    assert len(mine) == 1 and mine[0]["repeats"] == logins and mine[0]["last_at"] >= mine[0]["at"]
    assert _entries(api, "token.issued")[-len(issued) :] == issued  # the admin's entries are all there
    with api.db.session(write=False) as s:
        sessions = s.execute(text("SELECT count(*) FROM dashboard_sessions WHERE token_id = :t"), {"t": viewer["id"]})
        assert sessions.scalar() == storage.Retention().sessions_per_token


def test_refused_writes_are_recorded_once_per_sender(api: Api) -> None:
    viewer = _mint(api, "viewer", "bob")
    api.register("gpu-1")
    for _ in range(40):
        r = api.post("/commands", {"kind": "pause", "process_id": "gpu-1"}, headers=api.headers(viewer["token"]))
        assert r.status_code == 403
        r = api.post("/commands", {"kind": "pause", "process_id": "gpu-1"}, headers=api.headers("flx_wrong"))
        assert r.status_code == 401
        assert api.client.get(api.base + "/processes").status_code == 401  # a read refused: not recorded
    _refusals_written(api)
    refused = _entries(api, "request.refused")
    by_token = {e["token_id"]: e for e in refused}
    assert len(refused) == 2 and set(by_token) == {viewer["id"], None}
    assert by_token[viewer["id"]]["repeats"] == 40 and by_token[viewer["id"]]["token_name"] == "bob"
    assert by_token[viewer["id"]]["detail"].startswith("403 POST /api/w/default/commands: ")
    anonymous = by_token[None]
    assert anonymous["repeats"] == 40 and anonymous["token_name"] == "no valid token"
    assert anonymous["target"] == "POST /api/w/{workspace}/commands from testclient"
    assert anonymous["outcome"] == "refused"
    # the next flood within the hour counts in the same entries
    for _ in range(5):
        api.post("/commands", {"kind": "pause", "process_id": "gpu-1"}, headers=api.headers("flx_wrong"))
    _refusals_written(api)
    assert [e["repeats"] for e in _entries(api, "request.refused") if e["token_id"] is None] == [45]


def test_refusals_of_different_kinds_are_told_apart(api: Api) -> None:
    """A viewer refused a pause and refused minting an admin token: two entries, each naming what was
    refused, the mint not hidden in the pause's count."""
    viewer = _mint(api, "viewer", "carol")
    api.register("gpu-1")
    headers = api.headers(viewer["token"])
    for _ in range(3):
        assert api.post("/commands", {"kind": "pause", "process_id": "gpu-1"}, headers=headers).status_code == 403
    assert api.post("/tokens", {"name": "mine", "role": "admin"}, headers=headers).status_code == 403
    _refusals_written(api)
    mine = {e["target"]: e for e in _entries(api, "request.refused") if e["token_id"] == viewer["id"]}
    assert sorted(mine) == [
        "POST /api/w/{workspace}/commands from testclient",
        "POST /api/w/{workspace}/tokens from testclient",
    ]
    assert mine["POST /api/w/{workspace}/commands from testclient"]["repeats"] == 3
    assert mine["POST /api/w/{workspace}/tokens from testclient"]["detail"].startswith("403 POST /api/w/default/tokens")


def test_a_refused_login_is_recorded_in_its_tokens_workspace(api: Api) -> None:
    job = _mint(api, "job", "cluster-a")
    assert _login(api, job["token"]).status_code == 403
    assert _login(api, "flx_nobody").status_code == 401  # names no workspace: the server's log says it
    _refusals_written(api)
    (entry,) = _entries(api, "login.refused")
    assert (entry["token_id"], entry["detail"], entry["outcome"]) == (job["id"], "with a job token", "refused")


def test_the_servers_own_names_cannot_be_taken_by_a_token(api: Api) -> None:
    for name in ("server", "Command  Line", "no valid token", "policy: make room"):
        r = api.post("/tokens", {"name": name, "role": "viewer"})
        assert r.status_code in (400, 422) and "may not be named" in r.json()["message"], (name, r.text)
    assert _mint(api, "viewer", "server room")["token"]  # a name that only begins so is a name


def test_forgetting_a_process_is_recorded_with_its_running_commands_outcome(api: Api) -> None:
    api.register("gpu-1")
    command = api.command("pause").json()
    assert api.get("/processes/gpu-1/commands/next?wait=0").json()["id"] == command["id"]
    assert api.post(f"/commands/{command['id']}/report", {"state": "running"}).status_code == 200
    assert api.delete("/processes/gpu-1").status_code == 204
    (forgotten,) = _entries(api, "process.forgotten")
    assert forgotten["process_id"] == "gpu-1" and forgotten["token_id"] is not None
    assert f"command {command['id']} (pause) ended failed" in forgotten["detail"]
    (finished,) = _entries(api, "command.finished")
    assert finished["command_id"] == command["id"] and finished["outcome"] == "failed"
    assert "unregistered" in finished["detail"]


def test_refusals_are_written_within_a_flush(api: Api) -> None:
    """Nobody asks for the write: the refusal itself schedules it."""
    api.post("/commands", {"kind": "pause", "process_id": "gpu-1"}, headers=api.headers("flx_wrong"))
    deadline = time.monotonic() + refusals.FLUSH_S + 10
    while not _entries(api, "request.refused") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _entries(api, "request.refused")

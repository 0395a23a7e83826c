"""When a token was last used (``TokenInfo.last_used_at``): the tokens list, `flexium token list` and
the dashboard's Tokens page say whether a token is still in use before anyone revokes it. Each server
notes the requests that came with a token (a dashboard session of it included) and writes the latest
at most once a minute, in batches, never moving it backwards."""

from __future__ import annotations

import time
from typing import Any

import requests

from flexium.server import database_admin, storage
from flexium.server.db import Database
from support.server import LiveServer, process_body
from support.storage import make_workspace

WRITTEN_WITHIN_S = 5.0  # the server's flush runs every 0.5 s; room for a loaded machine


def _tokens(server: LiveServer) -> dict[str, dict[str, Any]]:
    listed = requests.get(
        f"{server.url}/api/w/default/tokens", headers={"Authorization": f"Bearer {server.token}"}, timeout=10
    )
    assert listed.status_code == 200, listed.text
    return {t["name"]: t for t in listed.json()}


def _used_once_written(server: LiveServer, name: str) -> float:
    deadline = time.monotonic() + WRITTEN_WITHIN_S
    while (used := _tokens(server)[name]["last_used_at"]) is None:
        assert time.monotonic() < deadline, f"token {name!r}'s use was not written"
        time.sleep(0.1)
    return float(used)


def test_a_tokens_last_use_is_written_and_listed(live_server: LiveServer) -> None:
    base = f"{live_server.url}/api/w/default"
    admin = {"Authorization": f"Bearer {live_server.token}"}

    def issue(name: str, role: str) -> str:
        issued = requests.post(base + "/tokens", json={"name": name, "role": role}, headers=admin, timeout=10)
        assert issued.status_code == 201, issued.text
        return str(issued.json()["token"])

    job, viewer = issue("a job", "job"), issue("a screen", "viewer")
    unused = issue("never used", "job")
    assert unused and all(_tokens(live_server)[n]["last_used_at"] is None for n in ("a job", "a screen"))

    before = time.time()
    registered = requests.post(
        base + "/processes", json=process_body("gpu-u"), headers={"Authorization": f"Bearer {job}"}, timeout=10
    )
    after = time.time()
    assert registered.status_code == 201, registered.text
    used = _used_once_written(live_server, "a job")
    assert before <= used <= after, (before, used, after)

    # Used again within the minute: not written again (a request does not cost a write).
    beat = requests.post(
        base + "/processes/gpu-u/heartbeat", json={}, headers={"Authorization": f"Bearer {job}"}, timeout=10
    )
    assert beat.status_code == 200, beat.text
    time.sleep(1.5)
    assert _tokens(live_server)["a job"]["last_used_at"] == used

    # A dashboard session of a token is a use of it.
    browser = requests.Session()
    before = time.time()
    login = browser.post(live_server.url + "/login", data={"token": viewer}, allow_redirects=False, timeout=10)
    assert login.status_code == 303, login.text
    assert browser.get(live_server.url + "/", timeout=10).status_code == 200
    assert before <= _used_once_written(live_server, "a screen") <= time.time()

    listed = _tokens(live_server)
    assert listed["never used"]["last_used_at"] is None
    [admin_name] = [name for name, t in listed.items() if t["role"] == "admin"]
    assert _used_once_written(live_server, admin_name) <= time.time()  # listing them is a use of it
    # The command line reads what the servers wrote.
    url = live_server.database
    assert url
    on_database = {t.name: t for t in database_admin.list_tokens("default", database_url=url)}
    assert on_database["a job"].last_used_at == used
    assert on_database["never used"].last_used_at is None


def test_a_written_use_never_moves_back(db: Database) -> None:
    """Replicas write their own uses of a token: the latest stays, whichever is written last."""
    ws, _token = make_workspace(db)
    [token] = db.run(storage.list_tokens, write=False, workspace_id=ws, now=time.time())
    db.run(storage.record_token_use, write=True, used={token.id: 2_000.0})
    db.run(storage.record_token_use, write=True, used={token.id: 1_000.0})
    [token] = db.run(storage.list_tokens, write=False, workspace_id=ws, now=time.time())
    assert token.last_used_at == 2_000.0
    db.run(storage.record_token_use, write=True, used={token.id: 3_000.0, 999_999: 3_000.0})  # one gone: no harm
    [token] = db.run(storage.list_tokens, write=False, workspace_id=ws, now=time.time())
    assert token.last_used_at == 3_000.0

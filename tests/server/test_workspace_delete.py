"""`flexium workspace delete NAME`: a workspace and everything of it go, in one transaction, and
nothing of any other; refused before anything changes while a process of it is heard (unless
--force), and confirmed by its name typed again (or --yes). The running servers refuse its tokens
as revoked ones."""

from __future__ import annotations

import io
import sys
import threading
import time
from typing import Any

import pytest
import requests
from sqlalchemy import func, select

from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from flexium.server import database_admin, storage
from flexium.server.db import Database
from flexium.server.errors import Conflict, NotFound
from flexium.server.models import Base, Token
from flexium.server.settings import normalize_database_url
from support.server import LiveServer, process_body
from support.storage import add_process, make_workspace

pytestmark = pytest.mark.timeout(180)

# What a server takes to refuse a token deleted on the database: at once on PostgreSQL (told), within its
# token cache time on SQLite (5 s), with room for a loaded machine; its streams end at once on PostgreSQL,
# at the server's next sweep on SQLite (every second here).
REFUSED_WITHIN_S = 10.0


def _rows_of(db: Database, workspace_id: int) -> dict[str, int]:
    """Every row that names the workspace, by table, and the sessions and login codes of its tokens."""
    counts = {}
    with db.session(write=False) as s:
        for table in Base.metadata.sorted_tables:
            if "workspace_id" in table.c:
                counts[table.name] = s.scalar(
                    select(func.count()).select_from(table).where(table.c.workspace_id == workspace_id)
                )
            elif "token_id" in table.c and table.name in ("dashboard_sessions", "login_codes"):
                tokens = select(Token.id).where(Token.workspace_id == workspace_id)
                counts[table.name] = s.scalar(
                    select(func.count()).select_from(table).where(table.c.token_id.in_(tokens))
                )
    return counts


def _stream(url: str, token: str, out: dict[str, Any]) -> None:
    with requests.get(url, headers={"Authorization": f"Bearer {token}"}, stream=True, timeout=60) as answer:
        out["status"] = answer.status_code
        for line in answer.iter_lines(decode_unicode=True):
            if line.startswith("event: hello"):
                out["open"] = True
    out["ended"] = time.monotonic()


def test_a_workspace_goes_with_everything_of_it_and_nothing_else(swept_live_server: LiveServer) -> None:
    live_server = swept_live_server
    url = live_server.database
    assert url
    db = Database(normalize_database_url(url), threads=2)
    team_admin = database_admin.create_workspace("team", database_url=url)
    job = database_admin.issue_token("team", role="job", database_url=url).token
    viewer = database_admin.issue_token("team", role="viewer", database_url=url).token
    team = f"{live_server.url}/api/w/team"
    default = f"{live_server.url}/api/w/default"

    def call(method: str, base: str, path: str, token: str, body: Any = None) -> requests.Response:
        return requests.request(
            method, base + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10
        )

    assert call("POST", team, "/processes", job, process_body("gpu-t", host="node-t")).status_code == 201
    assert call("POST", default, "/processes", live_server.token or "", process_body("gpu-d")).status_code == 201
    command = call("POST", team, "/commands", team_admin, {"kind": "pause", "process_id": "gpu-t"})
    assert command.status_code == 201, command.text
    code, _opened = database_admin.login_code_as("team", database_url=url)
    team_id = db.run(storage.get_workspace, write=False, name="team").id
    default_id = db.run(storage.get_workspace, write=False, name="default").id
    before = _rows_of(db, team_id)
    assert before["processes"] == 1 and before["commands"] == 1 and before["tokens"] == 3, before
    assert before["login_codes"] == 1 and before["audit_log"] > 0, before
    others = _rows_of(db, default_id)
    team_tokens = sorted(t.id for t in database_admin.list_tokens("team", database_url=url))

    # Heard now: refused, and nothing changed.
    with pytest.raises(Conflict, match=r"1 process\(es\) heard within the last .* \(gpu-t on node-t\).* --force"):
        database_admin.delete_workspace("team", database_url=url)
    assert _rows_of(db, team_id) == before
    assert call("GET", team, "/processes", viewer).status_code == 200

    stream: dict[str, Any] = {}
    streaming = threading.Thread(target=_stream, args=(team + "/events", viewer, stream))
    streaming.start()
    deadline = time.monotonic() + 10
    while "open" not in stream:
        assert time.monotonic() < deadline, "the event stream did not open"
        time.sleep(0.02)

    deleted = database_admin.delete_workspace("team", force=True, database_url=url)
    deleted_at = time.monotonic()
    assert sorted(deleted.tokens) == team_tokens
    assert deleted.processes == 1 and deleted.commands == 1 and deleted.heard == [("gpu-t", "node-t")]
    assert deleted.audit_entries == before["audit_log"]
    assert set(_rows_of(db, team_id).values()) == {0}, _rows_of(db, team_id)
    assert _rows_of(db, default_id) == others  # nothing of another workspace
    assert [w.name for w in database_admin.list_workspaces(database_url=url)] == ["default"]

    for token in (team_admin, job, viewer):
        deadline = time.monotonic() + REFUSED_WITHIN_S
        while (status := call("GET", team, "/processes/gpu-t", token).status_code) != 401:
            assert status in (200, 404) and time.monotonic() < deadline, status
            time.sleep(0.2)
    streaming.join(REFUSED_WITHIN_S)
    assert stream["status"] == 200 and stream["ended"] - deleted_at < REFUSED_WITHIN_S, stream
    login = requests.post(live_server.url + "/login", data={"code": code}, allow_redirects=False, timeout=10)
    assert login.status_code == 401
    listed = call("GET", default, "/processes", live_server.token or "")
    assert [p["process_id"] for p in listed.json()] == ["gpu-d"]
    with pytest.raises(NotFound, match="workspace 'team' not found"):
        database_admin.delete_workspace("team", database_url=url)
    db.dispose()


class _Terminal(io.StringIO):
    """What a person types at a terminal."""

    def isatty(self) -> bool:
        return True


def _cli(capsys: pytest.CaptureFixture[str], *args: str, url: str) -> tuple[int, str, str]:
    from flexium.cli.main import main

    capsys.readouterr()
    status = main([*args, "--database", url])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_command_line_asks_for_the_name_again_or_yes(
    db: Database, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = db.url
    ws, _token = make_workspace(db, "team")
    add_process(db, ws, "gpu-old", now=time.time() - 3600)  # long silent: STALE, no reason to refuse
    make_workspace(db, "kept")

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal to ask on
    status, _out, err = _cli(capsys, "workspace", "delete", "team", url=url)
    assert status == EXIT_USAGE and "pass --yes" in err, err
    monkeypatch.setattr(sys, "stdin", _Terminal("tema\n"))
    status, out, err = _cli(capsys, "workspace", "delete", "team", url=url)
    assert status == EXIT_FAILED and "1 process(es)" in out and "not deleted" in err, (out, err)
    assert {w.name for w in database_admin.list_workspaces(database_url=url)} == {"team", "kept"}

    monkeypatch.setattr(sys, "stdin", _Terminal("team\n"))
    status, out, err = _cli(capsys, "workspace", "delete", "team", url=url)
    assert status == EXIT_OK and "deleted workspace 'team': 1 token(s) in use, 1 process(es)" in out, (out, err)
    assert [w.name for w in database_admin.list_workspaces(database_url=url)] == ["kept"]
    assert set(_rows_of(db, ws).values()) == {0}

    status, _out, err = _cli(capsys, "workspace", "delete", "kept", "--yes", url=url)
    assert status == EXIT_OK, err
    status, _out, err = _cli(capsys, "workspace", "delete", "kept", "--yes", url=url)
    assert status == EXIT_FAILED and "workspace 'kept' not found" in err

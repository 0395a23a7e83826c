"""Dashboard sessions (server-side, with expiry; logout and revocation end them), one-time login
codes, cross-site login posts, a viewer's dashboard, cascade revocation, the upgrade of tokens
made before roles, and the audit log (SQLite and PostgreSQL)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import requests
from sqlalchemy import text

from flexium import protocol
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.storage import audit
from support.server import Api, LiveServer, columns, migrate_to, process_body, register

FORM = {"Content-Type": "application/x-www-form-urlencoded"}
NOW = 1_800_000_000.0


def _mint(api: Api, role: str, *, by: str | None = None, name: str = "") -> dict[str, Any]:
    r = api.post("/tokens", {"name": name, "role": role}, headers=api.headers(by))
    assert r.status_code == 201, r.text
    return dict(r.json())


def _login(api: Api, body: str, **headers: str) -> Any:
    return api.client.post("/login", content=body, headers={**FORM, **headers}, follow_redirects=False)


# --- sessions -------------------------------------------------------------------------------


def test_the_cookie_is_a_session_that_logout_ends_on_the_server(api: Api) -> None:
    r = _login(api, f"token={api.token}")
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(protocol.SESSION_COOKIE + "=") and api.token not in cookie
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    assert "Secure" not in cookie  # plain http here; over TLS the cookie is Secure
    secret = api.client.cookies[protocol.SESSION_COOKIE]
    assert api.client.get("/", follow_redirects=False).status_code == 200
    with api.db.session(write=False) as s:
        stored = [row[0] for row in s.execute(text("SELECT session_hash FROM dashboard_sessions"))]
    assert stored == [storage.hash_token(secret)]  # only its hash is kept

    out = api.client.post("/logout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/login"
    api.client.cookies.set(protocol.SESSION_COOKIE, secret)  # a copy kept after logout opens nothing
    try:
        assert api.client.get("/", follow_redirects=False).headers["location"] == "/login"
        r = api.client.get(api.base + "/processes")
        assert r.status_code == 401 and "session ended" in r.json()["message"]
    finally:
        api.client.cookies.clear()


def test_sessions_expire_when_idle_and_after_a_week(db: Database) -> None:
    _record, token = db.run(storage.create_workspace, write=True, name="team", now=NOW)
    auth = db.run(storage.authenticate, write=False, token=token, now=time.time())
    secret, _who = db.run(storage.open_session, write=True, auth=auth, how="token", now=NOW)

    def who(at: float) -> Any:
        found, touch = db.run(storage.session_auth, write=False, secret=secret, now=at)
        if found is not None and touch:
            db.run(storage.touch_session, write=True, session_id=found.session_id, now=at)
        return found

    assert who(NOW + 60).token_id == auth.token_id
    assert who(NOW + 60 + storage.SESSION_IDLE_S + 1) is None  # idle too long

    secret, _who = db.run(storage.open_session, write=True, auth=auth, how="token", now=NOW)
    at = NOW
    while at + storage.SESSION_IDLE_S / 2 < NOW + storage.SESSION_MAX_S:
        at += storage.SESSION_IDLE_S / 2  # used twice a day, it stays open ...
        assert who(at) is not None
    assert who(NOW + storage.SESSION_MAX_S + 1) is None  # ... for a week at most


def test_revoking_the_token_ends_its_sessions(api: Api) -> None:
    viewer = _mint(api, "viewer")
    assert _login(api, f"token={viewer['token']}").status_code == 303
    assert api.client.get("/", follow_redirects=False).status_code == 200
    assert api.delete(f"/tokens/{viewer['id']}").status_code == 200
    assert api.client.get("/", follow_redirects=False).headers["location"] == "/login"
    api.client.cookies.clear()
    with api.db.session(write=False) as s:
        assert s.execute(text("SELECT COUNT(*) FROM dashboard_sessions")).scalar() == 0


def test_a_job_token_cannot_open_the_dashboard(api: Api) -> None:
    job = _mint(api, "job")
    r = _login(api, f"token={job['token']}")
    assert r.status_code == 403 and "job token cannot open the dashboard" in r.text
    assert protocol.SESSION_COOKIE not in r.headers.get("set-cookie", "")


# --- login links ----------------------------------------------------------------------------


def test_a_login_code_works_once_and_not_after_ten_minutes(api: Api) -> None:
    code = api.db.run(storage.login_code_for, write=True, token=api.token, now=time.time())
    assert api.token not in code
    assert _login(api, f"code={code}").status_code == 303
    assert api.client.get("/", follow_redirects=False).status_code == 200
    api.client.cookies.clear()
    again = _login(api, f"code={code}")
    assert again.status_code == 401 and "used already or has expired" in again.text

    old = api.db.run(
        storage.login_code_for, write=True, token=api.token, now=time.time() - storage.LOGIN_CODE_TTL_S - 1
    )
    assert _login(api, f"code={old}").status_code == 401
    assert _login(api, "code=made-up").status_code == 401


def test_a_login_code_raced_by_two_logins_opens_one_session(db: Database) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _record, token = db.run(storage.create_workspace, write=True, name="team", now=NOW)
    for _ in range(5):
        code = db.run(storage.login_code_for, write=True, token=token, now=NOW)
        with ThreadPoolExecutor(4) as pool:
            found = list(pool.map(lambda c: db.run(storage.redeem_login_code, write=True, code=c, now=NOW), [code] * 4))
        assert sum(auth is not None for auth in found) == 1


@pytest.mark.parametrize(
    "headers",
    [
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": "http://testserver.evil.example"},
    ],
)
def test_a_cross_site_login_post_is_refused(api: Api, headers: dict[str, str]) -> None:
    r = _login(api, f"token={api.token}", **headers)
    assert r.status_code == 403 and "must be posted from this server" in r.text
    assert protocol.SESSION_COOKIE not in r.headers.get("set-cookie", "")


@pytest.mark.parametrize("headers", [{}, {"Sec-Fetch-Site": "same-origin"}, {"Origin": "http://testserver"}])
def test_a_same_origin_login_post_is_taken(api: Api, headers: dict[str, str]) -> None:
    assert _login(api, f"token={api.token}", **headers).status_code == 303
    api.client.cookies.clear()


# --- what a viewer sees ---------------------------------------------------------------------


def test_a_viewers_dashboard_shows_the_buttons_disabled_with_the_reason(api: Api) -> None:
    api.register("gpu-1")
    api.register("gpu-2", host="node2", state="PAUSED")
    viewer = _mint(api, "viewer", name="wall screen")
    assert _login(api, f"token={viewer['token']}").status_code == 303
    try:
        page = api.client.get("/").text
        rows = api.client.get("/ui/processes").text
        audit_page = api.client.get("/audit").text
    finally:
        api.client.cookies.clear()
    refusal = "moving, pausing, resuming or forgetting a job needs a token with role admin"
    for html in (page, rows):
        for button in ("Migrate", "Pause", "Resume"):
            assert f'disabled title="{refusal}' in html.split(f">{button}</button>")[0].rsplit("<button", 1)[1]
    assert 'id="role"' in page and ">viewer<" in page
    assert "token.issued" in audit_page and "wall screen" not in audit_page.split("<tbody>")[0]
    assert re.search(r'title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"', audit_page)  # each entry's exact time
    [admin_rows] = api.pages("/ui/processes")
    assert refusal not in admin_rows and "Migrate</button>" in admin_rows


# --- tokens ---------------------------------------------------------------------------------


def test_revoking_a_token_revokes_what_it_minted_transitively(api: Api) -> None:
    lead = _mint(api, "admin", name="lead")
    job = _mint(api, "job", by=lead["token"], name="job")
    deputy = _mint(api, "admin", by=lead["token"], name="deputy")
    screen = _mint(api, "viewer", by=deputy["token"], name="screen")
    other = _mint(api, "viewer", name="other")
    assert (job["minted_by"], deputy["minted_by"], screen["minted_by"]) == (lead["id"], lead["id"], deputy["id"])

    r = api.delete(f"/tokens/{lead['id']}")
    assert r.status_code == 200 and r.json()["revoked"]
    assert sorted(r.json()["cascade"]) == sorted([job["id"], deputy["id"], screen["id"]])
    for gone in (lead, job, deputy, screen):
        assert api.get("", headers=api.headers(gone["token"])).status_code == 401
    assert api.get("", headers=api.headers(other["token"])).status_code == 200
    assert api.get("").status_code == 200

    entries = api.get("/audit").json()
    revoked = [e for e in entries if e["action"] == "token.revoked"]
    assert len(revoked) == 4 and all(e["role"] == "admin" and e["outcome"] == "ok" for e in revoked)
    assert sum("revoked with it" in e["detail"] for e in revoked) == 3
    assert len([e for e in entries if e["action"] == "token.issued"]) >= 5


def test_tokens_made_before_roles_become_admin_and_0006_goes_back(database_url: str) -> None:
    """A database at 0005 with a token and a process with commands: after the upgrade the token
    is an admin token (no one is locked out) and keeps working; down to 0005 and up again,
    the commands stay."""
    from alembic import command

    from flexium.server.settings import normalize_database_url

    db = Database(normalize_database_url(database_url), threads=2)
    try:
        migrate_to(db, command.upgrade, "0005")
        with db.session(write=True) as s:
            s.execute(text("INSERT INTO workspaces (id, name, created_at) VALUES (1, 'old', 1.0)"))
            s.execute(
                text(
                    "INSERT INTO tokens (workspace_id, name, token_hash, prefix, created_at) "
                    "VALUES (1, 'old', :h, 'flx_abcdef', 1.0)"
                ),
                {"h": storage.hash_token("flx_old-token")},
            )
        db.upgrade()
        auth = db.run(storage.authenticate, write=False, token="flx_old-token", now=time.time())
        assert auth is not None and auth.role == "admin"
        [info] = db.run(storage.list_tokens, write=False, workspace_id=1, now=time.time())
        assert info.role == "admin" and info.minted_by is None
        register(db, 1, process_body("gpu-1"), now=NOW, stale_after=30.0)
        db.run(
            storage.create_commands,
            write=True,
            workspace_id=1,
            kind="pause",
            process_id="gpu-1",
            now=NOW,
            stale_after=30.0,
        )
        migrate_to(db, command.downgrade, "0005")
        assert "role" not in columns(db, "tokens") and "token_id" not in columns(db, "processes")
        with db.session(write=False) as s:
            assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
        db.upgrade()
        assert db.run(storage.authenticate, write=False, token="flx_old-token", now=time.time()).role == "admin"
    finally:
        db.dispose()


# --- the audit log --------------------------------------------------------------------------


def test_commands_and_their_outcomes_are_audited(api: Api) -> None:
    job = _mint(api, "job", name="trainer")
    r = api.post("/processes", process_body("gpu-1"), headers=api.headers(job["token"]))
    assert r.status_code == 201
    cmd = api.command("pause").json()
    refused = api.command("pause")  # one active command per process
    assert refused.status_code == 409
    done = api.post(f"/commands/{cmd['id']}/report", {"state": "succeeded"}, headers=api.headers(job["token"]))
    assert done.status_code == 200

    viewer = _mint(api, "viewer")
    entries = api.get("/audit", headers=api.headers(viewer["token"])).json()
    commands = [e for e in entries if e["action"].startswith("command.")]
    finished, refusal, created = commands[:3]
    assert created["action"] == "command.created" and created["outcome"] == "ok"
    assert created["target"] == f"command {cmd['id']} (pause gpu-1)" and created["role"] == "admin"
    assert refusal["outcome"] == "refused" and "already has command" in refusal["detail"]
    assert finished["action"] == "command.finished" and finished["outcome"] == "succeeded"
    assert (finished["token_name"], finished["role"], finished["token_id"]) == ("trainer", "job", job["id"])
    assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), reverse=True)  # newest first
    assert api.get("/audit?limit=2").json() == entries[:2]
    assert api.get(f"/audit?before_id={entries[1]['id']}").json() == entries[2:]
    r = api.get("/audit", headers=api.headers(job["token"]))
    assert r.status_code == 403


def test_commands_the_server_ends_are_audited_as_its_doing(database_url: str, tmp_path: Any) -> None:
    server = LiveServer(database_url, str(tmp_path / "home"), "--sweep-interval", "0.3", "--command-ttl", "1")
    server.start()
    try:
        headers = {"Authorization": f"Bearer {server.token}"}
        base = f"{server.url}/api/w/default"
        assert requests.post(base + "/processes", json=process_body("gpu-1"), headers=headers, timeout=10).ok
        command = requests.post(
            base + "/commands", json={"kind": "pause", "process_id": "gpu-1"}, headers=headers, timeout=10
        )
        assert command.status_code == 201  # nobody polls for it: it expires

        def expired() -> Any:
            entries = requests.get(base + "/audit", headers=headers, timeout=10).json()
            return next((e for e in entries if e["action"] == "command.finished"), None)

        deadline = time.monotonic() + 20
        while (entry := expired()) is None:
            assert time.monotonic() < deadline, "the expiry in the audit log"
            time.sleep(0.2)
        assert entry["outcome"] == "expired" and entry["token_name"] == "server" and entry["token_id"] is None
        assert entry["target"] == f"command {command.json()['id']} (pause gpu-1)"
    finally:
        server.stop()


def test_logins_and_logouts_are_audited(api: Api) -> None:
    code = api.db.run(storage.login_code_for, write=True, token=api.token, now=time.time())
    assert _login(api, f"code={code}").status_code == 303
    api.client.post("/logout")
    entries = api.get("/audit").json()
    (logout, login) = entries[:2]
    assert (logout["action"], login["action"], logout["target"]) == ("logout", "login", "the dashboard")
    assert login["detail"].startswith("with a login code (session ") and logout["detail"].startswith("session ")


def test_the_audit_log_keeps_entries_by_age_and_class(db: Database) -> None:
    """A login or refusal goes after its access keep, a change after its change keep (storage.Retention), however many
    entries there are; another workspace's are its own."""
    record, _token = db.run(storage.create_workspace, write=True, name="team", now=NOW)
    other, _token = db.run(storage.create_workspace, write=True, name="other", now=NOW)
    day = 86400.0
    old = {
        "an old login": ("login", NOW - storage.Retention().access_keep_s - day),
        "a login within its keep": ("login", NOW - storage.Retention().access_keep_s + day),
        "an old change": ("token.issued", NOW - storage.Retention().change_keep_s - day),
        "a change older than any login kept": ("token.issued", NOW - storage.Retention().access_keep_s - day),
    }
    for target, (action, at) in old.items():
        db.run(
            audit.record_audit,
            write=True,
            workspace_id=record.id,
            actor=None,
            action=action,
            target=target,
            outcome="ok",
            now=at,
        )
    for i in range(40):  # every 20th entry written prunes
        db.run(
            audit.record_audit,
            write=True,
            workspace_id=record.id,
            actor=None,
            action="test",
            target=str(i),
            outcome="ok",
            now=NOW + i,
        )
    kept = {e.target for e in db.run(storage.list_audit, write=False, workspace_id=record.id, limit=1000)}
    assert {"a login within its keep", "a change older than any login kept"} <= kept
    assert not {"an old login", "an old change"} & kept
    assert len(db.run(storage.list_audit, write=False, workspace_id=other.id, limit=1000)) == 1  # its own token

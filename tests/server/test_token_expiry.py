"""A token given a life (``POST /tokens`` with ``expires_in_s``, ``flexium token issue --expires-in``)
is refused from its end on as a revoked one is: its requests (cached auth or not), its dashboard
sessions and login links, its event streams and waiting long-polls, its place in the token quota;
what it minted expires with it at the latest, and the processes it registered say so."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import requests
from fastapi.testclient import TestClient

from flexium import protocol
from flexium.server import database_admin, storage
from flexium.server.app import bootstrap, create_app
from flexium.server.errors import InvalidRequest
from flexium.server.settings import Settings
from flexium.units import utc_time
from support.server import Api, LiveServer, make_settings, process_body

pytestmark = pytest.mark.timeout(180)

# Long enough for what a test does with the token before its end, on a loaded two-core machine (CI's
# four workers there once took 1.2 s to answer one request).
LIFE_S = 8.0
# What an expired token's waits take to end (as a revoked one's: test_roles.ENDED_WITHIN_S).
ENDED_WITHIN_S = 5.0


def _sleep_past(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()) + 0.1)


@pytest.fixture
def app_settings(database_url_at_head: str) -> Settings:
    """The ``api`` of this file's tests: a server that trusts a token's auth for a minute without reading
    the database again."""
    return make_settings(database_url_at_head, token_cache_s=60.0)


def _issue(api: Api, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    issued = api.post("/tokens", body, headers=api.headers(token))
    assert issued.status_code == 201, issued.text
    return dict(issued.json())


def test_an_expired_token_is_refused_though_the_server_cached_its_auth(api: Api) -> None:
    asked_at = time.time()
    viewer = _issue(api, {"name": "intern", "role": "viewer", "expires_in_s": LIFE_S})
    answered_at = time.time()
    job = _issue(api, {"name": "short job", "role": "job", "expires_in_s": LIFE_S})
    # Its life counts from when the server issued it, between the request and its answer.
    assert asked_at + LIFE_S <= viewer["expires_at"] <= answered_at + LIFE_S, (asked_at, viewer, answered_at)
    assert api.get("/processes", headers=api.headers(viewer["token"])).status_code == 200  # cached from now on
    registered = api.post("/processes", process_body("gpu-short"), headers=api.headers(job["token"]))
    assert registered.status_code == 201, registered.text
    beat = api.post("/processes/gpu-short/heartbeat", {}, headers=api.headers(job["token"]))
    assert beat.status_code == 200, beat.text  # the heartbeat's shortcut holds its auth too
    assert not api.get("/processes/gpu-short").json()["token_expired"]

    _sleep_past(max(viewer["expires_at"], job["expires_at"]))
    refused = api.get("/processes", headers=api.headers(viewer["token"]))
    assert refused.status_code == 401, refused.text
    assert refused.json()["message"] == storage.REFUSED_TOKEN
    beat = api.post("/processes/gpu-short/heartbeat", {}, headers=api.headers(job["token"]))
    assert beat.status_code == 401, beat.text
    listed = {t["id"]: t for t in api.get("/tokens").json()}
    assert listed[viewer["id"]]["expires_at"] == viewer["expires_at"] and listed[viewer["id"]]["expired"]
    assert not listed[viewer["id"]]["revoked"] and not viewer["expired"]
    # The process it registered trains on unheard, and says why.
    shown = api.get("/processes/gpu-short").json()
    assert shown["token_expired"] and not shown["token_revoked"], shown
    assert [p["token_expired"] for p in api.get("/processes").json()] == [True]
    [page] = api.pages("/")
    assert page.count("its token has expired") == 1


def test_the_dashboards_hear_at_its_expiry_which_processes_the_token_registered(api: Api) -> None:
    """As at a revocation: their rows say so at once, not when the processes next go STALE."""
    job = _issue(api, {"name": "short job", "role": "job", "expires_in_s": LIFE_S})
    for process_id in ("gpu-e1", "gpu-e2"):
        registered = api.post("/processes", process_body(process_id), headers=api.headers(job["token"]))
        assert registered.status_code == 201, registered.text
    api.register("gpu-kept")
    before = api.ctx.bus.last_id
    _sleep_past(job["expires_at"])
    deadline = time.monotonic() + 5
    while True:
        told = [
            (data["process"]["process_id"], data["process"]["token_expired"])
            for kind, data in api.events(before)
            if kind == protocol.EVENT_PROCESS and data["action"] == "updated"
        ]
        if told or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sorted(told) == [("gpu-e1", True), ("gpu-e2", True)], told


def test_a_token_never_outlives_the_token_that_minted_it(api: Api) -> None:
    lead = _issue(api, {"name": "lead", "role": "admin", "expires_in_s": 3600})
    inherited = _issue(api, {"name": "inherits", "role": "job"}, token=lead["token"])
    assert inherited["expires_at"] == lead["expires_at"]
    shorter = _issue(api, {"name": "shorter", "role": "job", "expires_in_s": 60}, token=lead["token"])
    assert shorter["expires_at"] < lead["expires_at"]
    count = len(api.get("/tokens").json())
    longer = api.post(
        "/tokens", {"name": "longer", "role": "job", "expires_in_s": 7200}, headers=api.headers(lead["token"])
    )
    assert longer.status_code == 422, longer.text
    assert "cannot outlive the token that minted it" in longer.json()["message"]
    assert len(api.get("/tokens").json()) == count  # refused before anything was written
    # A token valid until revoked mints one that is, unless asked otherwise.
    assert _issue(api, {"name": "forever", "role": "job"})["expires_at"] is None
    audit = [e for e in api.get("/audit").json() if e["action"] == "token.issued" and "lead" in e["target"]]
    assert audit and "expires at" in audit[0]["detail"], audit


@pytest.mark.parametrize("life", [0, -5, 1e12, "soon", True])
def test_a_life_out_of_bounds_is_refused(api: Api, life: Any) -> None:
    count = len(api.get("/tokens").json())
    refused = api.post("/tokens", {"name": "odd", "role": "job", "expires_in_s": life})
    assert refused.status_code == 422, refused.text
    assert "expires_in_s" in refused.text
    assert len(api.get("/tokens").json()) == count


def test_an_expired_minter_mints_nothing(api: Api) -> None:
    """Its cached auth would let it through the door a while: minting reads its row."""
    lead = _issue(api, {"name": "lead", "role": "admin", "expires_in_s": LIFE_S})
    assert api.get("/tokens", headers=api.headers(lead["token"])).status_code == 200
    _sleep_past(lead["expires_at"])
    refused = api.post("/tokens", {"name": "late", "role": "job"}, headers=api.headers(lead["token"]))
    assert refused.status_code == 401, refused.text
    assert "late" not in {t["name"] for t in api.get("/tokens").json()}


def test_expired_tokens_leave_the_quota(database_url_at_head: str) -> None:
    app = create_app(make_settings(database_url_at_head, max_tokens=3))
    token = bootstrap(app.state.ctx.db)
    assert token
    with TestClient(app) as client:
        api = Api(client, token)
        short = _issue(api, {"name": "short", "role": "job", "expires_in_s": LIFE_S})
        _issue(api, {"name": "kept", "role": "job"})
        full = api.post("/tokens", {"name": "one too many", "role": "job"})
        assert full.status_code == 409 and "neither revoked nor expired" in full.json()["message"], full.text
        _sleep_past(short["expires_at"])
        _issue(api, {"name": "in its place", "role": "job"})


def test_a_dashboard_session_and_a_login_link_end_with_their_token(api: Api) -> None:
    viewer = _issue(api, {"name": "screen", "role": "viewer", "expires_in_s": LIFE_S})
    assert api.log_in(viewer["token"]).status_code == 303
    assert api.client.get("/", follow_redirects=False).status_code == 200
    url = api.db.url
    code, opened = database_admin.login_code_as("default", str(viewer["id"]), database_url=url)
    assert opened.id == viewer["id"]
    assert api.client.get("/api/w/default/processes").status_code == 200  # the session's cookie alone
    _sleep_past(viewer["expires_at"])
    refused = api.client.get("/api/w/default/processes")
    assert refused.status_code == 401 and "12 h idle, 7 days old, or its token revoked or expired" in refused.text
    assert api.client.get("/", follow_redirects=False).headers["location"] == "/login"
    api.client.cookies.clear()
    link = api.client.post(
        "/login",
        content=f"code={code}",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    assert link.status_code == 401, link.text
    with pytest.raises(InvalidRequest, match=r"is expired: name another"):
        database_admin.login_code_as("default", str(viewer["id"]), database_url=url)
    refused = api.log_in(viewer["token"])
    assert refused.status_code == 401 and storage.REFUSED_TOKEN in refused.text


def _stream(base: str, token: str, out: dict[str, Any]) -> None:
    with requests.get(
        base + "/events", headers={"Authorization": f"Bearer {token}"}, stream=True, timeout=60
    ) as answer:
        out["status"] = answer.status_code
        for line in answer.iter_lines(decode_unicode=True):
            if line.startswith("event: hello"):
                out["open"] = time.monotonic()
    out["ended"] = time.time()


def _poll(base: str, token: str, process_id: str, out: dict[str, Any]) -> None:
    answer = requests.get(
        f"{base}/processes/{process_id}/commands/next?wait=30",
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    out["status"], out["ended"] = answer.status_code, time.time()


def test_an_expiring_tokens_event_stream_and_long_poll_end_at_its_end(live_server: LiveServer) -> None:
    """Left alone, a stream would last for ever and a poll its 30 s: the server ends them when the token
    expires, as it does at a revocation, though nobody revoked anything."""
    base = f"{live_server.url}/api/w/default"
    admin = {"Authorization": f"Bearer {live_server.token}"}

    def issue(role: str) -> dict[str, Any]:
        issued = requests.post(
            base + "/tokens", json={"role": role, "expires_in_s": LIFE_S + 2}, headers=admin, timeout=10
        )
        assert issued.status_code == 201, issued.text
        return dict(issued.json())

    viewer, job = issue("viewer"), issue("job")
    registered = requests.post(
        base + "/processes", json=process_body("gpu-e"), headers={"Authorization": f"Bearer {job['token']}"}, timeout=10
    )
    assert registered.status_code == 201, registered.text
    stream: dict[str, Any] = {}
    poll: dict[str, Any] = {}
    threads = [
        threading.Thread(target=_stream, args=(base, viewer["token"], stream)),
        threading.Thread(target=_poll, args=(base, job["token"], "gpu-e", poll)),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while "open" not in stream:
        assert time.monotonic() < deadline, "the event stream did not open"
        time.sleep(0.02)
    assert time.time() < viewer["expires_at"], "the machine was too slow to open the stream within the token's life"
    for thread in threads:
        thread.join(LIFE_S + 2 + ENDED_WITHIN_S + 10)
    assert stream["status"] == 200 and 0 <= stream["ended"] - viewer["expires_at"] < ENDED_WITHIN_S, stream
    assert poll["status"] == 401 and 0 <= poll["ended"] - job["expires_at"] < ENDED_WITHIN_S, poll


def _cli(capsys: pytest.CaptureFixture[str], *args: str, url: str) -> tuple[int, str, str]:
    """`flexium ARGS --database URL`: (its exit status, what it printed, what it said on stderr)."""
    from flexium.cli.main import main

    capsys.readouterr()
    try:
        status = main([*args, "--database", url])
    except SystemExit as exc:  # argparse's refusals
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_the_command_line_issues_an_expiring_token_and_lists_when_it_ends(
    db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = db.url
    database_admin.create_workspace("default", database_url=url)
    status, out, err = _cli(capsys, "token", "issue", "default", "--name", "contractor", "--expires-in", "8s", url=url)
    assert status == 0, err
    assert "expires 20" in out and "UTC" in out, out
    token = out.strip().splitlines()[-1]
    assert token.startswith(protocol.TOKEN_PREFIX)
    _status, listed, _err = _cli(capsys, "token", "list", "default", url=url)
    row = next(line for line in listed.splitlines() if "contractor" in line)
    assert " active " in row and " UTC " in row, listed
    assert db.run(storage.authenticate, write=False, token=token, now=time.time()) is not None
    [contractor] = [t for t in database_admin.list_tokens("default", database_url=url) if t.name == "contractor"]
    assert contractor.expires_at is not None and not contractor.expired
    assert f"expires {utc_time(contractor.expires_at)}" in out, out  # what the database stored
    _sleep_past(contractor.expires_at)
    assert db.run(storage.authenticate, write=False, token=token, now=time.time()) is None
    _status, listed, _err = _cli(capsys, "token", "list", "default", url=url)
    row = next(line for line in listed.splitlines() if "contractor" in line)
    assert " expired " in row, listed
    for life, said in (("3 fortnights", "is not a duration"), ("0s", "greater than 0"), ("4000d", "less than")):
        status, _out, err = _cli(capsys, "token", "issue", "default", "--expires-in", life, url=url)
        assert status != 0 and said in err, (life, err)

"""Roles of tokens against a real server process over real HTTP (SQLite and PostgreSQL): every
API operation, taken from the server's own OpenAPI description so that a new route cannot
escape the matrix, called with an admin, a job and a viewer token; a job token held to the
processes it registered; revocation of what a token minted; revocation ending open event
streams and long-polls within a second."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
from sqlalchemy import update

from flexium.server import database_admin, storage
from flexium.server.db import Database
from flexium.server.models import DashboardSession
from flexium.server.settings import normalize_database_url
from support.server import GIB, LiveServer, gpu, process_body, rank_body

pytestmark = pytest.mark.timeout(180)

ADMIN, JOB, VIEWER = "admin", "job", "viewer"
EVERYONE = frozenset((ADMIN, JOB, VIEWER))
READERS = frozenset((ADMIN, VIEWER))
WORKERS = frozenset((ADMIN, JOB))
W = "/api/w/{workspace}"

# Each operation of the API -> the roles it admits (a job token on its own process, command or
# job operation). The test fails when the server has an operation this table does not name.
ALLOWED: dict[tuple[str, str], frozenset[str]] = {
    ("GET", W): READERS,
    ("POST", W + "/processes"): WORKERS,
    ("GET", W + "/processes"): READERS,
    ("GET", W + "/processes/{process_id}"): EVERYONE,
    ("DELETE", W + "/processes/{process_id}"): WORKERS,
    ("GET", W + "/processes/{process_id}/targets"): EVERYONE,
    ("POST", W + "/processes/{process_id}/heartbeat"): WORKERS,
    ("GET", W + "/processes/{process_id}/commands/next"): WORKERS,
    ("POST", W + "/commands"): frozenset((ADMIN,)),
    ("GET", W + "/commands"): READERS,
    ("GET", W + "/commands/{command_id}"): EVERYONE,
    ("POST", W + "/commands/{command_id}/report"): WORKERS,
    ("GET", W + "/operations/{operation_id}"): EVERYONE,
    ("GET", W + "/jobs"): READERS,
    ("GET", W + "/devices"): READERS,
    ("GET", W + "/tokens"): READERS,
    ("POST", W + "/tokens"): frozenset((ADMIN,)),
    ("DELETE", W + "/tokens/{token_id}"): frozenset((ADMIN,)),
    ("GET", W + "/audit"): READERS,
    ("GET", W + "/events"): READERS,
    ("POST", W + "/waits"): frozenset((ADMIN,)),
    ("GET", W + "/waits"): READERS,
    ("GET", W + "/waits/{wait_id}"): READERS,
    ("DELETE", W + "/waits/{wait_id}"): frozenset((ADMIN,)),
    ("PUT", W + "/processes/{process_id}/priority"): frozenset((ADMIN,)),
    ("POST", W + "/placements"): WORKERS,
    ("GET", W + "/placements"): EVERYONE,
    ("GET", W + "/placements/{placement_id}"): EVERYONE,
    ("POST", W + "/placements/{placement_id}/report"): WORKERS,
    ("DELETE", W + "/placements/{placement_id}"): WORKERS,
    ("POST", W + "/drains"): frozenset((ADMIN,)),
    ("GET", W + "/drains"): READERS,
    ("GET", W + "/drains/{drain_id}"): READERS,
    ("DELETE", W + "/drains/{drain_id}"): frozenset((ADMIN,)),
}


class Workspace:
    """The default workspace of a live server, with a token of each role (minted by its first,
    an admin token) and a helper per HTTP method."""

    def __init__(self, server: LiveServer) -> None:
        assert server.token
        self.url = server.url
        self.base = f"{server.url}/api/w/default"
        self.tokens = {ADMIN: server.token}
        for role in (JOB, VIEWER):
            self.tokens[role] = self.mint(ADMIN, role, name=f"the {role}")["token"]

    def call(self, role_or_token: str, method: str, path: str, json: Any = None, **kw: Any) -> requests.Response:
        token = self.tokens.get(role_or_token, role_or_token)
        return requests.request(
            method,
            self.base + path,
            json=json,
            headers={"Authorization": f"Bearer {token}"},
            timeout=kw.pop("timeout", 10),
            **kw,
        )

    def mint(self, by: str, role: str, name: str = "") -> dict[str, Any]:
        r = self.call(by, "POST", "/tokens", {"name": name, "role": role})
        assert r.status_code == 201, r.text
        return dict(r.json())

    def register(self, role: str, body: dict[str, Any]) -> None:
        r = self.call(role, "POST", "/processes", body)
        assert r.status_code in (200, 201), r.text

    def command(self, process_id: str, kind: str = "pause") -> dict[str, Any]:
        r = self.call(ADMIN, "POST", "/commands", {"kind": kind, "process_id": process_id})
        assert r.status_code == 201, r.text
        return dict(r.json())


@pytest.fixture
def live(live_server: LiveServer) -> Workspace:
    return Workspace(live_server)


def _refused(r: requests.Response, needed: str) -> None:
    assert r.status_code == 403, (r.status_code, r.text)
    body = r.json()
    assert body["error"] == "forbidden" and f"needs a token with role {needed}" in body["message"], body
    assert "flexium token issue default --role" in body["message"]  # says what to do


def test_every_operation_admits_the_roles_it_should(live: Workspace) -> None:
    paths = requests.get(live.url + "/openapi.json", timeout=10).json()["paths"]
    operations = {(method.upper(), path) for path, item in paths.items() if path.startswith("/api/") for method in item}
    assert operations == set(ALLOWED), "an API operation the role matrix does not know"

    # The job token's own things: a process, and the two ranks of a job (their operation).
    live.register(JOB, process_body("gpu-1"))
    for rank in (0, 1):
        live.register(JOB, rank_body(rank))
    command = live.command("gpu-1")
    operation_id = live.command("rank-0")["job"]["operation_id"]

    def disposable(role: str, prefix: str) -> str:
        """A process of the job token's, for an operation that uses one up."""
        process_id = f"{prefix}-{role}"
        live.register(JOB, process_body(process_id, host=f"host-{prefix}-{role}"))
        return process_id

    def throwaway_token(_role: str) -> int:
        return int(live.mint(ADMIN, VIEWER)["id"])

    def paused(role: str, prefix: str) -> str:
        process_id = f"{prefix}-{role}"
        full = [gpu(i, used=140 * GIB) for i in range(2)]  # no room: it stays waiting
        body = process_body(
            process_id, host=f"host-{prefix}-{role}", state="PAUSED", memory=0, footprint_bytes=GIB, devices=full
        )
        live.register(JOB, body)
        return process_id

    def waiting(role: str) -> int:
        r = live.call(ADMIN, "POST", "/waits", {"process_id": paused(role, "waiting")})
        assert r.status_code == 201, r.text
        return int(r.json()["wait"]["id"])

    wait_id = waiting("seen")

    def placement(role: str) -> dict[str, object]:
        return {"host": f"host-placed-{role}", "devices": [gpu(0)], "command": "python train.py"}

    def placed_by_job(_role: str) -> int:
        """A placement of the job token's (a job token reads and ends only its own)."""
        r = live.call(JOB, "POST", "/placements", placement("job"))
        assert r.status_code == 201, r.text
        return int(r.json()["placement"]["id"])

    placement_id = placed_by_job("seen")

    def drained(role: str) -> int:
        paused(role, "undrain")
        r = live.call(ADMIN, "POST", "/drains", {"host": f"host-undrain-{role}", "gpu": 1})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    drain_id = drained("seen")

    def events(role: str) -> requests.Response:
        with live.call(role, "GET", "/events", stream=True, timeout=5) as r:
            if r.status_code != 200:
                r.content  # noqa: B018 - read the refusal before the connection closes
            return r

    calls: dict[tuple[str, str], Callable[[str], requests.Response]] = {
        ("GET", W): lambda role: live.call(role, "GET", ""),
        ("POST", W + "/processes"): lambda role: live.call(role, "POST", "/processes", process_body(f"new-{role}")),
        ("GET", W + "/processes"): lambda role: live.call(role, "GET", "/processes"),
        ("GET", W + "/processes/{process_id}"): lambda role: live.call(role, "GET", "/processes/gpu-1"),
        ("DELETE", W + "/processes/{process_id}"): lambda role: live.call(
            role, "DELETE", f"/processes/{disposable(role, 'gone')}"
        ),
        ("GET", W + "/processes/{process_id}/targets"): lambda role: live.call(role, "GET", "/processes/gpu-1/targets"),
        ("POST", W + "/processes/{process_id}/heartbeat"): lambda role: live.call(
            role, "POST", "/processes/gpu-1/heartbeat", {}
        ),
        ("GET", W + "/processes/{process_id}/commands/next"): lambda role: live.call(
            role, "GET", "/processes/gpu-1/commands/next?wait=0"
        ),
        ("POST", W + "/commands"): lambda role: live.call(
            role, "POST", "/commands", {"kind": "pause", "process_id": disposable(role, "paused")}
        ),
        ("GET", W + "/commands"): lambda role: live.call(role, "GET", "/commands"),
        ("GET", W + "/commands/{command_id}"): lambda role: live.call(role, "GET", f"/commands/{command['id']}"),
        ("POST", W + "/commands/{command_id}/report"): lambda role: live.call(
            role, "POST", f"/commands/{command['id']}/report", {"state": "running"}
        ),
        ("GET", W + "/operations/{operation_id}"): lambda role: live.call(role, "GET", f"/operations/{operation_id}"),
        ("GET", W + "/jobs"): lambda role: live.call(role, "GET", "/jobs"),
        ("GET", W + "/devices"): lambda role: live.call(role, "GET", "/devices"),
        ("GET", W + "/tokens"): lambda role: live.call(role, "GET", "/tokens"),
        ("POST", W + "/tokens"): lambda role: live.call(role, "POST", "/tokens", {"role": VIEWER}),
        ("DELETE", W + "/tokens/{token_id}"): lambda role: live.call(
            role, "DELETE", f"/tokens/{throwaway_token(role)}"
        ),
        ("GET", W + "/audit"): lambda role: live.call(role, "GET", "/audit"),
        ("GET", W + "/events"): events,
        ("POST", W + "/waits"): lambda role: live.call(role, "POST", "/waits", {"process_id": paused(role, "queued")}),
        ("GET", W + "/waits"): lambda role: live.call(role, "GET", "/waits"),
        ("GET", W + "/waits/{wait_id}"): lambda role: live.call(role, "GET", f"/waits/{wait_id}"),
        ("DELETE", W + "/waits/{wait_id}"): lambda role: live.call(role, "DELETE", f"/waits/{waiting(role)}"),
        ("PUT", W + "/processes/{process_id}/priority"): lambda role: live.call(
            role, "PUT", "/processes/gpu-1/priority", {"priority": "high"}
        ),
        ("POST", W + "/drains"): lambda role: live.call(
            role, "POST", "/drains", {"host": f"host-drain-{role}"} if paused(role, "drain") else {}
        ),
        ("GET", W + "/drains"): lambda role: live.call(role, "GET", "/drains"),
        ("GET", W + "/drains/{drain_id}"): lambda role: live.call(role, "GET", f"/drains/{drain_id}"),
        ("DELETE", W + "/drains/{drain_id}"): lambda role: live.call(role, "DELETE", f"/drains/{drained(role)}"),
        ("POST", W + "/placements"): lambda role: live.call(role, "POST", "/placements", placement(role)),
        ("GET", W + "/placements"): lambda role: live.call(role, "GET", "/placements"),
        ("GET", W + "/placements/{placement_id}"): lambda role: live.call(role, "GET", f"/placements/{placement_id}"),
        ("POST", W + "/placements/{placement_id}/report"): lambda role: live.call(
            role, "POST", f"/placements/{placement_id}/report", {"devices": [gpu(0)]}
        ),
        ("DELETE", W + "/placements/{placement_id}"): lambda role: live.call(
            role, "DELETE", f"/placements/{placed_by_job(role)}"
        ),
    }
    assert set(calls) == set(ALLOWED)
    seen: dict[tuple[str, str, str], int] = {}
    for operation, allowed in ALLOWED.items():
        for role in (ADMIN, JOB, VIEWER):
            r = calls[operation](role)
            seen[(*operation, role)] = r.status_code
            if role in allowed:
                assert 200 <= r.status_code < 300, (operation, role, r.status_code, r.text)
            else:
                _refused(r, " or ".join(sorted(allowed, key=(ADMIN, JOB, VIEWER).index)))
    assert len(seen) == 3 * len(ALLOWED)


def test_a_job_token_acts_only_on_the_processes_it_registered(live: Workspace) -> None:
    live.register(ADMIN, process_body("adm-1", host="admin-node"))
    live.register(ADMIN, rank_body(0, key="run-other", process_id="o-0"))
    live.register(ADMIN, rank_body(1, key="run-other", process_id="o-1"))
    command = live.command("adm-1")
    operation_id = live.command("o-0")["job"]["operation_id"]

    def not_yours(r: requests.Response) -> None:
        assert r.status_code == 403, r.text
        assert "a job token acts only on" in r.json()["message"]

    for _ in range(2):  # the second heartbeat would be answered from memory: refused there too
        not_yours(live.call(JOB, "POST", "/processes/adm-1/heartbeat", {}))
    not_yours(live.call(JOB, "GET", "/processes/adm-1"))
    not_yours(live.call(JOB, "GET", "/processes/adm-1/targets"))
    not_yours(live.call(JOB, "GET", "/processes/adm-1/commands/next?wait=0"))
    not_yours(live.call(JOB, "DELETE", "/processes/adm-1"))
    not_yours(live.call(JOB, "POST", "/processes", process_body("adm-1", host="admin-node")))  # no takeover
    not_yours(live.call(JOB, "GET", f"/commands/{command['id']}"))
    not_yours(live.call(JOB, "POST", f"/commands/{command['id']}/report", {"state": "failed", "error": "x"}))
    not_yours(live.call(JOB, "GET", f"/operations/{operation_id}"))
    # nothing changed: the command is still the admin's to run, the process still there
    assert live.call(ADMIN, "GET", f"/commands/{command['id']}").json()["state"] == "queued"
    assert live.call(ADMIN, "GET", "/processes/adm-1").status_code == 200
    # its own process, registered again after a restart, stays its own
    live.register(JOB, process_body("mine"))
    live.register(JOB, process_body("mine"))
    for _ in range(2):
        assert live.call(JOB, "POST", "/processes/mine/heartbeat", {}).status_code == 200
    # another job token is another job
    other_job = live.mint(ADMIN, JOB)["token"]
    not_yours(live.call(other_job, "POST", "/processes/mine/heartbeat", {}))


def test_a_viewer_and_a_job_cannot_mint_or_revoke(live: Workspace) -> None:
    admin_id = next(t["id"] for t in live.call(ADMIN, "GET", "/tokens").json() if t["role"] == ADMIN)
    for role in (JOB, VIEWER):
        _refused(live.call(role, "POST", "/tokens", {"role": JOB}), ADMIN)
        _refused(live.call(role, "DELETE", f"/tokens/{admin_id}"), ADMIN)
    assert live.call(ADMIN, "GET", "").status_code == 200  # the admin's token still works


# What a revoked token's waits take to end: within a second on an idle machine, five on one shared
# with other work (CI's has two cores); left alone they would last their whole 30 s (a stream, for
# ever).
ENDED_WITHIN_S = 5.0


def _poll(live: Workspace, token: str, process_id: str, out: dict[str, Any]) -> None:
    started = time.monotonic()
    r = live.call(token, "GET", f"/processes/{process_id}/commands/next?wait=30", timeout=40)
    out["status"], out["ended"], out["took"] = r.status_code, time.monotonic(), time.monotonic() - started


def _stream(live: Workspace, out: dict[str, Any], *, token: str | None = None, cookies: Any = None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with requests.get(live.base + "/events", headers=headers, cookies=cookies, stream=True, timeout=40) as r:
        out["status"] = r.status_code
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: hello"):
                out["open"] = time.monotonic()
            elif line.startswith("data: "):
                out.setdefault("data", []).append(json.loads(line[len("data: ") :]))
    out["ended"] = time.monotonic()


def _wait_for(condition: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_revocation_ends_streams_and_polls_within_a_second_and_cascades(live: Workspace) -> None:
    """An admin token A mints a job token J and a viewer token V; revoking A revokes J and V:
    J's waiting long-poll, V's open event stream and A's own wait for a command end within a
    second."""
    a = live.mint(ADMIN, ADMIN, name="team lead")
    j = live.mint(a["token"], JOB, name="a job")
    v = live.mint(a["token"], VIEWER, name="a screen")
    assert j["minted_by"] == a["id"] and v["minted_by"] == a["id"]
    live.register(j["token"], process_body("gpu-j"))
    live.register(j["token"], process_body("gpu-k", host="node-k"))
    command = live.call(a["token"], "POST", "/commands", {"kind": "pause", "process_id": "gpu-k"}).json()
    poll: dict[str, Any] = {}
    stream: dict[str, Any] = {}
    wait: dict[str, Any] = {}

    def wait_command() -> None:  # A waits for its command to end (what `flexium pause` does)
        r = live.call(a["token"], "GET", f"/commands/{command['id']}?wait=30", timeout=40)
        wait["status"], wait["ended"] = r.status_code, time.monotonic()

    threads = [
        threading.Thread(target=_poll, args=(live, j["token"], "gpu-j", poll)),
        threading.Thread(target=_stream, args=(live, stream), kwargs={"token": v["token"]}),
        threading.Thread(target=wait_command),
    ]
    for t in threads:
        t.start()
    _wait_for(lambda: "open" in stream, "the event stream to open")
    time.sleep(0.5)  # the polls are waiting
    assert "ended" not in poll and "ended" not in stream and "ended" not in wait

    revoked_at = time.monotonic()
    r = live.call(ADMIN, "DELETE", f"/tokens/{a['id']}")
    assert r.status_code == 200 and sorted(r.json()["cascade"]) == sorted([j["id"], v["id"]])
    for t in threads:
        t.join(10)
    assert poll["status"] == 401 and poll["ended"] - revoked_at < ENDED_WITHIN_S, poll
    assert stream["status"] == 200 and stream["ended"] - revoked_at < ENDED_WITHIN_S, stream
    assert wait["status"] == 401 and wait["ended"] - revoked_at < ENDED_WITHIN_S, wait
    for token in (a["token"], j["token"], v["token"]):
        assert live.call(token, "GET", "/processes/gpu-j").status_code == 401
    assert live.call(ADMIN, "GET", "").status_code == 200
    listed = {t["id"]: t for t in live.call(ADMIN, "GET", "/tokens").json()}
    assert all(listed[t["id"]]["revoked"] for t in (a, j, v))


def _session(live: Workspace, token: str) -> requests.Session:
    browser = requests.Session()
    r = browser.post(live.url + "/login", data={"token": token}, allow_redirects=False, timeout=10)
    assert r.status_code == 303, r.text
    return browser


def test_logout_and_revocation_end_the_dashboards_event_streams(live: Workspace) -> None:
    v = live.mint(ADMIN, VIEWER)
    kept, left = _session(live, v["token"]), _session(live, v["token"])
    streams: list[dict[str, Any]] = [{}, {}]
    threads = [
        threading.Thread(target=_stream, args=(live, out), kwargs={"cookies": browser.cookies})
        for out, browser in zip(streams, (kept, left), strict=True)
    ]
    for t in threads:
        t.start()
    _wait_for(lambda: all("open" in s for s in streams), "both dashboards' streams to open")

    logged_out = time.monotonic()
    assert left.post(live.url + "/logout", allow_redirects=False, timeout=10).status_code == 303
    threads[1].join(10)
    assert streams[1]["ended"] - logged_out < ENDED_WITHIN_S and "ended" not in streams[0]

    revoked_at = time.monotonic()
    assert live.call(ADMIN, "DELETE", f"/tokens/{v['id']}").status_code == 200
    threads[0].join(10)
    assert streams[0]["ended"] - revoked_at < ENDED_WITHIN_S
    assert kept.get(live.url + "/", allow_redirects=False, timeout=10).headers["location"] == "/login"


def test_what_ends_on_the_database_unheard_ends_its_streams_and_polls_at_the_sweep(
    swept_live_server: LiveServer,
) -> None:
    """`flexium token revoke` writes to the database, and a server on SQLite has no link to hear it: its
    sweep finds the tokens and dashboard sessions that hold a stream or a long-poll there and no longer
    open doors, and ends what they hold (on PostgreSQL the server is told at once), and tells its dashboards
    which processes those tokens registered. A session past its life (its start moved back a week) ends
    the same way, though its token lives on."""
    live = Workspace(swept_live_server)
    url = swept_live_server.database
    assert url
    j, v = live.mint(ADMIN, JOB, name="a job"), live.mint(ADMIN, VIEWER, name="a screen")
    browser = _session(live, live.tokens[VIEWER])
    live.register(j["token"], process_body("gpu-j"))
    poll: dict[str, Any] = {}
    stream: dict[str, Any] = {}
    dashboard: dict[str, Any] = {}
    threads = [
        threading.Thread(target=_poll, args=(live, j["token"], "gpu-j", poll)),
        threading.Thread(target=_stream, args=(live, stream), kwargs={"token": v["token"]}),
        threading.Thread(target=_stream, args=(live, dashboard), kwargs={"cookies": browser.cookies}),
    ]
    for t in threads:
        t.start()
    _wait_for(lambda: "open" in stream and "open" in dashboard, "the event streams to open")
    time.sleep(0.5)  # the poll is waiting

    revoked_at = time.monotonic()
    assert sorted(database_admin.revoke_token("default", j["id"], database_url=url).cascade) == []
    assert database_admin.revoke_token("default", v["token"], database_url=url).id == v["id"]
    threads[0].join(ENDED_WITHIN_S + 5)
    threads[1].join(ENDED_WITHIN_S + 5)
    assert poll["status"] == 401 and poll["ended"] - revoked_at < ENDED_WITHIN_S, poll
    assert stream["status"] == 200 and stream["ended"] - revoked_at < ENDED_WITHIN_S, stream
    assert "ended" not in dashboard  # its token and session live
    # ... and it was told that the revoked job token's process trains on unheard
    _wait_for(
        lambda: any(d.get("process", {}).get("token_revoked") for d in dashboard.get("data", [])),
        "the dashboard to hear of the process of the revoked token",
    )
    [told] = [d["process"] for d in dashboard["data"] if d.get("process", {}).get("token_revoked")]
    assert told["process_id"] == "gpu-j" and told["state"] == "RUNNING", told

    db = Database(normalize_database_url(url), threads=1)
    try:
        aged_at = time.monotonic()
        with db.session(write=True) as s:
            moved = s.execute(update(DashboardSession).values(created_at=time.time() - storage.SESSION_MAX_S - 60))
            assert moved.rowcount == 1
    finally:
        db.dispose()
    threads[2].join(ENDED_WITHIN_S + 5)
    assert dashboard["status"] == 200 and dashboard["ended"] - aged_at < ENDED_WITHIN_S, dashboard
    assert browser.get(live.url + "/", allow_redirects=False, timeout=10).headers["location"] == "/login"
    assert live.call(VIEWER, "GET", "/processes").status_code == 200  # the token itself lives

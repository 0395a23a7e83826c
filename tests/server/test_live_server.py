"""A real server process (``python -m flexium.server``, what ``flexium server`` runs) over real
HTTP: start-up output, live events, delivery latency, restart with work in flight, the
workspace command line."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import requests

from flexium.cli.main import main
from support.server import LiveServer, SimJob, process_body

pytestmark = pytest.mark.timeout(180)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Any:
    srv = LiveServer(
        database_url,
        str(tmp_path / "home"),
        "--stale-after",
        "5",
        "--device-write-interval",
        "1",
        "--sweep-interval",
        "0.5",
    )
    srv.start()
    yield srv
    srv.stop(signal.SIGKILL)


def test_start_prints_links_and_token(server: LiveServer) -> None:
    out = "\n".join(server.lines)
    assert f"dashboard {server.url}/" in out
    assert server.login_link and server.login_link.startswith(f"{server.url}/login#code=")
    assert server.token and server.token not in server.login_link  # a one-time code, never the token
    assert server.token and server.token.startswith("flx_")
    r = requests.get(f"{server.url}/api/w/default/processes", headers=_auth(server.token), timeout=5)
    assert r.status_code == 200 and r.json() == []
    r = requests.get(f"{server.url}/api/w/default/processes", timeout=5)
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert requests.get(f"{server.url}/openapi.json", timeout=5).json()["info"]["title"] == "flexium server"
    assert "flexium_processes" in requests.get(f"{server.url}/metrics", headers=_auth(server.token), timeout=5).text


def test_default_sqlite_under_home_in_wal_mode(tmp_path: Path) -> None:
    srv = LiveServer("", str(tmp_path / "home")).start()
    try:
        db = tmp_path / "home" / "server.db"
        assert db.exists() and Path(str(db) + "-wal").exists()
        assert srv.token
    finally:
        srv.stop()
    # second start: schema and workspace kept, no new token printed
    srv2 = LiveServer("", str(tmp_path / "home"), port=srv.port).start()
    try:
        assert srv2.token is None
        r = requests.get(f"{srv2.url}/api/w/default", headers=_auth(srv.token or ""), timeout=5)
        assert r.status_code == 200
    finally:
        srv2.stop()


@pytest.mark.parametrize("last_event_id", ["²".encode("latin-1"), b"12abc", b"-3"])
def test_an_event_id_that_is_not_a_number_starts_the_stream_without_replay(
    server: LiveServer, last_event_id: bytes
) -> None:
    """A Last-Event-ID of digits int() refuses ('²') gave a 500; any id that is not ASCII
    digits starts a fresh stream."""
    headers = {**_auth(server.token or ""), "Last-Event-ID": last_event_id}
    url = f"{server.url}/api/w/default/events"
    with requests.get(url, headers=headers, stream=True, timeout=30) as r:  # type: ignore[arg-type]
        assert r.status_code == 200
        first = next(line for line in r.iter_lines(decode_unicode=True) if line.startswith("event: "))
        assert first == "event: hello"


def test_sse_live_events_and_replay(server: LiveServer) -> None:
    base = f"{server.url}/api/w/default"
    headers = _auth(server.token or "")
    events: list[tuple[str, str, dict[str, Any]]] = []
    ready = threading.Event()

    def listen(extra: dict[str, str], sink: list[Any], count: int) -> None:
        with requests.get(base + "/events", headers={**headers, **extra}, stream=True, timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            eid, etype = "", ""
            for raw in r.iter_lines(decode_unicode=True):
                if raw.startswith("id: "):
                    eid = raw[4:]
                elif raw.startswith("event: "):
                    etype = raw[7:]
                elif raw.startswith("data: "):
                    sink.append((eid, etype, json.loads(raw[6:])))
                    if etype == "hello":
                        ready.set()
                    if len(sink) >= count:
                        return

    t = threading.Thread(target=listen, args=({}, events, 5), daemon=True)
    t.start()
    assert ready.wait(10)
    assert requests.post(base + "/processes", json=process_body(), headers=headers, timeout=5).status_code == 201
    cmd = requests.post(
        base + "/commands", json={"kind": "pause", "process_id": "gpu-1"}, headers=headers, timeout=5
    ).json()
    requests.get(base + "/processes/gpu-1/commands/next?wait=1", headers=headers, timeout=5)
    t.join(15)
    types = [(e[1], e[2].get("action")) for e in events]
    assert types[0] == ("hello", None)
    assert ("process", "registered") in types and ("command", "created") in types
    assert ("command", "updated") in types  # delivered
    created = next(e for e in events if e[1] == "command")
    assert created[2]["command"]["id"] == cmd["id"]
    # reconnect with Last-Event-ID: what came after it is replayed
    first_id = next(e[0] for e in events if e[1] == "process")
    replay: list[Any] = []
    ready.clear()
    t = threading.Thread(target=listen, args=({"Last-Event-ID": first_id}, replay, 3), daemon=True)
    t.start()
    t.join(15)
    after_first = [e[1] for e in events[[e[0] for e in events].index(first_id) + 1 :] if e[1] != "hello"]
    assert [e[1] for e in replay[1:]] == after_first[:2]
    # another workspace's stream never sees them
    r = requests.get(base + "/events", headers=_auth("flx_wrong"), stream=True, timeout=5)
    assert r.status_code == 401


def test_delivery_latency_over_http(server: LiveServer) -> None:
    base = f"{server.url}/api/w/default"
    headers = _auth(server.token or "")
    session = requests.Session()
    session.headers.update(headers)
    session.post(base + "/processes", json=process_body(), timeout=5)
    latencies = []
    for _ in range(10):
        got: dict[str, Any] = {}

        def poll(got: dict[str, Any] = got) -> None:
            r = requests.get(base + "/processes/gpu-1/commands/next?wait=10", headers=headers, timeout=15)
            got["t"] = time.monotonic()
            got["cmd"] = r.json()

        t = threading.Thread(target=poll)
        t.start()
        time.sleep(0.2)
        start = time.monotonic()
        cmd = session.post(base + "/commands", json={"kind": "pause", "process_id": "gpu-1"}, timeout=5).json()
        t.join(15)
        latencies.append(got["t"] - start)
        assert got["cmd"]["id"] == cmd["id"]
        session.post(f"{base}/commands/{cmd['id']}/report", json={"state": "failed", "error": "test"}, timeout=5)
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.1, latencies


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_restart_loses_nothing_and_jobs_reattach(database_url: str, tmp_path: Path, stop_signal: int) -> None:
    srv = LiveServer(database_url, str(tmp_path / "home"), "--stale-after", "5", "--device-write-interval", "1").start()
    token = srv.token or ""
    base = f"{srv.url}/api/w/default"
    admin = requests.Session()
    admin.headers.update(_auth(token))
    jobs = [SimJob(base, token, f"gpu-{i}", process_body(f"gpu-{i}", gpu_index=i, n_gpus=4)).start() for i in range(3)]
    try:
        # gpu-0 and gpu-1 are busy (not polling): their commands stay queued
        for job in jobs[:2]:
            job.accepting.clear()
        time.sleep(0.5)
        queued = [
            admin.post(base + "/commands", json={"kind": "pause", "process_id": "gpu-0"}, timeout=5).json(),
            admin.post(
                base + "/commands", json={"kind": "migrate", "process_id": "gpu-1", "target": 3}, timeout=5
            ).json(),
        ]
        assert [c["state"] for c in queued] == ["queued", "queued"]
        # gpu-2 receives its command and loses it before acknowledging
        jobs[2].drop_next = True
        lost = admin.post(base + "/commands", json={"kind": "pause", "process_id": "gpu-2"}, timeout=5).json()
        deadline = time.monotonic() + 10
        while not jobs[2].received and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admin.get(f"{base}/commands/{lost['id']}", timeout=5).json()["state"] == "delivered"

        srv.stop(stop_signal)
        time.sleep(1.0)  # jobs notice: requests fail
        srv.start()  # same database, same port
        assert srv.token is None  # nothing re-created
        for job in jobs:
            job.accepting.set()
        ids = [c["id"] for c in queued] + [lost["id"]]
        deadline = time.monotonic() + 30
        states: list[str] = []
        while time.monotonic() < deadline:
            states = [admin.get(f"{base}/commands/{i}", timeout=5).json()["state"] for i in ids]
            if states == ["succeeded"] * 3:
                break
            time.sleep(0.1)
        assert states == ["succeeded"] * 3
        assert sum(1 for c in jobs[2].received if c["id"] == lost["id"]) == 2  # redelivered
        # Each shown where its command left it; a beat that a loaded machine held past --stale-after (5 s)
        # shows one STALE for a moment, which its next beat ends: read until each is, within 10 s.
        procs: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            procs = {p["process_id"]: p for p in admin.get(base + "/processes", timeout=5).json()}
            if [procs[k]["state"] for k in sorted(procs)] == ["PAUSED", "RUNNING", "PAUSED"]:
                break
            time.sleep(0.2)
        assert sorted(procs) == ["gpu-0", "gpu-1", "gpu-2"]
        assert procs["gpu-0"]["state"] == "PAUSED" and procs["gpu-2"]["state"] == "PAUSED", procs
        assert procs["gpu-1"]["state"] == "RUNNING" and procs["gpu-1"]["gpu_uuid"] == "GPU-0003"
        restarted = time.time() - 5
        assert all(p["last_seen"] > restarted for p in procs.values())  # attached again
        assert len(admin.get(base + "/commands", timeout=5).json()) == 3
    finally:
        for job in jobs:
            job.close()
        srv.stop(signal.SIGKILL)


def test_sigterm_is_quick_with_waiting_polls_and_streams(server: LiveServer) -> None:
    base = f"{server.url}/api/w/default"
    headers = _auth(server.token or "")
    requests.post(base + "/processes", json=process_body(), headers=headers, timeout=5)
    results: list[int] = []

    def poll() -> None:
        try:
            results.append(
                requests.get(base + "/processes/gpu-1/commands/next?wait=60", headers=headers, timeout=90).status_code
            )
        except requests.RequestException:
            results.append(-1)

    def stream() -> None:
        try:
            with requests.get(base + "/events", headers=headers, stream=True, timeout=90) as r:
                for _ in r.iter_lines():
                    pass
        except requests.RequestException:
            pass

    threads = [threading.Thread(target=poll), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert server.stop(signal.SIGTERM) < 8
    for t in threads:
        t.join(10)
    assert results in ([204], [-1])


def _cli_env(server: LiveServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXIUM_")}
    env["FLEXIUM_HOME"] = str(server.home)
    return env


def _cli(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    """`flexium ARGS --database URL` in this process, with the environment and arguments a process
    would get."""
    argv = [*args, "--database", server.database] if server.database else list(args)
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, _cli_env(server), clear=True), redirect_stdout(out), redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's refusals
            status = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def test_workspace_command_line(server: LiveServer) -> None:
    """The first command runs as a process of its own (``python -m flexium.server workspace``:
    the entry point), the others in this process, with the environment and arguments a process
    would get (each process cost about 1.2 CPU-s, mostly imports)."""
    url = server.database

    def cli_process(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "flexium.server", *args]
        if url:
            cmd += ["--database", url]
        return subprocess.run(cmd, capture_output=True, text=True, env=_cli_env(server), timeout=60)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli(server, *args)

    created = cli_process("workspace", "create", "team-a")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip().splitlines()[-1]
    assert token.startswith("flx_")
    base = f"{server.url}/api/w/team-a"
    assert requests.get(base + "/processes", headers=_auth(token), timeout=5).status_code == 200
    # the default workspace's token does not open team-a, and team-a's does not open default
    assert requests.get(base + "/processes", headers=_auth(server.token or ""), timeout=5).status_code == 404
    assert requests.get(f"{server.url}/api/w/default/processes", headers=_auth(token), timeout=5).status_code == 404
    dup = cli("workspace", "create", "team-a")
    assert dup.returncode == 1 and "already exists" in dup.stderr
    issued = cli("token", "issue", "team-a", "--name", "ci", "--role", "viewer")
    assert "new viewer token" in issued.stdout
    second = issued.stdout.strip().splitlines()[-1]
    assert requests.get(base, headers=_auth(second), timeout=5).status_code == 200
    job = cli("token", "issue", "team-a", "--name", "a job").stdout.strip().splitlines()[-1]  # job: the default
    refused = requests.get(base, headers=_auth(job), timeout=5)
    assert refused.status_code == 403 and "role admin or viewer" in refused.json()["message"]
    listed = cli("token", "list", "team-a").stdout
    roles = {row.split()[3] for row in listed.splitlines()[1:]}  # under the header ID PREFIX STATE ROLE ...
    assert "ci" in listed and second not in listed and {"viewer", "job"} <= roles
    assert cli("token", "revoke", "team-a", second).returncode == 0
    deadline = time.monotonic() + 10  # the server's token cache lets it live <= 5 s
    while time.monotonic() < deadline:
        if requests.get(base, headers=_auth(second), timeout=5).status_code == 401:
            break
        time.sleep(0.2)
    assert requests.get(base, headers=_auth(second), timeout=5).status_code == 401
    assert requests.get(base, headers=_auth(token), timeout=5).status_code == 200
    # a job token's processes are named when it is revoked: they train on, unmanaged
    registered = requests.post(base + "/processes", json=process_body("gpu-a1"), headers=_auth(job), timeout=5)
    assert registered.status_code == 201, registered.text
    said = cli("token", "revoke", "team-a", job)
    assert said.returncode == 0, said.stderr
    assert "processes it registered: gpu-a1. They train on" in said.stdout, said.stdout
    assert "valid FLEXIUM_TOKEN" in said.stdout, said.stdout
    assert "team-a" in cli("workspace", "list").stdout
    assert cli("workspace", "create", "Bad Name").returncode == 1


def test_a_workspace_whose_login_link_was_lost_gets_another(server: LiveServer) -> None:
    """`flexium token link`: a one-time login as the workspace's oldest admin token by default, or
    as a token named by id; a job token and a revoked token are refused, and the audit log keeps
    each link made."""
    assert _cli(server, "workspace", "create", "team-b").returncode == 0
    _cli(server, "token", "issue", "team-b", "--role", "viewer", "--name", "wall screen")
    _cli(server, "token", "issue", "team-b", "--name", "jobs")
    listed = _cli(server, "token", "list", "team-b").stdout.splitlines()[1:]
    by_role = {row.split()[3]: row.split()[0] for row in listed}  # under the header ID PREFIX STATE ROLE ...

    def log_in(said: str) -> str:
        """The dashboard's page after logging in through the link in `said`: the link's own server."""
        found = re.search(r"^dashboard: (\S+)/login#code=(\S+)  \(works once", said, re.M)
        assert found, said
        if server.database.startswith("sqlite"):  # the server on this file says where it is
            assert found.group(1) == server.url
        with requests.Session() as browser:
            opened = browser.post(server.url + "/login", data={"code": found.group(2)}, timeout=10)
            assert opened.status_code == 200 and opened.url == server.url + "/", opened.text[-500:]
            return opened.text

    default = _cli(server, "token", "link", "team-b")
    assert default.returncode == 0, default.stderr
    assert f"token {by_role['admin']} (" in default.stdout and "role admin, in workspace 'team-b'" in default.stdout
    assert re.search(r'id="role"[^>]*>admin<', log_in(default.stdout))

    viewer = _cli(server, "token", "link", "team-b", by_role["viewer"])
    assert viewer.returncode == 0 and "wall screen" in viewer.stdout, viewer.stderr
    assert re.search(r'id="role"[^>]*>viewer<', log_in(viewer.stdout))

    job = _cli(server, "token", "link", "team-b", by_role["job"])
    assert job.returncode == 1 and "is a job token, which cannot open the dashboard" in job.stderr, job.stderr
    assert _cli(server, "token", "revoke", "team-b", by_role["viewer"]).returncode == 0
    revoked = _cli(server, "token", "link", "team-b", by_role["viewer"])
    assert revoked.returncode == 1 and "is revoked" in revoked.stderr, revoked.stderr
    missing = _cli(server, "token", "link", "team-b", "999")
    assert missing.returncode == 1 and "token not found in this workspace" in missing.stderr, missing.stderr

    admin = _cli(server, "token", "issue", "team-b", "--role", "admin").stdout.strip().splitlines()[-1]
    audit = requests.get(f"{server.url}/api/w/team-b/audit", headers=_auth(admin), timeout=10).json()
    links = [e for e in audit if e["action"] == "login_link.issued"]
    assert [e["target"].split(" (")[0] for e in links] == [f"token {by_role['viewer']}", f"token {by_role['admin']}"]


def test_stale_then_event(server: LiveServer) -> None:
    base = f"{server.url}/api/w/default"
    headers = _auth(server.token or "")
    requests.post(base + "/processes", json=process_body(), headers=headers, timeout=5)
    deadline = time.monotonic() + 15
    state = ""
    while time.monotonic() < deadline:
        state = requests.get(base + "/processes/gpu-1", headers=headers, timeout=5).json()["state"]
        if state == "STALE":
            break
        time.sleep(0.2)
    assert state == "STALE"
    r = requests.post(base + "/commands", json={"kind": "pause", "process_id": "gpu-1"}, headers=headers, timeout=5)
    assert r.status_code == 409 and r.json()["error"] == "stale"
    requests.post(base + "/processes/gpu-1/heartbeat", json={}, headers=headers, timeout=5)
    assert requests.get(base + "/processes/gpu-1", headers=headers, timeout=5).json()["state"] == "RUNNING"


def test_the_harness_starts_its_server_on_another_port_when_the_one_it_chose_is_taken(tmp_path: Path) -> None:
    """tests/support/live_server.py: a port found free can be taken by any process before the
    server binds it. An answer from that process must not pass for the server's, and a port the
    harness chose is chosen again, so a test never talks to a server that is not its own."""
    import http.server

    from support.live_server import ServerProcess, listens_on

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ServerProcess(tmp_path / "home")
    taken = server.port
    squatter = http.server.HTTPServer(("127.0.0.1", taken), Healthy)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        assert requests.get(f"http://127.0.0.1:{taken}/healthz", timeout=5).status_code == 200
        assert listens_on(os.getpid(), taken)  # the squatter is this process
        server.start()
        try:
            pid = server.proc.pid  # type: ignore[union-attr]
            assert server.port != taken and listens_on(pid, server.port) and not listens_on(pid, taken)
            assert requests.get(f"{server.url}/healthz", timeout=5).json()["status"] == "ok"
            server.check_alive()
            server.proc.kill()  # type: ignore[union-attr]  (as the OOM killer would)
            server.proc.wait()  # type: ignore[union-attr]
            with pytest.raises(AssertionError, match="exited .* by itself"):
                server.check_alive()
        finally:
            server.stop()
        server.check_alive()  # stopped by the test: nothing to say
    finally:
        squatter.shutdown()
        squatter.server_close()


def test_a_port_in_use_refuses_the_start_before_anything_is_made(tmp_path: Path) -> None:
    """The port is bound before the database, the first workspace and its tokens are made: a
    server that cannot listen leaves nothing behind, and says to choose another port."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    home = tmp_path / "home"
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXIUM_")}
        started = subprocess.run(
            [sys.executable, "-m", "flexium.cli.main", "server", "--port", str(taken.getsockname()[1])],
            env={**env, "FLEXIUM_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        taken.close()
    assert started.returncode == 1, started.stderr
    assert "address already in use" in started.stderr and "choose another with --port" in started.stderr
    assert "admin token" not in started.stdout
    assert not (home / "server.db").exists()


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_outside_the_tcp_range_is_refused(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--port", port]) == 2
    assert "--port must be a TCP port, 1 to 65535" in capsys.readouterr().err


def test_a_database_that_is_not_there_is_made_only_to_create_a_workspace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --database (or FLEXIUM_HOME) must not make a database no server uses: reads and
    tokens are refused naming where it was looked for; creating a workspace makes it, and says where."""
    url = f"sqlite:///{tmp_path / 'typo' / 'server.db'}"
    for argv in (["workspace", "list"], ["token", "list", "team"], ["token", "issue", "team"]):
        assert main([*argv, "--database", url]) == 1
        assert f"no database at {tmp_path / 'typo' / 'server.db'}" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists() or not any((tmp_path / "typo").iterdir())
    assert main(["workspace", "create", "team", "--database", url]) == 0
    assert f"created workspace 'team' in the database {url}" in capsys.readouterr().out
    assert main(["workspace", "list", "--database", url]) == 0
    assert capsys.readouterr().out.splitlines() == ["team"]

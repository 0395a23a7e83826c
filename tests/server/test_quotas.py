"""Per-workspace quotas on a real server process (options given on its command line): each
refusal is a 4xx that names the limit and the option that raises it, and nothing is stored."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from support.server import LiveServer, process_body

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    srv = LiveServer(
        database_url,
        str(tmp_path / "home"),
        "--max-processes",
        "2",
        "--max-tokens",
        "3",
        "--max-payload-bytes",
        "2000",
    ).start()
    yield srv
    srv.stop(signal.SIGKILL)


def _session(token: str) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    return session


def _api(server: LiveServer) -> str:
    return f"{server.url}/api/w/default"


def _refusal(r: requests.Response, status: int, code: str, option: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == code
    assert option in body["message"]
    return body


def test_processes_per_workspace(server: LiveServer) -> None:
    assert server.token
    s = _session(server.token)
    for name in ("p-1", "p-2"):
        assert s.post(f"{_api(server)}/processes", json=process_body(name), timeout=10).status_code == 201
    r = s.post(f"{_api(server)}/processes", json=process_body("p-3"), timeout=10)
    body = _refusal(r, 409, "quota_exceeded", "--max-processes or FLEXIUM_MAX_PROCESSES")
    assert "the workspace has 2 processes, its limit" in body["message"]
    assert body["detail"] == {"limit": "max_processes", "value": 2}
    # a process already registered registers again (a restart of its job): not a new one
    assert s.post(f"{_api(server)}/processes", json=process_body("p-1"), timeout=10).status_code == 200
    assert s.delete(f"{_api(server)}/processes/p-2", timeout=10).status_code == 204
    assert s.post(f"{_api(server)}/processes", json=process_body("p-3"), timeout=10).status_code == 201
    listed = sorted(p["process_id"] for p in s.get(f"{_api(server)}/processes", timeout=10).json())
    assert listed == ["p-1", "p-3"]


def test_tokens_per_workspace(server: LiveServer) -> None:
    assert server.token
    s = _session(server.token)
    first_start = s.get(f"{_api(server)}/tokens", timeout=10).json()
    assert len(first_start) == 2  # the admin token and the job token the first start printed
    third = s.post(f"{_api(server)}/tokens", json={"name": "third"}, timeout=10)
    assert third.status_code == 201, third.text
    r = s.post(f"{_api(server)}/tokens", json={"name": "fourth"}, timeout=10)
    body = _refusal(r, 409, "quota_exceeded", "--max-tokens or FLEXIUM_MAX_TOKENS")
    assert "3 tokens neither revoked nor expired" in body["message"]
    assert len(s.get(f"{_api(server)}/tokens", timeout=10).json()) == 3
    assert s.delete(f"{_api(server)}/tokens/{third.json()['id']}", timeout=10).status_code in (200, 204)
    assert s.post(f"{_api(server)}/tokens", json={"name": "fourth"}, timeout=10).status_code == 201


def test_payload_bytes_of_capabilities_and_results(server: LiveServer) -> None:
    assert server.token
    s = _session(server.token)
    big = ["a problem, described at length " + "x" * 500 for _ in range(5)]  # ~2.7 kB of JSON
    r = s.post(
        f"{_api(server)}/processes",
        json=process_body("caps", capabilities={"pause_resume": True, "migration": True, "problems": big}),
        timeout=10,
    )
    body = _refusal(r, 413, "payload_too_large", "--max-payload-bytes or FLEXIUM_MAX_PAYLOAD_BYTES")
    assert body["message"].startswith("the process's capabilities is ")
    assert body["detail"]["limit"] == "max_payload_bytes" and body["detail"]["size"] > 2000
    assert s.get(f"{_api(server)}/processes", timeout=10).json() == []

    assert s.post(f"{_api(server)}/processes", json=process_body("job"), timeout=10).status_code == 201
    cmd = s.post(f"{_api(server)}/commands", json={"kind": "pause", "process_id": "job"}, timeout=10)
    assert cmd.status_code == 201, cmd.text
    command_id = cmd.json()["id"]
    report = f"{_api(server)}/commands/{command_id}/report"
    r = s.post(report, json={"state": "succeeded", "result": {"notes": big}}, timeout=10)
    assert r.status_code == 200, r.text  # a final report is taken whatever its size: its result cut
    (note,) = r.json()["result"]["notes"]
    assert note.startswith("cut by the server: the command's result is ") and "--max-payload-bytes" in note
    assert s.get(f"{_api(server)}/commands/{command_id}", timeout=10).json()["state"] == "succeeded"


def test_the_token_command_keeps_the_quota_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flexium token issue` works on the database directly: FLEXIUM_MAX_TOKENS applies there as
    in the server."""
    from flexium.cli.main import main

    database = f"sqlite:///{tmp_path / 'admin.db'}"
    monkeypatch.setenv("FLEXIUM_MAX_TOKENS", "2")
    assert main(["workspace", "create", "team", "--database", database]) == 0
    assert main(["token", "issue", "team", "--database", database]) == 0
    capsys.readouterr()
    assert main(["token", "issue", "team", "--database", database]) != 0
    err = capsys.readouterr().err
    assert "the workspace has 2 tokens neither revoked nor expired, its limit" in err and "FLEXIUM_MAX_TOKENS" in err
    monkeypatch.setenv("FLEXIUM_MAX_TOKENS", "3")
    assert main(["token", "issue", "team", "--database", database]) == 0

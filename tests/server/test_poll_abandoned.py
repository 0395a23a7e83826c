"""Long-polls a job gives up on, over real HTTP: a server that answers late must not hand a command
to a connection its client closed, for then the job never receives it (it waits for its next poll's
delivery, which meets the same backlog, until the command expires)."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from support.server import LiveServer, process_body

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Any:
    srv = LiveServer(database_url, str(tmp_path / "home"), "--stale-after", "30", "--sweep-interval", "0.5")
    srv.start()
    yield srv
    srv.stop(signal.SIGKILL)


def _abandoned_poll(server: LiveServer, process_id: str, wait: float) -> None:
    """A long-poll sent on a raw connection, closed by its client half a second later (as a job
    closes one whose answer is later than it waits for)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(
            (
                f"GET /api/w/default/processes/{process_id}/commands/next?wait={wait} HTTP/1.1\r\n"
                f"Host: {host}\r\nAuthorization: Bearer {server.token}\r\n\r\n"
            ).encode()
        )
        time.sleep(0.5)
    time.sleep(0.5)  # the server sees the connection close


def test_a_poll_given_up_by_its_client_hands_out_nothing(server: LiveServer) -> None:
    base = f"{server.url}/api/w/default"
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {server.token}"
    assert api.post(base + "/processes", json=process_body(), timeout=5).status_code == 201
    _abandoned_poll(server, "gpu-1", wait=20)
    command = api.post(base + "/commands", json={"kind": "pause", "process_id": "gpu-1"}, timeout=5).json()
    time.sleep(0.5)
    left = api.get(f"{base}/commands/{command['id']}", timeout=5).json()
    assert (left["state"], left["deliveries"], left["delivered_at"]) == ("queued", 0, None)
    got = api.get(base + "/processes/gpu-1/commands/next?wait=5", timeout=10).json()
    assert (got["id"], got["state"], got["deliveries"]) == (command["id"], "delivered", 1)


def test_a_command_waiting_before_an_abandoned_poll_goes_to_the_next_one(server: LiveServer) -> None:
    base = f"{server.url}/api/w/default"
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {server.token}"
    assert api.post(base + "/processes", json=process_body(), timeout=5).status_code == 201
    command = api.post(base + "/commands", json={"kind": "pause", "process_id": "gpu-1"}, timeout=5).json()
    got = api.get(base + "/processes/gpu-1/commands/next?wait=5", timeout=10).json()
    assert (got["id"], got["deliveries"]) == (command["id"], 1)
    _abandoned_poll(server, "gpu-1", wait=20)  # answered at once, maybe before the client closed
    again = api.get(base + "/processes/gpu-1/commands/next?wait=5", timeout=10).json()
    assert again["id"] == command["id"] and again["state"] == "delivered"
    report = api.post(f"{base}/commands/{command['id']}/report", json={"state": "running"}, timeout=5)
    assert report.status_code == 200 and report.json()["state"] == "running"

"""Nothing depends on a client reaching the same replica twice, so a load balancer needs no sticky
routing (docs/guide/server.md): here each request of a client goes to the other replica than its
last (two apps on uvicorn in this process, one PostgreSQL database). A dashboard session opened
on one serves pages, live events and a command on the other, and its logout on one ends it on
both; a job registers on one, heartbeats on the other, takes a command from one and reports it to
the other, while the command line that sent it through one waits for it on the other. (An event
stream resumed on the other replica with Last-Event-ID: tests/server/test_replicas.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from flexium import protocol
from support.replica_apps import EventStream, Replica, auth, two_replicas
from support.server import make_settings, process_body

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)]

WAIT_S = 20.0  # the long-polls' wait: an answer well before it was woken from the other replica


@pytest.fixture
def replicas(database_url_at_head: str) -> Iterator[tuple[Replica, Replica]]:
    # No sweep in the test's time, tokens trusted from the cache for a minute: what a replica
    # learns of the other's work, it learns from the database or the link.
    with two_replicas(make_settings(database_url_at_head, token_cache_s=60.0, sweep_interval_s=3600.0)) as pair:
        yield pair


def test_a_dashboard_session_opened_on_one_replica_serves_on_the_other_and_ends_on_both(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    login = requests.post(f"{a.url}/login", data={"token": a.token}, allow_redirects=False, timeout=10)
    assert login.status_code == 303, login.text
    cookies = {protocol.SESSION_COOKIE: login.cookies[protocol.SESSION_COOKIE]}
    page = requests.get(f"{b.url}/", cookies=cookies, allow_redirects=False, timeout=10)
    assert page.status_code == 200, page.status_code
    stream = EventStream(b, None, cookies=cookies)
    try:
        assert a.post("/processes", process_body("gpu-5")).status_code == 201
        stream.wait_for(lambda e: e[1] == protocol.EVENT_PROCESS, "b's event of a's registration")
        # the dashboard's pause button, on the replica that did not open the session
        paused = requests.post(
            f"{b.api}/commands",
            json={"kind": "pause", "process_id": "gpu-5"},
            cookies=cookies,
            headers={protocol.CSRF_HEADER: "1"},
            timeout=10,
        )
        assert paused.status_code == 201, paused.text
        logout = requests.post(f"{a.url}/logout", cookies=cookies, allow_redirects=False, timeout=10)
        assert logout.status_code == 303, logout.text
        assert stream.ended.wait(10), "b's stream of the session logged out on a did not end"
        after = requests.get(f"{b.api}/processes", cookies=cookies, timeout=10)
        assert after.status_code == 401, after.text
    finally:
        stream.close()


def test_a_job_and_the_command_line_at_a_different_replica_each_request(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    process_id = "gpu-9"
    assert a.post("/processes", process_body(process_id)).status_code == 201
    beat = b.post(f"/processes/{process_id}/heartbeat", {"state": "RUNNING", "seq": time.monotonic_ns()})
    assert beat.status_code == 200, beat.text

    answers: dict[str, Any] = {}

    def ask(name: str, replica: Replica, path: str) -> threading.Thread:
        def run() -> None:
            started = time.monotonic()
            answers[name] = requests.get(
                replica.api + path, params={"wait": WAIT_S}, headers=auth(replica.token), timeout=WAIT_S + 10
            )
            answers[name + " took"] = time.monotonic() - started

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    poll = ask("poll", a, f"/processes/{process_id}/commands/next")
    time.sleep(0.5)  # the job's poll waits on a
    created = b.post("/commands", {"kind": "pause", "process_id": process_id})
    assert created.status_code == 201, created.text
    command_id = created.json()["id"]
    poll.join(WAIT_S + 15)
    assert answers["poll"].status_code == 200 and answers["poll"].json()["id"] == command_id, answers["poll"].text
    assert answers["poll took"] < WAIT_S / 2, answers["poll took"]

    waiting = ask("wait", a, f"/commands/{command_id}")  # the command line's --wait, on a
    time.sleep(0.5)
    assert b.post(f"/commands/{command_id}/report", {"state": "running"}).status_code == 200
    report = {
        "state": "succeeded",
        "process": {"state": "PAUSED", "seq": time.monotonic_ns()},
        "result": {"kind": "pause", "path": "driver", "ok": True, "seconds": 0.01},
    }
    assert b.post(f"/commands/{command_id}/report", report).status_code == 200
    waiting.join(WAIT_S + 15)
    assert answers["wait"].status_code == 200 and answers["wait"].json()["state"] == "succeeded", answers["wait"].text
    assert answers["wait took"] < WAIT_S / 2, answers["wait took"]

    # What b stored, a answers: the job's state, and no command left for its next poll (on b).
    assert a.get(f"/processes/{process_id}").json()["state"] == "PAUSED"
    beat = a.post(f"/processes/{process_id}/heartbeat", {"state": "PAUSED", "seq": time.monotonic_ns()})
    assert beat.status_code == 200, beat.text
    empty = b.get(f"/processes/{process_id}/commands/next", params={"wait": 1})
    assert empty.status_code == 204, empty.text

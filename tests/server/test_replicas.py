"""Two server replicas on one PostgreSQL database, each an app on its own uvicorn server in this
process with its own replica link, over real HTTP: a command created through one reaches a job
long-polling on the other within 100 ms; a dashboard's event stream on one gets the events of
changes made through the other; a token revoked through one is refused by the other at once, its
streams there ended; an event id of the other replica gets a resync; a replica whose link the
database cut (pg_terminate_backend) listens again and reads again what it may have missed; a job
queued through one is told what to watch, and resumed, by the other."""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests

from flexium import protocol
from flexium.server import database_admin
from flexium.server.replica_link import CHANNEL, LISTEN, conninfo
from flexium.server.storage import get_workspace, revoke_token
from support.live_server import wait_until
from support.replica_apps import EventStream, Replica, auth, two_replicas
from support.server import GIB, LiveServer, gpu, make_settings, process_body

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)]

DELIVERY_LIMIT_S = 0.100
APPLY_DELAY_S = 0.3  # b applies what its link hears this late (under the revocation's 1 s wait)


@pytest.fixture
def replicas(database_url_at_head: str) -> Iterator[tuple[Replica, Replica]]:
    # No sweep in the test's time, and tokens trusted from the cache for a minute: what a replica
    # learns of the other's work, it learns from the link alone.
    settings = make_settings(database_url_at_head, token_cache_s=60.0, sweep_interval_s=3600.0)
    with two_replicas(settings) as pair:
        yield pair


def test_a_command_created_through_one_replica_reaches_a_poll_on_the_other_within_100_ms(
    database_url_at_head: str, tmp_path: Path
) -> None:
    """Two ``flexium server`` processes. From the command's creation (its row's time) to its arrival
    at the job polling the other replica (one machine, one clock), judged on the median of seven as
    tests/e2e judges delivery: one in a few may wait for a core on a loaded machine."""
    options = ("--sweep-interval", "3600")  # no sweep finds the command for the other
    a = LiveServer(database_url_at_head, str(tmp_path / "a"), *options).start()
    b = LiveServer(database_url_at_head, str(tmp_path / "b"), *options)
    try:
        b.start()
        token = a.token or ""
        on_a, on_b = f"{a.url}/api/w/default", f"{b.url}/api/w/default"
        assert requests.post(on_a + "/processes", json=process_body(), headers=auth(token), timeout=10).ok
        latencies = []
        for _ in range(7):
            got: dict[str, Any] = {}

            def poll(got: dict[str, Any] = got) -> None:
                url = on_b + "/processes/gpu-1/commands/next?wait=10"
                answer = requests.get(url, headers=auth(token), timeout=15)
                got["at"] = time.time()
                got["command"] = answer.json()

            poller = threading.Thread(target=poll)
            poller.start()
            time.sleep(0.5)  # the poll waits on b (without the link it would wait its 10 s out)
            body = {"kind": "pause", "process_id": "gpu-1"}
            command = requests.post(on_a + "/commands", json=body, headers=auth(token), timeout=10).json()
            poller.join(15)
            assert got["command"]["id"] == command["id"], got
            latencies.append(got["at"] - command["created_at"])
            report = {"state": "failed", "error": "test"}
            url = f"{on_a}/commands/{command['id']}/report"
            assert requests.post(url, json=report, headers=auth(token), timeout=10).ok
    finally:
        for server in (a, b):
            server.stop(signal.SIGKILL)
    print(
        f"\nFIGURES replicas: command created through a -> at the job polling b: median "
        f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
    )
    assert statistics.median(latencies) < DELIVERY_LIMIT_S, latencies


def test_a_dashboard_stream_on_one_replica_gets_the_events_of_changes_made_through_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    stream = EventStream(b, b.token)
    try:
        assert a.post("/processes", process_body("gpu-7")).status_code == 201
        registered = stream.wait_for(lambda e: e[1] == protocol.EVENT_PROCESS, "b's event of a's registration")
        assert registered[2]["action"] == "registered" and registered[2]["process"]["process_id"] == "gpu-7"
        assert registered[0].startswith(b.ctx.bus.tag + "-")  # numbered by b, as b's own events are
        command = a.post("/commands", {"kind": "pause", "process_id": "gpu-7"}).json()
        created = stream.wait_for(lambda e: e[1] == protocol.EVENT_COMMAND, "b's event of a's command")
        assert created[2]["action"] == "created" and created[2]["command"]["id"] == command["id"]
        # An event too large for a notification (a command's long result) reaches b as a resync.
        assert a.ctx.loop is not None
        workspace_id = a.ctx.db.run(get_workspace, write=False, name="default").id
        big = {"result": "x" * 10_000}
        a.ctx.loop.call_soon_threadsafe(a.ctx.publish, workspace_id, protocol.EVENT_COMMAND, big)
        stream.wait_for(lambda e: e[1] == protocol.EVENT_RESYNC, "b's resync for a's event too large to tell")
    finally:
        stream.close()


def test_an_event_id_of_the_other_replica_gets_a_resync_and_one_of_its_own_a_replay(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    on_a, on_b = EventStream(a, a.token), EventStream(b, b.token)
    try:
        for n in range(3):
            assert a.post("/processes", process_body(f"gpu-{n}")).status_code == 201
        for stream in (on_a, on_b):
            stream.wait_for(lambda e: e[2].get("process", {}).get("process_id") == "gpu-2", "the third registration")
        first_on_a = next(e[0] for e in on_a.events if e[1] == protocol.EVENT_PROCESS)
        first_on_b = next(e[0] for e in on_b.events if e[1] == protocol.EVENT_PROCESS)
        # The same event, numbered alike by both (each counts from one): only the tag tells them apart.
        assert first_on_a.rsplit("-", 1)[1] == first_on_b.rsplit("-", 1)[1] and first_on_a != first_on_b
    finally:
        on_a.close()
        on_b.close()
    foreign = EventStream(b, b.token, last_event_id=first_on_a)
    own = EventStream(b, b.token, last_event_id=first_on_b)
    try:
        foreign.wait_for(lambda e: e[1] == protocol.EVENT_RESYNC, "a resync for a's id")
        assert [e[1] for e in foreign.events] == [protocol.EVENT_HELLO, protocol.EVENT_RESYNC]
        after = [e[1] for e in on_b.events[[e[0] for e in on_b.events].index(first_on_b) + 1 :]]
        wait_until(lambda: len(own.events) == 1 + len(after), 10, "the replay of what came after b's id")
        assert [e[1] for e in own.events] == [protocol.EVENT_HELLO, *after] and protocol.EVENT_RESYNC not in after
    finally:
        foreign.close()
        own.close()


def test_a_token_revoked_through_one_replica_is_refused_by_the_other_at_once(
    replicas: tuple[Replica, Replica],
) -> None:
    """Through a's API, and by the command line (``flexium token revoke``) on the database."""
    a, b = replicas
    for n, by_command_line in enumerate((False, False, True)):
        issued = a.post("/tokens", {"name": f"viewer {n}", "role": protocol.ROLE_VIEWER}).json()
        token, token_id = issued["token"], issued["id"]
        assert b.get("/processes", token=token).status_code == 200  # cached by b from now on
        stream = EventStream(b, token)
        try:
            if by_command_line:
                database_admin.revoke_token("default", token_id, database_url=a.ctx.db.url)
            else:
                revoked = requests.delete(f"{a.api}/tokens/{token_id}", headers=auth(a.token), timeout=10)
                assert revoked.status_code == 200, revoked.text
            refused = b.get("/processes", token=token)
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized", (
                by_command_line,
                refused.text,
            )
            assert stream.ended.wait(5), "b kept the revoked token's event stream open"
        finally:
            stream.close()


def test_a_revocation_returns_once_the_other_replica_applied_it(
    replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delivered to a replica's socket is not yet in force there: with b slow to apply what its link
    hears, a revocation through a and one by the command line each return only once b applied it,
    so b refuses the token as soon as either returned."""
    a, b = replicas
    link = b.ctx.link
    assert link is not None
    deliver = link._deliver

    def slowly(sender: str, message: Any) -> None:
        link._loop.call_later(APPLY_DELAY_S, deliver, sender, message)

    monkeypatch.setattr(link, "_deliver", slowly)
    for n, by_command_line in enumerate((False, True)):
        issued = a.post("/tokens", {"name": f"viewer {n}", "role": protocol.ROLE_VIEWER}).json()
        token, token_id = issued["token"], issued["id"]
        assert b.get("/processes", token=token).status_code == 200  # cached by b from now on
        started = time.monotonic()
        if by_command_line:
            database_admin.revoke_token("default", token_id, database_url=a.ctx.db.url)
        else:
            revoked = requests.delete(f"{a.api}/tokens/{token_id}", headers=auth(a.token), timeout=10)
            assert revoked.status_code == 200, revoked.text
        took = time.monotonic() - started
        refused = b.get("/processes", token=token)
        assert refused.status_code == 401, (by_command_line, took, refused.text)
        assert took >= APPLY_DELAY_S, (by_command_line, took)


def test_a_replica_whose_link_the_database_cut_listens_again_and_reads_again(
    replicas: tuple[Replica, Replica], database_url_at_head: str
) -> None:
    a, b = replicas
    assert b.ctx.link is not None
    issued = a.post("/tokens", {"name": "viewer", "role": protocol.ROLE_VIEWER}).json()
    assert b.get("/processes", token=issued["token"]).status_code == 200  # cached by b
    stream = EventStream(b, b.token)
    try:
        # Revoked on the database without a word to the replicas (as if the word were lost).
        workspace = a.ctx.db.run(get_workspace, write=False, name="default")
        a.ctx.db.run(revoke_token, write=True, workspace_id=workspace.id, token_id=issued["id"], now=time.time())
        assert b.get("/processes", token=issued["token"]).status_code == 200  # b's cache still trusts it
        listener = b.ctx.link.connection_name(LISTEN)
        seen = len(stream.events)
        with psycopg.connect(conninfo(b.ctx.db.url), autocommit=True) as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s AND query = %s",
                (listener, f"LISTEN {CHANNEL}"),
            ).fetchall()
        assert ended == [(True,)], ended
        wait_until(
            lambda: any(e[1] == protocol.EVENT_RESYNC for e in stream.events[seen:]),
            15,
            "b's dashboards told to reload",
        )
        assert b.ctx.link.listening.is_set()
        assert b.get("/processes", token=issued["token"]).status_code == 401  # read again: revoked
        # And it hears the other replica again.
        assert a.post("/processes", process_body("gpu-9")).status_code == 201
        stream.wait_for(lambda e: e[2].get("process", {}).get("process_id") == "gpu-9", "a's registration after")
    finally:
        stream.close()


def test_a_job_queued_through_one_replica_is_answered_and_resumed_by_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    """The queue's view is the other replica's too: its heartbeat there says what to watch, and the
    room it then sees, reported there, resumes it (no sweep runs in the test's time)."""
    a, b = replicas
    full = [gpu(0, used=139 * GIB)]
    body = process_body("paused-1", state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=full)
    assert a.post("/processes", body).status_code == 201
    wait = a.post("/waits", {"process_id": "paused-1"}).json()["wait"]
    assert wait["state"] == "waiting", wait
    beat = b.post("/processes/paused-1/heartbeat", {"state": "PAUSED"}).json()
    assert beat["watch"] is not None and beat["watch"]["wait_id"] == wait["id"], beat
    room = {"state": "PAUSED", "room_seen": True, "devices": [gpu(0, used=0)]}
    assert b.post("/processes/paused-1/heartbeat", room).status_code == 200
    wait_until(
        lambda: [c["kind"] for c in a.get("/commands", params={"process_id": "paused-1"}).json()] == ["resume"],
        10,
        "the resume the other replica's pass sent",
    )

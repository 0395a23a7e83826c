"""A process removed reaches each dashboard's event stream once, whichever replica the stream is on
and whichever removed it: two replicas (apps on uvicorn in this process, one PostgreSQL database)
whose sweeps remove the same silent processes at once (the test holds the processes' rows until
both sweeps wait on them), and a job's unregister racing them through one replica. Each removal is
announced by the one transaction that deleted the row: a sweep says what it deleted, not what it
found to delete."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
import requests

from flexium import protocol
from support.live_server import wait_until
from support.replica_apps import EventStream, Replica, auth, two_replicas
from support.server import make_settings, process_body

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)]

SILENT = ("gpu-1", "gpu-2")  # removed by the sweeps
UNREGISTERED = "gpu-3"  # unregistered by its job while the sweeps remove it
REMOVE_AFTER_S = 3.0
SWEEP_S = 0.2
SETTLE_S = 2.0  # after the last removal: long enough for a second event over the link (ms)


@pytest.fixture
def replicas(database_url_at_head: str) -> Iterator[tuple[Replica, Replica]]:
    settings = make_settings(
        database_url_at_head,
        token_cache_s=60.0,
        sweep_interval_s=SWEEP_S,
        device_write_interval_s=1.0,
        stale_after_s=2.0,
        remove_after_s=REMOVE_AFTER_S,
    )
    with two_replicas(settings) as pair:
        yield pair


def _waiting_on_processes(conn: psycopg.Connection) -> tuple[int, int]:
    """(sweeps' deletes, unregisters' reads) of processes waiting on a row lock."""
    rows = conn.execute(
        "SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
    ).fetchall()
    deletes = sum(1 for (query,) in rows if query.lstrip().upper().startswith("DELETE FROM PROCESSES"))
    reads = sum(1 for (query,) in rows if "FOR UPDATE" in query.upper() and "FROM processes" in query)
    return deletes, reads


def test_each_removal_reaches_each_dashboard_once(replicas: tuple[Replica, Replica], database_url_at_head: str) -> None:
    a, b = replicas
    streams = {"a": EventStream(a, a.token), "b": EventStream(b, b.token)}
    unregistered: list[requests.Response] = []
    try:
        admin_url = database_url_at_head.replace("postgresql+psycopg://", "postgresql://")
        # The lock is held on one connection; the waits are seen on another (pg_stat_activity
        # stays as it was for the rest of a transaction that read it).
        with psycopg.connect(admin_url) as conn, psycopg.connect(admin_url, autocommit=True) as watcher:
            for process_id in (*SILENT, UNREGISTERED):
                assert a.post("/processes", process_body(process_id)).status_code == 201
            # Held before the sweeps may remove them (REMOVE_AFTER_S of silence): both sweeps
            # then find them and wait for them, and so does the unregister.
            conn.execute("SELECT pk FROM processes FOR UPDATE")
            unregister = threading.Thread(
                target=lambda: unregistered.append(
                    requests.delete(f"{b.api}/processes/{UNREGISTERED}", headers=auth(b.token), timeout=60)
                )
            )
            unregister.start()
            wait_until(lambda: _waiting_on_processes(watcher) == (2, 1), 60, "both sweeps and the unregister to wait")
            conn.commit()
        unregister.join(60)
        assert unregistered and unregistered[0].status_code in (204, 404), unregistered
        wait_until(lambda: a.get("/processes").json() == [], 30, "every process removed")
        time.sleep(SETTLE_S)
        for name, stream in streams.items():
            removed = Counter(
                e[2]["process"]["process_id"]
                for e in stream.events
                if e[1] == protocol.EVENT_PROCESS and e[2]["action"] == "removed"
            )
            assert removed == {p: 1 for p in (*SILENT, UNREGISTERED)}, (name, removed)
    finally:
        for stream in streams.values():
            stream.close()

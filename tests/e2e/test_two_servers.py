"""Two real ``flexium server`` processes on one PostgreSQL database, both running the queue (at
every sweep, a fifth of a second apart, and on each GPU report): paused jobs queued on one server,
the room they wait for told to both at once, round after round; every queued job is resumed
exactly once."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.e2e import Server, wait_until
from support.replicas import postgres_database

pytestmark = pytest.mark.timeout(240)

GIB = 1 << 30
HOSTS = 4  # one paused job per host, each waiting for its host's GPU
ROUNDS = 3


@pytest.fixture
def database() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def _devices(used: int) -> list[dict[str, Any]]:
    return [{"uuid": "GPU-0", "index": 0, "name": "NVIDIA H200", "memory_total": 140 * GIB, "memory_used": used}]


def _paused(server: Server, round_: int, host: int) -> str:
    process_id = f"r{round_}-job-{host}"
    body = {
        "process_id": process_id,
        "host": f"node-{round_}-{host}",
        "gpu_uuid": "GPU-0",
        "gpu_model": "NVIDIA H200",
        "visible_gpus": ["GPU-0"],
        "capabilities": {"pause_resume": True, "migration": True},
        "state": "PAUSED",
        "memory_bytes": 0,
        "footprint_bytes": 30 * GIB,
        "devices": _devices(139 * GIB),
    }
    r = server.post("/processes", body)
    assert r.status_code in (200, 201), r.text
    return process_id


def _room_seen(barrier: threading.Barrier, server: Server, process_id: str) -> None:
    """The job tells a server the room it waits for is free, all jobs to both servers at once."""
    barrier.wait()
    server.post(f"/processes/{process_id}/heartbeat", {"state": "PAUSED", "room_seen": True, "devices": _devices(0)})


def test_two_servers_on_one_database_resume_each_queued_job_once(tmp_path: Path, database: str) -> None:
    options = ("--stale-after", "20", "--sweep-interval", "0.2")
    first = Server(tmp_path / "a", options=options, database=database)
    first.create_workspace()
    second = Server(tmp_path / "b", options=options, database=database)
    second.token = first.token
    servers = [first.start(), second.start()]
    try:
        for round_ in range(ROUNDS):
            jobs = [_paused(first, round_, host) for host in range(HOSTS)]
            for process_id in jobs:
                r = first.post("/waits", {"process_id": process_id})
                assert r.status_code == 201 and r.json()["wait"]["state"] == "waiting", r.text
            barrier = threading.Barrier(len(jobs) * len(servers))
            threads = [
                threading.Thread(target=_room_seen, args=(barrier, server, process_id))
                for process_id in jobs
                for server in servers
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            wait_until(
                lambda: all(w["state"] == "dispatched" for w in first.get("/waits").json()),
                20,
                "every queued job's resume",
            )
            time.sleep(1.0)  # a few sweeps of both later, nothing more
            for process_id in jobs:
                resumes = second.get("/commands", params={"process_id": process_id}).json()
                assert [c["kind"] for c in resumes] == ["resume"], (process_id, resumes)
            waits = first.get("/waits", params={"all": "true"}).json()
            assert all(w["dispatches"] == 1 for w in waits if w["process_id"] in jobs), waits
        print(f"\nFIGURES two servers, one database: {ROUNDS * HOSTS} queued jobs resumed once each")
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)

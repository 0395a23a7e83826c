"""A CPU-only training process (torch without CUDA, no driver; NVML from the fake driver so the
host has GPUs) attached to a real server: registration, heartbeats, device reports, the
command line, refusals, bad input, unregistering at exit."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import requests

from support.e2e import WORKSPACE, Job, Server, ps_row, wait_until
from support.fake_driver import FakeDriver

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def job(server: Server) -> Iterator[Job]:
    j = Job(server, fake=False)
    j.wait_registered()
    yield j
    j.stop()


def test_registers_with_capabilities_saying_no_migration(server: Server, job: Job) -> None:
    # Under a second on an idle machine; five leaves room for one shared with other work.
    assert job.init_seconds < 5.0, "flexium.init() must not wait for the server"
    done = server.cli("ps", "--json")
    assert done.returncode == 0, done.stderr
    processes = {p["process_id"]: p for p in json.loads(done.stdout)}
    p = processes[job.process_id]
    assert p["pid"] == job.proc.pid
    assert p["state"] == "RUNNING" and not p["stale"]
    assert p["capabilities"]["migration"] is False and p["capabilities"]["pause_resume"] is False
    assert any("engine is not running" in problem for problem in p["capabilities"]["problems"])
    assert p["gpu_uuid"] is None and p["logical_device"] == "cpu"
    assert p["torch_version"].startswith("2.") and p["flexium_version"]
    assert "train_job.py" in p["cmdline"] and p["name"] == "train_job.py"
    table = server.cli("ps")
    assert table.returncode == 0 and job.process_id in table.stdout and "RUNNING" in table.stdout
    row = ps_row(table.stdout, job.process_id)
    assert (row["NAME"], row["MOVES"], row["DOING"]) == ("train_job.py", "-", "-"), row
    assert "train_job.py" in row["COMMAND"], row  # the job's own command line
    assert "MOVES: fast = " not in table.stdout  # the legend is in `flexium ps --help`
    assert "MOVES: fast = " in " ".join(server.cli("ps", "--help").stdout.split())


def test_heartbeats_keep_it_fresh(server: Server, job: Job) -> None:
    first = server.process(job.process_id)
    assert first is not None
    wait_until(
        lambda: (server.process(job.process_id) or {}).get("last_seen", 0) > first["last_seen"] + 0.4,
        10,
        "a later heartbeat",
    )


def test_devices_of_the_host_are_reported(server: Server, job: Job) -> None:
    fake = FakeDriver()
    expected = {fake.uuid(i) for i in range(2)}
    done = server.cli("devices", "--json")
    assert done.returncode == 0, done.stderr
    hosts = json.loads(done.stdout)["hosts"]
    assert len(hosts) == 1
    devices = hosts[0]["devices"]
    assert {d["uuid"] for d in devices} == expected
    assert all(d["name"] == "NVIDIA H200" and d["memory_total"] > 0 and d["health"] == "ok" for d in devices)
    table = server.cli("devices")
    assert table.returncode == 0 and "NVIDIA H200" in table.stdout and hosts[0]["host"] in table.stdout


def test_commands_to_a_cpu_job_are_refused_with_a_reason(server: Server, job: Job) -> None:
    done = server.cli("migrate", job.process_id, "cuda:1")
    assert done.returncode == 1
    # One short reason first; every cause only when asked (--verbose).
    assert "cannot migrate: CPU-only torch: no GPU memory to move" in done.stderr, done.stderr
    verbose = server.cli("migrate", job.process_id, "cuda:1", "--verbose")
    assert verbose.returncode == 1 and "capability" in verbose.stderr, verbose.stderr
    done = server.cli("pause", job.process_id)
    assert done.returncode == 1 and "cannot pause" in done.stderr
    r = server.post("/commands", {"kind": "migrate", "process_id": job.process_id, "target": "cuda:1"})
    assert r.status_code == 422
    assert r.json()["error"] == "capability" and r.json()["message"]
    assert server.get(f"/commands?process_id={job.process_id}").json() == []


def test_bad_input_is_a_4xx_with_a_message(server: Server, job: Job) -> None:
    cases = [
        requests.post(
            server.api + "/commands",
            data=b"{not json",
            timeout=10,
            headers={**server.headers(), "Content-Type": "application/json"},
        ),
        server.post("/commands", {"kind": "explode", "process_id": job.process_id}),
        server.post("/commands", {"kind": "pause", "process_id": "gpu-nobody00"}),
        server.post("/commands", {"kind": "pause", "process_id": job.process_id}, headers={}),
        server.post(
            "/commands", {"kind": "pause", "process_id": job.process_id}, headers=server.headers("flx_not-a-real-token")
        ),
        server.post(f"/processes/{job.process_id}/heartbeat", {"state": "DANCING"}),
        server.post("/processes", {"process_id": "bad id with blanks", "host": "h"}),
    ]
    statuses = [r.status_code for r in cases]
    assert statuses == [400, 422, 404, 401, 401, 422, 422]
    for r in cases:
        body = r.json()
        assert body["error"] and body["message"], body
    done = server.cli("pause", "gpu-nobody00")
    assert done.returncode == 1 and "no process" in done.stderr
    done = server.cli("ps", "--token", "flx_not-a-real-token")
    assert done.returncode == 1 and "does not accept this token" in done.stderr
    done = server.cli("ps", "--server", "127.0.0.1:1/" + WORKSPACE)
    assert done.returncode == 3 and "cannot reach" in done.stderr
    done = server.cli("ps", "--server", "127.0.0.1:1")
    assert done.returncode == 2 and "has no workspace" in done.stderr
    assert server.process(job.process_id)["state"] == "RUNNING"


def test_exit_unregisters(server: Server, job: Job) -> None:
    started = time.monotonic()
    assert job.stop() == 0
    assert time.monotonic() - started < 10
    assert server.process(job.process_id) is None

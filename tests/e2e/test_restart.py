"""The server goes away and comes back: a command queued and a job attached survive a restart,
a paused job stays paused (also when the server has forgotten it), and a job started while
the server is down trains at once and registers when the server comes up."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from support.e2e import Job, Server, wait_until

pytestmark = pytest.mark.timeout(180)


def test_restart_loses_nothing_and_jobs_reattach(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.create_workspace()
    server.start()
    job = Job(server, fake=True)
    try:
        job.wait_registered()
        assert server.cli("pause", job.process_id).returncode == 0
        # Frozen, the job cannot take the next command: it stays queued (or delivered but
        # unacknowledged) in the database while the server restarts.
        os.kill(job.proc.pid, signal.SIGSTOP)
        r = server.post("/commands", {"kind": "resume", "process_id": job.process_id, "target": "cuda:1"})
        assert r.status_code == 201, r.text
        command_id = r.json()["id"]
        server.stop()
        server.start()
        p = server.process(job.process_id)
        assert p is not None and p["state"] == "PAUSED" and p["footprint_bytes"] == 1024 << 20
        queued = server.get(f"/commands/{command_id}").json()
        assert queued["state"] in ("queued", "delivered") and queued["kind"] == "resume"
        restarted = time.time()

        os.kill(job.proc.pid, signal.SIGCONT)
        done = server.get(f"/commands/{command_id}", params={"wait": 30}, timeout=40).json()
        assert done["state"] == "succeeded", done
        p = server.process(job.process_id)
        assert p is not None and p["state"] == "RUNNING" and p["physical_device"] == "cuda:1"
        wait_until(
            lambda: server.process(job.process_id)["last_seen"] > restarted + 0.5,
            10,
            "heartbeats to the restarted server",
        )

        # A paused job across a restart, then forgotten by the server: it registers again, PAUSED.
        assert server.cli("pause", job.process_id).returncode == 0
        server.stop()
        server.start()
        assert server.process(job.process_id)["state"] == "PAUSED"
        assert server.cli("ps").returncode == 0
        r = server.post("/commands", {"kind": "pause", "process_id": job.process_id})
        assert r.status_code == 409 and "PAUSED" in r.json()["message"]
        import requests

        assert (
            requests.delete(
                f"{server.api}/processes/{job.process_id}", headers=server.headers(), timeout=10
            ).status_code
            == 204
        )
        job.output.wait_for(r"registered again with the server", 20)
        p = wait_until(lambda: server.process(job.process_id), 10, "the job to register again")
        assert p["state"] == "PAUSED" and p["memory_bytes"] == 0 and p["footprint_bytes"] == 1024 << 20
        done = server.cli("resume", job.process_id)
        assert done.returncode == 0, done.stdout + done.stderr
        assert server.process(job.process_id)["state"] == "RUNNING"
        before = job.steps()
        wait_until(lambda: job.steps() > before, 10, "training to go on")
    finally:
        job.stop()
        server.stop(signal.SIGKILL)


def test_server_down_at_job_start(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.create_workspace()
    job = Job(server, fake=False)  # nothing listens on the port yet
    try:
        # It trains with nothing listening (below), so init() did not wait for the server; the bound
        # leaves room for a machine shared with other work.
        assert job.init_seconds < 5.0, "flexium.init() waited for the server"
        job.output.wait_for(r"^step 10 ", 10)
        job.output.wait_for(r"cannot reach the flexium server .*training continues", 10)
        server.start()
        up = time.monotonic()
        job.wait_registered(timeout=20)
        print(f"\nregistered {time.monotonic() - up:.1f} s after the server came up")
        p = server.process(job.process_id)
        assert p is not None and p["state"] == "RUNNING"
        before = job.steps()
        wait_until(lambda: job.steps() > before, 10, "training to go on")
    finally:
        job.stop()
        server.stop(signal.SIGKILL)

"""Sharing a GPU host through the real server, real jobs on the simulated driver and the CLI, a
neighbour (another program's memory on the host's GPUs) started and ended by the test through the
simulated host's file: a paused job queued to resume when free is resumed within a few seconds of
the neighbour's exit, told by the job itself watching its GPUs; a resume typed just after the
neighbour left succeeds; a wait survives the server's SIGKILL, nothing lost and nothing resumed
twice."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from support.e2e import Job, Server, wait_until
from support.fake_driver import write_host_file

pytestmark = pytest.mark.timeout(240)

GPU_MIB = 143771  # the simulated driver's GPUs (FAKE_CUDA_TOTAL_MIB's default)
FULL = (GPU_MIB - 256) << 20  # a neighbour that leaves 256 MiB on a GPU: less than a job needs
DISPATCH_BOUND_S = 3.0  # the goal is 1 s on a GPU host; this machine is shared and slow


def _job(server: Server, host_file: Path) -> Job:
    job = Job(server, fake=True, extra_env={"FAKE_CUDA_HOST_FILE": str(host_file)})
    job.wait_registered()
    return job


def _gpus_stored_full(server: Server) -> bool:
    hosts = server.get("/devices").json()["hosts"]
    return bool(hosts) and all(d["memory_free"] < 1 << 30 for h in hosts for d in h["devices"])


def _resumes(server: Server, process_id: str) -> list[dict[str, Any]]:
    commands = server.get("/commands", params={"process_id": process_id}).json()
    return [c for c in commands if c["kind"] == "resume"]


def test_a_queued_job_resumes_when_its_neighbour_exits(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "host"
    write_host_file(host_file, {})
    job = _job(server, host_file)
    try:
        assert server.cli("pause", job.process_id).returncode == 0
        write_host_file(host_file, {0: FULL, 1: FULL})
        wait_until(lambda: _gpus_stored_full(server), 20, "a GPU report with the neighbour")
        refused = server.cli("resume", job.process_id)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"queue it? flexium resume {job.process_id} --when-free" in refused.stderr
        assert server.process(job.process_id)["state"] == "PAUSED"
        # A GPU the job's host does not have: no queue can resume it there, so none is offered.
        nowhere = server.cli("resume", job.process_id, "cuda:7")
        assert nowhere.returncode == 1 and "cuda:7 is not one of them" in nowhere.stderr, nowhere.stderr
        assert "--when-free" not in nowhere.stderr and "`flexium devices` lists its host's GPUs" in nowhere.stderr

        queued = server.cli("resume", job.process_id, "--when-free")
        assert queued.returncode == 0, queued.stdout + queued.stderr
        assert "queued as wait" in queued.stdout
        again = server.cli("resume", job.process_id, "--when-free")
        assert again.returncode == 0 and "already queued since " in again.stdout, again.stdout + again.stderr
        assert "its place kept: queued as wait" in again.stdout, again.stdout
        listed = server.cli("queue")
        assert job.process_id in listed.stdout and "waiting" in listed.stdout, listed.stdout
        assert "waiting for room" in server.cli("ps").stdout
        time.sleep(2.0)  # its heartbeats' answers tell it what to watch
        assert not [r for r in _resumes(server, job.process_id) if r["reason"]]  # no room yet: none sent

        exited = time.time()
        write_host_file(host_file, {})
        resume = wait_until(
            lambda: next((r for r in _resumes(server, job.process_id) if r["reason"]), None),
            15,
            "the queue's resume",
        )
        dispatched = resume["created_at"] - exited
        wait_until(lambda: server.process(job.process_id)["state"] == "RUNNING", 15, "the job to run again")
        running = time.time() - exited
        print(
            f"\nFIGURES resume when free: sent {dispatched:.2f} s after the neighbour's exit, "
            f"running after {running:.2f} s"
        )
        assert dispatched < DISPATCH_BOUND_S
        assert resume["reason"].startswith("resume when free: GPU 0 had")
        job.output.wait_for(r"room appeared on a GPU this paused job waits for", 5)
        [wait] = [w for w in server.get("/waits", params={"all": "true"}).json() if w["process_id"] == job.process_id]
        assert wait["state"] == "done" and wait["command_id"] == resume["id"]
        before = job.steps()
        wait_until(lambda: job.steps() > before, 10, "training to go on")
    finally:
        job.stop()


def test_a_resume_half_a_second_after_the_neighbour_left_succeeds(server: Server, tmp_path: Path) -> None:
    """The server's last GPU report still shows the neighbour: the resume goes to the job, whose own
    room check sees the GPU as it is now."""
    host_file = tmp_path / "host"
    write_host_file(host_file, {})
    job = _job(server, host_file)
    try:
        assert server.cli("pause", job.process_id).returncode == 0
        write_host_file(host_file, {0: FULL, 1: FULL})
        wait_until(lambda: _gpus_stored_full(server), 20, "a GPU report with the neighbour")
        write_host_file(host_file, {})
        time.sleep(0.5)
        assert _gpus_stored_full(server)  # what the server knows is older than the resume
        done = server.cli("resume", job.process_id)
        assert done.returncode == 0, done.stdout + done.stderr
        assert server.process(job.process_id)["state"] == "RUNNING"
    finally:
        job.stop()


def test_a_wait_survives_the_servers_sigkill(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.create_workspace()
    server.start()
    host_file = tmp_path / "host"
    write_host_file(host_file, {})
    job = _job(server, host_file)
    try:
        assert server.cli("pause", job.process_id).returncode == 0
        write_host_file(host_file, {0: FULL, 1: FULL})
        wait_until(lambda: _gpus_stored_full(server), 20, "a GPU report with the neighbour")
        queued = server.cli("resume", job.process_id, "--when-free")
        assert queued.returncode == 0, queued.stdout + queued.stderr
        server.stop(signal.SIGKILL)
        write_host_file(host_file, {})  # the neighbour leaves while the server is down
        server.start()
        wait_until(
            lambda: server.process(job.process_id)["state"] == "RUNNING", 30, "the job resumed after the restart"
        )
        resumes = _resumes(server, job.process_id)
        assert len(resumes) == 1 and resumes[0]["state"] == "succeeded", resumes
        [wait] = server.get("/waits", params={"all": "true"}).json()
        assert wait["state"] == "done" and wait["dispatches"] == 1
        time.sleep(2.0)  # a sweep or two later: still one resume
        assert len(_resumes(server, job.process_id)) == 1
    finally:
        job.stop()
        server.stop(signal.SIGKILL)

"""Draining a GPU through the real server, real jobs on the simulated driver (four simulated GPUs
per host, each test a simulated host of its own) and the CLI: `flexium drain HOST:0` migrates both
jobs on GPU 0 to the GPUs of the host with room, printing each move and a summary, and the drained
GPU then takes nothing (a migrate there is refused naming the drain) until `flexium undrain`; a job
that fits nowhere is paused and queued, and resumed when room appears on another GPU; a job that
can neither move nor pause (every lock of its checkpoint fails) is named with its reason while the
others go on; undrained, the GPU takes a queued job back."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from support.e2e import Job, Server, wait_until
from support.fake_driver import write_host_file

pytestmark = pytest.mark.timeout(300)

GPUS = 4
GPU_MIB = 143771  # the simulated driver's GPUs (FAKE_CUDA_TOTAL_MIB's default)
FULL = (GPU_MIB - 256) << 20  # a neighbour that leaves 256 MiB on a GPU: less than a job needs
CUDA_ERROR_TIMEOUT = 909


def _jobs(server: Server, host: str, host_file: Path, count: int, **env: str) -> list[Job]:
    """``count`` jobs on GPU 0 of simulated host ``host``, registered."""
    jobs: list[Job] = []
    try:
        for _ in range(count):
            full_env = {
                "FLEXIUM_SIMULATED_HOST": host,
                "FAKE_CUDA_GPUS": str(GPUS),
                "FAKE_CUDA_HOST_FILE": str(host_file),
                **env,
            }
            jobs.append(Job(server, fake=True, extra_env=full_env))
        for job in jobs:
            job.wait_registered()
    except BaseException:
        for job in jobs:
            job.stop()
        raise
    return jobs


def _devices(server: Server, host: str) -> list[dict[str, Any]]:
    return next((h["devices"] for h in server.get("/devices").json()["hosts"] if h["host"] == host), [])


def _reported_full(server: Server, host: str, gpus: set[int]) -> bool:
    devices = _devices(server, host)
    return bool(devices) and all(d["memory_free"] < 1 << 30 for d in devices if d["index"] in gpus)


def _gpu_index(server: Server, job: Job) -> int | None:
    process = server.process(job.process_id)
    assert process is not None
    return int(process["gpu_index"]) if process["gpu_index"] is not None else None


def _state(server: Server, job: Job) -> str:
    process = server.process(job.process_id)
    assert process is not None
    return str(process["state"])


def test_a_drain_moves_both_jobs_off_and_the_gpu_takes_nothing_until_undrained(server: Server, tmp_path: Path) -> None:
    host = "drain-both"
    host_file = tmp_path / "host"
    write_host_file(host_file, {})
    first, second = _jobs(server, host, host_file, 2)
    try:
        assert _gpu_index(server, first) == 0 and _gpu_index(server, second) == 0
        done = server.cli("drain", f"{host}:0", "--reason", "driver update", timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith("drain ") and f"until `flexium undrain {host}:0`" in lines[0], done.stdout
        for job in (first, second):
            assert re.search(rf"^  {job.process_id}: migrate \(command \d+\) \[succeeded\]: moving ", done.stdout, re.M)
        assert re.search(r"^drain \d+: drained: 2 moved, 0 paused \(queued to resume when free\)$", lines[-1])
        assert not done.stderr.strip(), done.stderr

        # Each went to the GPU with the most room, counting the first one's arrival: two GPUs.
        moved_to = {_gpu_index(server, first), _gpu_index(server, second)}
        assert moved_to == {1, 2}, moved_to
        for job in (first, second):
            assert _state(server, job) == "RUNNING"
            before = job.steps()
            wait_until(lambda job=job, before=before: job.steps() > before, 15, "training to go on after the move")
        [drain] = server.get("/drains", params={"host": host}).json()
        assert drain["state"] == "drained" and drain["reason"] == "driver update"
        assert [m["action"] for m in drain["moves"]] == ["migrate", "migrate"]

        listed = server.cli("devices", "--host", host)  # the drained GPU says so, and until what
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert re.search(r"^  0 .* ok, drained ", listed.stdout, re.M), listed.stdout
        assert re.search(rf"^  GPU 0: drained by .* until `flexium undrain {host}:0`$", listed.stdout, re.M)

        refused = server.cli("migrate", first.process_id, "cuda:0")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "drained by" in refused.stderr and f"flexium undrain {host}:0" in refused.stderr, refused.stderr
        assert _gpu_index(server, first) in (1, 2)

        undone = server.cli("undrain", f"{host}:0")
        assert undone.returncode == 0, undone.stdout + undone.stderr
        assert f"undrained {host}:0 (drain {drain['id']})" in undone.stdout
        back = server.cli("migrate", first.process_id, "cuda:0")
        assert back.returncode == 0, back.stdout + back.stderr
        assert _gpu_index(server, first) == 0
        assert server.get("/drains", params={"host": host}).json() == []
    finally:
        for job in (first, second):
            job.stop()


def test_a_job_that_fits_nowhere_is_queued_and_one_that_cannot_move_is_named(server: Server, tmp_path: Path) -> None:
    host = "drain-full"
    host_file = tmp_path / "host"
    write_host_file(host_file, {})
    [movable] = _jobs(server, host, host_file, 1)
    # Every lock of its checkpoint times out: each move it is sent fails, and it stays where it is.
    [stuck] = _jobs(server, host, host_file, 1, FAKE_CUDA_FAIL=f"cuCheckpointProcessLock:{CUDA_ERROR_TIMEOUT}")
    try:
        write_host_file(host_file, {1: FULL, 2: FULL, 3: FULL})
        wait_until(lambda: _reported_full(server, host, {1, 2, 3}), 20, "a GPU report with the neighbours")
        done = server.cli("drain", f"{host}:0", timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr  # a job is left there
        assert f"1 job(s) still on {host}:0: {stuck.process_id}" in done.stderr, done.stderr
        assert re.search(
            rf"^  {movable.process_id}: pause \(command \d+\) \[succeeded\]: no other GPU of host '{host}' can take "
            rf"process '{movable.process_id}'",
            done.stdout,
            re.M,
        ), done.stdout
        # The job that can do neither is named on stderr with its reason; the other was paused all the same.
        named = f"  {stuck.process_id}: not moved: left where it is: its pause, command "
        assert named in done.stderr and "cuCheckpointProcessLock" in done.stderr, done.stderr
        assert done.stdout.splitlines()[-1].endswith(
            "drained: 0 moved, 1 paused (queued to resume when free), 1 left where they are (named above)"
        ), done.stdout
        assert _state(server, movable) == "PAUSED" and _state(server, stuck) == "RUNNING"
        queued = server.cli("queue")
        assert movable.process_id in queued.stdout and "waiting" in queued.stdout, queued.stdout

        # GPU 0 has room all along, but is drained: the job resumes where room appears, GPU 3.
        write_host_file(host_file, {1: FULL, 2: FULL})
        wait_until(lambda: _state(server, movable) == "RUNNING", 30, "the paused job to resume when free")
        assert _gpu_index(server, movable) == 3
        commands = server.get("/commands", params={"process_id": movable.process_id}).json()
        assert [c["kind"] for c in commands] == ["resume", "pause"], commands  # newest first
        assert commands[0]["reason"].startswith("resume when free: GPU 3 had"), commands[0]
    finally:
        for job in (movable, stuck):
            job.stop()


def test_undrained_the_gpu_takes_its_queued_job_back(server: Server, tmp_path: Path) -> None:
    host = "drain-back"
    host_file = tmp_path / "host"
    write_host_file(host_file, {1: FULL, 2: FULL, 3: FULL})
    [job] = _jobs(server, host, host_file, 1)
    try:
        wait_until(lambda: _reported_full(server, host, {1, 2, 3}), 20, "a GPU report with the neighbours")
        done = server.cli("drain", host, timeout=120)  # every GPU of the host
        assert done.returncode == 0, done.stdout + done.stderr
        assert "drained: 0 moved, 1 paused" in done.stdout, done.stdout
        assert _state(server, job) == "PAUSED"
        refused = server.cli("resume", job.process_id, "cuda:0")
        assert refused.returncode == 1 and "drained by" in refused.stderr, refused.stdout + refused.stderr

        undone = server.cli("undrain", host)
        assert undone.returncode == 0, undone.stdout + undone.stderr
        assert f"undrained {host} (drain " in undone.stdout, undone.stdout
        wait_until(lambda: _state(server, job) == "RUNNING", 30, "the queued job to resume on its GPU")
        assert _gpu_index(server, job) == 0
        [wait] = [w for w in server.get("/waits", params={"all": "true"}).json() if w["process_id"] == job.process_id]
        assert wait["state"] == "done"
    finally:
        job.stop()

"""`flexium migrate JOB auto` through the real server, a real job on the simulated driver (four
simulated GPUs, other programs' memory on them written to the simulated host's file) and the CLI:
the job goes to the GPU with the most room; when no GPU will do, nothing moves and the refusal says
why, GPU by GPU (too little room, drained)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.e2e import Job, Server, wait_until
from support.fake_driver import write_host_file

pytestmark = pytest.mark.timeout(240)

HOST = "auto-host"
GIB = 1 << 30
GPU_MIB = 143771  # the simulated driver's GPUs (FAKE_CUDA_TOTAL_MIB's default)
FULL = (GPU_MIB - 256) << 20  # a neighbour that leaves 256 MiB on a GPU: less than a job needs


def _devices(server: Server) -> dict[int, dict[str, Any]]:
    hosts = server.get("/devices").json()["hosts"]
    return {d["index"]: d for h in hosts if h["host"] == HOST for d in h["devices"]}


def _reported(server: Server, used: dict[int, int]) -> bool:
    devices = _devices(server)
    return bool(devices) and all(devices[i]["memory_used"] >= nbytes for i, nbytes in used.items())


def _gpu_index(server: Server, job: Job) -> int:
    process = server.process(job.process_id)
    assert process is not None
    return int(process["gpu_index"])


def test_auto_picks_the_gpu_with_most_room_and_says_why_when_none_will_do(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "host"
    others = {1: 100 * GIB, 2: 20 * GIB, 3: 60 * GIB}
    write_host_file(host_file, others)
    env = {"FLEXIUM_SIMULATED_HOST": HOST, "FAKE_CUDA_GPUS": "4", "FAKE_CUDA_HOST_FILE": str(host_file)}
    job = Job(server, fake=True, extra_env=env)
    try:
        job.wait_registered()
        wait_until(lambda: _reported(server, others), 20, "a GPU report with the other programs")
        moved = server.cli("migrate", job.process_id, "auto")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert _gpu_index(server, job) == 2
        [command] = server.get("/commands", params={"process_id": job.process_id}).json()
        assert command["state"] == "succeeded" and command["reason"].startswith("auto: GPU 2 had the most room")

        drained = server.cli("drain", f"{HOST}:3")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        full = {0: FULL, 1: FULL}
        write_host_file(host_file, full)
        wait_until(lambda: _reported(server, full), 20, "a GPU report with GPUs 0 and 1 full")
        refused = server.cli("migrate", job.process_id, "auto")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"no GPU of host '{HOST}' can take process '{job.process_id}'" in refused.stderr, refused.stderr
        for gpu in (0, 1):
            assert f"GPU {gpu}: 0.2 GiB free of the " in refused.stderr, refused.stderr
        assert "GPU 3: drained by " in refused.stderr, refused.stderr
        assert _gpu_index(server, job) == 2
        assert len(server.get("/commands", params={"process_id": job.process_id}).json()) == 1
    finally:
        job.stop()

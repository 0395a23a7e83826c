"""One process on two GPUs (DataParallel, a model split over devices; here the fake driver
with 4 GPUs and memory on cuda:0 and cuda:1) attached to a real server and moved GPU by GPU by
the `flexium` command: each GPU's memory goes where the command says, the server shows the
process on its new GPUs, and a move that names a GPU it does not use is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from support.e2e import Job, Server, wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def job(server: Server) -> Iterator[Job]:
    j = Job(server, fake=True, memory_mib=1024, extra_env={"FAKE_CUDA_GPUS": "4", "E2E_JOB_SECOND_GPU_MIB": "512"})
    j.wait_registered()
    yield j
    j.stop()


def test_a_process_on_two_gpus_is_moved_gpu_by_gpu(server: Server, job: Job) -> None:
    def shown() -> dict[str, Any]:
        listed = json.loads(server.cli("ps", "--json").stdout or "[]")
        return next(p for p in listed if p["process_id"] == job.process_id)

    uuids = shown()["visible_gpus"]  # the job's cuda:0..3
    assert len(uuids) == 4
    wait_until(
        lambda: shown()["other_gpus"] == [uuids[1]] and shown()["capabilities"]["migration"],
        30,
        "the process registered on two GPUs, movable",
    )
    moved = server.cli("migrate", job.process_id, "--gpus", "cuda:0=cuda:2,cuda:1=cuda:3", timeout=120)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert f"migrate {job.process_id} GPU by GPU: cuda:0 to cuda:2, cuda:1 to cuda:3" in moved.stdout
    wait_until(
        lambda: (shown()["gpu_uuid"], shown()["other_gpus"]) == (uuids[2], [uuids[3]]),
        30,
        "the process shown on GPUs 2 and 3",
    )

    refused = server.cli("migrate", job.process_id, "--gpus", "cuda:1=cuda:0", "--json")
    assert refused.returncode == 1
    assert f"holds nothing on GPU {uuids[1]} (cuda:1): gpus name the GPUs it uses" in refused.stdout, refused.stdout
    malformed = server.cli("migrate", job.process_id, "--gpus", "cuda:2")
    assert malformed.returncode == 2 and "--gpus 'cuda:2': each entry is GPU=GPU" in malformed.stderr
    mistyped = server.cli("migrate", job.process_id, "--gpus", "cuda:2=gpu1")
    assert mistyped.returncode == 2 and "gpu1" in mistyped.stderr, mistyped.stderr
    both = server.cli("migrate", job.process_id, "cuda:0", "--gpus", "cuda:2=cuda:0")
    assert both.returncode == 2 and "or --gpus (the GPUs of one process on several), not both" in both.stderr

    back = server.cli("migrate", job.process_id, "--gpus", "cuda:2=cuda:0,cuda:3=cuda:1", "--json", timeout=120)
    assert back.returncode == 0, back.stdout + back.stderr
    outcome = json.loads(back.stdout)
    assert outcome["state"] == "succeeded" and outcome["gpu_moves"] == {uuids[2]: uuids[0], uuids[3]: uuids[1]}
    assert outcome["result"]["path"] == "driver"
    wait_until(lambda: (shown()["gpu_uuid"], shown()["other_gpus"]) == (uuids[0], [uuids[1]]), 30, "back home")

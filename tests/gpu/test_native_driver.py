"""flexium._C against the real driver: the measured facts our engine relies on still hold."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from conftest import GIB, HERE, _keep_log, end_process_group
from live_server import ProcessOutput


def run_native() -> dict[str, dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(HERE / "native_job.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {c["check"]: c for c in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}


# native_job.py restores GPU 0's context onto GPU 1 (devices[1]).
@pytest.mark.usefixtures("two_gpus")
def test_native_layer_on_the_real_driver(host_gpus: list[Any]) -> None:
    checks = run_native()
    devices = checks["devices"]
    assert devices["status"]["loaded"] and devices["status"]["checkpoint_api"]
    assert set(devices["uuids"]) <= set(devices["nvml"])

    unlock = checks["unlock_running"]
    assert unlock["raised"] and unlock["call"] == "cuCheckpointProcessUnlock"
    assert unlock["name"] in unlock["message"]

    # One pair is refused (docs/facts.md fact 2); the recover rollback brings the job back in place
    # (docs/facts.md fact 3).
    single = checks["single_pair"]
    failed = [o for o in single["outcomes"] if o["code"] != 0]
    assert failed[0]["step"] == "restore" and not failed[0]["rollback"]
    assert [o["step"] for o in single["outcomes"] if o["rollback"]] == ["restore", "unlock"]
    assert single["state"] == "RUNNING" and single["intact"]
    assert single["ours"][devices["uuids"][0]] >= GIB

    full = checks["full_pairs"]
    assert all(o["code"] == 0 for o in full["outcomes"]), full["outcomes"]
    assert full["state"] == "RUNNING" and full["intact"]
    assert full["ours"][devices["uuids"][1]] >= GIB and full["ours"][devices["uuids"][0]] == 0
    # The driver API names the new GPU after the move (PyTorch's cached properties do not: docs/facts.md fact 5).
    assert full["reported_uuid"] == devices["uuids"][1]


def test_importing_flexium_before_torch_leaves_torch_working() -> None:
    # docs/facts.md fact 20: a job that imports flexium first (python -m flexium.cli.demo_job does)
    # once crashed inside `import torch`.
    code = "import flexium._C; import torch; print(torch.ones(2, device='cuda').sum().item())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "2.0"


def test_the_driver_cannot_restore_host_cumem_memory_and_the_process_is_lost() -> None:
    """Why flexium never checkpoints a process holding cuMem host memory (docs/facts.md fact 26,
    engine/uncheckpointable_memory.py): the driver's restore of it fails, a second restore and the
    unlock fail too, the process stays checkpointed and its CUDA calls never return. Should a
    driver restore it one day, this test says so (and the refusal can go)."""
    job = subprocess.Popen(
        [sys.executable, str(HERE / "unrestorable_job.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    output = ProcessOutput(job)
    try:
        output.wait_for(r'^\{"event": "ready"', 120)
        seen = json.loads(output.wait_for(r'^\{"event": "outcome"', 120).string)
        assert seen["first"][:2] == [["lock", 0], ["checkpoint", 0]], seen
        restore, code = seen["first"][2]
        assert restore == "restore" and code != 0, f"the driver restored memory it could not before (fact 26): {seen}"
        assert seen["again"][0][1] != 0 and seen["unlock"][0][1] != 0, seen
        assert seen["state"] == "CHECKPOINTED", seen
        assert seen["cuda_call"].startswith("no return in"), seen
    finally:
        end_process_group(job, lambda seconds: job.wait(seconds))
        job.wait(30)  # reaped after a SIGKILL too; a process the kill cannot end fails here
        _keep_log(("unrestorable_job.py",), None, job.returncode, output.text, "")


def test_the_room_check_before_a_restore_asks_nvml_and_a_refusal_rolls_back_in_place() -> None:
    """csrc/room_check.h on one GPU, against the real driver and NVML: the process checkpoints
    itself and asks its NVML reader process (engine/nvml.py --serve) over its pipes how much the GPU
    has free. Needing more than the GPU has, the restore is not tried and the rollback restores the
    process in place, its memory intact (docs/facts.md fact 28: a restore without room loses the
    job); needing what it holds, the restore runs."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "room_check_job.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = {c["case"]: c for c in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    uuid, total = cases["gpu"]["uuid"], cases["gpu"]["total"]

    refused = cases["refused"]
    steps = [(o["step"], o["rollback"], o["error"]) for o in refused["outcomes"]]
    assert steps == [
        ("lock", False, ""),
        ("checkpoint", False, ""),
        ("room", False, "CUDA_ERROR_OUT_OF_MEMORY"),
        ("restore", True, ""),
        ("unlock", True, ""),
    ], refused["outcomes"]
    said = re.fullmatch(rf"{uuid} has (\d+) MiB free, the restore needs (\d+) MiB", refused["outcomes"][2]["text"])
    assert said is not None, refused["outcomes"][2]
    # checkpointed, the process holds nothing there: nearly the whole GPU is free
    assert total // 2 < int(said[1]) << 20 <= total and int(said[2]) << 20 == refused["needed"], said.groups()
    assert refused["outcomes"][2]["seconds"] < 0.5, refused["outcomes"][2]
    assert refused["state"] == "RUNNING" and refused["intact"], refused

    passed = cases["passed"]
    assert [(o["step"], o["code"]) for o in passed["outcomes"]] == [
        ("lock", 0),
        ("checkpoint", 0),
        ("room", 0),
        ("restore", 0),
        ("unlock", 0),
    ], passed["outcomes"]
    assert passed["outcomes"][2]["text"] == "", passed["outcomes"][2]  # answered, not "not checked"
    assert passed["state"] == "RUNNING" and passed["intact"], passed

"""Real training migrated and paused on real GPUs: bit-identical losses, nothing left behind."""

from __future__ import annotations

from typing import Any

import pytest

from support.gpu import GIB, assert_left, run_job, uuid_of

# Every test here moves the job to GPU 1 or fills it.
pytestmark = pytest.mark.usefixtures("two_gpus")

BALLAST_GB = "4"
STEPS = "80"  # the pause at step 40 prepares its host staging while the job trains


def idle_used(host_gpus: list[Any]) -> dict[str, int]:
    return {gpu.uuid: gpu.memory_used for gpu in host_gpus}


def test_migrate_there_and_back_then_pause_and_resume_elsewhere(host_gpus: list[Any]) -> None:
    idle = idle_used(host_gpus)
    gpu0, gpu1 = uuid_of(host_gpus, 0), uuid_of(host_gpus, 1)
    reference = run_job("--ballast-gb", BALLAST_GB, "--steps", STEPS)
    assert reference.returncode == 0, reference.stderr[-3000:]

    moved = run_job(
        "--ballast-gb",
        BALLAST_GB,
        "--steps",
        STEPS,
        "--plan",
        "10:migrate:cuda:1",
        "--plan",
        "25:migrate:cuda:0",
        "--plan",
        "40:pause",
        "--plan",
        "40:resume:cuda:1",
    )
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert moved.one("ready")["migration"] is True
    assert [op["ok"] for op in moved.ops] == [True] * 4, moved.ops
    to1, to0, pause, resume = moved.ops

    assert to1["physical"] == "cuda:1" and to1["logical"] == "cuda:0"
    assert to1["nvml"][gpu1]["ours"] >= float(BALLAST_GB) * GIB
    assert_left(to1, gpu0, idle)

    assert to0["physical"] == "cuda:0"
    assert to0["nvml"][gpu0]["ours"] >= float(BALLAST_GB) * GIB
    assert_left(to0, gpu1, idle)

    assert_left(pause, gpu0, idle)
    assert_left(pause, gpu1, idle)

    assert resume["physical"] == "cuda:1"
    assert resume["nvml"][gpu1]["ours"] >= float(BALLAST_GB) * GIB
    assert_left(resume, gpu0, idle)

    done = moved.one("done")
    assert done["ballast_ok"] is True
    assert done["losses"] == reference.one("done")["losses"], "loss trace differs from the undisturbed run"
    for op in moved.ops:
        steps = {s["step"] for s in op["result"]["steps"]}
        assert op["result"]["bytes_moved"] >= float(BALLAST_GB) * GIB
        assert steps >= ({"lock", "checkpoint"} if op["op"] == "pause" else {"restore", "unlock"})


def test_target_without_room_is_refused_and_training_continues(host_gpus: list[Any], gpu_filler: Any) -> None:
    reference = run_job("--ballast-gb", BALLAST_GB, "--steps", "30")
    gpu_filler(1, 2.0)  # leaves 2 GiB free on GPU 1; the job holds over 4
    run = run_job("--ballast-gb", BALLAST_GB, "--steps", "30", "--plan", "10:migrate:cuda:1")
    assert run.returncode == 0, run.stderr[-3000:]
    (op,) = run.ops
    assert op["ok"] is False and op["error_type"] == "TargetRefusedError", op
    assert "free" in op["error"] and op["state"] == "RUNNING"
    done = run.one("done")
    assert done["physical"] == "cuda:0" and done["ballast_ok"] is True
    assert done["losses"] == reference.one("done")["losses"]


def test_a_target_taken_while_the_job_is_checkpointed_is_caught_before_the_restore(host_gpus: list[Any]) -> None:
    """Another process takes all but 1 GiB of GPU 1 the moment a driver-path move starts, after the
    target check (the move locks and checkpoints the job only once it has: job_control.py's arm, so
    the race cannot be lost): the room check just before the restore (csrc/room_check.h, the NVML
    reader asked from inside the locked section) fails the move there, the job is restored on GPU 0
    and trains on, and once GPU 1 is free the move runs. A restore without room would have lost the
    job (fact `restore-without-room-loses-process`)."""
    args = ("--ballast-gb", BALLAST_GB, "--steps", "40", "--step-sleep", "0.1")
    reference = run_job(*args)
    plan = ["10:arm:cuda:1", "10:migrate:cuda:1@driver", "10:vacate", "25:migrate:cuda:1@driver"]
    run = run_job(*args, *[a for item in plan for a in ("--plan", item)])
    assert run.returncode == 0, run.stderr[-3000:]
    filled = run.one("filled")
    assert filled["filled"] is not None, f"the filler did not fill GPU 1 within {filled['within_s']} s"
    assert filled["filled"]["free_after"] < 2 * GIB, filled
    order = [e["event"] for e in run.events if e["event"] in ("filled", "op")]
    assert order[:2] == ["filled", "op"], order  # GPU 1 was full before the move reached its restore
    caught, moved = run.ops
    assert caught["ok"] is False and caught["step"] == "room", caught
    assert "another process took memory there while the job was checkpointed" in caught["error"], caught["error"]
    assert caught["state"] == "RUNNING" and caught["physical"] == "cuda:0"
    steps = [(s["step"], s["ok"], s["rollback"]) for s in caught["result"]["steps"]]
    assert ("room", False, False) in steps and ("restore", True, True) in steps, steps
    assert run.one("vacated")["filled"] == filled["filled"]
    assert moved["ok"] is True and moved["physical"] == "cuda:1"
    done = run.one("done")
    assert done["ballast_ok"] is True
    assert done["losses"] == reference.one("done")["losses"], "loss trace differs from the undisturbed run"


def test_identity_is_tracked_with_cuda_visible_devices_reordered(host_gpus: list[Any]) -> None:
    """CUDA_VISIBLE_DEVICES=1,0: the job's cuda:0 is nvidia-smi's GPU 1; "cuda:1" names GPU 0."""
    gpu0, gpu1 = uuid_of(host_gpus, 0), uuid_of(host_gpus, 1)
    run = run_job(
        "--ballast-gb",
        "2",
        "--steps",
        "30",
        "--plan",
        "10:migrate:cuda:1",
        "--plan",
        "20:migrate:cuda:0",
        env={"CUDA_VISIBLE_DEVICES": "1,0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.one("ready")["uuid"].replace("GPU-", "") in gpu1
    there, back = run.ops
    assert there["ok"] and back["ok"], run.ops
    assert there["physical"] == "cuda:1" and there["nvml"][gpu0]["ours"] > 0 and there["nvml"][gpu1]["ours"] == 0
    assert back["physical"] == "cuda:0" and back["nvml"][gpu1]["ours"] > 0 and back["nvml"][gpu0]["ours"] == 0

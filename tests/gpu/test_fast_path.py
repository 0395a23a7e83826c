"""The fast path on real GPUs: PyTorch's memory in flexium's pool, moved at a safe point.

Each job runs in a fresh process (bench/jobs/train_job.py; the out-of-memory check through
support/fresh_process.py's run_in_fresh_process). Every moved
run is compared bit for bit (float.hex loss traces) with an undisturbed run of the same flags.
Jobs are small (2 GiB ballast or less, at most 40 steps) so the file runs in a few minutes.
Tests that move the job to GPU 1 (or fill it) use the `two_gpus` fixture and are skipped on a
one-GPU machine; the in-place pause / resume tests and the out-of-memory test need one GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.fresh_process import run_in_fresh_process
from support.gpu import (
    GIB,
    JOB_TIMEOUT,
    assert_left,
    idle_used,
    ok_run,
    reference,
    run_job,
    summary,
    uuid_of,
)

BALLAST_GB = "2"
ALL_FEATURES = ("--amp", "--checkpointing", "--side-stream", "--dataloader", "--cuda-graph")
# A plain AdamW MLP job; the plain reference run is shared by the tests that use these flags.
PLAIN = ("--ballast-gb", BALLAST_GB, "--steps", "30")
# Tiny jobs for the driver-path checks.
TINY = ("--ballast-gb", "0.5", "--steps", "20", "--width", "1024")
FAST_ONLY_STEPS = {"copy", "release", "map"}
LOCKED_STEPS = {"lock", "checkpoint", "restore", "unlock"}


# ---- helpers -----------------------------------------------------------------------------------


def assert_holds(op: dict[str, Any], uuid: str, ballast_gb: str) -> None:
    ours = op["nvml"][uuid]["ours"]
    assert ours >= float(ballast_gb) * GIB, f"after {op['op']} the job holds only {ours >> 20} MiB on {uuid}"


def assert_copier_ran(pause: dict[str, Any], resume: dict[str, Any]) -> None:
    """The pause's host copies ran in the copier process, not in the job's."""
    notes = [*pause["result"]["notes"], *resume["result"]["notes"]]
    # "pinned ... of host staging by the copier process" (kept ahead) or "made the host staging by the
    # copier process" (made at the safe point, stop first)
    assert any("host staging by the copier process" in n for n in notes), notes
    assert not any("ran in this process" in n for n in notes), notes


def out_of_memory_retry(first_fraction: float, second_fraction: float) -> dict[str, Any]:
    """Out-of-memory retry inside flexium's memory pool (run in a fresh process): after
    flexium.init() a tensor of ``first_fraction`` of the GPU's free memory is made and deleted, so
    its block stays cached in the pool; then one of ``second_fraction`` is asked for. Both do not
    fit at once: the allocation succeeds only if PyTorch frees the cached block (oversize, thanks
    to max_split_size_mb) and retries."""
    import torch

    import flexium
    from flexium import _C
    from flexium.api import runtime

    flexium.init()
    device = flexium.auto.get_device()
    current = runtime.current()
    pool = current.memory_pool if current is not None else None
    free, total = torch.cuda.mem_get_info(device)  # after the context exists
    first, second = int(free * first_fraction), int(free * second_fraction)

    held = torch.empty(first, dtype=torch.uint8, device=device)
    held.fill_(1)
    torch.cuda.synchronize()
    del held
    reserved_cached = torch.cuda.memory_reserved(device)
    error = None
    first_attempt_ok = True
    big = None
    for attempt in range(2):
        try:
            big = torch.empty(second, dtype=torch.uint8, device=device)
            break
        except torch.cuda.OutOfMemoryError as exc:
            # PyTorch's retry inside a routed pool frees oversize cached blocks, but retries only
            # when they cover the request; a second attempt then finds the memory free.
            first_attempt_ok = False
            error = f"attempt {attempt + 1}: {type(exc).__name__}: {str(exc)[:1500]}"
    success = False
    if big is not None:
        big.fill_(7)
        torch.cuda.synchronize()
        success = bool(big[:: 1 << 20].eq(7).all().item())
    pool_bytes = None
    try:
        pool_bytes = int(_C.vmm_bytes_on(int(str(device).split(":")[1])))
    except Exception:  # informative only
        pass
    result = {
        "success": success,
        "first_attempt_ok": first_attempt_ok,
        "error": error,
        "free": free,
        "total": total,
        "first": first,
        "second": second,
        "reserved_cached": reserved_cached,
        "reserved_after": torch.cuda.memory_reserved(device),
        "pool_bytes": pool_bytes,
        "pool_active": bool(pool is not None and pool.active),
        "pool_reason": pool.reason_off if pool is not None else "no memory pool in the session",
    }
    del big
    flexium.shutdown()
    return result


def step_names(op: dict[str, Any]) -> set[str]:
    return {s["step"] for s in op["result"]["steps"] if not s["rollback"]}


def driver_note(op: dict[str, Any]) -> str:
    notes = [n for n in op["result"]["notes"] if n.startswith("driver path: ")]
    assert notes, f"a driver-path {op['op']} in auto mode has no 'driver path: ' note: {op['result']['notes']}"
    return notes[0]


# ---- tests -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("two_gpus")
def test_fast_path_all_features_bit_identical(host_gpus: list[Any]) -> None:
    """AMP + GradScaler, activation checkpointing, a side stream with record_stream, a DataLoader
    with workers and pinned memory, a CUDA graph captured before any move: migrate there and back,
    pause, resume elsewhere, all on the fast path, and the loss trace is unchanged."""
    gpu0, gpu1 = uuid_of(host_gpus, 0), uuid_of(host_gpus, 1)
    idle = idle_used()
    # Slower steps (the losses do not depend on them): a fast pause prepares its host staging while
    # the job trains (1.1-1.4 s here), and its safe point must come well before the job's last step.
    common = (
        "--ballast-gb",
        BALLAST_GB,
        "--steps",
        "60",
        "--step-sleep",
        "0.1",
        "--pause-seconds",
        "0.5",
        *ALL_FEATURES,
    )
    expected = reference(*common)

    moved = ok_run(
        run_job(
            *common,
            "--plan",
            "8:migrate:cuda:1",
            "--plan",
            "16:migrate:cuda:0",
            "--plan",
            "24:pause",
            "--plan",
            "24:resume:cuda:1",
            timeout=JOB_TIMEOUT,
        )
    )
    ready = moved.one("ready")
    assert ready["pool_active"] is True, ready["pool_reason"]
    assert ready["migration"] is True
    assert ready["features"] == ["amp", "checkpointing", "side_stream", "dataloader", "cuda_graph"]
    assert [op["ok"] for op in moved.ops] == [True] * 4, summary(moved.ops)
    assert [op["result"]["path"] for op in moved.ops] == ["fast"] * 4, summary(moved.ops)
    to1, to0, pause, resume = moved.ops

    assert to1["physical"] == "cuda:1" and to1["logical"] == "cuda:0"
    assert_holds(to1, gpu1, BALLAST_GB)
    assert_left(to1, gpu0, idle)

    assert to0["physical"] == "cuda:0"
    assert_holds(to0, gpu0, BALLAST_GB)
    assert_left(to0, gpu1, idle)

    assert_left(pause, gpu0, idle)
    assert_left(pause, gpu1, idle)
    assert_copier_ran(pause, resume)

    assert resume["physical"] == "cuda:1"
    assert_holds(resume, gpu1, BALLAST_GB)
    assert_left(resume, gpu0, idle)

    for op in (to1, to0):
        assert step_names(op) >= FAST_ONLY_STEPS | LOCKED_STEPS, op["result"]["steps"]
        assert op["result"]["bytes_moved"] >= float(BALLAST_GB) * GIB
    assert step_names(pause) >= {"copy", "release", "lock", "checkpoint"}, pause["result"]["steps"]
    assert step_names(resume) >= {"restore", "unlock", "copy_back"}, resume["result"]["steps"]

    done = moved.one("done")
    assert done["ballast_ok"] is True
    assert done["physical"] == "cuda:1"
    assert tuple(done["losses"]) == expected, "loss trace differs from the undisturbed run"


@pytest.mark.usefixtures("two_gpus")
def test_fast_path_plain_adamw_and_paths_side_by_side(host_gpus: list[Any]) -> None:
    """The same job moved once on each path: fast to cuda:1, driver back to cuda:0."""
    gpu0, gpu1 = uuid_of(host_gpus, 0), uuid_of(host_gpus, 1)
    idle = idle_used()
    expected = reference(*PLAIN)
    run = ok_run(
        run_job(
            *PLAIN,
            "--plan",
            "10:migrate:cuda:1@fast",
            "--plan",
            "20:migrate:cuda:0@driver",
            timeout=JOB_TIMEOUT,
        )
    )
    assert run.one("ready")["pool_active"] is True, run.one("ready")["pool_reason"]
    assert [op["ok"] for op in run.ops] == [True, True], summary(run.ops)
    fast, driver = run.ops
    assert fast["result"]["path"] == "fast" and driver["result"]["path"] == "driver", summary(run.ops)

    assert step_names(fast) >= FAST_ONLY_STEPS | LOCKED_STEPS, fast["result"]["steps"]
    # The mapped copies came in through fds (a driver checkpoint cannot restore imported memory,
    # and NVML does not count it for the process): made the job's own at the next optimizer
    # steps, outside the move's downtime, and before the driver move.
    assert "own" not in step_names(fast), fast["result"]["steps"]
    assert fast["own_wait"] is not None, "the moved memory was still imported 60 s after the move"
    assert not step_names(driver) & (FAST_ONLY_STEPS | {"own"}), driver["result"]["steps"]
    assert step_names(driver) >= LOCKED_STEPS, driver["result"]["steps"]

    assert fast["physical"] == "cuda:1"
    assert_holds(fast, gpu1, BALLAST_GB)
    assert_left(fast, gpu0, idle)
    assert driver["physical"] == "cuda:0"
    assert_holds(driver, gpu0, BALLAST_GB)
    assert_left(driver, gpu1, idle)

    done = run.one("done")
    assert done["ballast_ok"] is True
    assert tuple(done["losses"]) == expected


def test_fast_pause_and_resume_in_place_all_features(host_gpus: list[Any]) -> None:
    """One GPU: the all-features job paused on the fast path and resumed where it was, twice (the
    staging is given back after each resume and prepared again for the next pause). While paused
    the job holds nothing on the GPU; the loss trace is unchanged."""
    gpu0 = uuid_of(host_gpus, 0)
    idle = idle_used()
    # Slower steps (the losses do not depend on them): a fast pause prepares its host staging while
    # the job trains, and its safe point must come before the job's last step. The second pause
    # comes right after the first resume and once took until step 39 to prepare: 60 steps.
    common = (
        "--ballast-gb",
        BALLAST_GB,
        "--steps",
        "60",
        "--step-sleep",
        "0.1",
        "--pause-seconds",
        "0.5",
        *ALL_FEATURES,
    )
    expected = reference(*common)

    run = ok_run(
        run_job(
            *common,
            "--plan",
            "8:pause",
            "--plan",
            "8:resume",
            "--plan",
            "16:pause",
            "--plan",
            "16:resume",
            timeout=JOB_TIMEOUT,
        )
    )
    ready = run.one("ready")
    assert ready["pool_active"] is True, ready["pool_reason"]
    assert ready["features"] == ["amp", "checkpointing", "side_stream", "dataloader", "cuda_graph"]
    assert [op["op"] for op in run.ops] == ["pause", "resume"] * 2, summary(run.ops)
    assert [op["ok"] for op in run.ops] == [True] * 4, summary(run.ops)
    assert [op["result"]["path"] for op in run.ops] == ["fast"] * 4, summary(run.ops)

    for pause, resume in (run.ops[0:2], run.ops[2:4]):
        assert_left(pause, gpu0, idle)  # the copier process's context is gone too
        assert_copier_ran(pause, resume)
        assert step_names(pause) >= {"copy", "release", "lock", "checkpoint"}, pause["result"]["steps"]
        assert resume["physical"] == "cuda:0"
        assert_holds(resume, gpu0, BALLAST_GB)
        assert step_names(resume) >= {"restore", "unlock", "copy_back"}, resume["result"]["steps"]

    done = run.one("done")
    assert done["ballast_ok"] is True
    assert done["physical"] == "cuda:0"
    assert tuple(done["losses"]) == expected, "loss trace differs from the undisturbed run"


@pytest.mark.parametrize("kind", ["host-cumem", "managed", "cuda-ipc"])
def test_memory_the_driver_cannot_checkpoint_is_refused_until_the_job_frees_it(host_gpus: list[Any], kind: str) -> None:
    """The job holds 4 MiB a kernel wrote that the driver's checkpoint cannot carry: cuMem host memory
    (as NCCL makes it; fact `cumem-host-memory-unrestorable`: the restore fails and the process never runs CUDA
    again), managed memory (as bitsandbytes' paged optimizers make it; fact `managed-memory-refused`: the checkpoint
    refuses it) or a CUDA tensor another process sent through torch.multiprocessing (fact `ipc-import-unrestorable`: the
    restore fails as for host memory). Its pause (and, with two GPUs, its migration) is refused before anything is
    touched, the job trains on, and once it freed that memory the pause and resume run; the loss
    trace is the undisturbed one."""
    gpu0 = uuid_of(host_gpus, 0)
    idle = idle_used()
    common = (*PLAIN, "--steps", "50", "--step-sleep", "0.1", "--pause-seconds", "0.5")
    expected = reference(*common)
    refused = ["4:pause", *(["4:migrate:cuda:1"] if len(host_gpus) >= 2 else [])]
    plan = [arg for item in (*refused, "40:pause", "40:resume") for arg in ("--plan", item)]
    # Held 36 steps (3.6 s): the keeper of a kept-ready pause looks every 2 s.
    run = ok_run(run_job(*common, "--hold-memory", f"{kind}:36", *plan, timeout=JOB_TIMEOUT))
    held = run.one("memory_held")["address"]
    said = {
        "managed": "managed memory (1 mapping",
        "host-cumem": "cuMem memory located on the host (1 mapping",
        "cuda-ipc": "CUDA memory imported from another process (1 storage",
    }[kind]
    assert [op["ok"] for op in run.ops] == [False] * len(refused) + [True, True], summary(run.ops)
    for op in run.ops[: len(refused)]:
        assert op["error_type"] == "CapabilityError", summary(run.ops)
        assert op["error"].startswith(f"cannot {op['op']}: this process holds {said}, 4.0 MiB, "), op
        assert f"the first at {held:#x}" in op["error"], op["error"]
        assert op["state"] == "RUNNING" and op["result"] is None  # refused before any step ran
        assert_holds(op, gpu0, BALLAST_GB)
    freed = run.one("memory_freed")
    assert freed["intact"] is True  # what the kernel wrote was never touched
    # no host memory was kept pinned for a pause that would have been refused
    assert freed["kept_pinned"] == 0, freed
    assert freed["keeper_note"].startswith(
        f"nothing is kept pinned between pauses: a pause of this job is refused now: this process holds {said}"
    ), freed
    pause, resume = run.ops[len(refused) :]
    assert pause["result"]["path"] == "fast", summary(run.ops)
    if kind == "managed":
        # A job that used managed memory leaves 124-128 MiB on its GPU while paused, counted for
        # no process, beside its copier process (fact `managed-memory-refused`): only its own is checked.
        assert pause["nvml"][gpu0]["ours"] == 0, pause["nvml"]
    else:
        assert_left(pause, gpu0, idle)
    assert_holds(resume, gpu0, BALLAST_GB)
    done = run.one("done")
    assert done["ballast_ok"] is True
    assert tuple(done["losses"]) == expected, "loss trace differs from the undisturbed run"


@pytest.mark.parametrize("path", ["fast", "driver"])
def test_a_resume_onto_a_gpu_taken_meanwhile_is_refused_and_the_job_stays_paused(
    host_gpus: list[Any], path: str
) -> None:
    """Paused to hand its GPU to another job, the job is resumed while that job still holds the GPU:
    the resume is refused before the driver is asked (a restore without room would fail), the job
    stays paused with nothing on the GPU, and once the GPU is free again the resume runs and the loss
    trace is the undisturbed one."""
    common = (*PLAIN, "--step-sleep", "0.1", "--pause-seconds", "0.5")
    expected = reference(*common)
    plan = ["8:pause@" + path, "8:occupy:1", "8:resume", "8:vacate", "8:resume"]
    run = ok_run(run_job(*common, *[arg for item in plan for arg in ("--plan", item)], timeout=JOB_TIMEOUT))
    assert [op["ok"] for op in run.ops] == [True, False, True], summary(run.ops)
    pause, refused, resume = run.ops
    assert pause["result"]["path"] == path, summary(run.ops)
    gpu = uuid_of(host_gpus, 0)
    occupied = run.one("occupied")
    assert occupied["free_after"] < 1.5 * GIB, occupied
    assert refused["error_type"] == "TargetRefusedError", summary(run.ops)
    assert " free; the paused job needs " in refused["error"], refused["error"]
    assert "it stays paused; free memory there" in refused["error"], refused["error"]
    assert refused["state"] == "PAUSED" and refused["result"] is None  # refused before any step ran
    assert refused["nvml"][gpu]["ours"] == 0, refused["nvml"]
    assert run.one("vacated")["exit"] == 0
    assert_holds(resume, gpu, BALLAST_GB)
    done = run.one("done")
    assert done["ballast_ok"] is True
    assert tuple(done["losses"]) == expected, "loss trace differs from the undisturbed run"


def test_a_resume_with_room_for_the_job_but_not_the_copier_copies_back_in_this_process(host_gpus: list[Any]) -> None:
    """After a fast pause another process leaves the GPU only 0.2 GiB more than the job held: the
    copier's context (about 0.5 GiB) would leave the restore or the copy back without room (a
    restore without room loses the job, fact `restore-without-room-loses-process`), so it sleeps on and the job's own
    process copies back; the loss trace is the undisturbed one."""
    common = (*PLAIN, "--step-sleep", "0.1", "--pause-seconds", "0.5")
    expected = reference(*common)
    plan = ["8:pause@fast", "8:occupy:+0.2", "8:resume", "8:vacate"]
    run = ok_run(run_job(*common, *[arg for item in plan for arg in ("--plan", item)], timeout=JOB_TIMEOUT))
    assert [op["ok"] for op in run.ops] == [True, True], summary(run.ops)
    pause, resume = run.ops
    assert pause["result"]["path"] == "fast" and resume["result"]["path"] == "fast", summary(run.ops)
    occupied = run.one("occupied")
    assert occupied["free_after"] < pause["result"]["bytes_moved"] + 0.3 * GIB, occupied
    assert any(
        note.startswith("the copies to and from host memory ran in this process: the GPU has ")
        for note in resume["result"]["notes"]
    ), summary(run.ops)
    assert_holds(resume, uuid_of(host_gpus, 0), BALLAST_GB)
    done = run.one("done")
    assert done["ballast_ok"] is True
    assert tuple(done["losses"]) == expected, "loss trace differs from the undisturbed run"


@pytest.mark.parametrize("path", ["fast", "driver"])
def test_batches_delivered_while_paused_are_pinned_after_the_resume(path: str) -> None:
    """A DataLoader whose workers take longer per batch than a step: batches keep arriving while
    the job is paused, and its pin-memory thread would pin them then, which kills a checkpointed
    process (fact `pinning-while-paused-kills`). flexium holds that thread until the resume: the job lives
    through two pauses of 2 s and its loss trace is unchanged."""
    common = ("--ballast-gb", "1", "--steps", "40", "--step-sleep", "0", "--dataloader", "--batch-delay", "0.2")
    expected = reference(*common)
    run = ok_run(
        run_job(
            *common,
            "--pause-seconds",
            "2",
            "--path",
            path,
            "--plan",
            "8:pause",
            "--plan",
            "8:resume",
            "--plan",
            "20:pause",
            "--plan",
            "20:resume",
            timeout=JOB_TIMEOUT,
        )
    )
    assert [op["ok"] for op in run.ops] == [True] * 4, summary(run.ops)
    assert [op["result"]["path"] for op in run.ops] == [path] * 4, summary(run.ops)
    assert tuple(run.one("done")["losses"]) == expected, "loss trace differs from the undisturbed run"


def test_driver_and_fast_pause_side_by_side_in_place(host_gpus: list[Any]) -> None:
    """One GPU: the plain job paused on the driver path and resumed in place, then paused again
    in auto mode, which takes the fast path (the driver round trip left nothing that blocks it),
    and resumed in place. Nothing of the job stays on the GPU while paused; the loss trace is
    unchanged."""
    gpu0 = uuid_of(host_gpus, 0)
    idle = idle_used()
    # Slower steps (the losses do not depend on them): the fast pause prepares its host staging
    # while the job trains, and its safe point must come well before the job's last step (it came
    # at step 24 of 30 once): 45 steps.
    common = (*PLAIN, "--steps", "45")
    expected = reference(*common)
    run = ok_run(
        run_job(
            *common,
            "--step-sleep",
            "0.1",
            "--plan",
            "6:pause@driver",
            "--plan",
            "6:resume",
            "--plan",
            "12:pause",
            "--plan",
            "12:resume",
            timeout=JOB_TIMEOUT,
        )
    )
    assert run.one("ready")["pool_active"] is True, run.one("ready")["pool_reason"]
    assert [op["op"] for op in run.ops] == ["pause", "resume"] * 2, summary(run.ops)
    assert [op["ok"] for op in run.ops] == [True] * 4, summary(run.ops)
    assert [op["result"]["path"] for op in run.ops] == ["driver", "driver", "fast", "fast"], summary(run.ops)
    driver_pause, driver_resume, fast_pause, fast_resume = run.ops

    assert not step_names(driver_pause) & FAST_ONLY_STEPS, driver_pause["result"]["steps"]
    assert step_names(driver_pause) >= {"lock", "checkpoint"}, driver_pause["result"]["steps"]
    assert "copy_back" not in step_names(driver_resume), driver_resume["result"]["steps"]
    assert step_names(driver_resume) >= {"restore", "unlock"}, driver_resume["result"]["steps"]
    assert step_names(fast_pause) >= {"copy", "release", "lock", "checkpoint"}, fast_pause["result"]["steps"]
    assert step_names(fast_resume) >= {"restore", "unlock", "copy_back"}, fast_resume["result"]["steps"]
    # The driver's restore left the pool unexportable; it was made exportable again in time.
    assert_copier_ran(fast_pause, fast_resume)

    for pause, resume in ((driver_pause, driver_resume), (fast_pause, fast_resume)):
        assert_left(pause, gpu0, idle)
        assert resume["physical"] == "cuda:0"
        assert_holds(resume, gpu0, BALLAST_GB)

    done = run.one("done")
    assert done["ballast_ok"] is True
    assert done["physical"] == "cuda:0"
    assert tuple(done["losses"]) == expected, "loss trace differs from the undisturbed run"


@pytest.mark.usefixtures("two_gpus")
def test_no_safe_point_falls_back_to_driver_path(host_gpus: list[Any]) -> None:
    """Step 10 sleeps 6 s before its optimizer step. The migrate, issued right after step 9,
    waits FLEXIUM_SAFE_POINT_WAIT=1 s for a safe point, then runs the driver path inline while
    the loop sleeps. A later migrate finds safe points again and takes the fast path."""
    gpu0, gpu1 = uuid_of(host_gpus, 0), uuid_of(host_gpus, 1)
    idle = idle_used()
    env = {"FLEXIUM_SAFE_POINT_WAIT": "1"}
    stall = ("--stall-at", "10", "--stall-seconds", "6")
    reference_run = ok_run(run_job(*PLAIN, *stall, env=env, timeout=JOB_TIMEOUT))
    run = ok_run(
        run_job(
            *PLAIN,
            *stall,
            "--plan",
            "9:migrate:cuda:1",
            "--plan",
            "20:migrate:cuda:0",
            env=env,
            timeout=JOB_TIMEOUT,
        )
    )
    assert run.one("ready")["pool_active"] is True, run.one("ready")["pool_reason"]
    assert [op["ok"] for op in run.ops] == [True, True], summary(run.ops)
    stalled, later = run.ops

    assert stalled["result"]["path"] == "driver", summary(run.ops)
    assert "safe point" in driver_note(stalled), stalled["result"]["notes"]
    assert not step_names(stalled) & FAST_ONLY_STEPS, stalled["result"]["steps"]
    assert stalled["physical"] == "cuda:1"
    assert_holds(stalled, gpu1, BALLAST_GB)
    assert_left(stalled, gpu0, idle)

    assert later["result"]["path"] == "fast", summary(run.ops)
    assert later["physical"] == "cuda:0"
    assert_left(later, gpu1, idle)

    done = run.one("done")
    assert done["ballast_ok"] is True
    assert done["losses"] == reference_run.one("done")["losses"]


@pytest.mark.usefixtures("two_gpus")
def test_pool_switched_off_and_early_allocation_use_driver_path(host_gpus: list[Any]) -> None:
    gpu0 = uuid_of(host_gpus, 0)
    idle = idle_used()

    # (1) FLEXIUM_FAST_PATH=0: no pool; auto takes the driver path, "fast" is refused.
    off = ok_run(
        run_job(
            *TINY,
            "--plan",
            "5:migrate:cuda:1",
            "--plan",
            "10:migrate:cuda:0@fast",
            env={"FLEXIUM_FAST_PATH": "0"},
            timeout=JOB_TIMEOUT,
        )
    )
    ready = off.one("ready")
    assert ready["pool_active"] is False and ready["pool_reason"], ready
    moved, refused = off.ops
    assert moved["ok"] is True and moved["result"]["path"] == "driver", summary(off.ops)
    driver_note(moved)
    assert moved["physical"] == "cuda:1"
    assert_left(moved, gpu0, idle)
    assert refused["ok"] is False and refused["error_type"] == "CapabilityError", summary(off.ops)
    assert refused["state"] == "RUNNING"
    done = off.one("done")
    assert done["ballast_ok"] is True and done["physical"] == "cuda:1"

    # (2) CUDA memory allocated before flexium.init(): the pool stays off, the driver path runs.
    early = ok_run(run_job(*TINY, "--alloc-before-init", "64", "--plan", "5:migrate:cuda:1", timeout=JOB_TIMEOUT))
    ready = early.one("ready")
    assert ready["pool_active"] is False, ready
    assert "before flexium.init()" in (ready["pool_reason"] or ""), ready["pool_reason"]
    (op,) = early.ops
    assert op["ok"] is True and op["result"]["path"] == "driver", summary(early.ops)
    assert "before flexium.init()" in driver_note(op)
    assert op["physical"] == "cuda:1"
    assert_left(op, gpu0, idle)
    done = early.one("done")
    assert done["ballast_ok"] is True and done["early_ok"] is True


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param("0.6", "0.7", id="cached-smaller-then-larger"),
        pytest.param("0.7", "0.6", id="cached-larger-then-smaller"),
    ],
)
def test_out_of_memory_retry_frees_pool_cache(host_gpus: list[Any], first: str, second: str) -> None:
    """A deleted tensor's block stays cached in the pool; a second allocation that does not fit
    beside it must still succeed: PyTorch frees the oversize cached block (max_split_size_mb,
    set by flexium) and retries. When the cached block is smaller than the request, PyTorch
    frees it but does not retry while a pool is routed (the caller's retry then succeeds;
    without the setting nothing would be freed and it would fail again)."""
    result = run_in_fresh_process(out_of_memory_retry, float(first), float(second), timeout=JOB_TIMEOUT)
    assert result["pool_active"] is True, result["pool_reason"]
    assert result["first"] + result["second"] > result["free"]
    assert result["reserved_cached"] >= result["first"], result  # the first block was cached, not freed
    assert result["success"] is True, result
    if float(first) > float(second):
        assert result["first_attempt_ok"] is True, result  # the cached block covered the request
    assert result["reserved_after"] < result["first"] + result["second"], result


@pytest.mark.usefixtures("two_gpus")
def test_target_without_room_is_refused_on_the_fast_path(host_gpus: list[Any], gpu_filler: Any) -> None:
    """With the pool active and the fast path asked for, a target without room is refused before
    anything moves, and training continues unchanged."""
    gpu0, gpu1 = uuid_of(host_gpus, 0), uuid_of(host_gpus, 1)
    expected = reference(*PLAIN)
    gpu_filler(1, 1.0)  # leaves 1 GiB free on GPU 1; the job holds over 2
    run = ok_run(run_job(*PLAIN, "--path", "fast", "--plan", "10:migrate:cuda:1", timeout=JOB_TIMEOUT))
    assert run.one("ready")["pool_active"] is True, run.one("ready")["pool_reason"]
    (op,) = run.ops
    assert op["ok"] is False and op["error_type"] == "TargetRefusedError", summary(run.ops)
    assert "free" in op["error"] and op["state"] == "RUNNING"
    assert op["nvml"][gpu1]["ours"] == 0
    assert op["nvml"][gpu0]["ours"] >= float(BALLAST_GB) * GIB
    done = run.one("done")
    assert done["physical"] == "cuda:0" and done["ballast_ok"] is True
    assert tuple(done["losses"]) == expected

"""flexium._C against the real driver: the measured facts our engine relies on still hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.fresh_process import run_in_fresh_process
from support.gpu import GIB

# The probe that measured fact `cumem-host-memory-unrestorable`.
PROBES = Path(__file__).resolve().parents[2] / "bench" / "probes"
CUDA_CALL_WAIT_S = 10.0


def native_checks() -> dict[str, dict[str, Any]]:
    """Drives flexium._C against the real driver (run in a fresh process): each check's readings."""
    import torch

    from flexium import _C
    from flexium.engine import nvml

    def fields(record: object) -> dict[str, object]:
        """A bound record (DriverStatus) as a dict."""
        return {name: getattr(record, name) for name in dir(record) if not name.startswith("_")}

    def outcomes(items: list[Any]) -> list[dict[str, object]]:
        return [{"step": o.step, "rollback": o.rollback, "code": o.code, "error": o.error_name} for o in items]

    def ours() -> dict[str, int]:
        return {gpu.uuid: gpu.used_by(os.getpid()) or 0 for gpu in nvml.host_gpus()}

    pid = os.getpid()
    devices = _C.list_devices()
    checks: dict[str, dict[str, Any]] = {}
    checks["devices"] = {
        "uuids": [d.uuid for d in devices],
        "names": [d.name for d in devices],
        "nvml": [g.uuid for g in nvml.host_gpus()],
        "status": fields(_C.driver_status()),
    }
    data = torch.arange(256 << 20, dtype=torch.int32, device="cuda:0")  # 1 GiB
    expected = int(data[::1009].sum().item())
    torch.cuda.synchronize()
    u0, u1 = devices[0].uuid, devices[1].uuid
    others = [(d.uuid, d.uuid) for d in devices[2:]]
    try:
        _C.unlock(pid)
        checks["unlock_running"] = {"raised": False}
    except _C.DriverError as exc:
        checks["unlock_running"] = {
            "raised": True,
            "call": exc.call,
            "code": exc.code,
            "name": exc.error_name,
            "message": str(exc),
        }
    rollbacks = [[], [_C.Step(_C.StepKind.RECOVER)], [_C.Step(_C.StepKind.RECOVER)], [_C.Step(_C.StepKind.UNLOCK)]]
    single = _C.run_steps(
        pid,
        [
            _C.Step(_C.StepKind.LOCK, timeout_ms=10000),
            _C.Step(_C.StepKind.CHECKPOINT),
            _C.Step(_C.StepKind.RESTORE, pairs=[_C.GpuPair(u0, u1)]),
            _C.Step(_C.StepKind.UNLOCK),
        ],
        rollbacks,
    )
    checks["single_pair"] = {
        "outcomes": outcomes(single),
        "state": _C.process_state(pid).name,
        "intact": int(data[::1009].sum().item()) == expected,
        "ours": ours(),
    }
    pairs = [_C.GpuPair(u0, u1), _C.GpuPair(u1, u0)] + [_C.GpuPair(a, b) for a, b in others]
    full = _C.run_steps(
        pid,
        [
            _C.Step(_C.StepKind.LOCK, timeout_ms=10000),
            _C.Step(_C.StepKind.CHECKPOINT),
            _C.Step(_C.StepKind.RESTORE, pairs=pairs),
            _C.Step(_C.StepKind.UNLOCK),
        ],
        rollbacks,
    )
    checks["full_pairs"] = {
        "outcomes": outcomes(full),
        "state": _C.process_state(pid).name,
        "intact": int(data[::1009].sum().item()) == expected,
        "ours": ours(),
        "reported_uuid": _C.list_devices()[0].uuid,
    }
    return checks


def unrestorable_outcome() -> dict[str, Any]:
    """A process the driver cannot restore (run in a fresh process, which is lost): it holds a cuMem
    allocation on the host NUMA node mapped for the GPU and the CPU (as NCCL makes its shared host
    memory unless NCCL_CUMEM_HOST_ENABLE=0), reached by a kernel, and runs flexium's native steps on
    itself from a thread: lock, checkpoint, restore; then, what is left: a second restore, an
    unlock, the driver's state of the process, and whether a CUDA call returns within 10 s. Each
    call's CUresult."""
    import threading
    import time

    import torch

    from flexium import _C

    sys.path.insert(0, str(PROBES))
    from host_memory_restore import DeviceView, mapped_host_memory

    def codes(outcomes: list[Any]) -> list[list[object]]:
        return [[o.step, o.code] for o in outcomes]

    torch.ones(1, device="cuda").sum().item()
    device, _host, _keep = mapped_host_memory("cumem-host", 4 << 20)
    view = torch.as_tensor(DeviceView(device, 1 << 20), device="cuda")
    view.fill_(1.0)  # a kernel has reached it, as NCCL's do (fact `cumem-host-memory-unrestorable`'s probe)
    assert view.sum().item() == 1 << 20
    pid = os.getpid()
    outcome: dict[str, Any] = {}

    def locked_section() -> None:  # no CUDA call on the thread that locks: it would wait for the unlock
        steps = [_C.Step(_C.StepKind.LOCK, timeout_ms=10_000), _C.Step(_C.StepKind.CHECKPOINT)]
        outcome["first"] = codes(_C.run_steps(pid, [*steps, _C.Step(_C.StepKind.RESTORE)], [[], [], []]))
        outcome["again"] = codes(_C.run_steps(pid, [_C.Step(_C.StepKind.RESTORE)], [[]]))
        outcome["unlock"] = codes(_C.run_steps(pid, [_C.Step(_C.StepKind.UNLOCK)], [[]]))
        outcome["state"] = _C.process_state(pid).name

    section = threading.Thread(target=locked_section, daemon=True)
    section.start()
    section.join()
    summed: list[float] = []
    call = threading.Thread(target=lambda: summed.append(view.sum().item()), daemon=True)
    started = time.perf_counter()
    call.start()
    call.join(CUDA_CALL_WAIT_S)
    waited = time.perf_counter() - started
    outcome["cuda_call"] = f"returned {summed[0]:g}" if summed else f"no return in {waited:.0f} s"
    return outcome


def room_check_cases() -> dict[str, dict[str, Any]]:
    """The room check before a restore (csrc/room_check.h) against the real driver and NVML, on one
    GPU (run in a fresh process): the process checkpoints itself, asks its NVML reader process how
    much the GPU has free, and restores only where that covers what it needs. Each case's outcome."""
    import torch

    from flexium import _C
    from flexium.engine import nvml

    pid = os.getpid()
    data = torch.arange(256 << 20, dtype=torch.int32, device="cuda:0")  # 1 GiB
    expected = int(data[::1009].sum().item())
    torch.cuda.synchronize()
    uuid = _C.list_devices()[0].uuid
    total = next(gpu.memory_total for gpu in nvml.host_gpus() if gpu.uuid == uuid)
    cases: dict[str, dict[str, Any]] = {"gpu": {"uuid": uuid, "total": total}}
    nvml.start_reader()
    # More than the GPU has: the restore is not tried and the rollback restores the job where it was.
    # Then what it holds: the restore runs.
    for case, needed in (("refused", total + (1 << 30)), ("passed", 1 << 30)):
        with nvml.reader_pipes() as pipes:
            assert pipes is not None, "no NVML reader process"
            steps = [
                _C.Step(_C.StepKind.LOCK, timeout_ms=10000),
                _C.Step(_C.StepKind.CHECKPOINT),
                _C.room_check_step(pipes[0], pipes[1], uuid, needed, 2000),
                _C.Step(_C.StepKind.RESTORE),
                _C.Step(_C.StepKind.UNLOCK),
            ]
            rollbacks = [
                [],
                [_C.Step(_C.StepKind.RECOVER)],
                [_C.Step(_C.StepKind.RECOVER)],
                [_C.Step(_C.StepKind.RECOVER)],
                [_C.Step(_C.StepKind.UNLOCK)],
            ]
            outcomes = _C.run_steps(pid, steps, rollbacks)
        cases[case] = {
            "needed": needed,
            "outcomes": [
                {
                    "step": o.step,
                    "rollback": o.rollback,
                    "code": o.code,
                    "error": o.error_name,
                    "text": o.error_text,
                    "seconds": o.seconds,
                }
                for o in outcomes
            ],
            "state": _C.process_state(pid).name,
            "intact": int(data[::1009].sum().item()) == expected,
        }
    nvml.stop_reader()
    return cases


# native_checks restores GPU 0's context onto GPU 1 (devices[1]).
@pytest.mark.usefixtures("two_gpus")
def test_native_layer_on_the_real_driver() -> None:
    checks = run_in_fresh_process(native_checks)
    devices = checks["devices"]
    assert devices["status"]["loaded"] and devices["status"]["checkpoint_api"]
    assert set(devices["uuids"]) <= set(devices["nvml"])

    unlock = checks["unlock_running"]
    assert unlock["raised"] and unlock["call"] == "cuCheckpointProcessUnlock"
    assert unlock["name"] in unlock["message"]

    # One pair is refused (fact `restore-pairs-every-gpu`); the recover rollback brings the job back in place
    # (fact `failed-restore-stays-checkpointed`).
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
    # The driver API names the new GPU after the move (PyTorch's cached properties do not: fact
    # `remap-keeps-old-identity`).
    assert full["reported_uuid"] == devices["uuids"][1]


def test_importing_flexium_before_torch_leaves_torch_working() -> None:
    # fact `extension-loads-before-torch`: a job that imports flexium first (python -m flexium.cli.demo_job does)
    # once crashed inside `import torch`.
    code = "import flexium._C; import torch; print(torch.ones(2, device='cuda').sum().item())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "2.0"


def test_the_driver_cannot_restore_host_cumem_memory_and_the_process_is_lost() -> None:
    """Why flexium never checkpoints a process holding cuMem host memory (fact `cumem-host-memory-unrestorable`,
    engine/uncheckpointable_memory.py): the driver's restore of it fails, a second restore and the
    unlock fail too, the process stays checkpointed and its CUDA calls never return. Should a
    driver restore it one day, this test says so (and the refusal can go)."""
    seen = run_in_fresh_process(unrestorable_outcome, exit_at_once=True)
    assert seen["first"][:2] == [["lock", 0], ["checkpoint", 0]], seen
    restore, code = seen["first"][2]
    assert restore == "restore" and code != 0, (
        f"the driver restored memory it could not before (fact `cumem-host-memory-unrestorable`): {seen}"
    )
    assert seen["again"][0][1] != 0 and seen["unlock"][0][1] != 0, seen
    assert seen["state"] == "CHECKPOINTED", seen
    assert seen["cuda_call"].startswith("no return in"), seen


def test_the_room_check_before_a_restore_asks_nvml_and_a_refusal_rolls_back_in_place() -> None:
    """csrc/room_check.h on one GPU, against the real driver and NVML: the process checkpoints
    itself and asks its NVML reader process (engine/nvml.py --serve) over its pipes how much the GPU
    has free. Needing more than the GPU has, the restore is not tried and the rollback restores the
    process in place, its memory intact (fact `restore-without-room-loses-process`: a restore without room loses the
    job); needing what it holds, the restore runs."""
    cases = run_in_fresh_process(room_check_cases)
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
    # said in whole MiB; the total leaves out the driver's reserve (engine/nvml.py), so need not be whole MiB
    assert total // 2 < int(said[1]) << 20 <= total and int(said[2]) == refused["needed"] >> 20, said.groups()
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

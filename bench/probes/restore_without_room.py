"""What the driver does when a restore finds too little room on the GPU: fact `restore-without-room-loses-process`
(the process is lost: out of memory, then CUDA_ERROR_OPERATING_SYSTEM for good), to run again on
a new driver (NVIDIA's cuda-checkpoint issue 44).

    python bench/probes/restore_without_room.py [--gb 8] [--cases 2,-0.25] [--timeout 120]

Each case is a fresh process that holds --gb GiB of device memory written by a kernel, and runs
the driver's steps on itself from a thread of its own (no CUDA call on the thread that locks):
lock and checkpoint. Another process then takes the GPU, leaving the case's GiB free (a negative
case: that much less than the job held), and the restore is tried: its CUresult, the process's
state, and what the job then holds on the GPU. The other process ends, and the restore is tried
again; then whatever brings the process back (an unlock), and whether a CUDA call returns with
the bytes intact within 10 s. One table row per case. Needs a GPU and flexium built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import run_child  # noqa: E402
from tables import print_table  # noqa: E402

GIB = 1 << 30
CUDA_CALL_WAIT_S = 10.0


def _emit(event: str, **data: object) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def _progress(what: str) -> None:
    print(what, file=sys.stderr, flush=True)  # the last line says how far a killed case came


def filler_main(leave: int) -> None:
    """Takes the GPU until stdin closes, leaving `leave` bytes free."""
    import torch

    torch.ones(1, device="cuda").sum().item()
    free, _ = torch.cuda.mem_get_info()
    hold = torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda")
    _emit("filled", free_after=torch.cuda.mem_get_info()[0], held=hold.numel())
    sys.stdin.read()


def case_main(gb: float, leave_gib: float) -> None:
    import torch

    from flexium import _C
    from flexium.engine import nvml

    pid = os.getpid()
    data = torch.full((int(gb * GIB) // 4,), 3.0, device="cuda")
    torch.cuda.synchronize()
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)

    def held() -> int:
        gpu = nvml.gpu_by_uuid(uuid)
        return (gpu.used_by(pid) or 0) if gpu is not None else -1

    result: dict[str, Any] = {"held_before": held()}

    def steps(*kinds: Any) -> list[list[object]]:
        outcomes: list[Any] = []
        thread = threading.Thread(
            target=lambda: outcomes.extend(_C.run_steps(pid, [_C.Step(k) for k in kinds], [[] for _ in kinds])),
            daemon=True,
        )
        thread.start()
        thread.join(60)
        if thread.is_alive():
            return [["no return in 60 s"]]
        return [[o.step, o.error_name if o.code else "ok", round(float(o.seconds), 3)] for o in outcomes]

    # NVML calls of a locked or checkpointed process wait until it runs again: read from a child.
    nvml.set_frozen(True)
    _progress("lock and checkpoint")
    result["checkpoint"] = steps(_C.StepKind.LOCK, _C.StepKind.CHECKPOINT)
    result["held_checkpointed"] = held()
    leave = int(leave_gib * GIB) if leave_gib >= 0 else max(0, result["held_before"] + int(leave_gib * GIB))
    filler = subprocess.Popen(
        [sys.executable, __file__, "--fill", str(leave)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert filler.stdout is not None and filler.stdin is not None
    result["filled"] = json.loads(filler.stdout.readline())
    _progress(f"restore with {result['filled']['free_after'] / GIB:.2f} GiB free")
    result["restore_without_room"] = steps(_C.StepKind.RESTORE)
    result["state_after"] = _C.process_state(pid).name
    result["held_after"] = held()
    filler.stdin.close()
    filler.wait(timeout=60)
    _progress("restore with the GPU free")
    result["restore_with_room"] = steps(_C.StepKind.RESTORE)
    result["state_then"] = _C.process_state(pid).name
    if result["state_then"] != "RUNNING":
        result["unlock"] = steps(_C.StepKind.UNLOCK)
    result["state_end"] = _C.process_state(pid).name
    if result["state_end"] == "RUNNING":
        nvml.set_frozen(False)
    _progress(f"{result['state_end']}; a CUDA call")
    summed: list[float] = []
    call = threading.Thread(target=lambda: summed.append(float(data[:: 1 << 20].sum().item())), daemon=True)
    started = time.perf_counter()
    call.start()
    call.join(CUDA_CALL_WAIT_S)
    expected = 3.0 * len(range(0, data.numel(), 1 << 20))
    if summed:
        result["cuda_call"] = "bytes intact" if summed[0] == expected else f"sum {summed[0]:g}, expected {expected:g}"
    else:
        result["cuda_call"] = f"no return in {time.perf_counter() - started:.0f} s"
    _emit("result", ok=True, **result)
    sys.stdout.flush()
    os._exit(0)  # a CUDA call may still wait: no interpreter shutdown


def _short(outcomes: Any) -> str:
    return ", ".join(f"{o[0]} {o[1]} {o[2]} s" if len(o) == 3 else str(o[0]) for o in outcomes or [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=8.0, help="GiB the job holds")
    parser.add_argument("--cases", default="2,-0.25", help="GiB left free while the restore runs (negative: short by)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--case", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--fill", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fill is not None:
        filler_main(args.fill)
        return 0
    if args.case is not None:
        case_main(args.gb, args.case)
        return 0
    columns = ("GiB free at the restore", "restore without room", "then", "restore with room", "end")
    rows = []
    for case in (float(c) for c in args.cases.split(",")):
        argv = [sys.executable, __file__, "--gb", str(args.gb), "--case", str(case)]
        seen = run_child(argv, dict(os.environ), args.timeout).result(failed={}, timeout=args.timeout)
        print(json.dumps({"case": case, **seen}), flush=True)
        free = seen.get("filled", {}).get("free_after")
        held = seen.get("held_before", 0) / GIB
        rows.append(
            (
                "-" if free is None else f"{free / GIB:.2f} (the job held {held:.2f})",
                _short(seen.get("restore_without_room")) or str(seen.get("error", "")),
                f"{seen.get('state_after', '-')}, holds {seen.get('held_after', 0) / GIB:.2f} GiB",
                _short(seen.get("restore_with_room")),
                f"{seen.get('state_end', '-')} {_short(seen.get('unlock'))}; CUDA: {seen.get('cuda_call', '-')}",
            )
        )
    print_table(columns, rows)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(columns, r, strict=True)) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

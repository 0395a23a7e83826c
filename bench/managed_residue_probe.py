"""What a checkpointed process that used managed memory leaves on its GPU: the measurement behind
docs/facts.md fact 27's last part.

    python bench/managed_residue_probe.py [--timeout 60]

Each case is a fresh process on cuda:0 (torch initialised) that, before it checkpoints itself with
flexium's native steps, did what the case names: "managed" made 4 MiB of managed memory
(cuMemAllocManaged), had a kernel write it and freed it; "vmm kept" made 1 GiB of cuMem device
memory in an address range of its own, had a kernel write it, and unmapped and released it with
the range still reserved (as flexium's pool does at a pause); "vmm freed" freed the range too;
"vmm mapped" kept the memory mapped (the checkpoint carries it). The "managed" case runs again
beside another process that only initialised CUDA (cuInit, as flexium's copier process waits), or
that holds a context on the GPU (as another job, or the copier while it pins); that process then
ends while the case is still checkpointed. The table gives nvidia-smi's memory.used of the GPU
before the case started, while it ran, while it was checkpointed, and (beside another process)
once that process ended. Needs a GPU, nvidia-smi and flexium built.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # children.py, tables.py, staging_probe.py beside it

from children import run_child  # noqa: E402
from tables import print_table  # noqa: E402

CASES = ("managed", "vmm kept", "vmm kept + managed", "vmm freed + managed", "vmm mapped + managed")
BESIDE = ("cuInit only", "a context")  # what the other process beside the "managed" case did
MANAGED_BYTES = 4 << 20
VMM_BYTES = 1 << 30


def used_mib() -> int:
    """The GPU's memory.used as nvidia-smi reads it (what an operator sees)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(out.stdout.split()[0])


def beside_main(kind: str) -> None:
    """Initialises CUDA (and with "a context" makes one on cuda:0), says so, and waits for stdin to close."""
    from staging_probe import Driver

    drv = Driver()
    if kind == "a context":
        drv.primary_context(0)
        drv.synchronize()
    else:
        drv.call("cuInit", 0)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()


def case_main(case: str, wait: bool) -> None:
    import torch

    from flexium import _C
    from shared_gpu_probe import _DeviceView
    from staging_probe import Driver

    def written_by_a_kernel(address: int, nbytes: int) -> None:
        view = torch.as_tensor(_DeviceView(address, nbytes // 4), device="cuda")
        view.fill_(1.0)
        torch.cuda.synchronize()

    torch.ones(1, device="cuda:0").sum().item()
    drv = Driver()
    drv.primary_context(0)
    if case.startswith("vmm"):
        va = drv.reserve(VMM_BYTES)
        handle = drv.create(VMM_BYTES, drv.prop(0, exportable=False))
        drv.map(va, VMM_BYTES, handle)
        drv.set_access(va, VMM_BYTES, 0)
        written_by_a_kernel(va, VMM_BYTES)
    if case.endswith("managed"):
        address = ctypes.c_uint64()
        allocate = drv.lib.cuMemAllocManaged
        allocate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_uint]
        assert allocate(ctypes.byref(address), MANAGED_BYTES, 1) == 0  # CU_MEM_ATTACH_GLOBAL
        written_by_a_kernel(address.value, MANAGED_BYTES)
        drv.call("cuMemFree", address.value)
    if case.startswith(("vmm kept", "vmm freed")):
        drv.call("cuMemUnmap", va, VMM_BYTES)
        drv.call("cuMemRelease", handle)
        if case.startswith("vmm freed"):
            drv.call("cuMemAddressFree", va, VMM_BYTES)
    torch.cuda.synchronize()
    running = used_mib()
    pid = os.getpid()
    recover = [_C.Step(_C.StepKind.RECOVER)]
    stopped = _C.run_steps(
        pid, [_C.Step(_C.StepKind.LOCK, timeout_ms=10000), _C.Step(_C.StepKind.CHECKPOINT)], [[], recover]
    )
    time.sleep(0.5)  # what the driver frees, it frees before the checkpoint returns; read after a pause
    checkpointed = used_mib()
    later = None
    if wait:  # the parent ends the process beside this one, then says go
        print(json.dumps({"checkpointed": checkpointed}), flush=True)
        sys.stdin.readline()
        time.sleep(0.5)
        later = used_mib()
    back = _C.run_steps(pid, [_C.Step(_C.StepKind.RESTORE), _C.Step(_C.StepKind.UNLOCK)], [recover, []])
    ok = all(o.code == 0 for o in [*stopped, *back])
    print(json.dumps({"running": running, "checkpointed": checkpointed, "later": later, "ok": ok}), flush=True)


def _line(stream: Any, deadline: float) -> dict[str, Any]:
    """The next JSON line of a child's output, within `deadline` (a monotonic time)."""
    ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
    line = stream.readline() if ready else ""
    if not line.startswith("{"):
        raise RuntimeError(f"no answer in time (got {line!r})")
    return json.loads(line)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def beside_row(kind: str, timeout: float) -> list[str]:
    """The "managed" case beside another CUDA process, which ends while the case is checkpointed."""
    before = used_mib()
    deadline = time.monotonic() + timeout
    other = _spawn("--beside", kind)
    case = None
    try:
        _line(other.stdout, deadline)
        case = _spawn("--case", "managed", "--wait")
        _line(case.stdout, deadline)  # checkpointed
        assert other.stdin is not None and case.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
        case.stdin.write("go\n")
        case.stdin.flush()
        seen = _line(case.stdout, deadline)
    except Exception as exc:
        return [f"managed, beside {kind}", str(before), "-", "-", "-", f"failed: {exc}"]
    finally:
        for proc in (other, case):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    steps = "ok" if seen["ok"] else "a step failed"
    return [
        f"managed, beside {kind}",
        str(before),
        str(seen["running"]),
        str(seen["checkpointed"]),
        str(seen["later"]),
        steps,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # a case's own process
    parser.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)  # checkpointed until told
    parser.add_argument("--beside", choices=BESIDE, help=argparse.SUPPRESS)  # the process beside a case
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    args = parser.parse_args()
    if args.case:
        case_main(args.case, args.wait)
        return
    if args.beside:
        beside_main(args.beside)
        return
    rows = []
    for case in CASES:
        before = used_mib()
        child = run_child([sys.executable, __file__, "--case", case], dict(os.environ), args.timeout)
        lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
        if child.returncode != 0 or not lines:
            why = (child.stderr.strip().splitlines() or ["?"])[-1]
            rows.append([case, str(before), "-", "-", "-", f"failed: {why}"])
            continue
        seen = json.loads(lines[-1])
        steps = "ok" if seen["ok"] else "a step failed"
        rows.append([case, str(before), str(seen["running"]), str(seen["checkpointed"]), "-", steps])
    rows.extend(beside_row(kind, args.timeout) for kind in BESIDE)
    columns = ["case", "MiB before", "MiB running", "MiB checkpointed", "then, the other ended", "checkpoint / restore"]
    print_table(columns, rows)


if __name__ == "__main__":
    main()

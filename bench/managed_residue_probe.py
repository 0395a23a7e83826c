"""What a checkpointed process that used managed memory leaves on its GPU: the measurement behind
docs/facts.md fact 27's last part.

    python bench/managed_residue_probe.py [--timeout 60]

Each case is a fresh process on cuda:0 (torch initialised) that, before it checkpoints itself with
flexium's native steps, did what the case names: "managed" made 4 MiB of managed memory
(cuMemAllocManaged), had a kernel write it and freed it; "vmm kept" made 1 GiB of cuMem device
memory in an address range of its own, had a kernel write it, and unmapped and released it with
the range still reserved (as flexium's pool does at a pause); "vmm freed" freed the range too;
"vmm mapped" kept the memory mapped (the checkpoint carries it). The table gives nvidia-smi's
memory.used of the GPU before the case started, while it ran, and while it was checkpointed. Needs
a GPU, nvidia-smi and flexium built.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # children.py, tables.py, staging_probe.py beside it

from children import run_child  # noqa: E402
from tables import print_table  # noqa: E402

CASES = ("managed", "vmm kept", "vmm kept + managed", "vmm freed + managed", "vmm mapped + managed")
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


def case_main(case: str) -> None:
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
    back = _C.run_steps(pid, [_C.Step(_C.StepKind.RESTORE), _C.Step(_C.StepKind.UNLOCK)], [recover, []])
    ok = all(o.code == 0 for o in [*stopped, *back])
    print(json.dumps({"running": running, "checkpointed": checkpointed, "ok": ok}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # a case's own process
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take")
    args = parser.parse_args()
    if args.case:
        case_main(args.case)
        return
    rows = []
    for case in CASES:
        before = used_mib()
        child = run_child([sys.executable, __file__, "--case", case], dict(os.environ), args.timeout)
        lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
        if child.returncode != 0 or not lines:
            rows.append([case, str(before), "-", "-", f"failed: {(child.stderr.strip().splitlines() or ['?'])[-1]}"])
            continue
        seen = json.loads(lines[-1])
        steps = "ok" if seen["ok"] else "a step failed"
        rows.append([case, str(before), str(seen["running"]), str(seen["checkpointed"]), steps])
    print_table(["case", "MiB before", "MiB running", "MiB checkpointed", "checkpoint / restore"], rows)


if __name__ == "__main__":
    main()

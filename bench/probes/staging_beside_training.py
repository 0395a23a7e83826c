"""How fast a pause prepared at its command touches and pins its staging with the job training
beside it: fact `training-slows-staging-prep`, and its "Open" question whether 16 touching files and
threads instead of 8 help with training beside (alone they touched 22% faster).

    python bench/probes/staging_beside_training.py [--sizes 16,64] [--timeout 240] [--json out.json]

Each size is a fresh process with a bare driver context on cuda:0 that prepares SIZE GiB as the
copier does (memfd8: 8 files touched by a thread each, registered per 256 MiB with 2 ms between
chunks), a fresh staging per load running beside it in other processes: none, nvml (NVML's
process list read every 5 ms, as bench/migrate.py does), train (a matmul loop on cuda:0), both;
and memfd16 (16 files and threads) alone and beside train. Prints the touch and pin GB/s per load.
Needs one NVIDIA GPU and pynvml.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from children import report_part, run_parts
from cuda_driver import CU_MEMHOSTREGISTER_PORTABLE, Driver
from host_staging import GIB, HUGE, Libc, Staging, fmt, gbps, round_up, timed_each

LOADS = {
    "nvml": "import pynvml, time\npynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
    "print('running', flush=True)\nwhile True:\n    pynvml.nvmlDeviceGetComputeRunningProcesses(h)\n"
    "    time.sleep(0.005)\n",
    "train": "import torch\na = torch.randn(4096, 4096, device='cuda:0')\n(a @ a).sum().item()\n"
    "print('running', flush=True)\nwhile True:\n    (a @ a).sum().item()\n",
}
# (the staging's kind, the loads beside it joined by "+")
RUNS = (
    ("memfd8", "none"),
    ("memfd16", "none"),
    ("memfd8", "nvml"),
    ("memfd8", "train"),
    ("memfd8", "nvml+train"),
    ("memfd16", "train"),
)


def beside(gib: float, result: dict[str, Any]) -> None:
    drv = Driver()
    drv.primary_context(0)
    libc = Libc()
    size = round_up(int(gib * GIB), HUGE)

    def register(a: int, n: int) -> None:
        drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
        time.sleep(0.002)  # the break the copier takes between chunks

    result["loads"] = {}
    for kind, load in RUNS:
        others = []
        for name in load.split("+"):
            if name in LOADS:
                child = subprocess.Popen([sys.executable, "-c", LOADS[name]], stdout=subprocess.PIPE, text=True)
                assert child.stdout is not None
                child.stdout.readline()  # 'running'
                others.append(child)
        try:
            staging = Staging(libc, kind, size)
            touch_s = staging.touch()
            register_s = timed_each(staging.chunks, register)
            for a, _n in staging.chunks:
                drv.call("cuMemHostUnregister", a)
            staging.unmap()
        finally:
            for child in others:
                child.kill()
                child.wait()
        result["loads"][f"{kind} {load}"] = {"touch_gbps": gbps(size, touch_s), "pin_gbps": gbps(size, register_s)}
    result["ok"] = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64", help="GiB per part, comma-separated (default 16,64)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per part (default 240)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # GIB, in the part's own process
    args = parser.parse_args()
    if args.part:
        return report_part(args.part, lambda result: beside(float(args.part), result))
    sizes = [float(s) for s in args.sizes.split(",") if s]
    results = run_parts(__file__, [f"{gib:g}" for gib in sizes], args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    for r in results:
        for load, rates in r.get("loads", {}).items():
            touch, pin = fmt(rates.get("touch_gbps"), 1), fmt(rates.get("pin_gbps"), 1)
            print(f"{r['part']} GiB {load:18s}: touch {touch} GB/s, pin {pin} GB/s")
        if not r.get("ok"):
            print(f"{r['part']} GiB FAILED: {r.get('error')}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

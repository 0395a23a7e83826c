"""Whether copiers pinning at once (the ranks of a job resumed as a whole) share the host's pinning
rate: fact `pinning-does-not-scale` (on one GPU they do), open for copiers on GPUs of their own.

    python bench/probes/pinning_processes.py [--sizes 16,8] [--devices 0,1] [--timeout 240] [--json out.json]

Each size is a fresh process that starts 1, then 2 pinner processes, pinner k with a context of
its own on the k-th of --devices (round robin; default 0: all on cuda:0), each with SIZE GiB of
memfd8 (8 files) touched; all register their staging per 256 MiB at once after a barrier, then
again after unregistering and a fresh context (as a copier's wake pins a kept staging). Prints
the rate of all of them together and each one's seconds. Needs an NVIDIA GPU per device named.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from children import report_part, run_parts
from cuda_driver import CU_MEMHOSTREGISTER_PORTABLE, Driver
from host_staging import GIB, HUGE, Libc, Staging, fmt, gbps, round_up, timed_each


def pinner_main(gib: float, device: int) -> int:
    """A pinner: a context on `device` and SIZE GiB of memfd8 touched; then, at each 'go' on
    stdin, every chunk registered and one line of the seconds it took: first on touched pages,
    then, after unregistering and a fresh context, on the same pages."""
    drv = Driver()
    drv.primary_context(device)
    staging = Staging(Libc(), "memfd8", round_up(int(gib * GIB), HUGE))
    staging.touch()
    for again in (False, True):
        if again:
            for a, _n in staging.chunks:
                drv.call("cuMemHostUnregister", a)
            drv.call("cuDevicePrimaryCtxReset", drv.device)
            drv.primary_context(device)
        print("ready", flush=True)
        sys.stdin.readline()
        seconds = timed_each(
            staging.chunks, lambda a, n: drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
        )
        print(json.dumps({"seconds": seconds}), flush=True)
    return 0


def processes(gib: float, devices: list[int], result: dict[str, Any]) -> None:
    size = round_up(int(gib * GIB), HUGE)
    result["counts"] = {}
    for count in (1, 2):
        pinners = [
            subprocess.Popen(
                [sys.executable, __file__, "--pinner", f"{gib}:{devices[k % len(devices)]}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for k in range(count)
        ]
        rounds: dict[str, Any] = {}
        try:
            for label in ("touched", "again"):
                for p in pinners:
                    assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a pinner failed"
                for p in pinners:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                each = [float(json.loads(p.stdout.readline())["seconds"]) for p in pinners if p.stdout is not None]
                rounds[label] = {"each_s": each, "gbps_all": gbps(count * size, max(each))}
        finally:
            for p in pinners:
                p.kill()
                p.wait()
        result["counts"][str(count)] = rounds
    result["ok"] = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,8", help="GiB per pinner, comma-separated (default 16,8)")
    parser.add_argument("--devices", default="0", help="CUDA ordinals the pinners take in turn (default 0)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per part (default 240)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # GIB@DEVICES, in the part's own process
    parser.add_argument("--pinner", help=argparse.SUPPRESS)  # GIB:DEVICE, a pinner's process
    args = parser.parse_args()
    if args.pinner:
        gib, _, device = args.pinner.partition(":")
        return pinner_main(float(gib), int(device))
    if args.part:
        gib, _, devices = args.part.partition("@")
        ordinals = [int(d) for d in devices.split(",")]
        return report_part(args.part, lambda result: processes(float(gib), ordinals, result))
    sizes = [float(s) for s in args.sizes.split(",") if s]
    results = run_parts(__file__, [f"{gib:g}@{args.devices}" for gib in sizes], args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    for r in results:
        gib, _, devices = r["part"].partition("@")
        for count, rounds in r.get("counts", {}).items():
            for label, w in rounds.items():
                each = ", ".join(fmt(x, 3) for x in w["each_s"])
                print(
                    f"{gib} GiB each, {count} process(es) on cuda {devices} pinning at once, {label:7s}: "
                    f"{fmt(w['gbps_all'], 1)} GB/s in all (each {each} s)"
                )
        if not r.get("ok"):
            print(f"{r['part']} FAILED: {r.get('error')}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

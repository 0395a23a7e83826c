"""Which host memory pins fastest on this host: fact `staging-kept-pinned-ahead`, to run again on a host
whose settings differ (shmem huge pages allowed, huge pages reserved).

    python bench/probes/host_memory_pinning.py [--sizes 16,64] [--kinds memfd,memfd8,...] [--timeout 240]
                                               [--json out.json]

Each kind and size is a fresh process with a bare driver context on cuda:0 that maps SIZE GiB of
the kind (host_staging.Staging), touches it from 8 threads (MADV_POPULATE_WRITE), registers it
(cuMemHostRegister per 256 MiB), copies a 1 GiB device buffer into all of it (D2H), unregisters
it, registers it again (a staging kept resident across pauses pins only), then resets the context
with it still registered (how long letting go of a kept pinned staging takes). Kinds: memfd (one
file), memfd8 (8 files, one per touching thread: what the copier maps), memfd_madv (memfd +
MADV_HUGEPAGE), hugetlb (needs free huge pages reserved on the host; said so where there are too
few), anon_thp (anonymous + MADV_HUGEPAGE). Prints the host's settings and one table row per part.
Needs one NVIDIA GPU. Sizes are GiB (2^30 bytes), bandwidths GB/s (10^9).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import report_part, run_parts  # noqa: E402
from cuda_driver import CU_MEMHOSTREGISTER_PORTABLE, Driver, copy_to_host  # noqa: E402
from host_staging import (  # noqa: E402
    GIB,
    HUGE,
    Libc,
    Staging,
    fmt,
    gbps,
    host_settings,
    now,
    round_up,
    smaps_huge,
    timed_each,
)
from tables import print_table  # noqa: E402

KINDS = ("memfd", "memfd8", "memfd_madv", "hugetlb", "anon_thp")


def pin(kind: str, gib: float, result: dict[str, Any]) -> None:
    size = round_up(int(gib * GIB), HUGE)
    if kind == "hugetlb":
        info = host_settings()
        free_pages = int(str(info.get("HugePages_Free", "0")).split()[0])
        page_kib = int(str(info.get("Hugepagesize", "2048 kB")).split()[0])
        if free_pages * page_kib * 1024 < size:
            result.update(ok=True, not_possible=f"{free_pages} free huge pages of {page_kib} kB reserved on the host")
            return
    drv = Driver()
    drv.primary_context(0)
    register = lambda a, n: drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)  # noqa: E731
    unregister = lambda a, _n: drv.call("cuMemHostUnregister", a)  # noqa: E731
    staging = Staging(Libc(), kind, size)
    before = smaps_huge()
    result["touch_s"] = staging.touch()
    after = smaps_huge()
    result["huge_gib"] = {
        k: round((after[k] - before.get(k, 0)) / GIB, 2) for k in after if after[k] != before.get(k, 0)
    }
    result["register_s"] = timed_each(staging.chunks, register)
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    copied, seconds = copy_to_host(drv, staging.chunks, int(device.value), GIB, drv.stream())
    result["d2h_gbps"] = gbps(copied, seconds)
    result["unregister_s"] = timed_each(staging.chunks, unregister)
    result["register_again_s"] = timed_each(staging.chunks, register)
    started = now()
    drv.call("cuDevicePrimaryCtxReset", drv.device)
    result["ctx_reset_registered_s"] = now() - started
    started = now()
    staging.unmap()
    result["unmap_s"] = now() - started
    result["ok"] = True


def row(r: dict[str, Any]) -> tuple[str, ...]:
    kind, _, gib_text = r["part"].partition(":")
    if not r.get("ok"):
        return (kind, gib_text, *["-"] * 6, f"FAILED: {r.get('error')}"[:40])
    if r.get("not_possible"):
        return (kind, gib_text, *["-"] * 6, r["not_possible"][:40])
    size = float(gib_text) * GIB
    return (
        kind,
        gib_text,
        fmt(gbps(size, r.get("touch_s")), 2),
        fmt(gbps(size, r.get("register_s")), 2),
        fmt(gbps(size, r.get("register_again_s")), 2),
        fmt(gbps(size, r.get("unregister_s")), 2),
        fmt(r.get("d2h_gbps"), 2),
        fmt(r.get("ctx_reset_registered_s"), 2),
        json.dumps(r.get("huge_gib", {}))[:40],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64", help="GiB per part, comma-separated (default 16,64)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"kinds of host memory (default {','.join(KINDS)})")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per part (default 240)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # KIND:GIB, in the part's own process
    args = parser.parse_args()
    if args.part:
        kind, _, gib = args.part.partition(":")
        return report_part(args.part, lambda result: pin(kind, float(gib), result))
    print("host:", json.dumps(host_settings()), flush=True)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {', '.join(sorted(unknown))}: choose from {', '.join(KINDS)}")
    sizes = [float(s) for s in args.sizes.split(",") if s]
    results = run_parts(__file__, [f"{kind}:{gib:g}" for gib in sizes for kind in kinds], args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    columns = ("kind", "GiB", "touch GB/s", "pin GB/s", "pin again", "unpin GB/s", "D2H GB/s", "ctx reset s")
    print_table((*columns, "huge pages"), [row(r) for r in results])
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

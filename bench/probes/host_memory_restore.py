"""Which host memory that kernels reach comes through the driver's checkpoint and restore:
fact `cumem-host-memory-unrestorable` (cuMem memory on the host does not: the restore fails and the process never
runs CUDA again), to run again on a new driver. tests/gpu's jobs make such memory with
`mapped_host_memory` from here.

    python bench/probes/host_memory_restore.py [--cases pinned:plain,cumem-host:restored,...] [--timeout 90]

Each case is a fresh process without NCCL or flexium.init() that makes 4 MiB of host memory of
one kind, mapped for the GPU: pinned by cudaHostAlloc (as torch's pinned memory and NCCL's
ncclCudaHostCalloc), a memfd mapped shared and registered with the driver (as NCCL's /dev/shm
transport with NCCL_CUMEM_HOST_ENABLE=0), and a cuMem allocation on the host NUMA node mapped for
the GPU and the CPU (as NCCL 2.30 makes its host memory on driver 12.6+). A kernel fills it with
ones; "restored" cases then lock, checkpoint, restore and unlock themselves (flexium._C, from a
thread), "plain" ones do not; then a kernel adds 1 and the CPU reads one element back. One table
row per case. Needs a GPU and flexium built.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import run_child  # noqa: E402
from cuda_driver import (  # noqa: E402
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_LOCATION_TYPE_HOST_NUMA,
    CU_MEMHOSTREGISTER_DEVICEMAP,
    CU_MEMHOSTREGISTER_PORTABLE,
    CUmemAccessDesc,
    Driver,
    checkpoint_and_restore_self,
)
from tables import print_table  # noqa: E402

CASES = tuple(f"{kind}:{mode}" for kind in ("pinned", "registered", "cumem-host") for mode in ("plain", "restored"))
FLOATS = 1 << 20


class DeviceView:
    """float32s the GPU reaches at ``pointer``, for torch.as_tensor (CUDA array interface)."""

    def __init__(self, pointer: int, count: int) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "data": (pointer, False), "version": 3}


def mapped_host_memory(kind: str, size: int) -> tuple[int, int, Any]:
    """Host memory of ``size`` bytes that kernels reach: (the GPU's pointer, the CPU's pointer,
    what keeps it alive; for cumem-host its handle and mapped size, for free_cumem_host)."""
    import torch

    if kind == "pinned":  # cudaHostAlloc: mapped for the GPU at the same address (UVA)
        tensor = torch.empty(size // 4, dtype=torch.float32, pin_memory=True)
        return tensor.data_ptr(), tensor.data_ptr(), tensor
    driver, gpu = Driver(), torch.cuda.current_device()  # torch's context is current on this thread
    if kind == "registered":  # shared memory registered with the driver, as NCCL's /dev/shm fallback
        fd = os.memfd_create("host-memory-probe")
        os.ftruncate(fd, size)
        shared = mmap.mmap(fd, size, mmap.MAP_SHARED)
        host = ctypes.addressof(ctypes.c_char.from_buffer(shared))
        driver.call("cuMemHostRegister", host, size, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)
        device = ctypes.c_uint64()
        driver.call("cuMemHostGetDevicePointer", ctypes.byref(device), host, 0)
        return device.value, host, (shared, fd)
    if kind != "cumem-host":
        raise ValueError(kind)
    # NCCL's ncclCuMemHostAlloc: pinned memory on the GPU's host NUMA node, exportable as an fd,
    # mapped read-write for the GPU and for the CPU.
    numa = ctypes.c_int()
    driver.call("cuDeviceGetAttribute", ctypes.byref(numa), CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, gpu)
    prop = driver.prop(gpu)
    prop.location.type, prop.location.id = CU_MEM_LOCATION_TYPE_HOST_NUMA, max(numa.value, 0)
    granularity = driver.granularity(prop)
    size = (size + granularity - 1) // granularity * granularity
    handle = driver.create(size, prop)
    pointer = driver.reserve(size)
    driver.map(pointer, size, handle)
    driver.set_access(pointer, size, gpu)
    for_cpu = CUmemAccessDesc(location=prop.location, flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    driver.call("cuMemSetAccess", pointer, size, ctypes.byref(for_cpu), 1)
    return pointer, pointer, (handle, size)


def free_cumem_host(pointer: int, keep: tuple[int, int]) -> None:
    """Gives back what mapped_host_memory("cumem-host", ...) made (torch's context current)."""
    handle, size = keep
    driver = Driver()
    driver.call("cuMemUnmap", pointer, size)
    driver.call("cuMemRelease", handle)
    driver.call("cuMemAddressFree", pointer, size)


def case_main(kind: str, mode: str) -> None:
    """In a case's process: host memory of ``kind`` filled by a kernel, optionally checkpointed
    and restored by the driver, then added to by a kernel and read by the CPU; one JSON line."""
    import torch

    torch.ones(1, device="cuda").sum().item()
    seen: dict[str, Any] = {}
    try:
        device, host, keep = mapped_host_memory(kind, FLOATS * 4)
        view = torch.as_tensor(DeviceView(device, FLOATS), device="cuda")
        view.fill_(1.0)
        seen["before"] = f"{view.sum().item():g}"
    except Exception as exc:
        print(json.dumps({"after": f"set-up failed: {exc}".splitlines()[0]}), flush=True)
        return
    if mode == "restored":
        seen["driver"] = checkpoint_and_restore_self()
    try:
        view.add_(1.0)
        total = view.sum().item()
        print("a kernel ran after the restore", file=sys.stderr, flush=True)
        last = ctypes.cast(host, ctypes.POINTER(ctypes.c_float))[FLOATS - 1]
        seen["after"] = f"{total:g}, the CPU reads {last:g}"
    except Exception as exc:
        seen["after"] = f"{exc}".splitlines()[0]
    del keep
    print(json.dumps(seen), flush=True)


def run_case(case: str, timeout: float) -> tuple[str, ...]:
    kind, mode = case.split(":")
    child = run_child([sys.executable, __file__, "--case", case], dict(os.environ), timeout)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    seen: dict[str, Any] | None = json.loads(lines[-1]) if lines else None
    if seen is None:  # its last line on stderr says how far it came
        said = child.stderr.strip().splitlines()
        died = f"died: {child.stderr.strip()[-200:]}"
        seen = {"after": f"timeout, {said[-1] if said else 'nothing said'}" if child.timed_out else died}
    return (
        kind,
        "restored" if mode == "restored" else "not checkpointed",
        seen.get("before", "-"),
        ", ".join(seen.get("driver", [])) or "-",
        seen["after"],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="KIND:plain|restored, comma-separated")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds each case may take")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a case's own process
    args = parser.parse_args()
    if args.case:
        case_main(*args.case.split(":"))
        return 0
    rows = []
    for case in (c.strip() for c in args.cases.split(",") if c.strip()):
        print(f"-- {case}", file=sys.stderr, flush=True)
        rows.append(run_case(case, args.timeout))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each row as it comes: a run cut short keeps them
    after = f"after (expected: sum {2 * FLOATS}, the CPU reads 2)"
    print_table(("host memory", "case", "sum before", "driver", after), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

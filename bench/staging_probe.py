"""Probes for the fast pause's host staging (docs/fast-path.md, "Open"): how to pin without
stalling the job, what pinned memory costs the driver checkpoint, whether a helper process can
hold the staging instead, and what the fast path's `own` step is made of.

    python bench/staging_probe.py [--gb 8] [--experiments pin_stall,checkpoint_pinned,...]
                                  [--repeats 2] [--timeout 150] [--json out.json]

Needs one NVIDIA GPU (cuda:0), torch with CUDA and flexium built (flexium._C for the checkpoint
rounds). Driver calls flexium._C does not expose go through ctypes on libcuda.so.1. Every part
below runs in a fresh process (this file with --part EXPERIMENT:PART) that prints one JSON
result line, dumps its threads' stacks (faulthandler) and exits 10 s before --timeout, and is
killed (its whole process group) at --timeout. A failed part is reported; the others still run;
the exit status is non-zero if any failed. Sizes are GiB (2^30 bytes), bandwidths GB/s (10^9).

Experiments (parts):
  pin_stall          A training-like thread (fp32 2048x2048 matmul + synchronize on cuda:0,
                     recording each iteration's end) runs while the main thread pins --gb GiB:
                     hostalloc_256m / hostalloc_32m: cuMemHostAlloc(PORTABLE) in 256 / 32 MiB
                     chunks; register_chunks: mmap anonymous + madvise(MADV_HUGEPAGE) + touch
                     every page (memset) + cuMemHostRegister(PORTABLE) per 256 MiB;
                     register_once: the same with one cuMemHostRegister call. Reports pin seconds
                     and GB/s, the training thread's largest gap between iteration ends while
                     pinning (and per phase: touch / register), its median iteration then and
                     before (1 s baseline), the share of its normal speed it kept, then (training
                     stopped) D2H / H2D GB/s between a 1 GiB device buffer and the pinned memory,
                     and the seconds to unpin.
  checkpoint_pinned  A small torch context (cuBLAS loaded) plus --gb GiB pinned; lock ->
                     checkpoint -> restore in place -> unlock through flexium._C.run_steps,
                     --repeats rounds per state. hostalloc: states none / pinned (cuMemHostAlloc,
                     256 MiB chunks) / freed. register: states none / registered (mmap +
                     cuMemHostRegister per 256 MiB) / unregistered (cuMemHostUnregister before the
                     rounds; the pages stay mapped and touched) / reregistered; the unregister and
                     re-register are timed and D2H GB/s re-checked after re-registering. Markers in
                     the host memory are checked after the rounds.
  helper_copy        The staging outside the checkpointed process. The parent (torch context)
                     makes one cuMemCreate allocation of --gb GiB on cuda:0 (POSIX-fd exportable),
                     maps it, fills it (cuMemsetD32, markers at 8 offsets), exports an fd and sends
                     it (SCM_RIGHTS over a Unix seqpacket socket) to a helper child (its own context
                     on cuda:0, --gb GiB pinned by cuMemHostAlloc once at its start; the parent then
                     runs one baseline checkpoint round, before any VMM memory exists), which imports,
                     maps, copies D2H into its pinned buffer, unmaps and releases. The parent
                     releases its memory (unmap + cuMemRelease; the address range stays reserved),
                     runs checkpoint + restore in place, creates new memory at the same address,
                     sends its fd, the helper copies H2D, and the parent checks the pattern.
                     pause = export + D2H round trip + release + lock + checkpoint;
                     resume = restore + unlock + create + map + export + H2D round trip.
  shared_staging     Pure ctypes, no torch: can a helper process pin memory the job maps too? For
                     each kind of host memory (memfd: memfd_create + MAP_SHARED, what a helper and
                     the job can both map; anon: MAP_PRIVATE|MAP_ANONYMOUS, what the staging uses
                     now), --gb GiB: mmap + MADV_HUGEPAGE + touch (MADV_POPULATE_WRITE), huge pages
                     got, cuMemHostRegister per 256 MiB, H2D GB/s, unregister; then pinning and
                     copying chunk by chunk (register chunk k+1 while chunk k's copy runs) against
                     register-all-then-copy. Also a bare driver context: its create time, the GPU
                     memory NVML shows for it, and cuDevicePrimaryCtxReset with the memory still
                     registered (does it unpin, how long).
  memfd_fill         Pure ctypes: how to fill the staging's memfd (csrc/vmm_host_staging.cpp
                     map_extent). --gb GiB each way: touch (MADV_POPULATE_WRITE from up to 8
                     threads, what csrc does now), fallocate (posix_fallocate of the memfd, no
                     touch), fallocate+touch; then cuMemHostRegister per 256 MiB, timed, to see
                     whether the way of filling changes how fast the pages pin afterwards.
  pin_threads        Pure ctypes: does pinning scale with threads? A touched --gb GiB memfd (what
                     the copier pins on resume, its pages already in) is registered per 256 MiB
                     from 1, 2, 4 and 8 threads, then 1 again (each thread with the primary
                     context current, chunks dealt round robin), then unregistered the same way.
  own_cost           Pure ctypes: --gb segments of 1 GiB made "imported" (cuMemCreate, export,
                     import, mapped at a reserved address), then replaced by own memory one segment
                     at a time as csrc/vmm_relocate.cpp own_imported does: cuMemCreate; reserve +
                     map + access a temporary range; cuMemcpyDtoDAsync + stream sync; swap (unmap the
                     imported, map the new at the segment's address, access); clean up (release the
                     imported handle, unmap + free the temporary range). Per step, per segment and
                     in total.

About 2 minutes on an H200 with --gb 8 (pinning dominates: cuMemHostAlloc pins at ~1.8 GB/s).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from children import run_child

THIS = Path(__file__).resolve()
sys.path.insert(0, str(THIS.parent))  # tables.py beside this file (also when run as a worker)

GIB = 1 << 30
MIB = 1 << 20
HUGE = 2 * MIB
CHUNK = 256 * MIB
LOCK_TIMEOUT_MS = 30000
EXPERIMENTS: dict[str, tuple[str, ...]] = {
    "pin_stall": ("hostalloc_256m", "hostalloc_32m", "register_chunks", "register_once"),
    "checkpoint_pinned": ("hostalloc", "register"),
    "helper_copy": ("helper",),
    "shared_staging": ("compare",),
    "own_cost": ("own",),
    "memfd_fill": ("compare",),
    "pin_threads": ("compare",),
}
FAST_COPY_GBPS = 45.0  # "reaches ~50 GB/s" (docs/facts.md fact 10: 55 GB/s pinned here)
PAUSE_GOAL_S = 1.0
RESUME_GOAL_S = 1.0

# cuda.h values (CUDA 13.0)
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134
CU_STREAM_NON_BLOCKING = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST_NUMA = 3
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
# Linux (x86_64 and aarch64 share these)
PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MADV_HUGEPAGE = 14
MAP_SHARED = 0x01
MADV_POPULATE_WRITE = 23


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def now() -> float:
    return time.perf_counter()


def gbps(nbytes: float, seconds: Optional[float]) -> Optional[float]:
    return nbytes / seconds / 1e9 if seconds else None


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# ---- libcuda through ctypes ----------------------------------------------------------------------


class CUmemLocation(ctypes.Structure):
    # CUDA 13 made `id` a union (int id / {deviceId, localityDomainId} bytes): same 4 bytes.
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


# The same layout checks as csrc/cuda_driver_types.h.
assert ctypes.sizeof(CUmemLocation) == 8
assert ctypes.sizeof(CUmemAllocationProp) == 32 and CUmemAllocationProp.allocFlags.offset == 24
assert CUmemAllocationProp.win32HandleMetaData.offset == 16
assert ctypes.sizeof(CUmemAccessDesc) == 12

_P = ctypes.POINTER
_int, _uint, _size, _u64, _ull, _vp = (
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_size_t,
    ctypes.c_uint64,
    ctypes.c_ulonglong,
    ctypes.c_void_p,
)
# name used here -> (exported symbol, argtypes); every restype is CUresult (int). The symbols are
# the ones cuda.h's #defines select (cuMemcpyDtoH -> cuMemcpyDtoH_v2 ...): the unversioned v1 of
# those takes a 32-bit CUdeviceptr or unsigned sizes, so no fallback to it.
SIGNATURES: dict[str, tuple[str, list[Any]]] = {
    "cuInit": ("cuInit", [_uint]),
    "cuGetErrorName": ("cuGetErrorName", [_int, _P(ctypes.c_char_p)]),
    "cuDeviceGet": ("cuDeviceGet", [_P(_int), _int]),
    "cuDeviceGetAttribute": ("cuDeviceGetAttribute", [_P(_int), _int, _int]),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", [_P(_vp), _int]),
    "cuCtxSetCurrent": ("cuCtxSetCurrent", [_vp]),
    "cuDevicePrimaryCtxReset": ("cuDevicePrimaryCtxReset_v2", [_int]),
    "cuCtxSynchronize": ("cuCtxSynchronize", []),
    "cuMemGetInfo": ("cuMemGetInfo_v2", [_P(_size), _P(_size)]),
    "cuMemAlloc": ("cuMemAlloc_v2", [_P(_u64), _size]),
    "cuMemFree": ("cuMemFree_v2", [_u64]),
    "cuMemsetD32": ("cuMemsetD32_v2", [_u64, _uint, _size]),
    "cuMemcpyDtoH": ("cuMemcpyDtoH_v2", [_vp, _u64, _size]),
    "cuMemcpyDtoHAsync": ("cuMemcpyDtoHAsync_v2", [_vp, _u64, _size, _vp]),
    "cuMemcpyHtoDAsync": ("cuMemcpyHtoDAsync_v2", [_u64, _vp, _size, _vp]),
    "cuMemcpyDtoDAsync": ("cuMemcpyDtoDAsync_v2", [_u64, _u64, _size, _vp]),
    "cuStreamCreate": ("cuStreamCreate", [_P(_vp), _uint]),
    "cuStreamSynchronize": ("cuStreamSynchronize", [_vp]),
    "cuStreamDestroy": ("cuStreamDestroy_v2", [_vp]),
    "cuMemHostAlloc": ("cuMemHostAlloc", [_P(_vp), _size, _uint]),
    "cuMemFreeHost": ("cuMemFreeHost", [_vp]),
    "cuMemHostRegister": ("cuMemHostRegister_v2", [_vp, _size, _uint]),
    "cuMemHostUnregister": ("cuMemHostUnregister", [_vp]),
    "cuMemHostGetDevicePointer": ("cuMemHostGetDevicePointer_v2", [_P(_u64), _vp, _uint]),
    "cuMemGetAllocationGranularity": ("cuMemGetAllocationGranularity", [_P(_size), _P(CUmemAllocationProp), _int]),
    "cuMemAddressReserve": ("cuMemAddressReserve", [_P(_u64), _size, _size, _u64, _ull]),
    "cuMemAddressFree": ("cuMemAddressFree", [_u64, _size]),
    "cuMemCreate": ("cuMemCreate", [_P(_ull), _size, _P(CUmemAllocationProp), _ull]),
    "cuMemRelease": ("cuMemRelease", [_ull]),
    "cuMemMap": ("cuMemMap", [_u64, _size, _size, _ull, _ull]),
    "cuMemUnmap": ("cuMemUnmap", [_u64, _size]),
    "cuMemSetAccess": ("cuMemSetAccess", [_u64, _size, _P(CUmemAccessDesc), _size]),
    # shareableHandle: void* to an int that receives the fd
    "cuMemExportToShareableHandle": ("cuMemExportToShareableHandle", [_vp, _ull, _int, _ull]),
    # osHandle: the fd itself, cast to void*
    "cuMemImportFromShareableHandle": ("cuMemImportFromShareableHandle", [_P(_ull), _vp, _int]),
}


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


class Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ.get("FLEXIUM_LIBCUDA", "libcuda.so.1"))  # FLEXIUM_LIBCUDA as flexium reads it
        self.fns: dict[str, Any] = {}
        for name, (symbol, argtypes) in SIGNATURES.items():
            # The fake driver (tests/fake_driver) exports the plain names flexium resolves.
            found = [getattr(self.lib, s) for s in (symbol, name) if hasattr(self.lib, s)]
            if not found:
                continue
            fn = found[0]
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self.fns[name] = fn

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        fn = self.fns.get("cuGetErrorName")
        if fn is None or fn(code, ctypes.byref(text)) != 0 or not text.value:
            return f"CUresult {code}"
        return text.value.decode()

    def call(self, name: str, *args: Any) -> None:
        fn = self.fns.get(name)
        if fn is None:
            raise RuntimeError(f"libcuda.so.1 has no {SIGNATURES[name][0]}")
        code = fn(*args)
        if code != 0:
            raise CudaError(name, code, self.error_name(code))

    # contexts
    def primary_context(self, ordinal: int = 0) -> int:
        """Retains the device's primary context (torch's) and makes it current on this thread."""
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev.value)
        self.call("cuCtxSetCurrent", ctx)
        self.device = dev.value
        return int(ctx.value or 0)

    def synchronize(self) -> None:
        self.call("cuCtxSynchronize")

    def mem_free(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        return int(free.value)

    # streams and copies
    def stream(self) -> int:
        s = ctypes.c_void_p()
        self.call("cuStreamCreate", ctypes.byref(s), CU_STREAM_NON_BLOCKING)
        return int(s.value or 0)

    def stream_sync(self, stream: int) -> None:
        self.call("cuStreamSynchronize", stream)

    def read_u32(self, address: int) -> int:
        word = ctypes.c_uint32()
        self.call("cuMemcpyDtoH", ctypes.byref(word), address, 4)
        return int(word.value)

    # host memory
    def host_alloc(self, size: int) -> int:
        p = ctypes.c_void_p()
        self.call("cuMemHostAlloc", ctypes.byref(p), size, CU_MEMHOSTALLOC_PORTABLE)
        return int(p.value or 0)

    # VMM
    def prop(self, device: int, exportable: bool = True) -> CUmemAllocationProp:
        p = CUmemAllocationProp()
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable else 0
        p.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = device
        return p

    def granularity(self, prop: CUmemAllocationProp) -> int:
        g = ctypes.c_size_t()
        self.call(
            "cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        )
        return int(g.value)

    def create(self, size: int, prop: CUmemAllocationProp) -> int:
        h = ctypes.c_ulonglong()
        self.call("cuMemCreate", ctypes.byref(h), size, ctypes.byref(prop), 0)
        return int(h.value)

    def reserve(self, size: int) -> int:
        va = ctypes.c_uint64()
        self.call("cuMemAddressReserve", ctypes.byref(va), size, 0, 0, 0)
        return int(va.value)

    def map(self, va: int, size: int, handle: int) -> None:
        self.call("cuMemMap", va, size, 0, handle, 0)

    def set_access(self, va: int, size: int, device: int) -> None:
        desc = CUmemAccessDesc()
        desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.call("cuMemSetAccess", va, size, ctypes.byref(desc), 1)

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self.call(
            "cuMemExportToShareableHandle", ctypes.addressof(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        )
        return int(fd.value)

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_ulonglong()
        self.call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(h),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        return int(h.value)


def copy_host_device(
    drv: Driver,
    chunks: list[tuple[int, int]],
    device_base: int,
    device_size: int,
    to_host: bool,
    stream: int,
    total: Optional[int] = None,
    piece: int = CHUNK,
) -> tuple[int, float]:
    """Copies between the host chunks (in order) and a device range (wrapping around it when the
    chunks are larger), at most `piece` bytes per call and never across a chunk's end; `total`
    limits the bytes. Returns (bytes, seconds including the stream synchronize)."""
    limit = sum(size for _, size in chunks) if total is None else total
    done = 0
    device_offset = 0
    started = now()
    for host, size in chunks:
        offset = 0
        while offset < size and done < limit:
            n = min(piece, size - offset, device_size - device_offset, limit - done)
            if to_host:
                drv.call("cuMemcpyDtoHAsync", host + offset, device_base + device_offset, n, stream)
            else:
                drv.call("cuMemcpyHtoDAsync", device_base + device_offset, host + offset, n, stream)
            offset += n
            done += n
            device_offset = (device_offset + n) % device_size
        if done >= limit:
            break
    drv.stream_sync(stream)
    return done, now() - started


# ---- pinned host memory ---------------------------------------------------------------------------


class Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.mmap.restype = ctypes.c_void_p
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.munmap.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.memset.restype = ctypes.c_void_p
        self.lib = lib


def anon_huge_bytes() -> Optional[int]:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def thp_settings() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            out[name] = "?"
    return out


class Pinned:
    """Host memory pinned one of two ways; `chunks` are (address, size) in order."""

    def __init__(self, drv: Driver, kind: str) -> None:
        self.drv, self.kind = drv, kind
        self.chunks: list[tuple[int, int]] = []
        self.registered: list[int] = []  # base addresses passed to cuMemHostRegister
        self.mapping: Optional[tuple[int, int]] = None  # (mmap address, length)
        self.size = 0
        self.libc: Optional[Libc] = None

    @classmethod
    def host_alloc(cls, drv: Driver, size: int, chunk: int) -> "Pinned":
        pinned = cls(drv, "hostalloc")
        try:
            for offset in range(0, size, chunk):
                n = min(chunk, size - offset)
                pinned.chunks.append((drv.host_alloc(n), n))
        except BaseException:
            pinned.free()
            raise
        pinned.size = size
        return pinned

    @classmethod
    def mapped(cls, drv: Driver, size: int, phases: dict[str, list[float]], info: dict[str, Any]) -> "Pinned":
        """mmap + madvise(MADV_HUGEPAGE) + touch every page; not registered yet. `phases`
        gets "touch" -> [start, end]."""
        pinned = cls(drv, "register")
        libc = Libc()
        pinned.libc = libc
        length = size + HUGE
        addr = libc.lib.mmap(None, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {length} bytes: {os.strerror(ctypes.get_errno())}")
        pinned.mapping = (int(addr), length)
        base = round_up(int(addr), HUGE)
        huge_before = anon_huge_bytes()
        rc = libc.lib.madvise(base, size, MADV_HUGEPAGE)
        info["madvise"] = "ok" if rc == 0 else f"errno {ctypes.get_errno()}"
        t0 = now()
        for offset in range(0, size, CHUNK):  # ctypes releases the GIL in each call
            libc.lib.memset(base + offset, 0x5A, min(CHUNK, size - offset))
        phases["touch"] = [t0, now()]
        huge_after = anon_huge_bytes()
        if huge_before is not None and huge_after is not None:
            info["thp_gib"] = round((huge_after - huge_before) / GIB, 2)
        pinned.size = size
        pinned.chunks = [(base + offset, min(CHUNK, size - offset)) for offset in range(0, size, CHUNK)]
        return pinned

    def register(self, once: bool) -> None:
        if once:
            base = self.chunks[0][0]
            self.drv.call("cuMemHostRegister", base, self.size, CU_MEMHOSTREGISTER_PORTABLE)
            self.registered.append(base)
            return
        for address, size in self.chunks:
            self.drv.call("cuMemHostRegister", address, size, CU_MEMHOSTREGISTER_PORTABLE)
            self.registered.append(address)

    def unregister(self) -> None:
        while self.registered:
            self.drv.call("cuMemHostUnregister", self.registered[-1])
            self.registered.pop()

    def free(self) -> None:
        if self.kind == "hostalloc":
            while self.chunks:
                self.drv.call("cuMemFreeHost", self.chunks[-1][0])
                self.chunks.pop()
            return
        self.unregister()
        if self.mapping is not None and self.libc is not None:
            self.libc.lib.munmap(self.mapping[0], self.mapping[1])
            self.mapping = None
            self.chunks = []

    def write_markers(self) -> None:
        for index, (address, _) in enumerate(self.chunks):
            ctypes.c_uint64.from_address(address).value = 0xC0FFEE0000000000 + index

    def markers_ok(self) -> bool:
        return all(
            ctypes.c_uint64.from_address(address).value == 0xC0FFEE0000000000 + index
            for index, (address, _) in enumerate(self.chunks)
        )


def pinned_bytes(gb: float) -> int:
    return max(HUGE, round_up(int(gb * GIB), HUGE))


# ---- torch and the checkpoint rounds ---------------------------------------------------------------


def torch_context(with_matmul: bool = True) -> Any:
    """A small job context on cuda:0: torch initialised, cuBLAS loaded by one matmul."""
    import torch

    torch.cuda.init()
    torch.cuda.set_device(0)
    a = torch.randn(1024, 1024, device="cuda:0")
    if with_matmul:
        (a @ a).sum().item()
    torch.cuda.synchronize()
    return torch


class Rounds:
    """lock -> checkpoint -> restore in place -> unlock through flexium._C.run_steps."""

    def __init__(self, check: Callable[[], bool]) -> None:
        from flexium import _C

        self._C = _C
        self.pid = os.getpid()
        self.check = check
        self.steps = [
            _C.Step(_C.StepKind.LOCK, timeout_ms=LOCK_TIMEOUT_MS),
            _C.Step(_C.StepKind.CHECKPOINT),
            _C.Step(_C.StepKind.RESTORE),
            _C.Step(_C.StepKind.UNLOCK),
        ]
        recover = [_C.Step(_C.StepKind.RECOVER)]
        self.rollbacks = [[], recover, recover, [_C.Step(_C.StepKind.UNLOCK)]]

    def running(self) -> bool:
        return self._C.process_state(self.pid) == self._C.ProcessState.RUNNING

    def one(self) -> dict[str, Any]:
        _C = self._C
        started = now()
        outcomes = list(_C.run_steps(self.pid, self.steps, self.rollbacks))
        record: dict[str, Any] = {"wall_s": now() - started, "state": _C.process_state(self.pid).name}
        for o in outcomes:
            if not o.rollback and o.code == 0:
                record[f"{o.step}_s"] = o.seconds
        failed = [o for o in outcomes if o.code != 0]
        if failed or record["state"] != "RUNNING":
            first = failed[0] if failed else None
            what = f"{first.step}: {first.error_name} ({first.code}) {first.error_text}" if first else "no step failed"
            raise RuntimeError(f"checkpoint round: {what}; the process is {record['state']}")
        started = now()
        record["intact"] = bool(self.check())
        record["first_use_s"] = now() - started
        if not record["intact"]:
            raise RuntimeError("checkpoint round: data changed across checkpoint + restore")
        return record

    def many(self, label: str, count: int, into: dict[str, Any]) -> dict[str, Any]:
        rounds = [self.one() for _ in range(count)]
        summary: dict[str, Any] = {"rounds": rounds}
        for key in ("lock", "checkpoint", "restore", "unlock"):
            values = [r[f"{key}_s"] for r in rounds if r.get(f"{key}_s") is not None]
            summary[f"{key}_s"] = statistics.median(values) if values else None
        into.setdefault("states", {})[label] = summary
        log(f"   {label}: checkpoint {fmt(summary['checkpoint_s'])} s, restore {fmt(summary['restore_s'])} s")
        return summary


# ---- experiment: pin_stall ---------------------------------------------------------------------------


def gap_stats(ends: list[float], t0: float, t1: float) -> dict[str, Any]:
    """Gaps between consecutive iteration ends whose interval overlaps [t0, t1]."""
    gaps = [b - a for a, b in itertools.pairwise(ends) if b > t0 and a < t1]
    return {
        "max_gap_s": max(gaps) if gaps else None,
        "median_iter_s": statistics.median(gaps) if gaps else None,
        "iterations": len(gaps),
        "seconds": t1 - t0,
    }


def part_pin_stall(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    torch = torch_context()
    drv = Driver()
    drv.primary_context(0)
    size = pinned_bytes(args.gb)
    result.update(pinned_gib=size / GIB, thp=thp_settings(), torch=torch.__version__)
    x = torch.randn(2048, 2048, device="cuda:0")
    ends: list[float] = []
    stop = threading.Event()
    errors: list[str] = []

    def train() -> None:
        try:
            torch.cuda.set_device(0)
            while not stop.is_set():
                x @ x  # the product is dropped at once; its kernel still runs before the synchronize
                torch.cuda.synchronize()
                ends.append(now())
        except BaseException as exc:  # reported, never raised in the thread
            errors.append(f"{type(exc).__name__}: {exc}")

    for _ in range(3):
        (x @ x)
    torch.cuda.synchronize()
    trainer = threading.Thread(target=train, name="trainer", daemon=True)
    trainer.start()
    time.sleep(1.0)
    phases: dict[str, list[float]] = {}
    pinned: Optional[Pinned] = None
    t_pin0 = now()
    try:
        if part.startswith("hostalloc"):
            chunk = 256 * MIB if part == "hostalloc_256m" else 32 * MIB
            result["chunk_mib"] = chunk // MIB
            pinned = Pinned.host_alloc(drv, size, chunk)
            phases["pin"] = [t_pin0, now()]
        else:
            once = part == "register_once"
            result["register_calls"] = 1 if once else len(range(0, size, CHUNK))
            pinned = Pinned.mapped(drv, size, phases, result)
            t_reg = now()
            pinned.register(once)
            phases["register"] = [t_reg, now()]
            phases["pin"] = [t_pin0, now()]
        time.sleep(0.5)  # the trainer's first iterations after pinning close the last gap
    finally:
        stop.set()
        trainer.join(timeout=30)
    if errors:
        raise RuntimeError(f"training thread: {errors[0]}")
    base = gap_stats(ends, t_pin0 - 1.0, t_pin0)
    result["baseline"] = base
    result["phases"] = {name: gap_stats(ends, t0, t1) for name, (t0, t1) in phases.items()}
    pin = result["phases"]["pin"]
    result["pin_s"] = pin["seconds"]
    result["pin_gbps"] = gbps(size, pin["seconds"])
    for name in ("touch", "register"):
        if name in phases:
            result[f"{name}_s"] = phases[name][1] - phases[name][0]
    if base["median_iter_s"] and pin["seconds"]:
        result["train_speed_kept"] = pin["iterations"] * base["median_iter_s"] / pin["seconds"]
    assert pinned is not None
    # Copy speed into / out of the pinned memory (training stopped).
    dev = ctypes.c_uint64()
    dev_size = min(GIB, size)
    drv.call("cuMemAlloc", ctypes.byref(dev), dev_size)
    stream = drv.stream()
    try:
        copy_host_device(drv, pinned.chunks[:1], dev.value, dev_size, True, stream)  # warm-up
        nbytes, seconds = copy_host_device(drv, pinned.chunks, dev.value, dev_size, True, stream)
        result["d2h_gbps"] = gbps(nbytes, seconds)
        nbytes, seconds = copy_host_device(drv, pinned.chunks, dev.value, dev_size, False, stream)
        result["h2d_gbps"] = gbps(nbytes, seconds)
        result["d2h_fast"] = (result["d2h_gbps"] or 0) >= FAST_COPY_GBPS
    finally:
        drv.call("cuStreamDestroy", stream)
        drv.call("cuMemFree", dev.value)
    started = now()
    pinned.free()
    result["free_s"] = now() - started
    result["ok"] = True


# ---- experiment: checkpoint_pinned -----------------------------------------------------------------


def part_checkpoint_pinned(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    torch = torch_context()
    drv = Driver()
    drv.primary_context(0)
    size = pinned_bytes(args.gb)
    result.update(pinned_gib=size / GIB, torch=torch.__version__)
    expected = torch.arange(4096, dtype=torch.float32) * 0.5 + 3.0
    tiny = expected.to("cuda:0")
    torch.cuda.synchronize()
    holder: dict[str, Optional[Pinned]] = {"pinned": None}

    def check() -> bool:
        torch.cuda.synchronize()
        ok = bool(torch.equal(tiny.cpu(), expected))
        pinned = holder["pinned"]
        return ok and (pinned is None or pinned.markers_ok())

    rounds = Rounds(check)
    state["rounds"] = rounds
    errors: list[str] = []

    def rounds_of(label: str, count: int) -> None:
        """A failed state is recorded; the next ones still run while the process is RUNNING."""
        try:
            rounds.many(label, count, result)
        except Exception as exc:
            errors.append(f"{label}: {type(exc).__name__}: {exc}")
            result.setdefault("states", {})[label] = {"error": errors[-1]}
            log(f"   {errors[-1]}")
            if not rounds.running():
                raise

    rounds_of("none", args.repeats)
    if part == "hostalloc":
        started = now()
        pinned = Pinned.host_alloc(drv, size, CHUNK)
        result["pin_s"] = now() - started
        pinned.write_markers()
        holder["pinned"] = pinned
        rounds_of("pinned", args.repeats)
        holder["pinned"] = None
        started = now()
        pinned.free()
        result["free_s"] = now() - started
        rounds_of("freed", 1)
    else:
        phases: dict[str, list[float]] = {}
        pinned = Pinned.mapped(drv, size, phases, result)
        result["touch_s"] = phases["touch"][1] - phases["touch"][0]
        started = now()
        pinned.register(once=False)
        result["register_s"] = now() - started
        pinned.write_markers()
        holder["pinned"] = pinned
        rounds_of("registered", args.repeats)
        started = now()
        pinned.unregister()
        result["unregister_s"] = now() - started
        rounds_of("unregistered", args.repeats)
        started = now()
        pinned.register(once=False)
        result["reregister_s"] = now() - started
        dev = ctypes.c_uint64()
        dev_size = min(GIB, size)
        drv.call("cuMemAlloc", ctypes.byref(dev), dev_size)
        stream = drv.stream()
        try:
            saved = [ctypes.c_uint64.from_address(a).value for a, _ in pinned.chunks]
            nbytes, seconds = copy_host_device(drv, pinned.chunks, dev.value, dev_size, True, stream)
            result["d2h_gbps_after_reregister"] = gbps(nbytes, seconds)
            for (a, _), value in zip(pinned.chunks, saved, strict=True):  # the copy overwrote the markers
                ctypes.c_uint64.from_address(a).value = value
        finally:
            drv.call("cuStreamDestroy", stream)
            drv.call("cuMemFree", dev.value)
        rounds_of("reregistered", 1)
        holder["pinned"] = None
        started = now()
        pinned.free()
        result["free_s"] = now() - started
    if errors:
        result["error"] = "; ".join(errors)
    result["ok"] = not errors


# ---- experiment: helper_copy --------------------------------------------------------------------------


def send(sock: socket.socket, message: dict[str, Any], fd: Optional[int] = None) -> None:
    data = json.dumps(message).encode()
    if fd is None:
        sock.send(data)
    else:
        socket.send_fds(sock, [data], [fd])


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the other side closed the socket")
    return json.loads(data.decode()), list(fds)


def helper_main(args: argparse.Namespace) -> int:
    """The helper child: own context on cuda:0, pinned buffer once, then copy orders."""
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(max(5.0, args.timeout - 10), exit=True)
    sock = socket.socket(fileno=args.helper_sock)
    try:
        drv = Driver()
        drv.primary_context(0)
        prop = drv.prop(0)
        granularity = drv.granularity(prop)
        size = pinned_bytes(args.gb)
        started = now()
        pinned = Pinned.host_alloc(drv, size, CHUNK)
        pin_s = now() - started
        stream = drv.stream()
        send(sock, {"ready": True, "pin_s": pin_s, "pinned": size, "granularity": granularity})
    except BaseException as exc:
        traceback.print_exc()
        try:
            send(sock, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1
    while True:
        try:
            message, fds = receive(sock)
        except (ConnectionError, OSError):
            return 0
        op = message.get("op")
        if op == "quit":
            for fd in fds:
                os.close(fd)
            return 0
        reply: dict[str, Any] = {"ok": False}
        handle = va = 0
        mapped = False
        nbytes = int(message.get("size", 0))
        try:
            if len(fds) != 1:
                raise RuntimeError(f"expected one fd, got {len(fds)}")
            if nbytes > pinned.size or nbytes % granularity:
                raise RuntimeError(f"size {nbytes} does not fit the pinned {pinned.size} / granularity {granularity}")
            t0 = now()
            handle = drv.import_fd(fds[0])
            os.close(fds.pop())
            va = drv.reserve(nbytes)
            drv.map(va, nbytes, handle)
            mapped = True
            drv.set_access(va, nbytes, 0)
            t1 = now()
            copied, seconds = copy_host_device(drv, pinned.chunks, va, nbytes, op == "d2h", stream, total=nbytes)
            t2 = now()
            drv.call("cuMemUnmap", va, nbytes)
            mapped = False
            drv.call("cuMemAddressFree", va, nbytes)
            va = 0
            drv.call("cuMemRelease", handle)
            handle = 0
            t3 = now()
            reply = {
                "ok": True,
                "import_map_s": t1 - t0,
                "copy_s": seconds,
                "bytes": copied,
                "gbps": gbps(copied, seconds),
                "unmap_release_s": t3 - t2,
            }
        except BaseException as exc:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            for fd in fds:
                os.close(fd)
            try:
                if mapped:
                    drv.call("cuMemUnmap", va, nbytes)
                if va:
                    drv.call("cuMemAddressFree", va, nbytes)
                if handle:
                    drv.call("cuMemRelease", handle)
            except Exception:
                traceback.print_exc()
        send(sock, reply)


def part_helper_copy(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    torch = torch_context()
    drv = Driver()
    drv.primary_context(0)
    size = pinned_bytes(args.gb)
    result.update(gib=size / GIB, torch=torch.__version__)
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [
            sys.executable,
            str(THIS),
            "--helper-sock",
            str(child_sock.fileno()),
            "--gb",
            str(args.gb),
            "--timeout",
            str(max(20.0, args.timeout - 15)),
        ],
        pass_fds=[child_sock.fileno()],
        stdout=sys.stderr,
    )
    child_sock.close()
    parent_sock.settimeout(max(20.0, args.timeout / 2))
    prop = drv.prop(0)
    handle = va = 0
    mapped = False
    try:
        ready, _ = receive(parent_sock)  # the helper has pinned its buffer
        if not ready.get("ready"):
            raise RuntimeError(f"helper: {ready.get('error')}")
        result["helper_pin_s"] = ready.get("pin_s")
        # The job's fixed checkpoint cost, before any VMM memory exists.
        rounds = Rounds(lambda: True)
        state["rounds"] = rounds
        rounds.many("baseline", 1, result)

        granularity = drv.granularity(prop)
        if size % granularity:
            raise RuntimeError(f"{size} bytes is not a multiple of the granularity {granularity}")
        va = drv.reserve(size)
        handle = drv.create(size, prop)
        drv.map(va, size, handle)
        mapped = True
        drv.set_access(va, size, 0)
        drv.call("cuMemsetD32", va, 0x5EED1234, size // 4)
        eighth = size // 8 // 4 * 4
        marks = [(k * eighth, 0xA5000000 + k) for k in range(8)]
        for offset, value in marks:
            drv.call("cuMemsetD32", va + offset, value, 1024)
        drv.synchronize()
        checks = marks + [(k * eighth + 8192, 0x5EED1234) for k in range(8)] + [(size - 4, 0x5EED1234)]

        # pause: export, helper copies D2H, release, checkpoint
        t = now()
        fd = drv.export_fd(handle)
        result["export_s"] = now() - t
        t = now()
        send(parent_sock, {"op": "d2h", "size": size}, fd)
        os.close(fd)
        reply, _ = receive(parent_sock)
        result["d2h_roundtrip_s"] = now() - t
        if not reply.get("ok"):
            raise RuntimeError(f"helper d2h: {reply.get('error')}")
        result["d2h"] = reply
        free_before = drv.mem_free()
        t = now()
        drv.call("cuMemUnmap", va, size)
        mapped = False
        drv.call("cuMemRelease", handle)
        handle = 0
        result["release_s"] = now() - t
        result["gpu_freed_gib"] = (drv.mem_free() - free_before) / GIB
        drv.synchronize()
        ck = rounds.many("paused", 1, result)

        # resume: new memory at the same address, helper copies H2D
        t = now()
        handle = drv.create(size, prop)
        result["create_s"] = now() - t
        t = now()
        drv.map(va, size, handle)
        mapped = True
        drv.set_access(va, size, 0)
        result["map_s"] = now() - t
        t = now()
        fd = drv.export_fd(handle)
        result["export2_s"] = now() - t
        t = now()
        send(parent_sock, {"op": "h2d", "size": size}, fd)
        os.close(fd)
        reply, _ = receive(parent_sock)
        result["h2d_roundtrip_s"] = now() - t
        if not reply.get("ok"):
            raise RuntimeError(f"helper h2d: {reply.get('error')}")
        result["h2d"] = reply
        bad = [(hex(off), hex(got), hex(want)) for off, want in checks if (got := drv.read_u32(va + off)) != want]
        result["data_ok"] = not bad
        if bad:
            result["bad_words"] = bad[:5]

        result["pause_s"] = (
            result["export_s"]
            + result["d2h_roundtrip_s"]
            + result["release_s"]
            + (ck["lock_s"] or 0)
            + (ck["checkpoint_s"] or 0)
        )
        result["resume_s"] = (
            (ck["restore_s"] or 0)
            + (ck["unlock_s"] or 0)
            + result["create_s"]
            + result["map_s"]
            + result["export2_s"]
            + result["h2d_roundtrip_s"]
        )
        result["d2h_gbps"] = result["d2h"].get("gbps")
        result["h2d_gbps"] = result["h2d"].get("gbps")
        result["checkpoint_s"] = ck["checkpoint_s"]
        result["restore_s"] = ck["restore_s"]
        result["ok"] = bool(result["data_ok"])
        if not result["data_ok"]:
            result["error"] = f"pattern wrong after the H2D copy: {bad[:3]}"
    finally:
        try:
            alive = "rounds" not in state or state["rounds"].running()  # CUDA calls would hang otherwise
            if alive and mapped:
                drv.call("cuMemUnmap", va, size)
            if alive and handle:
                drv.call("cuMemRelease", handle)
            if alive and va:
                drv.call("cuMemAddressFree", va, size)
        except Exception:
            traceback.print_exc()
        try:
            send(parent_sock, {"op": "quit"})
        except OSError:
            pass
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        result["helper_returncode"] = child.returncode
        parent_sock.close()


# ---- experiment: shared_staging ----------------------------------------------------------------------


def nvml_used_mib(pid: int) -> Optional[int]:
    """GPU memory NVML shows for `pid` (nvidia-smi), None where it shows none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            try:
                return int(fields[1])
            except ValueError:
                return None
    return None


def smaps_huge() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if "Huge" in name or "Pmd" in name:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def map_host(libc: Libc, size: int, kind: str) -> tuple[int, int, int]:
    """(mmap address, length, memfd or -1) of `size` bytes (2 MiB aligned start) of `kind`."""
    length = size + HUGE
    fd = -1
    if kind == "memfd":
        fd = os.memfd_create("flexium-probe-staging", 0)
        os.ftruncate(fd, length)
        addr = libc.lib.mmap(None, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
    else:
        addr = libc.lib.mmap(None, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), f"mmap of {length} bytes ({kind})")
    return int(addr), length, fd


def part_shared_staging(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    drv = Driver()
    t = now()
    drv.primary_context(0)
    result["ctx_create_s"] = now() - t
    result["ctx_nvml_mib"] = nvml_used_mib(os.getpid())
    thp = thp_settings()
    try:
        thp["shmem_enabled"] = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        thp["shmem_enabled"] = "?"
    result["thp"] = thp
    libc = Libc()
    size = pinned_bytes(args.gb)
    result["gib"] = size / GIB
    device_size = GIB
    allocated = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(allocated), device_size)
    device = int(allocated.value)
    stream = drv.stream()
    kinds: dict[str, Any] = {}
    result["kinds"] = kinds
    for kind in ("memfd", "anon"):
        r: dict[str, Any] = {}
        kinds[kind] = r
        addr, length, fd = map_host(libc, size, kind)
        base = round_up(addr, HUGE)
        chunks = [(base + off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
        try:
            before = smaps_huge()
            r["madvise_rc"] = libc.lib.madvise(base, size, MADV_HUGEPAGE)
            t = now()
            rc = libc.lib.madvise(base, size, MADV_POPULATE_WRITE)
            if rc != 0:
                for off in range(0, size, CHUNK):
                    libc.lib.memset(base + off, 0, min(CHUNK, size - off))
            r["touch_s"] = now() - t
            r["populate_rc"] = rc
            after = smaps_huge()
            r["huge_gib"] = {
                k: round((after.get(k, 0) - before.get(k, 0)) / GIB, 2)
                for k in after
                if after.get(k, 0) != before.get(k, 0)
            }
            t = now()
            for a, n in chunks:
                drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
            r["register_s"] = now() - t
            _, r["h2d_s"] = copy_host_device(drv, chunks, device, device_size, False, stream)
            _, r["d2h_s"] = copy_host_device(drv, chunks, device, device_size, True, stream)
            t = now()
            for a, _n in chunks:
                drv.call("cuMemHostUnregister", a)
            r["unregister_s"] = now() - t
            # serial: register all, then copy all
            t = now()
            for a, n in chunks:
                drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
            copy_host_device(drv, chunks, device, device_size, False, stream)
            r["serial_s"] = now() - t
            for a, _n in chunks:
                drv.call("cuMemHostUnregister", a)
            # pipelined: register chunk k, queue its copy, go on with k+1 while it runs
            t = now()
            for k, (a, n) in enumerate(chunks):
                drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
                off = (k * CHUNK) % device_size
                drv.call("cuMemcpyHtoDAsync", device + off, a, min(n, device_size - off), stream)
            drv.stream_sync(stream)
            r["pipelined_s"] = now() - t
            if kind == "memfd":
                # context reset with the memory still registered: does it unpin, and how long
                t = now()
                drv.call("cuDevicePrimaryCtxReset", drv.device)
                r["ctx_reset_registered_s"] = now() - t
                result["nvml_after_reset_mib"] = nvml_used_mib(os.getpid())
                t = now()
                drv.primary_context(0)
                r["ctx_recreate_s"] = now() - t
                drv.call("cuMemAlloc", ctypes.byref(allocated), device_size)
                device = int(allocated.value)
                stream = drv.stream()
                t = now()
                try:
                    drv.call("cuMemHostRegister", chunks[0][0], chunks[0][1], CU_MEMHOSTREGISTER_PORTABLE)
                    r["after_reset"] = "registers again (the reset unpinned it)"
                    drv.call("cuMemHostUnregister", chunks[0][0])
                except CudaError as exc:
                    r["after_reset"] = f"register again: {exc.name}"
            else:
                for a, _n in chunks:
                    drv.call("cuMemHostUnregister", a)
        finally:
            libc.lib.munmap(addr, length)
            if fd >= 0:
                os.close(fd)
        log(f"   {kind}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()))
    result["ok"] = True


# ---- experiment: memfd_fill ------------------------------------------------------------------------------


def populate(libc: Libc, base: int, size: int, threads: int) -> None:
    """Faults [base, base+size) in from `threads` threads (ctypes lets the GIL go during madvise)."""
    slice_bytes = round_up(-(-size // threads), HUGE)

    def work(start: int, length: int) -> None:
        if libc.lib.madvise(start, length, MADV_POPULATE_WRITE) != 0:
            libc.lib.memset(start, 0, length)

    workers = [
        threading.Thread(target=work, args=(base + off, min(slice_bytes, size - off)))
        for off in range(0, size, slice_bytes)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def part_memfd_fill(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    drv = Driver()
    drv.primary_context(0)
    libc = Libc()
    size = pinned_bytes(args.gb)
    threads = max(1, min(8, (os.cpu_count() or 2) // 2))  # as csrc's touch() picks them
    result.update(gib=size / GIB, threads=threads, ways={})
    for way in ("touch", "fallocate", "fallocate+touch"):
        r: dict[str, Any] = {}
        result["ways"][way] = r
        addr, length, fd = map_host(libc, size, "memfd")
        base = round_up(addr, HUGE)
        chunks = [(base + off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
        try:
            libc.lib.madvise(base, size, MADV_HUGEPAGE)
            if way.startswith("fallocate"):
                t = now()
                os.posix_fallocate(fd, 0, length)
                r["fallocate_s"] = now() - t
            if way.endswith("touch"):
                t = now()
                populate(libc, base, size, threads)
                r["touch_s"] = now() - t
            r["fill_s"] = (r.get("fallocate_s") or 0.0) + (r.get("touch_s") or 0.0)
            t = now()
            for a, n in chunks:
                drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
            r["register_s"] = now() - t
            for a, _n in chunks:
                drv.call("cuMemHostUnregister", a)
        finally:
            libc.lib.munmap(addr, length)
            os.close(fd)
        log(f"   {way}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()))
    result["ok"] = True


# ---- experiment: pin_threads -----------------------------------------------------------------------------


def in_threads(works: list[Callable[[], None]]) -> float:
    """Seconds to run every work in a thread of its own, all at once; a failure in any is raised."""
    errors: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(work,)) for work in works]
    started = now()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return now() - started


def across_threads(
    ctx: int, drv: Driver, threads: int, chunks: list[tuple[int, int]], call: Callable[[int, int], None]
) -> float:
    """Runs call(address, size) for every chunk from `threads` threads (round robin); seconds."""

    def work(mine: list[tuple[int, int]]) -> Callable[[], None]:
        def run() -> None:
            drv.call("cuCtxSetCurrent", ctx)
            for a, n in mine:
                call(a, n)

        return run

    return in_threads([work(chunks[i::threads]) for i in range(threads)])


def part_pin_threads(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    drv = Driver()
    ctx = drv.primary_context(0)
    libc = Libc()
    size = pinned_bytes(args.gb)
    addr, length, fd = map_host(libc, size, "memfd")
    base = round_up(addr, HUGE)
    chunks = [(base + off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
    result.update(gib=size / GIB, ways={})
    try:
        libc.lib.madvise(base, size, MADV_HUGEPAGE)
        populate(libc, base, size, max(1, min(8, (os.cpu_count() or 2) // 2)))
        for name, threads in (("1", 1), ("2", 2), ("4", 4), ("8", 8), ("1 again", 1)):
            r = result["ways"][name] = {}
            r["register_s"] = across_threads(
                ctx, drv, threads, chunks, lambda a, n: drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
            )
            r["unregister_s"] = across_threads(
                ctx, drv, threads, chunks, lambda a, n: drv.call("cuMemHostUnregister", a)
            )
            log(f"   {name} thread(s): " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()))
    finally:
        libc.lib.munmap(addr, length)
        os.close(fd)
    result["ok"] = True


# ---- experiment: own_cost ----------------------------------------------------------------------------------


def part_own_cost(part: str, args: argparse.Namespace, result: dict[str, Any], state: dict[str, Any]) -> None:
    drv = Driver()
    drv.primary_context(0)
    prop = drv.prop(0)
    granularity = drv.granularity(prop)
    seg = round_up(GIB, granularity)
    count = max(1, int(round(args.gb)))
    result.update(segments=count, segment_gib=seg / GIB, granularity=granularity)
    segments: list[dict[str, int]] = []
    try:
        # Setup: segments holding imported memory at their own reserved address (after a fast move).
        for index in range(count):
            va = drv.reserve(seg)
            own = drv.create(seg, prop)
            drv.map(va, seg, own)
            drv.set_access(va, seg, 0)
            drv.call("cuMemsetD32", va, 0x1000 + index, seg // 4)
            drv.synchronize()
            fd = drv.export_fd(own)
            try:
                imported = drv.import_fd(fd)
            finally:
                os.close(fd)
            drv.call("cuMemUnmap", va, seg)
            drv.call("cuMemRelease", own)
            drv.map(va, seg, imported)
            drv.set_access(va, seg, 0)
            segments.append({"va": va, "handle": imported, "imported": 1})
        drv.synchronize()

        t = now()
        drv.synchronize()
        stream = drv.stream()
        result["sync_stream_s"] = now() - t
        steps: dict[str, list[float]] = {"create": [], "map_temp": [], "copy": [], "swap": [], "cleanup": []}
        started = now()
        for segment in segments:
            va = segment["va"]
            t0 = now()
            fresh = drv.create(seg, prop)
            t1 = now()
            temp = drv.reserve(seg)
            drv.map(temp, seg, fresh)
            drv.set_access(temp, seg, 0)
            t2 = now()
            drv.call("cuMemcpyDtoDAsync", temp, va, seg, stream)
            drv.stream_sync(stream)
            t3 = now()
            drv.call("cuMemUnmap", va, seg)
            drv.map(va, seg, fresh)
            drv.set_access(va, seg, 0)
            t4 = now()
            drv.call("cuMemRelease", segment["handle"])
            segment["handle"], segment["imported"] = fresh, 0
            drv.call("cuMemUnmap", temp, seg)
            drv.call("cuMemAddressFree", temp, seg)
            t5 = now()
            for name, a, b in (
                ("create", t0, t1),
                ("map_temp", t1, t2),
                ("copy", t2, t3),
                ("swap", t3, t4),
                ("cleanup", t4, t5),
            ):
                steps[name].append(b - a)
        result["total_s"] = now() - started
        drv.call("cuStreamDestroy", stream)
        result["steps"] = {
            name: {"total_s": sum(v), "median_s": statistics.median(v), "max_s": max(v)} for name, v in steps.items()
        }
        result["copy_gbps"] = gbps(seg * count, sum(steps["copy"]))
        bad = [
            i
            for i, s in enumerate(segments)
            if drv.read_u32(s["va"] + 4096) != 0x1000 + i or drv.read_u32(s["va"] + seg - 4) != 0x1000 + i
        ]
        result["data_ok"] = not bad
        result["ok"] = not bad
        if bad:
            result["error"] = f"segments {bad[:5]} lost their pattern"
    finally:
        for s in segments:
            try:
                drv.call("cuMemUnmap", s["va"], seg)
                drv.call("cuMemRelease", s["handle"])
                drv.call("cuMemAddressFree", s["va"], seg)
            except Exception:
                traceback.print_exc()


PARTS: dict[str, Callable[[str, argparse.Namespace, dict[str, Any], dict[str, Any]], None]] = {
    "pin_stall": part_pin_stall,
    "checkpoint_pinned": part_checkpoint_pinned,
    "helper_copy": part_helper_copy,
    "shared_staging": part_shared_staging,
    "own_cost": part_own_cost,
    "memfd_fill": part_memfd_fill,
    "pin_threads": part_pin_threads,
}


def worker(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(max(5.0, args.timeout - 10), exit=True)
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    experiment, _, part = args.part.partition(":")
    result: dict[str, Any] = {"experiment": experiment, "part": part, "ok": False, "pid": os.getpid(), "gb": args.gb}
    state: dict[str, Any] = {}
    started = now()
    try:
        if experiment not in PARTS or part not in EXPERIMENTS[experiment]:
            raise RuntimeError(f"unknown part {args.part}")
        PARTS[experiment](part, args, result, state)
    except BaseException as exc:  # report, never hang: the driver reads the JSON line
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    result["worker_s"] = now() - started
    print(json.dumps({"event": "result", **result}, default=str), flush=True)
    rounds = state.get("rounds")
    if rounds is not None:
        try:
            if not rounds.running():
                os._exit(1)  # a process that is not RUNNING would hang in any CUDA call at exit
        except Exception:
            os._exit(1)
    return 0 if result.get("ok") else 1


# ---- the driver ------------------------------------------------------------------------------------------


def run_part(experiment: str, part: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(THIS),
        "--part",
        f"{experiment}:{part}",
        "--gb",
        str(args.gb),
        "--repeats",
        str(args.repeats),
        "--timeout",
        str(args.timeout),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_MODULE_LOADING": "LAZY"}
    env.pop("FLEXIUM_SERVER", None)
    return run_child(argv, env, args.timeout).result(
        failed={"experiment": experiment, "part": part}, timeout=args.timeout
    )


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


def ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def status(r: dict[str, Any]) -> str:
    return "ok" if r.get("ok") else "FAILED"


def table_pin_stall(results: list[dict[str, Any]]) -> None:
    import tables

    columns = (
        "method",
        "pin s",
        "GB/s",
        "touch s",
        "register s",
        "THP GiB",
        "max gap ms",
        "base max ms",
        "iter ms",
        "base iter ms",
        "speed kept",
        "D2H GB/s",
        "H2D GB/s",
        "free s",
        "status",
    )
    rows = []
    for r in results:
        pin = (r.get("phases") or {}).get("pin") or {}
        base = r.get("baseline") or {}
        kept = r.get("train_speed_kept")
        rows.append(
            (
                r["part"],
                fmt(r.get("pin_s"), 2),
                fmt(r.get("pin_gbps"), 2),
                fmt(r.get("touch_s"), 2),
                fmt(r.get("register_s"), 2),
                fmt(r.get("thp_gib"), 1),
                ms(pin.get("max_gap_s")),
                ms(base.get("max_gap_s")),
                ms(pin.get("median_iter_s")),
                ms(base.get("median_iter_s")),
                "-" if kept is None else f"{kept:.0%}",
                fmt(r.get("d2h_gbps"), 1),
                fmt(r.get("h2d_gbps"), 1),
                fmt(r.get("free_s"), 2),
                status(r),
            )
        )
    tables.print_table(columns, rows)
    for r in results:
        phases = r.get("phases") or {}
        extra = [
            f"{name}: max gap {ms(p.get('max_gap_s'))} ms over {p.get('seconds', 0):.2f} s"
            for name, p in phases.items()
            if name != "pin"
        ]
        if extra:
            print(f"  {r['part']}: " + "; ".join(extra) + f" (madvise {r.get('madvise', '-')}, THP {r.get('thp')})")
    print(
        "max gap: the training thread's longest time between iteration ends while pinning (base: in the 1 s "
        "before); iter: median; speed kept: iterations while pinning x base median / pin seconds."
    )


def state_row(r: dict[str, Any], label: str) -> tuple[str, ...]:
    s = (r.get("states") or {}).get(label) or {}
    c, t = s.get("checkpoint_s"), s.get("restore_s")
    return (
        r["part"],
        label,
        fmt(c),
        fmt(t),
        fmt(None if c is None or t is None else c + t),
        str(len(s.get("rounds", []))),
        "FAILED" if s.get("error") else "ok",
    )


def table_checkpoint_pinned(results: list[dict[str, Any]]) -> None:
    import tables

    columns = ("part", "state", "checkpoint s", "restore s", "total s", "rounds", "status")
    rows = []
    for r in results:
        for label in r.get("states") or {}:
            rows.append(state_row(r, label))
    tables.print_table(columns, rows)
    for r in results:
        keys = (
            "pin_s",
            "touch_s",
            "register_s",
            "unregister_s",
            "reregister_s",
            "free_s",
            "d2h_gbps_after_reregister",
            "thp_gib",
        )
        text = ", ".join(f"{k} {fmt(r.get(k), 3)}" for k in keys if r.get(k) is not None)
        print(f"  {r['part']} ({fmt(r.get('pinned_gib'), 1)} GiB, {status(r)}): {text}")
        if r.get("error"):
            print(f"    error: {r['error']}")


def table_helper(results: list[dict[str, Any]]) -> None:
    import tables

    for r in results:
        d2h, h2d = r.get("d2h") or {}, r.get("h2d") or {}
        base = (r.get("states") or {}).get("baseline") or {}
        paused = (r.get("states") or {}).get("paused") or {}
        rows = [
            ("helper pins its buffer (once, at its start)", fmt(r.get("helper_pin_s")), ""),
            (
                "baseline checkpoint / restore (no VMM memory)",
                f"{fmt(base.get('checkpoint_s'))} / {fmt(base.get('restore_s'))}",
                "",
            ),
            ("pause: export fd", fmt(r.get("export_s")), ""),
            (
                "pause: D2H round trip",
                fmt(r.get("d2h_roundtrip_s")),
                f"helper import+map {fmt(d2h.get('import_map_s'))}, copy {fmt(d2h.get('copy_s'))} "
                f"({fmt(d2h.get('gbps'), 1)} GB/s), unmap+release {fmt(d2h.get('unmap_release_s'))}",
            ),
            (
                "pause: release (unmap + cuMemRelease)",
                fmt(r.get("release_s")),
                f"GPU memory freed {fmt(r.get('gpu_freed_gib'), 2)} GiB",
            ),
            ("pause: lock + checkpoint", f"{fmt(paused.get('lock_s'), 4)} + {fmt(paused.get('checkpoint_s'))}", ""),
            ("PAUSE total", fmt(r.get("pause_s")), ""),
            ("resume: restore + unlock", f"{fmt(paused.get('restore_s'))} + {fmt(paused.get('unlock_s'), 4)}", ""),
            ("resume: cuMemCreate", fmt(r.get("create_s")), ""),
            ("resume: map at the same address + access", fmt(r.get("map_s")), ""),
            ("resume: export fd", fmt(r.get("export2_s")), ""),
            (
                "resume: H2D round trip",
                fmt(r.get("h2d_roundtrip_s")),
                f"helper import+map {fmt(h2d.get('import_map_s'))}, copy {fmt(h2d.get('copy_s'))} "
                f"({fmt(h2d.get('gbps'), 1)} GB/s), unmap+release {fmt(h2d.get('unmap_release_s'))}",
            ),
            ("RESUME total", fmt(r.get("resume_s")), ""),
            ("data_ok", fmt(r.get("data_ok")), status(r)),
        ]
        print(f"helper_copy, {fmt(r.get('gib'), 1)} GiB:")
        tables.print_table(("step", "seconds", "detail"), rows)


def table_shared(results: list[dict[str, Any]]) -> None:
    import tables

    for r in results:
        kinds = r.get("kinds") or {}
        gib = r.get("gib") or 0
        rows = []
        for kind, k in kinds.items():
            rows.append(
                (
                    kind,
                    fmt(k.get("touch_s")),
                    str(k.get("huge_gib")),
                    fmt(k.get("register_s")),
                    fmt(gbps(gib * GIB, k.get("register_s")), 1),
                    fmt(gbps(gib * GIB, k.get("h2d_s")), 1),
                    fmt(gbps(gib * GIB, k.get("d2h_s")), 1),
                    fmt(k.get("unregister_s")),
                    fmt(k.get("serial_s")),
                    fmt(k.get("pipelined_s")),
                )
            )
        print(f"shared_staging, {fmt(gib, 1)} GiB, THP {r.get('thp')} ({status(r)}):")
        tables.print_table(
            (
                "memory",
                "touch s",
                "huge GiB",
                "register s",
                "reg GB/s",
                "H2D GB/s",
                "D2H GB/s",
                "unreg s",
                "reg+copy serial s",
                "pipelined s",
            ),
            rows,
        )
        memfd = kinds.get("memfd") or {}
        print(
            f"  bare driver context: create {fmt(r.get('ctx_create_s'))} s, NVML {r.get('ctx_nvml_mib')} MiB; "
            f"reset with {fmt(gib, 1)} GiB registered {fmt(memfd.get('ctx_reset_registered_s'))} s (NVML after: "
            f"{r.get('nvml_after_reset_mib')} MiB), recreate {fmt(memfd.get('ctx_recreate_s'))} s; after the reset: "
            f"{memfd.get('after_reset')}"
        )


def table_fill(results: list[dict[str, Any]]) -> None:
    import tables

    for r in results:
        gib = r.get("gib") or 0
        rows = [
            (
                way,
                fmt(w.get("fallocate_s")),
                fmt(w.get("touch_s")),
                fmt(w.get("fill_s")),
                fmt(gbps(gib * GIB, w.get("fill_s")), 1),
                fmt(w.get("register_s")),
                fmt(gbps(gib * GIB, w.get("register_s")), 1),
                fmt(w.get("fill_s", 0) + w.get("register_s", 0)),
            )
            for way, w in (r.get("ways") or {}).items()
        ]
        print(f"memfd_fill, {fmt(gib, 1)} GiB, touch with {r.get('threads')} threads ({status(r)}):")
        tables.print_table(
            ("way", "fallocate s", "touch s", "fill s", "fill GB/s", "register s", "reg GB/s", "fill + register s"),
            rows,
        )


def table_pin_threads(results: list[dict[str, Any]]) -> None:
    import tables

    for r in results:
        gib = r.get("gib") or 0
        ways = r.get("ways") or {}
        one = (ways.get("1") or {}).get("register_s")
        rows = [
            (
                threads,
                fmt(w.get("register_s")),
                fmt(gbps(gib * GIB, w.get("register_s")), 1),
                fmt(one / w["register_s"] if one and w.get("register_s") else None, 2),
                fmt(w.get("unregister_s")),
                fmt(gbps(gib * GIB, w.get("unregister_s")), 1),
            )
            for threads, w in ways.items()
        ]
        print(f"pin_threads, {fmt(gib, 1)} GiB memfd, touched, 256 MiB chunks ({status(r)}):")
        tables.print_table(("threads", "register s", "reg GB/s", "vs 1 thread", "unregister s", "unreg GB/s"), rows)


def table_own(results: list[dict[str, Any]]) -> None:
    import tables

    for r in results:
        steps = r.get("steps") or {}
        rows = [
            (name, fmt(s.get("total_s"), 4), ms(s.get("median_s")), ms(s.get("max_s"))) for name, s in steps.items()
        ]
        rows.append(("all", fmt(r.get("total_s"), 4), "-", "-"))
        print(
            f"own_cost, {r.get('segments')} segments of {fmt(r.get('segment_gib'), 2)} GiB "
            f"(sync + stream {ms(r.get('sync_stream_s'))} ms, copy {fmt(r.get('copy_gbps'), 0)} GB/s, data_ok "
            f"{fmt(r.get('data_ok'))}, {status(r)}):"
        )
        tables.print_table(("step", "total s", "median ms", "max ms"), rows)
        print(
            "  create: cuMemCreate; map_temp: reserve + map + access of a temporary range; copy: cuMemcpyDtoDAsync + "
            "stream sync; swap: unmap the imported + map the new + access; cleanup: release the imported handle + "
            "unmap + free the temporary range."
        )


def summary(by_experiment: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines: list[str] = []
    pins = {r["part"]: r for r in by_experiment.get("pin_stall", []) if r.get("ok")}
    if pins:
        for name, r in pins.items():
            pin = (r.get("phases") or {}).get("pin") or {}
            rate = r.get("pin_gbps")
            t16 = 16 * GIB / (rate * 1e9) if rate else None
            lines.append(
                f"pin_stall {name}: {fmt(rate, 2)} GB/s (16 GiB in {fmt(t16, 1)} s), training max gap "
                f"{ms(pin.get('max_gap_s'))} ms, kept {fmt((r.get('train_speed_kept') or 0) * 100, 0)} % of its "
                f"speed, D2H {fmt(r.get('d2h_gbps'), 1)} GB/s ({'fast' if r.get('d2h_fast') else 'NOT fast'})"
            )
        fast = [r for r in pins.values() if r.get("d2h_fast") and r.get("pin_gbps")]
        if fast:
            best = max(fast, key=lambda r: r["pin_gbps"])
            calm = min(fast, key=lambda r: ((r.get("phases") or {}).get("pin") or {}).get("max_gap_s") or 1e9)
            ref = pins.get("hostalloc_256m")
            vs = f" ({best['pin_gbps'] / ref['pin_gbps']:.1f}x hostalloc_256m)" if ref and ref.get("pin_gbps") else ""
            lines.append(
                f"fastest pinning with fast copies: {best['part']} {best['pin_gbps']:.2f} GB/s{vs}; smallest "
                f"training stall: {calm['part']}"
            )
    cks = {r["part"]: r for r in by_experiment.get("checkpoint_pinned", [])}

    def total(r: dict[str, Any], label: str) -> Optional[float]:
        s = (r.get("states") or {}).get(label) or {}
        c, t = s.get("checkpoint_s"), s.get("restore_s")
        return None if c is None or t is None else c + t

    for name, r in cks.items():
        none = total(r, "none")
        for label in ("pinned", "registered", "unregistered", "reregistered", "freed"):
            value = total(r, label)
            if none is not None and value is not None:
                lines.append(
                    f"checkpoint_pinned {name} {label}: checkpoint + restore {value:.3f} s, {value - none:+.3f} s "
                    f"over none ({none:.3f} s) with {fmt(r.get('pinned_gib'), 1)} GiB"
                )
        reg, unreg = total(r, "registered"), total(r, "unregistered")
        if none is not None and reg is not None and unreg is not None:
            extra, left = reg - none, unreg - none
            removed = left <= max(0.05, 0.2 * extra)
            lines.append(
                f"unregistering before the checkpoint {'removes' if removed else 'does NOT remove'} the pinned "
                f"cost ({extra:+.3f} s registered, {left:+.3f} s unregistered); unregister "
                f"{fmt(r.get('unregister_s'))} s, re-register {fmt(r.get('reregister_s'))} s "
                f"({fmt(gbps((r.get('pinned_gib') or 0) * GIB, r.get('reregister_s')), 1)} GB/s; first "
                f"register {fmt(r.get('register_s'))} s), D2H after re-register "
                f"{fmt(r.get('d2h_gbps_after_reregister'), 1)} GB/s"
            )
            if r.get("unregister_s") is not None and r.get("reregister_s") is not None:
                net = extra - r["unregister_s"] - r["reregister_s"]
                lines.append(
                    f"  net per pause + resume from unregistering: {net:+.3f} s (positive: worth it), "
                    "re-register could also run after the job resumes"
                )
    for r in by_experiment.get("helper_copy", []):
        if not r.get("ok"):
            continue
        gib = r.get("gib") or 0
        d2h, h2d = r.get("d2h") or {}, r.get("h2d") or {}
        paused = (r.get("states") or {}).get("paused") or {}
        lines.append(
            f"helper_copy {gib:.1f} GiB: pause {r['pause_s']:.3f} s, resume {r['resume_s']:.3f} s (D2H "
            f"{fmt(d2h.get('gbps'), 1)} GB/s, H2D {fmt(h2d.get('gbps'), 1)} GB/s, checkpoint "
            f"{fmt(paused.get('checkpoint_s'))} s, restore {fmt(paused.get('restore_s'))} s), data_ok "
            f"{fmt(r.get('data_ok'))}"
        )
        if gib and d2h.get("copy_s") and h2d.get("copy_s"):
            scale = 16.0 / gib
            pause16 = r["pause_s"] + d2h["copy_s"] * (scale - 1)
            resume16 = r["resume_s"] + h2d["copy_s"] * (scale - 1) + r["create_s"] * (scale - 1)
            verdict = "meets" if pause16 <= PAUSE_GOAL_S and resume16 <= RESUME_GOAL_S else "misses"
            lines.append(
                f"  estimate for 16 GiB (copies and cuMemCreate scaled linearly): pause {pause16:.2f} s, resume "
                f"{resume16:.2f} s: {verdict} the goal of {PAUSE_GOAL_S:.1f} s each"
            )
    for r in by_experiment.get("own_cost", []):
        if not r.get("ok") or not r.get("segments"):
            continue
        gib = r["segments"] * (r.get("segment_gib") or 1)
        per = r["total_s"] / gib
        steps = r.get("steps") or {}
        share = ", ".join(f"{n} {s['total_s'] / r['total_s']:.0%}" for n, s in steps.items() if r["total_s"])
        lines.append(
            f"own_cost: {r['total_s']:.3f} s for {gib:.0f} GiB ({per * 1e3:.1f} ms/GiB, 64 GiB ~ {per * 64:.2f} s "
            f"vs 0.28 s measured in the fast path); shares: {share}"
        )
    for r in by_experiment.get("memfd_fill", []):
        ways = {w: v for w, v in (r.get("ways") or {}).items() if v.get("register_s") is not None}
        if not r.get("ok") or "touch" not in ways:
            continue
        now_s = ways["touch"]["fill_s"] + ways["touch"]["register_s"]
        best = min(ways, key=lambda w: ways[w]["fill_s"] + ways[w]["register_s"])
        best_s = ways[best]["fill_s"] + ways[best]["register_s"]
        scale = 16.0 / r["gib"] if r.get("gib") else 0.0
        lines.append(
            f"memfd_fill: fill + pin {r['gib']:.1f} GiB: touch (what csrc does) {now_s:.2f} s, best {best} "
            f"{best_s:.2f} s ({now_s / best_s:.1f}x); 16 GiB ~ {now_s * scale:.1f} s against {best_s * scale:.1f} s"
        )
    for r in by_experiment.get("pin_threads", []):
        ways = {w: v for w, v in (r.get("ways") or {}).items() if v.get("register_s")}
        if not r.get("ok") or "1 again" not in ways:
            continue
        one = ways["1 again"]["register_s"]  # the warm single thread: the first run pays a cold start
        best = min(ways, key=lambda w: ways[w]["register_s"])
        lines.append(
            f"pin_threads: pinning {r['gib']:.1f} GiB, 1 thread (warm) {one:.2f} s "
            f"({gbps(r['gib'] * GIB, one):.1f} GB/s), fastest {best} thread(s) "
            f"{ways[best]['register_s']:.2f} s ({one / ways[best]['register_s']:.2f}x)"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=8.0, help="GiB pinned / copied / owned (default 8)")
    parser.add_argument(
        "--experiments",
        default=",".join(EXPERIMENTS),
        help=f"comma list of experiments or EXPERIMENT:PART (default all): {', '.join(EXPERIMENTS)}",
    )
    parser.add_argument("--repeats", type=int, default=2, help="checkpoint rounds per state (default 2)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per part process (default 150)")
    parser.add_argument("--json", type=Path, help="write every raw result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--helper-sock", type=int, help=argparse.SUPPRESS)  # helper child mode
    args = parser.parse_args()
    if args.gb <= 0:
        parser.error("--gb must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.helper_sock is not None:
        return helper_main(args)
    if args.part:
        return worker(args)

    plan: list[tuple[str, str]] = []
    for item in (s.strip() for s in args.experiments.split(",")):
        if not item:
            continue
        experiment, _, part = item.partition(":")
        if experiment not in EXPERIMENTS or (part and part not in EXPERIMENTS[experiment]):
            parser.error(
                f"unknown experiment {item!r}: choose from "
                + ", ".join(f"{e} ({'/'.join(p)})" for e, p in EXPERIMENTS.items())
            )
        plan.extend((experiment, p) for p in ([part] if part else EXPERIMENTS[experiment]))
    if not plan:
        parser.error("no experiment given")

    started = now()
    by_experiment: dict[str, list[dict[str, Any]]] = {}
    for experiment, part in plan:
        log(f"-- {experiment}:{part} ...")
        result = run_part(experiment, part, args)
        by_experiment.setdefault(experiment, []).append(result)
        log(
            f"   {status(result)} in {result['wall_s']:.1f} s"
            + ("" if result.get("ok") else f": {result.get('error')}")
        )

    printers = {
        "pin_stall": table_pin_stall,
        "checkpoint_pinned": table_checkpoint_pinned,
        "helper_copy": table_helper,
        "shared_staging": table_shared,
        "own_cost": table_own,
        "memfd_fill": table_fill,
        "pin_threads": table_pin_threads,
    }
    for experiment, results in by_experiment.items():
        print()
        print(f"== {experiment}")
        try:
            printers[experiment](results)
        except Exception:  # a printing bug must not hide the rest
            traceback.print_exc()
    print()
    print("what this says (computed from this run)")
    try:
        lines = summary(by_experiment)
    except Exception as exc:
        traceback.print_exc()
        lines = [f"(summary failed: {type(exc).__name__}: {exc})"]
    for line in lines or ["(nothing succeeded to summarise)"]:
        print(f"  - {line}")
    failures = [
        f"{r['experiment']}:{r['part']}: {r.get('error')}"
        for rs in by_experiment.values()
        for r in rs
        if not r.get("ok")
    ]
    for rs in by_experiment.values():
        for r in rs:
            if not r.get("ok") and r.get("stderr_tail"):
                print(f"\n{r['experiment']}:{r['part']} FAILED ({r.get('error')}); stderr tail:")
                for text in r["stderr_tail"].rstrip().splitlines()[-30:]:
                    print(f"    {text}")
    elapsed = now() - started
    print(
        f"\n{sum(len(rs) for rs in by_experiment.values())} parts in {elapsed:.0f} s"
        + (f"; FAILED: {'; '.join(failures)}" if failures else "")
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": by_experiment,
                    "summary": lines,
                    "failures": failures,
                    "seconds": elapsed,
                    "gb": args.gb,
                    "repeats": args.repeats,
                },
                indent=1,
                default=str,
            )
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

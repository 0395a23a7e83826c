"""The probes' one way to the CUDA driver: libcuda through ctypes for the calls flexium._C does not
expose (typed, one table of signatures), and flexium._C's checkpoint of this process.
tests/gpu's jobs use it too (their memory the driver cannot checkpoint)."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Any

# cuda.h values (CUDA 13.0)
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
COPY_PIECE = 256 << 20


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
# the ones cuda.h's #defines select (cuMemAlloc -> cuMemAlloc_v2 ...): the unversioned v1 of
# those takes a 32-bit CUdeviceptr or unsigned sizes, so no fallback to it.
SIGNATURES: dict[str, tuple[str, list[Any]]] = {
    "cuInit": ("cuInit", [_uint]),
    "cuGetErrorName": ("cuGetErrorName", [_int, _P(ctypes.c_char_p)]),
    "cuDeviceGet": ("cuDeviceGet", [_P(_int), _int]),
    "cuDeviceGetAttribute": ("cuDeviceGetAttribute", [_P(_int), _int, _int]),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", [_P(_vp), _int]),
    "cuCtxSetCurrent": ("cuCtxSetCurrent", [_vp]),
    "cuDevicePrimaryCtxReset": ("cuDevicePrimaryCtxReset_v2", [_int]),
    "cuMemAlloc": ("cuMemAlloc_v2", [_P(_u64), _size]),
    "cuMemFree": ("cuMemFree_v2", [_u64]),
    "cuMemcpyDtoHAsync": ("cuMemcpyDtoHAsync_v2", [_vp, _u64, _size, _vp]),
    "cuStreamCreate": ("cuStreamCreate", [_P(_vp), _uint]),
    "cuStreamSynchronize": ("cuStreamSynchronize", [_vp]),
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
    "cuMemExportToShareableHandle": ("cuMemExportToShareableHandle", [_vp, _ull, _int, _ull]),
    "cuMemImportFromShareableHandle": ("cuMemImportFromShareableHandle", [_P(_ull), _vp, _int]),
    "cuMemcpyAsync": ("cuMemcpyAsync", [_u64, _u64, _size, _vp]),
    "cuMemsetD8": ("cuMemsetD8_v2", [_u64, ctypes.c_ubyte, _size]),
    "cuMemcpyDtoDAsync": ("cuMemcpyDtoDAsync_v2", [_u64, _u64, _size, _vp]),
    "cuMemcpyHtoDAsync": ("cuMemcpyHtoDAsync_v2", [_u64, _vp, _size, _vp]),
    "cuCtxSynchronize": ("cuCtxSynchronize", []),
    "cuCheckpointProcessLock": ("cuCheckpointProcessLock", [_int, _vp]),
    "cuCheckpointProcessCheckpoint": ("cuCheckpointProcessCheckpoint", [_int, _vp]),
    "cuCheckpointProcessRestore": ("cuCheckpointProcessRestore", [_int, _vp]),
    "cuCheckpointProcessUnlock": ("cuCheckpointProcessUnlock", [_int, _vp]),
}


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


class Driver:
    def __init__(self) -> None:
        self.device = 0
        self.context = 0
        self.lib = ctypes.CDLL(os.environ.get("FLEXIUM_LIBCUDA", "libcuda.so.1"))  # FLEXIUM_LIBCUDA as flexium reads it
        self.fns: dict[str, Any] = {}
        for name, (symbol, argtypes) in SIGNATURES.items():
            # The fake driver (tests/support/fake_driver.py) exports the plain names flexium resolves.
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
        self.context = int(ctx.value or 0)  # for other threads to make current
        return self.context

    # streams
    def stream(self) -> int:
        s = ctypes.c_void_p()
        self.call("cuStreamCreate", ctypes.byref(s), CU_STREAM_NON_BLOCKING)
        return int(s.value or 0)

    def stream_sync(self, stream: int) -> None:
        self.call("cuStreamSynchronize", stream)

    # VMM
    def prop(self, device: int) -> CUmemAllocationProp:
        p = CUmemAllocationProp()
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
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


def copy_to_host(
    drv: Driver, chunks: list[tuple[int, int]], device_base: int, device_size: int, stream: int
) -> tuple[int, float]:
    """Copies a device range into the host chunks, in order (wrapping around the range when the
    chunks are larger), at most COPY_PIECE bytes per call and never across a chunk's end.
    Returns (bytes, seconds including the stream synchronize)."""
    done = 0
    device_offset = 0
    started = time.perf_counter()
    for host, size in chunks:
        offset = 0
        while offset < size:
            n = min(COPY_PIECE, size - offset, device_size - device_offset)
            drv.call("cuMemcpyDtoHAsync", host + offset, device_base + device_offset, n, stream)
            offset += n
            done += n
            device_offset = (device_offset + n) % device_size
    drv.stream_sync(stream)
    return done, time.perf_counter() - started


def checkpoint_and_restore_self() -> list[str]:
    """Locks, checkpoints, restores in place and unlocks this process through flexium._C, from
    a thread of its own (the locking thread's own CUDA calls would block); each step's result."""
    from flexium import _C

    done: list[str] = []

    def drive() -> None:
        pid = os.getpid()
        for name, call in (
            ("lock", lambda: _C.lock(pid, 20_000)),
            ("checkpoint", lambda: _C.checkpoint(pid)),
            ("restore", lambda: _C.restore(pid)),
            ("unlock", lambda: _C.unlock(pid)),
        ):
            try:
                call()
                done.append(name)
                print(f"driver: {name} done", file=sys.stderr, flush=True)  # a run that hangs says where
            except Exception as exc:
                done.append(f"{name}: {exc}")
                # A failed restore leaves the process checkpointed: the next CUDA call waits for good.
                print(f"driver: {name} failed: {exc}", file=sys.stderr, flush=True)
                return

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    return done
